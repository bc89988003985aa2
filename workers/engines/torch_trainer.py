"""Training on plain torch: a transformers causal LM with AdamW, on one device.

`TorchTrainerEngine` scores prompt+response rows (per-token logprobs under the logprob
contract of `protocols`), accumulates gradients over micro-batches, steps AdamW with gradient
clipping and a constant-with-linear-warmup learning rate, and exports weights for rollout.

Guarantees:
- `logprobs` and `train_micro_batch` compute the same function (dropout is off), and it matches
  `HFRolloutEngine`'s recorded logprobs for the same weights and tokens up to kernel rounding.
- A step whose gradient norm is not finite is skipped (gradients dropped, counted in
  ``skipped``); the weights and optimizer state stay as they were.
- `export_weights` is a snapshot (later steps do not change it), one entry per tied weight.
- Checkpoints carry no pickle: `state_dict` is flat tensors plus JSON metadata
  (`TrainerState.save` writes safetensors + JSON); weights go through `save_pretrained`.

With ``lora`` (`flowrl.worker_spec.LoraSpec`) only low-rank adapters train
(`workers.engines.lora`): the optimizer holds only them, `export_weights` is the adapter
payload (``sync="adapter"``) or the merged weights with the adapters beside them
(``sync="merged"``), and `save_pretrained` writes merged weights, which plain transformers
loads, with the adapter in peft's format in ``adapter/`` (`ADAPTER_DIR`). ``gradient_checkpointing``
recomputes each decoder layer's activations in the backward pass
(`workers.engines.activation_checkpointing`).

Data parallelism over several ranks wraps this engine in `workers.roles.dp_trainer`: either
every rank holds the whole model (one gradient all-reduce per step), or `shard` makes it FSDP2
shards. Sharded, `export_weights` (`export_bucketed`: one bucket at a time), `state_dict` and
`save_pretrained` gather whole tensors and are collectives (every rank calls them, in the same
order); `load_state_dict` takes whole tensors and keeps this rank's shards.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowrl.worker_spec import LoraSpec
from workers.devices import pick_device
from workers.distributed import full_tensor, shard_like, shard_model
from workers.engines.activation_checkpointing import checkpoint_layers
from workers.engines.hf_rollout import _ForwardNames, load_causal_lm
from workers.engines.lora import ADAPTER_DIR, LoraPolicy, adapter_entries
from workers.engines.protocols import LossFn, SequenceBatch, TrainerState, token_logprobs
from workers.engines.tied_weights import tied_groups
from workers.resharding import BucketSink, export_bucketed

__all__ = ["TorchTrainerEngine", "adamw", "clip_and_step", "portable_tokenizer_config"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

# transformers 5 saves a plain fast tokenizer as class ``TokenizersBackend``, a name transformers
# 4 does not know ("Tokenizer class TokenizersBackend does not exist"); its transformers 4 name
# is ``PreTrainedTokenizerFast`` (transformers 5 keeps that name as an alias). The two differ
# in defaults, so these are written out: transformers 4's fast tokenizer would also return
# ``token_type_ids`` (which ``generate`` refuses) and clean up spaces when decoding.
_V5_ONLY_CLASS = "TokenizersBackend"
_PORTABLE_DEFAULTS = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "model_input_names": ["input_ids", "attention_mask"],
                      "clean_up_tokenization_spaces": False}


def portable_tokenizer_config(directory: str | os.PathLike[str]) -> bool:
    """Make ``directory/tokenizer_config.json`` load with every transformers version flowrl
    supports (4.45 on): a class only transformers 5 knows is named by its transformers 4
    name, with transformers 5's defaults stated. Returns whether the file was changed."""
    file = Path(directory) / "tokenizer_config.json"
    try:
        config = json.loads(file.read_text())
    except (FileNotFoundError, ValueError):  # none, or not one we can read: left as it is
        return False
    if not isinstance(config, dict) or config.get("tokenizer_class") != _V5_ONLY_CLASS:
        return False
    config = {**config, "tokenizer_class": _PORTABLE_DEFAULTS["tokenizer_class"]}
    for key, value in _PORTABLE_DEFAULTS.items():
        config.setdefault(key, value)
    file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return True


