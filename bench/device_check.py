"""Device readiness: what flowrl runs on a CUDA or Ascend machine, each part in its own guarded
section, in one JSON line. ``make test-gpu`` runs it (at most 10 minutes); it exits 1 when any
section failed.

Sections (each says ``status``: passed, failed, skipped or not built; its seconds; details):

- ``device``: the accelerator found (CUDA, else an Ascend NPU through torch_npu), its count
  and names, torch's version, bfloat16 support.
- ``model``: a tiny Qwen2 policy with its tokenizer (`flowrl.tiny_model`).
- ``ranks``: data-parallel trainer ranks (`workers.distributed`): two (one per device) when
  there are two devices or more, else one, on the device's backend (NCCL or HCCL; gloo on the
  CPU); an all-reduce whose sum is checked, an FSDP2 train step with bfloat16 passes
  (`TorchTrainerEngine.shard`), the ranks' parameter checksums compared, and the bucketed
  export (`workers.resharding`) compared bit for bit with a whole gather.
- ``vllm``: the vLLM engine (`workers.engines.vllm_rollout`): greedy generation, a reload of
  the same weights exported bucket by bucket from a trainer engine on the device (the
  generation must not change), a reload of changed weights (it must). Skipped where vLLM does
  not import.
- ``colocated``: colocated mode's parts on the device (`check_colocated`): a trainer step
  whose optimizer state and gradients go to pinned host memory while the HF engine generates
  with the trainer's own tensors (the same tokens as from a copy), and come back bit for bit.
  Then the vllm section's engine colocated with a trainer (`workers.colocated_vllm`): on CUDA
  it sleeps through each train phase (the device memory freed) and wakes up with the trainer's
  tensors loaded (the same tokens as before the sleep); a stepped version loaded from the
  trainer generates what the same weights loaded as a copy generate. On the CPU (no sleep mode)
  the same phases run, releasing nothing.

``--cpu`` is the dry run the normal test suite makes (``tests/test_device_check.py``): the
same code on the CPU with two gloo ranks (bfloat16 passes), vLLM skipped where it does not
import, so every path this script takes on a device but vLLM's sleep and wake-up is exercised
before a device is lent.

    python bench/device_check.py [--cpu] [--budget-s 570]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PASSED, FAILED, SKIPPED, NOT_BUILT = "passed", "failed", "skipped", "not built"
#: the whole check's default budget: ``make test-gpu`` kills it at 10 minutes.
BUDGET_S = 570.0
#: how long the ranks' processes may take, at most.
RANKS_TIMEOUT_S = 240.0


@dataclass
class Context:
    """What the sections share: the device, the budget, the model built for them."""

    device: str  # "cuda", "npu" or "cpu"
    count: int
    deadline: float
    tmp: Path
    model: Path | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


class Skip(Exception):
    """A section that cannot run here (said in its result, not a failure)."""


class NotBuilt(Exception):
    """A section whose feature is not in this build yet."""


def detect(cpu: bool) -> tuple[str, int]:
    """The accelerator's kind and count: ("cpu", 0) with ``cpu`` or without one."""
    if cpu:
        return "cpu", 0
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    from workers.devices import npu_available

    if npu_available():
        return "npu", int(torch.npu.device_count())  # type: ignore[attr-defined]
    return "cpu", 0


def run_section(name: str, fn: Callable[[Context], dict[str, Any]], ctx: Context,
                min_s: float = 5.0) -> dict[str, Any]:
    """``fn(ctx)`` guarded: its details with its status and seconds; an exception is a failed
    section (its message and the traceback's end), never the end of the check."""
    start = time.perf_counter()
    try:
        if ctx.left_s() < min_s:
            raise Skip(f"out of time ({ctx.left_s():.0f} s left of the budget)")
        result = {"status": PASSED, **fn(ctx)}
    except Skip as e:
        result = {"status": SKIPPED, "reason": str(e)}
    except NotBuilt as e:
        result = {"status": NOT_BUILT, "reason": str(e)}
    except Exception as e:  # every failure is reported, and the next section still runs
        result = {"status": FAILED, "error": f"{type(e).__name__}: {e}"[:2000],
                  "trace": traceback.format_exc()[-1500:]}
    result["s"] = round(time.perf_counter() - start, 2)
    print(f"device_check: {name} {result['status']} in {result['s']} s", file=sys.stderr)
    return result


