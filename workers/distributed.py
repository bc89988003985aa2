"""The trainer ranks' process group: rendezvous, one gradient all-reduce per step, checksums.

`DataParallel` describes one rank: its rank and world size, the backend (``gloo`` on a CPU,
``nccl`` on CUDA, ``hccl`` on Ascend NPUs) and the rendezvous. The ranks of a run are processes
``train.0 .. train.<N-1>``; a rank's number is its process index (`DataParallel.of_process`).
Ranks on one node meet in a ``file://`` store inside the run's private directory
(``/tmp/flowrl-<run_id>``, mode 0700), so nothing listens on a network port, and keep gloo's
links on loopback. Ranks on several nodes (the opt-in ``trainer_rendezvous="cluster"``) meet in
a TCPStore the controller hosts (``store = "host:port"``), under a key prefix of their group's
generation so that a restarted group never reads a dead group's keys; gloo's (or NCCL's)
interface is then the environment's choice (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).
That store and the collectives' links are neither authenticated nor encrypted
(torch.distributed): trusted fabrics only.

`all_reduce_step` is what DDP does for a step whose micro-batches are accumulated locally
(``no_sync`` on every micro-batch but the last): the ranks' gradient sums are added up in one
collective per dtype, with the step's counts riding in a second (float64, exact for counts
below 2**53), after which every rank holds the same gradients and counts. A parameter that no
rank gave a gradient keeps none, as in a single process.

A collective waits at most ``timeout_s``; a peer that dies makes it fail at once (its sockets
close). Either way the step raises, the rank's task fails and the controller restarts the whole
group in a fresh rendezvous (ranks cannot rejoin a group mid-run).

With ``sharding="fsdp2"`` (`shard_model`) the ranks hold 1/N shards of the parameters,
gradients and optimizer state instead (torch FSDP2: every decoder layer, and then the whole
model, is a ``fully_shard`` unit). Each pass gathers a unit's parameters before it runs and
each backward reduce-scatters its gradients (averaged over the ranks, since gloo has no
pre-scaled sum: the step multiplies by N again), so only the step's counts need
`all_reduce_counts`. Every rank must run the same number of passes (`flowrl.dp`: the step's
end says how many). `full_tensor` and `shard_like` move between a shard and the whole tensor
for weight export, checkpoints and loads.

Verified on CPUs with gloo, both ways of holding the model. NCCL and HCCL are named for
devices and not exercised here.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.tensor import DTensor, distribute_tensor

from flowrl.worker_spec import (
    DEFAULT_DP_TIMEOUT_S,
    DEFAULT_EXPORT_BUCKET_BYTES,
    DataParallelSpec,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RENDEZVOUS_FILE",
    "SHARDINGS",
    "DataParallel",
    "all_reduce_counts",
    "all_reduce_step",
    "backend_for",
    "broadcast_parameters",
    "full_tensor",
    "local_part",
    "parameter_checksum",
    "shard_like",
    "shard_model",
    "split_address",
]

#: how long one collective (or the rendezvous) may wait for the other ranks.
DEFAULT_TIMEOUT_S = DEFAULT_DP_TIMEOUT_S
#: the file store's name inside the run directory.
RENDEZVOUS_FILE = "train-ranks.store"

#: how the ranks hold the model: whole copies, or FSDP2 shards.
SHARDINGS = ("replicate", "fsdp2")

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def backend_for(device: torch.device) -> str:
    """The collective backend of ``device``'s type: gloo, nccl or hccl."""
    try:
        return _BACKENDS[device.type]
    except KeyError:
        raise ValueError(f"no collective backend for device type {device.type!r}") from None


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as (host, port); ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"data_parallel.store must be host:port, got {address!r}")
    return host, int(port)