class TorchTrainerEngine:
    """`TrainerEngine` for a transformers causal LM on one device (CPU, CUDA or NPU).

    Weight decay applies to matrices only (not biases or norms). ``grad_clip`` None (or 0)
    disables clipping. ``seed`` seeds torch's global RNG: the trainer owns its worker process.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float | None = 1.0,
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        total_steps: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        attn_implementation: str | None = None,
        lora: LoraSpec | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        if lr <= 0 or warmup_steps < 0 or (grad_clip is not None and grad_clip < 0):
            raise ValueError("need lr > 0, warmup_steps >= 0, grad_clip >= 0 or None")
        if schedule not in ("constant", "cosine") or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"schedule must be 'constant' or 'cosine' and 0 <= min_lr_ratio "
                             f"<= 1, got {schedule!r}, {min_lr_ratio}")
        if schedule == "cosine" and (total_steps is None or total_steps < 1):
            raise ValueError("a cosine schedule needs total_steps >= 1")
        torch.manual_seed(seed)
        self.device = pick_device(device)
        self.model_dir = Path(model_dir)
        self.model = load_causal_lm(
            model_dir, device=self.device, dtype=dtype, attn_implementation=attn_implementation
        )
        if gradient_checkpointing:
            checkpoint_layers(self.model)
        #: the adapters, when only they train (None: every weight trains)
        self.lora = None if lora is None else LoraPolicy(self.model, lora)
        self._sync = "full" if lora is None else lora.sync
        if self.lora is None:
            self.model.requires_grad_(True)
        self._names = _ForwardNames(self.model)
        self._groups = tied_groups(self.model)
        self._lr = lr
        self._warmup = warmup_steps
        self._schedule = schedule
        self._min_lr = lr * min_lr_ratio
        self._total = total_steps or 0
        self._grad_clip = grad_clip
        # named_parameters() lists a tied weight once, so each tensor is optimised once.
        self._params = _trainable(self.model)
        self._adamw = functools.partial(adamw, lr=lr, weight_decay=weight_decay, betas=betas,
                                        eps=eps)
        self.optimizer = self._adamw(self._params.values())
        self.sharded = False
        self._step = 0
        self._skipped = 0
        self._pending = 0  # micro-batches accumulated since the last optimizer step
        #: the schedule's rate is multiplied by this (the stability guard lowers it)
        self.lr_scale = 1.0

    @property
    def step(self) -> int:
        return self._step

    def shard(self, compute_dtype: str = "float32") -> None:
        """Shard the model over the joined process group (FSDP2, `shard_model`, passes in
        ``compute_dtype``) and build the optimizer over the shards. Call before any step and
        before `load_state_dict`."""
        if self._step or self._pending or self.optimizer.state:
            raise RuntimeError("shard() must come before the first step and any state load")
        if self.lora is not None:
            raise ValueError("adapters train on replicated ranks only, not sharded ones")
        shard_model(self.model, compute_dtype)
        self._params = _trainable(self.model)
        self.optimizer = self._adamw(self._params.values())
        self.sharded = True

    def empty_pass(self) -> None:
        """A forward and backward that adds nothing to the gradients: a sharded rank with
        fewer micro-batches than its peers runs these so that its collectives pair up."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits
        torch.autograd.backward(logits.sum() * 0.0)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): a linear warmup over the
        first ``warmup_steps``, then constant, or cosine from ``lr`` down to ``lr *
        min_lr_ratio`` at the last of ``total_steps`` (and there after it)."""
        if step < self._warmup:
            return self._lr * (step + 1) / self._warmup
        if self._schedule == "constant":
            return self._lr
        span = max(1, self._total - 1 - self._warmup)
        done = min(1.0, (step - self._warmup) / span)
        return self._min_lr + (self._lr - self._min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))

    # -- scoring and training ----------------------------------------------------------------

    def _logprobs(self, batch: SequenceBatch, temperature: float) -> Tensor:
        ids = batch.input_ids.to(self.device, torch.long)
        attn = batch.attention_mask.to(self.device, torch.long)
        resp = batch.response_mask.to(self.device, torch.bool)
        width = ids.shape[1]
        has_resp = resp.any(dim=0)
        if not bool(has_resp.any()):
            return torch.zeros(ids.shape, dtype=torch.float32, device=self.device)
        first = int(has_resp.int().argmax())
        if first == 0:
            raise ValueError("a response token at position 0 has no prefix to condition on")
        # Position ids follow the mask, as in rollout, so padding never shifts positions.
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        kwargs: dict[str, Any] = {"use_cache": False}
        if self._names.keep is not None:
            # Only the logits that predict response tokens: positions first-1 .. width-2.
            kwargs[self._names.keep] = width - first + 1
        logits = self.model(
            input_ids=ids, attention_mask=attn, position_ids=positions, **kwargs
        ).logits
        logits = logits[:, -(width - first + 1) : -1, :]
        lps = token_logprobs(logits, ids[:, first:], temperature)
        out = torch.zeros(ids.shape, dtype=lps.dtype, device=self.device)
        out[:, first:] = lps
        return out.masked_fill(~resp, 0.0)

    def logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0) -> Tensor:
        with torch.no_grad():
            return self._logprobs(batch, temperature).cpu()

    def train_micro_batch(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn,
        *,
        loss_scale: float = 1.0,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        if not bool(batch.response_mask.any()):
            raise ValueError("batch has no response tokens to train on")
        # Adapter dropout stays on through the backward: a checkpointed layer's recomputation
        # must run the forward's ops (and replays its masks).
        with self.lora.dropout() if self.lora is not None else contextlib.nullcontext():
            lps = self._logprobs(batch, temperature)
            result = loss_fn(lps, _on_device(batch, self.device))
            loss, metrics = result if isinstance(result, tuple) else (result, {})
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            torch.autograd.backward(loss * loss_scale)
        self._pending += 1
        out = {"loss": float(loss.detach()), "response_tokens": float(batch.num_response_tokens)}
        out.update({k: float(v) for k, v in metrics.items()})
        return out

    def join_at(self, steps: int) -> None:
        # The optimizer's moments start afresh; the schedule must not (a restarted trainer
        # would warm up again, or climb back to the peak of a cosine).
        self._step = max(self._step, steps)

    def discard_gradients(self) -> None:
        """Forget what the micro-batches since the last optimizer step accumulated."""
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = 0

    def optimizer_step(self, *, advance: bool = True) -> dict[str, float]:
        if self._pending == 0:
            raise RuntimeError("optimizer_step without any train_micro_batch since the last step")
        lr = self.lr_at(self._step) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm, skipped = clip_and_step(self.optimizer, self._params.values(), self._grad_clip)
        if skipped:
            self._skipped += 1
        elif advance:
            self._step += 1
        self._pending = 0
        return {"grad_norm": grad_norm, "lr": lr, "step": float(self._step),
                "skipped": float(skipped)}

    # -- weights and checkpoints ---------------------------------------------------------------

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """What a new version publishes: the whole weights, or with adapters what the
        recipe's sync says (see the module docstring)."""
        if self.lora is None:
            return self._whole_weights(dtype)
        adapter = self.lora.adapter_payload()
        if self._sync == "adapter":
            return adapter
        return {**self._whole_weights(dtype), **adapter}

    def export_bucketed(self, bucket_bytes: int, sink: BucketSink,
                        dtype: torch.dtype | None = None) -> int:
        """`export_weights` (whole weights, no adapters) handed to ``sink`` one bucket of
        about ``bucket_bytes`` at a time (`workers.resharding`); the same tensors, bit for
        bit. Sharded, a collective. Returns the number of buckets."""
        if self.lora is not None:
            raise ValueError("a bucketed export is of whole weights: this model trains adapters")
        state = self.model.state_dict()
        return export_bucketed([(group[0], state[group[0]]) for group in self._groups],
                               bucket_bytes, sink, dtype)

    def export_trainable(self) -> dict[str, Tensor]:
        """A snapshot of what trains (the adapters, or every weight): what `load_weights`
        takes back."""
        return self._whole_weights() if self.lora is None else self.lora.adapter_payload()

    def load_adapter(self, payload: Mapping[str, Tensor]) -> None:
        """Take the adapters of a payload (`workers.engines.lora`); a payload's whole weights,
        if any, are ignored: they are the base with these adapters merged."""
        if self.lora is None:
            raise ValueError("an adapter payload for a model that trains every weight")
        self.lora.load_adapter(adapter_entries(payload)[1])

    def _whole_weights(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Every weight as CPU copies, a tied weight once; with adapters, merged and named
        as the base model names them."""
        if self.lora is not None:
            merged = self.lora.merged_weights(self._groups)
            return merged if dtype is None else {k: v.to(dtype) for k, v in merged.items()}
        state = self.model.state_dict()
        return {
            group[0]: full_tensor(state[group[0]].detach()).to(
                "cpu", dtype=dtype, copy=True).contiguous()
            for group in self._groups
        }

    def whole_state(self) -> dict[str, Tensor]:
        """The model's state dict as whole CPU tensors, a tied weight shared by its names
        (with adapters: merged, as the base model names them)."""
        weights = self._whole_weights()
        if self.lora is None:
            return {name: weights[group[0]] for group in self._groups for name in group}
        clean = LoraPolicy.clean_name
        return {clean(name): weights[clean(group[0])] for group in self._groups
                if clean(group[0]) in weights for name in group}

    def state_dict(self) -> TrainerState:
        return optimizer_state(self.optimizer, self._params,
                               {"step": self._step, "skipped": self._skipped})

    def load_state_dict(self, state: TrainerState) -> None:
        load_optimizer_state(self.optimizer, self._params, state)
        self._step = int(state.meta["step"])
        self._skipped = int(state.meta.get("skipped", 0))

    def save_pretrained(
        self, directory: str | os.PathLike[str], *, state_dict: Mapping[str, Tensor] | None = None
    ) -> Path:
        # Sharded: gather first (a collective) and only then touch the disk, so a failed write
        # on one rank cannot leave the others waiting in a gather.
        whole = state_dict is None and (self.sharded or self.lora is not None)
        state = self.whole_state() if whole else state_dict
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, state_dict=state)
        if self.lora is not None:
            self.lora.save_adapter(out / ADAPTER_DIR)
        # Tokenizer files are copied byte for byte: re-saving through a tokenizer class can
        # rewrite them (class name, normalisation) and the policy must keep its tokenizer.
        # The one exception names a transformers-5-only class portably (same tokenizer).
        for name in _TOKENIZER_FILES:
            src = self.model_dir / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
        portable_tokenizer_config(out)
        return out


def adamw(
    params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float,
    betas: tuple[float, float], eps: float,
) -> torch.optim.AdamW:
    """AdamW whose weight decay applies to matrices only (not biases or norms)."""
    params = list(params)
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps,
    )


def optimizer_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], meta: Mapping[str, Any]
) -> TrainerState:
    """``optimizer``'s state by parameter name (CPU copies), with ``meta`` and its groups."""
    names = {id(p): n for n, p in params.items()}
    tensors: dict[str, Tensor] = {}
    for param, st in optimizer.state.items():
        for key, value in st.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"non-tensor optimizer state {key!r}")
            tensors[f"{names[id(param)]}/{key}"] = full_tensor(value.detach()).to(
                "cpu", copy=True)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"},
         "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return TrainerState(tensors, {**meta, "param_groups": groups})


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], state: TrainerState
) -> None:
    """Load what `optimizer_state` saved into ``optimizer`` (over the same named params);
    ValueError if the names or their order differ."""
    meta = state.meta
    index = {n: i for i, n in enumerate(n for g in meta["param_groups"] for n in g["params"])}
    if set(index) != set(params):
        raise ValueError("optimizer state names do not match the model's parameters")
    per_param: dict[int, dict[str, Tensor]] = {}
    for key, value in state.tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise ValueError(f"optimizer state for unknown parameter {name!r}")
        if value.shape == params[name].shape:  # a moment, sharded as its parameter is
            value = shard_like(value, params[name])
        per_param.setdefault(index[name], {})[field] = value
    groups = []
    for g in meta["param_groups"]:
        group = dict(g)
        group["params"] = [index[n] for n in g["params"]]
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    # torch.optim maps saved ids onto its own param order: match our ordering first.
    names = {id(p): n for n, p in params.items()}
    ours = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    theirs = [n for g in meta["param_groups"] for n in g["params"]]
    if ours != theirs:
        raise ValueError("optimizer parameter order differs from the checkpoint's")
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
    grad_clip: float | None,
) -> tuple[float, bool]:
    """Clip the accumulated gradients to ``grad_clip`` (None or 0: no clip), step unless their
    norm is not finite, zero them; returns (grad_norm before clipping, skipped)."""
    max_norm = grad_clip if grad_clip else math.inf
    grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(list(params), max_norm)))
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _on_device(batch: SequenceBatch, device: torch.device) -> SequenceBatch:
    if batch.input_ids.device == device:
        return batch
    return batch.to(device)
