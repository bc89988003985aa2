"""The critic's engine on plain torch: a causal LM's backbone with a scalar value head.

`ValueModel` is the transformer body of a transformers causal LM (its ``base_model``, without
the vocabulary head) followed by ``Linear(hidden, 1)``. The value of response token t is read
from the hidden state of the token before it — the state in which the policy chose token t —
exactly where the trainer reads the logits that score token t, so values and logprobs of a row
are aligned position by position.

`ValueModelEngine` scores rows (`values`), accumulates gradients of a caller's loss over
micro-batches (`train_micro_batch`), steps AdamW with gradient clipping (`optimizer_step`), and
saves and loads its weights and optimizer state (`save`, `load`).

Guarantees:
- `values` and `train_micro_batch` compute the same function (dropout is off, eval mode).
- Values are float32 and exactly 0 off the response positions.
- The head is initialised from ``seed`` alone (normal, std ``1/(hidden+1)``, zero bias), so two
  engines built from the same directory and seed are identical.
- A step whose gradient norm is not finite is skipped (gradients dropped, counted in
  ``skipped``); the weights and optimizer state stay as they were.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from workers.devices import pick_device
from workers.engines.hf_rollout import load_causal_lm
from workers.engines.protocols import SequenceBatch, TrainerState
from workers.engines.torch_trainer import (
    adamw,
    clip_and_step,
    load_optimizer_state,
    optimizer_state,
)

__all__ = ["ValueLossFn", "ValueModel", "ValueModelEngine"]

#: the value model's weights in a directory written by `ValueModelEngine.save`
VALUE_WEIGHTS = "value_model.safetensors"

ValueLossFn = Callable[[Tensor, SequenceBatch], tuple[Tensor, Mapping[str, float]]]
"""``loss_fn(values [B, L] float32 with grad, batch on the engine's device) -> (loss, metrics)``."""


class ValueModel(torch.nn.Module):
    """Backbone + scalar head; ``forward`` returns per-token values aligned as the module says."""

    def __init__(self, backbone: torch.nn.Module, hidden: int, *, seed: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden, 1)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = torch.randn(self.head.weight.shape, generator=gen) / (hidden + 1)
            self.head.weight.copy_(w)
            self.head.bias.zero_()

    def forward(self, batch: SequenceBatch) -> Tensor:
        dev = self.head.weight.device
        ids = batch.input_ids.to(dev, torch.long)
        attn = batch.attention_mask.to(dev, torch.long)
        resp = batch.response_mask.to(dev, torch.bool)
        if bool(resp[:, :1].any()):
            raise ValueError("a response token at position 0 has no prefix to condition on")
        # Position ids follow the mask, as in rollout and the trainer.
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=ids, attention_mask=attn, position_ids=positions,
                               use_cache=False).last_hidden_state
        v = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()
        out = torch.zeros(ids.shape, dtype=torch.float32, device=dev)
        out = torch.cat([out[:, :1], v[:, :-1]], dim=1)  # token t's value from state t-1
        return out.masked_fill(~resp, 0.0)


class ValueModelEngine:
    """A `ValueModel` with AdamW on one device (CPU, CUDA or NPU).

    Weight decay applies to matrices only. ``grad_clip`` None (or 0) disables clipping.
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
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        if lr <= 0 or (grad_clip is not None and grad_clip < 0):
            raise ValueError("need lr > 0 and grad_clip >= 0 or None")
        self.device = pick_device(device)
        lm = load_causal_lm(model_dir, device=self.device, dtype=dtype)
        hidden = int(lm.config.hidden_size)
        self.model = ValueModel(lm.base_model, hidden, seed=seed).to(self.device)
        self.model.eval()  # dropout off for good: scoring and training compute one function
        self.model.requires_grad_(True)
        self._lr = lr
        self._grad_clip = grad_clip
        self._params = dict(self.model.named_parameters())
        self.optimizer = adamw(self._params.values(), lr=lr, weight_decay=weight_decay,
                               betas=betas, eps=eps)
        self._step = 0
        self._skipped = 0
        self._pending = 0  # micro-batches accumulated since the last optimizer step

    @property
    def step(self) -> int:
        """Optimizer steps applied so far."""
        return self._step

    @property
    def pending(self) -> int:
        """Micro-batches whose gradients are accumulated but not yet stepped."""
        return self._pending

    def values(self, batch: SequenceBatch) -> Tensor:
        """[B, L] float32 values on the CPU, 0 off the response; no gradient."""
        with torch.no_grad():
            out: Tensor = self.model(batch)
        return out.cpu()

    def train_micro_batch(self, batch: SequenceBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """Forward with gradients, ``loss_fn``, backward into the accumulated gradients."""
        if not bool(batch.response_mask.any()):
            raise ValueError("batch has no response tokens to train on")
        values = self.model(batch)
        loss, metrics = loss_fn(values, batch.to(self.device))
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
        torch.autograd.backward(loss)
        self._pending += 1
        return {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

    def scale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (e.g. 1 / tokens of the step)."""
        with torch.no_grad():
            for p in self._params.values():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients; returns grad_norm, lr, step, skipped."""
        if self._pending == 0:
            raise RuntimeError("optimizer_step without any train_micro_batch since the last step")
        grad_norm, skipped = clip_and_step(self.optimizer, self._params.values(), self._grad_clip)
        if skipped:
            self._skipped += 1
        else:
            self._step += 1
        self._pending = 0
        return {"grad_norm": grad_norm, "lr": self._lr, "step": float(self._step),
                "skipped": float(skipped)}

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the weights (`VALUE_WEIGHTS`) and the optimizer state (`TrainerState`, with
        ``step`` and ``skipped``) into ``directory``; gradients not yet stepped are not kept."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu").contiguous()
                   for k, v in self.model.state_dict().items()}, str(out / VALUE_WEIGHTS))
        optimizer_state(self.optimizer, self._params,
                        {"step": self._step, "skipped": self._skipped}).save(out)
        return out

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Load what `save` wrote; ValueError if it does not fit this model (nothing changed
        then), FileNotFoundError if a file is missing."""
        from safetensors.torch import load_file

        src = Path(directory)
        state = TrainerState.load(src)
        weights = load_file(str(src / VALUE_WEIGHTS))
        mine = self.model.state_dict()
        if set(weights) != set(mine) or any(
                weights[k].shape != mine[k].shape for k in mine):
            raise ValueError(f"{src / VALUE_WEIGHTS}: weights do not fit this value model")
        load_optimizer_state(self.optimizer, self._params, state)  # checks before it loads
        self.model.load_state_dict(weights)
        self._step = int(state.meta["step"])
        self._skipped = int(state.meta.get("skipped", 0))
        self._pending = 0