def exit_code(sections: dict[str, dict[str, Any]]) -> int:
    """1 when any section failed, else 0 (skipped and not built are not failures)."""
    return int(any(s["status"] == FAILED for s in sections.values()))


# -- sections --------------------------------------------------------------------------------


def device_section(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"device": ctx.device, "count": ctx.count,
                           "torch": torch.__version__}
    if ctx.device == "cuda":
        out["names"] = [torch.cuda.get_device_name(i) for i in range(ctx.count)]
        out["bf16"] = bool(torch.cuda.is_bf16_supported())
        out["cuda"] = torch.version.cuda
    elif ctx.device == "npu":
        npu: Any = torch.npu  # type: ignore[attr-defined]
        out["names"] = [npu.get_device_name(i) for i in range(ctx.count)]
    else:
        out["bf16"] = True  # torch's CPU kernels take bfloat16
    return out


def model_section(ctx: Context) -> dict[str, Any]:
    from flowrl.tiny_model import build_tiny_model

    # Heads of 64: every attention backend of vLLM on a device takes that size.
    ctx.model = build_tiny_model(ctx.tmp / "tiny", vocab_size=512, hidden=256, layers=2,
                                 heads=4, kv_heads=2, max_positions=128)
    return {"path": str(ctx.model)}


def ranks_section(ctx: Context) -> dict[str, Any]:
    if ctx.model is None:
        raise Skip("no model (its section failed)")
    world = 2 if ctx.device == "cpu" or ctx.count >= 2 else 1
    out = ctx.tmp / "ranks"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "rank", str(r), str(world), ctx.device,
         str(ctx.tmp / "ranks.store"), str(ctx.model), str(out)],
        env=env, stderr=subprocess.PIPE, text=True) for r in range(world)]
    errors: list[str] = []
    try:
        timeout = min(RANKS_TIMEOUT_S, max(1.0, ctx.left_s() - 5))
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if p.returncode:
                errors.append(err[-1500:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    if errors:
        raise RuntimeError(f"a rank failed: {errors[0]}")
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    checksums = {r["checksum"] for r in results}
    if len(checksums) != 1:
        raise RuntimeError(f"the ranks' parameters differ after the step: {sorted(checksums)}")
    first = results[0]
    for key in ("all_reduce_ok", "bit_equal"):
        if not all(r[key] for r in results):
            raise RuntimeError(f"{key} is false on a rank: {results}")
    return {"world": world, "backend": first["backend"], "loss": first["loss"],
            "buckets": first["buckets"], "step_ms": first["step_ms"],
            "export_ms": first["export_ms"], "gather_ms": first["gather_ms"]}


def rank_main(rank: int, world: int, device_kind: str, store: str, model: str,
              out: str) -> None:
    """One rank of the ``ranks`` section, in its own process: see the module docstring."""
    import torch.distributed as dist

    from workers.distributed import DataParallel, backend_for, parameter_checksum
    from workers.engines.protocols import SequenceBatch
    from workers.engines.torch_trainer import TorchTrainerEngine

    torch.set_num_threads(1)
    if device_kind == "npu":  # torch knows the npu device once torch_npu is imported
        from workers.devices import npu_available

        npu_available()
    base = torch.device(device_kind)
    if world >= 2:
        group = DataParallel(rank=rank, world=world, init_method=f"file://{store}",
                             timeout_s=120, sharding="fsdp2", compute_dtype="bfloat16")
        device = group.device(base)
        group.join(device)
    else:  # one device: a group of one (FSDP2 then shards nothing, but runs every path)
        device = base if base.type == "cpu" else torch.device(base.type, 0)
        if device.type != "cpu":
            getattr(torch, device.type).set_device(device)
        dist.init_process_group(backend_for(device), init_method=f"file://{store}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        probe = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(probe)
        all_reduce_ok = bool((probe.cpu() == world * (world + 1) / 2).all())

        engine = TorchTrainerEngine(model, lr=1e-3, device=device, seed=0)
        engine.shard("bfloat16")
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(3, 500, (2, 24), generator=g)
        resp = torch.zeros_like(ids, dtype=torch.bool)
        resp[:, 8:] = True
        batch = SequenceBatch(ids, torch.ones_like(ids), resp)
        start = time.perf_counter()
        metrics = engine.train_micro_batch(
            batch, lambda lps, b: -(lps * b.response_mask.to(lps.dtype)).sum())
        engine.optimizer_step()
        _sync(device)
        step_ms = (time.perf_counter() - start) * 1e3
        checksum = parameter_checksum(p for p in engine.model.parameters())

        start = time.perf_counter()
        reference = engine.export_weights()
        gather_ms = (time.perf_counter() - start) * 1e3
        model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
        collected: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        buckets = engine.export_bucketed(max(1, model_bytes // 4), collected.update)
        export_ms = (time.perf_counter() - start) * 1e3
        bit_equal = list(collected) == list(reference) and all(
            collected[n].dtype == v.dtype and torch.equal(collected[n], v)
            for n, v in reference.items())
        Path(f"{out}.{rank}").write_text(json.dumps({
            "backend": dist.get_backend(), "all_reduce_ok": all_reduce_ok,
            "loss": metrics["loss"], "checksum": checksum, "step_ms": round(step_ms, 1),
            "buckets": buckets, "bit_equal": bit_equal, "export_ms": round(export_ms, 1),
            "gather_ms": round(gather_ms, 1)}))
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _vllm_or_skip() -> Any:
    try:
        vllm = importlib.import_module("vllm")
    except Exception as e:  # not installed, or a build for another platform
        raise Skip(f"vllm does not import here ({type(e).__name__}: {e})"[:300]) from None
    if not hasattr(vllm, "LLM"):  # a directory named vllm on the path, not the package
        raise Skip(f"vllm is not installed here (found only {list(vllm.__path__)[:1]})")
    return vllm


def vllm_section(ctx: Context) -> dict[str, Any]:
    if ctx.model is None:
        raise Skip("no model (its section failed)")
    vllm = _vllm_or_skip()
    from workers.engines.protocols import SamplingParams
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.engines.vllm_rollout import VLLMRolloutEngine

    kwargs: dict[str, Any] = {}
    if ctx.device == "cuda":  # sleep mode: the colocated section puts it to sleep
        kwargs = {"enable_sleep_mode": True, "gpu_memory_utilization": 0.3}
    start = time.perf_counter()
    # bfloat16 on a device (what its attention kernels take), the CPU build's float32 here;
    # eager: this checks what runs, not how fast (no graph capture at start).
    engine = VLLMRolloutEngine(ctx.model, seed=0, max_model_len=128, enforce_eager=True,
                               dtype="float32" if ctx.device == "cpu" else "bfloat16",
                               llm_kwargs=kwargs)
    ctx.facts["vllm_engine"] = engine
    init_s = time.perf_counter() - start
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    before = [g.response_ids.tolist() for g in engine.generate(prompts, greedy)]
    # The trainer's weights, exported bucket by bucket on the device, reloaded: unchanged.
    trainer = TorchTrainerEngine(ctx.model, device=None if ctx.device == "cpu" else ctx.device)
    state: dict[str, torch.Tensor] = {}
    buckets = trainer.export_bucketed(64 << 10, state.update)
    start = time.perf_counter()
    engine.load_weights(state, 1)
    reload_ms = (time.perf_counter() - start) * 1e3
    same = [g.response_ids.tolist() for g in engine.generate(prompts, greedy)]
    if same != before:
        raise RuntimeError(f"the same weights reloaded generate otherwise: {before} → {same}")
    changed = {n: (t * 0.0 if n.endswith("lm_head.weight") or "embed" in n else t)
               for n, t in state.items()}
    engine.load_weights(changed, 2)
    after = [g.response_ids.tolist() for g in engine.generate(prompts, greedy)]
    if after == before:
        raise RuntimeError("changed weights reloaded generate the same tokens")
    engine.load_weights(state, 3)  # the model's own weights again
    out = {"vllm": str(getattr(vllm, "__version__", "?")), "init_s": round(init_s, 1),
           "reload_ms": round(reload_ms, 1), "export_buckets": buckets,
           "tokens": sum(len(t) for t in before)}
    return out


def check_colocated(ctx: Context) -> dict[str, Any]:
    """Colocated mode's parts on the device, wired as `workers.roles.factory` wires them: a
    trainer engine and an HF rollout engine over the trainer's module taking turns in one
    `Phases`. The trainer steps and leaves gradients part-way; switching to generate moves its
    optimizer state and gradients to (pinned) host memory, the engine serves the trainer's
    tensors in place and generates what an engine loaded with a copy of them generates;
    switching back restores them bit for bit and the step finishes. The CPU dry run offloads
    host to host, so it takes the same path. Then the same on the vllm section's engine
    (`_colocated_vllm`), where it runs."""
    if ctx.model is None:
        raise Skip("no model (its section failed)")
    from workers.colocated import Phases, RolloutMemory, TrainerMemory
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.protocols import SamplingParams
    from workers.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(ctx.model, device=None if ctx.device == "cpu" else ctx.device,
                                 lr=1e-2)
    device = trainer.device
    engine = HFRolloutEngine(ctx.model, device=device, model=trainer.model)
    phases = Phases({"train": TrainerMemory(trainer, offloads=True),
                     "generate": RolloutMemory(device)})
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]], device=device)

    def backward() -> None:
        trainer.model.train()
        trainer.model(input_ids=ids, labels=ids).loss.backward()

    def snapshot() -> dict[str, torch.Tensor]:
        out = {f"grad.{n}": p.grad.detach().clone() for n, p in trainer.model.named_parameters()
               if p.grad is not None}
        for i, state in enumerate(trainer.optimizer.state.values()):
            out.update({f"state.{i}.{k}": v.clone() for k, v in state.items()
                        if isinstance(v, torch.Tensor)})
        return out

    async def turns() -> dict[str, Any]:
        async with phases.enter("train"):
            backward()
            trainer.optimizer.step()  # optimizer state exists from here
            trainer.optimizer.zero_grad(set_to_none=True)
            backward()  # a step part-way: its gradients outlive the phase
            held = snapshot()
            train_bytes = _device_allocated(device)
        async with phases.enter("generate"):
            generate_bytes = _device_allocated(device)
            engine.serve_in_place(1)
            in_place = [g.response_ids.tolist() for g in engine.generate(prompts, greedy)]
            served = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        async with phases.enter("train"):
            back = snapshot()
            trainer.optimizer.step()
        if back.keys() != held.keys() or not all(torch.equal(back[k], held[k]) for k in held):
            raise RuntimeError("the optimizer state or gradients came back changed")
        copy = HFRolloutEngine(ctx.model, device=device)
        copy.load_weights(served, 1)
        copied = [g.response_ids.tolist() for g in copy.generate(prompts, greedy)]
        if copied != in_place:
            raise RuntimeError(f"served in place it generates {in_place}, from a copy of the "
                               f"same weights {copied}")
        metrics = phases.take_metrics()
        return {"switches": int(metrics["phase_switches"]),
                "switch_ms": round(metrics["phase_switch_ms"], 2),
                "moved_mb": round(metrics["phase_moved_mb"], 3),
                "device_mb_train": round(train_bytes / (1 << 20), 2),
                "device_mb_generate": round(generate_bytes / (1 << 20), 2),
                "tokens": sum(len(t) for t in in_place)}

    out = asyncio.run(turns())
    engine = ctx.facts.get("vllm_engine")
    out["vllm"] = ("skipped: no vLLM engine (see the vllm section)" if engine is None
                   else asyncio.run(_colocated_vllm(ctx, engine, prompts, greedy)))
    return out


async def _colocated_vllm(ctx: Context, engine: Any, prompts: list[list[int]],
                          greedy: Any) -> dict[str, Any]:
    """vLLM colocated with a trainer as `workers.roles.factory` wires it: generate, a train
    phase without a step (on CUDA vLLM sleeps, level 2, and wakes up with the trainer's
    tensors reloaded: the same tokens), a train phase with a step (the new version loaded from
    the trainer generates what a copy of its weights loaded the separated way generates)."""
    from workers.colocated import Phases, TrainerMemory
    from workers.colocated_vllm import SLEEP_LEVEL, VLLMInPlace, module_buckets
    from workers.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(ctx.model, device=None if ctx.device == "cpu" else ctx.device,
                                 lr=1e-2)
    version = 10
    served = VLLMInPlace(engine, lambda: module_buckets(trainer.model), lambda: version)
    phases = Phases({"train": TrainerMemory(trainer, offloads=True), "generate": served})
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]], device=trainer.device)

    def tokens() -> list[list[int]]:
        return [g.response_ids.tolist() for g in engine.generate(prompts, greedy)]

    async with phases.enter("generate"):  # loads the trainer's weights (version 10)
        before = tokens()
    async with phases.enter("train"):  # no step: the weights stay
        freed = served.last_release
    if ctx.device == "cuda" and not (served.sleeps and freed > 0):
        raise RuntimeError(f"vLLM did not sleep (sleep mode {served.sleeps}, {freed} bytes "
                           "freed)")
    async with phases.enter("generate"):
        woken = tokens()
    if woken != before:
        raise RuntimeError(f"vLLM woken up generates otherwise: {before} → {woken}")
    async with phases.enter("train"):
        trainer.model.train()
        trainer.model(input_ids=ids, labels=ids).loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        version += 1
    async with phases.enter("generate"):
        stepped = tokens()
    assert served.last_load is not None
    engine.load_weights(trainer.export_weights(), version)  # the separated route
    if tokens() != stepped:
        raise RuntimeError("the version loaded from the trainer generates otherwise than a "
                           "copy of its weights")
    metrics = phases.take_metrics()
    return {"sleeps": served.sleeps, "sleep_level": SLEEP_LEVEL if served.sleeps else None,
            "freed_mb": round(freed / (1 << 20), 1), "load_ms": round(served.last_load[1], 1),
            "switch_ms": round(metrics["phase_switch_ms"], 1),
            "moved_mb": round(metrics["phase_moved_mb"], 1),
            "tokens": sum(len(t) for t in before), "changed": stepped != before}