@dataclass(frozen=True)
class DataParallel:
    """One trainer rank of a data-parallel group."""

    rank: int
    world: int
    #: one node's rendezvous: a ``file://`` store (or a loopback ``tcp://``); "" with `store`.
    init_method: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: None: chosen from the device (`backend_for`).
    backend: str | None = None
    sharding: str = "replicate"
    #: sharded: the dtype parameters are gathered and passes compute in (`shard_model`).
    compute_dtype: str = "float32"
    #: rank 0 exports a version in buckets of about this many bytes (`workers.resharding`).
    export_bucket_bytes: int = DEFAULT_EXPORT_BUCKET_BYTES
    #: ranks on several nodes: the controller's TCPStore, ``host:port``; "" with `init_method`.
    store: str = ""
    #: restarts of the group before this one: its keys' prefix in `store`.
    generation: int = 0

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"data_parallel.sharding must be one of {SHARDINGS}, got "
                             f"{self.sharding!r}")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"data_parallel.compute_dtype must be one of "
                             f"{sorted(_COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if not (self.world >= 2 and 0 <= self.rank < self.world):
            raise ValueError(f"data_parallel: rank {self.rank} of world {self.world}")
        if bool(self.init_method) == bool(self.store):
            raise ValueError("data_parallel needs exactly one of init_method (ranks on one "
                             "node) and store (ranks on several nodes)")
        if self.store:
            split_address(self.store)
        elif not self.init_method.startswith(("file://", "tcp://127.0.0.1:", "tcp://[::1]:")):
            raise ValueError(f"data_parallel.init_method must be a file:// store or a loopback "
                             f"tcp:// address, got {self.init_method!r}")
        if self.export_bucket_bytes < 1:
            raise ValueError(f"data_parallel.export_bucket_bytes must be >= 1, got "
                             f"{self.export_bucket_bytes}")
        if self.generation < 0:
            raise ValueError(f"data_parallel.generation must be >= 0, got {self.generation}")
        if not self.timeout_s > 0:
            raise ValueError(f"data_parallel.timeout_s must be > 0, got {self.timeout_s}")

    @classmethod
    def of_process(cls, spec: DataParallelSpec, *, process: str, run_dir: Path) -> DataParallel:
        """The rank of trainer process ``process`` (``train.<rank>``) in the group ``spec``
        describes; ranks on one node meet in a file store in ``run_dir``."""
        head, _, index = process.rpartition(".")
        if head != "train" or not index.isdigit():
            raise ValueError(f"a data-parallel trainer process must be named train.<rank>, "
                             f"got {process!r}")
        init_method = ""
        if not spec.store:
            # A group the controller restarted (``generation``) meets in a fresh store: the
            # old one holds the dead group's keys.
            store = (RENDEZVOUS_FILE if not spec.generation
                     else f"{RENDEZVOUS_FILE}.{spec.generation}")
            init_method = f"file://{run_dir / store}"
        return cls(rank=int(index), world=spec.world, init_method=init_method,
                   timeout_s=spec.timeout_s, sharding=spec.sharding,
                   compute_dtype=spec.compute_dtype,
                   export_bucket_bytes=spec.export_bucket_bytes, store=spec.store,
                   generation=spec.generation)

    @property
    def sharded(self) -> bool:
        return self.sharding != "replicate"

    def device(self, base: torch.device) -> torch.device:
        """This rank's device of ``base``'s type: accelerator ``rank % count``, or the CPU."""
        if base.type == "cpu":
            return base
        module = getattr(torch, base.type)
        return torch.device(base.type, self.rank % max(1, int(module.device_count())))

    def join(self, device: torch.device) -> None:
        """Meet the other ranks (blocks until all have joined, at most ``timeout_s``)."""
        backend = self.backend or backend_for(device)
        if backend == "gloo" and not self.store:
            # Keep gloo's pairs on loopback: every rank runs on this node. (Across nodes the
            # environment names the fabric's interface.)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if device.type != "cpu":
            getattr(torch, device.type).set_device(device)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not self.store:
            dist.init_process_group(backend, init_method=self.init_method, rank=self.rank,
                                    world_size=self.world, timeout=timeout)
            return
        host, port = split_address(self.store)
        # (TCPStore is public, though missing from torch.distributed's explicit exports.)
        client = dist.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                               timeout=timeout)
        dist.init_process_group(
            backend, store=PrefixStore(f"g{self.generation}", client), rank=self.rank,
            world_size=self.world, timeout=timeout)

    @staticmethod
    def leave() -> None:
        """Leave the group (a no-op when this process never joined one)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def broadcast_parameters(params: Iterable[torch.nn.Parameter], src: int = 0) -> None:
    """Give every rank ``src``'s parameter values (one collective per dtype), as DDP does
    when it wraps a model: the ranks then start identical whatever their seeds."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = _flat([p.detach() for p in group])
            dist.broadcast(flat, src=src)
            offset = 0
            for p in group:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def all_reduce_step(params: Sequence[torch.nn.Parameter], counts: Sequence[float]) -> list[float]:
    """Sum the ranks' gradients of ``params`` in place and return the sums of ``counts``.

    Every rank must pass the same parameters in the same order. Gradients are summed in one
    flat buffer per dtype (a rank without a gradient for a parameter adds zeros); a parameter
    left without a gradient on every rank keeps ``grad = None``.
    """
    if not params:
        raise ValueError("no parameters to reduce")
    has = [p.grad is not None for p in params]
    # Counts and which parameters have gradients anywhere: one small float64 collective.
    reduced = all_reduce_counts([*counts, *map(float, has)], params[0].device)
    sums, anywhere = reduced[:len(counts)], reduced[len(counts):]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if anywhere[i] > 0:
            by_dtype.setdefault(p.dtype, []).append(i)
    with torch.no_grad():
        for idx in by_dtype.values():
            grads = [params[i].grad for i in idx]
            flat = _flat([g if g is not None else torch.zeros_like(params[i])
                          for i, g in zip(idx, grads, strict=True)])
            dist.all_reduce(flat)
            offset = 0
            for i in idx:
                p = params[i]
                value = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
    return sums