def _device_allocated(device: torch.device) -> int:
    """Bytes the accelerator's allocator holds for tensors (0 on the CPU, where host memory is
    the device's and the phases' RSS says it)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "npu":
        return int(torch.npu.memory_allocated(device))  # type: ignore[attr-defined]
    return 0


SECTIONS: tuple[tuple[str, Callable[[Context], dict[str, Any]]], ...] = (
    ("device", device_section),
    ("model", model_section),
    ("ranks", ranks_section),
    ("vllm", vllm_section),
    ("colocated", check_colocated),
)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what is written to stdout (vLLM's logs, a library's prints, at the descriptor)
    to stderr meanwhile: stdout carries the one JSON line."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(cpu: bool, budget_s: float = BUDGET_S) -> tuple[dict[str, Any], int]:
    start = time.monotonic()
    kind, count = detect(cpu)
    sections: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-device-check-") as d:
        ctx = Context(device=kind, count=count, deadline=start + budget_s, tmp=Path(d))
        for name, fn in SECTIONS:
            sections[name] = run_section(name, fn, ctx)
        ctx.facts.clear()  # the vLLM engine goes before its model's directory
    code = exit_code(sections)
    return {"device": kind, "count": count, "ok": code == 0,
            "total_s": round(time.monotonic() - start, 1), "sections": sections}, code


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
                  sys.argv[7])
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--cpu", action="store_true",
                            help="the dry run on the CPU (gloo ranks, vLLM if it imports)")
        parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                            help="sections that would start after this many seconds are "
                                 "skipped")
        args = parser.parse_args()
        with stdout_to_stderr():
            result, status = main(args.cpu, args.budget_s)
        print(json.dumps(result))
        sys.exit(status)