def all_reduce_counts(counts: Sequence[float], device: torch.device) -> list[float]:
    """The ranks' sums of ``counts`` (one float64 collective, exact below 2**53)."""
    flat = torch.tensor(list(counts), dtype=torch.float64, device=device)
    dist.all_reduce(flat)
    return [float(v) for v in flat.tolist()]


def parameter_checksum(params: Iterable[torch.nn.Parameter]) -> float:
    """A float64 sum of every parameter: equal on ranks that hold equal parameters (the same
    kernels on the same values), so the controller can check that no rank drifted. Sharded
    parameters add up their shards across the ranks (a collective: every rank must call)."""
    sharded, device = False, torch.device("cpu")
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            sharded = sharded or isinstance(p, DTensor)
            local = local_part(p.detach())
            device = local.device
            total += local.to(torch.float64).sum().cpu()
    if sharded:
        return all_reduce_counts([float(total)], device)[0]
    return float(total)


def shard_model(model: torch.nn.Module, compute_dtype: str = "float32") -> None:
    """Shard ``model`` over the joined group with FSDP2, in place: each module class the model
    names in ``_no_split_modules`` (its decoder layers, for a transformers model) is one unit,
    the rest of the model the root unit. With ``compute_dtype`` ``bfloat16``, parameters are
    gathered and passes run in it and gradients are reduced in float32 (FSDP2 mixed
    precision; the shards and the optimizer keep the model's dtype). Build the optimizer
    afterwards: the parameters are replaced by sharded ones."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = _COMPUTE_DTYPES[compute_dtype]
    policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
              if dtype != torch.float32 else MixedPrecisionPolicy())
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank must call), or ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its shard's local tensor, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, laid out as ``like`` (no communication: every rank
    holds ``full``); ``full`` itself when ``like`` is not sharded."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.detach().to(like.device, like.dtype), like.device_mesh,
                             like.placements, src_data_rank=None)
