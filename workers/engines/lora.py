"""Low-rank adapters (LoRA) on a causal LM through ``peft``, and the weight payload that
carries only them.

The trainer wraps its policy with `wrap`: every targeted linear layer gets two small matrices
``A`` [r, in] and ``B`` [out, r] (``B`` starts at zero, so the wrapped model computes what the
base model does) and only they train. A new policy version then needs only the adapters:

- An *adapter payload* (`adapter_payload`) maps ``<module>.lora_A`` and ``<module>.lora_B`` to
  the matrices of each adapted module (its name in the base model: ``<module>.weight`` is the
  weight it adapts) and `SCALE_KEY` to the scale ``alpha / rank`` ([1] float32). It is complete
  for its version: any engine holding the base weights rebuilds that version from it alone.
- The merged weight of a module is ``base + scale * (B @ A)`` computed in float32 and cast to the
  base weight's dtype (`merged`): the one formula the trainer's merged export and a rollout
  engine's merge both use, so they agree bit for bit given the same base.

`BaseCopy` is a rollout engine's side: it keeps the base weights of the adapted modules and
merges each payload into the engine's weights. `save_adapter` writes peft's own format
(``adapter_model.safetensors`` + ``adapter_config.json``); `payload_from_dir` reads it back.

Imports peft lazily: only a run with adapters needs it (``pip install 'flowrl[lora]'``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowrl.worker_spec import LoraSpec

__all__ = [
    "ADAPTER_DIR",
    "SCALE_KEY",
    "BaseCopy",
    "LoraPolicy",
    "adapter_entries",
    "is_adapter_payload",
    "merged",
    "payload_from_dir",
    "payload_nbytes",
]

#: where `save_pretrained` puts the adapter beside the merged weights it writes
ADAPTER_DIR = "adapter"
#: the payload's scale entry; its presence marks a payload that carries adapters.
SCALE_KEY = "lora.scale"
_A, _B = ".lora_A", ".lora_B"
_ADAPTER = "default"  # peft's name for the one adapter a model gets
_PEFT_PREFIX = "base_model.model."  # what peft puts before a module's name in its files


def is_adapter_payload(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` carries adapters (alone, or beside merged weights)."""
    return SCALE_KEY in state


def adapter_entries(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``state`` split into (whole weights, adapter entries with the scale)."""
    adapter = {k: v for k, v in state.items()
               if k == SCALE_KEY or k.endswith(_A) or k.endswith(_B)}
    return {k: v for k, v in state.items() if k not in adapter}, adapter


def payload_nbytes(state: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def merged(base: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``base + scale * (b @ a)`` in float32, cast to ``base``'s dtype (a new tensor)."""
    delta = (b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)) * scale
    return (base.float() + delta).to(base.dtype)


def _modules(payload: Mapping[str, Tensor]) -> tuple[dict[str, tuple[Tensor, Tensor]], float]:
    """The payload's (A, B) by module and its scale; ValueError when it is malformed."""
    scale_t = payload.get(SCALE_KEY)
    if scale_t is None or scale_t.numel() != 1:
        raise ValueError(f"an adapter payload needs {SCALE_KEY!r} with one value")
    scale = float(scale_t.reshape(()))
    if not math.isfinite(scale):
        raise ValueError(f"adapter scale {scale} is not finite")
    names = {k[: -len(_A)] for k in payload if k.endswith(_A)}
    other = {k[: -len(_B)] for k in payload if k.endswith(_B)}
    if names != other:
        raise ValueError(f"adapters without their pair: {sorted(names ^ other)[:5]}")
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for name in sorted(names):
        a, b = payload[name + _A], payload[name + _B]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not pair")
        out[name] = (a, b)
    return out, scale


class LoraPolicy:
    """A transformers causal LM with adapters injected by peft (`wrap`), seen by the trainer.

    ``model`` stays the transformers model (its targeted linear layers now peft's); ``peft``
    is peft's wrapper of it, which saves the adapter in peft's format.
    """

    def __init__(self, model: Any, spec: LoraSpec) -> None:
        try:
            import peft
        except ImportError:
            raise ImportError("model.lora needs the peft package: pip install "
                              "'flowrl[lora]'") from None
        from workers.engines.tied_weights import tied_groups

        tied = {n for g in tied_groups(model) if len(g) > 1 for n in g}
        targets: Any = (spec.target_modules if isinstance(spec.target_modules, str)
                        else list(spec.target_modules))
        config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                 target_modules=targets, bias="none")
        model.requires_grad_(False)
        try:
            with warnings.catch_warnings():
                # peft reads transformers' deprecated ``is_gradient_checkpointing`` alias.
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                        category=FutureWarning)
                self.peft: Any = peft.get_peft_model(model, config)
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"model.lora.target_modules: {e}") from None
        self.model = model
        #: module name (in the base model) → its peft layer
        self.layers: dict[str, Any] = {
            name: module for name, module in model.named_modules()
            if isinstance(module, peft.tuners.lora.LoraLayer)}
        for name, layer in self.layers.items():
            if not isinstance(layer.base_layer, torch.nn.Linear):
                raise ValueError(f"model.lora.target_modules: {name} is a "
                                 f"{type(layer.base_layer).__name__}; adapters go on "
                                 "torch.nn.Linear layers only")
            if f"{name}.weight" in tied:
                raise ValueError(f"model.lora.target_modules: {name}'s weight is tied to "
                                 "another one (an adapter on it would untie them)")
        scales = {float(layer.scaling[_ADAPTER]) for layer in self.layers.values()}
        if len(scales) != 1:
            raise ValueError(f"the adapters have several scales {sorted(scales)}")
        self.scale = scales.pop()
        self._dropouts = [m for layer in self.layers.values()
                          for m in layer.lora_dropout.values() if isinstance(m, torch.nn.Dropout)]

    @staticmethod
    def clean_name(name: str) -> str:
        """A state-dict name of the wrapped model as the base model names it."""
        return name.replace(".base_layer.", ".")

    @contextlib.contextmanager
    def dropout(self) -> Iterator[None]:
        """Adapter dropout on for a training pass (the model stays in eval mode otherwise)."""
        for m in self._dropouts:
            m.train(True)
        try:
            yield
        finally:
            for m in self._dropouts:
                m.train(False)

    def adapter_payload(self) -> dict[str, Tensor]:
        """The adapters of this version: contiguous CPU copies, with the scale."""
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, layer in self.layers.items():
                for suffix, mods in ((_A, layer.lora_A), (_B, layer.lora_B)):
                    out[name + suffix] = mods[_ADAPTER].weight.detach().to(
                        "cpu", copy=True).contiguous()
        out[SCALE_KEY] = torch.tensor([self.scale], dtype=torch.float32)
        return out

    def load_adapter(self, payload: Mapping[str, Tensor]) -> None:
        """Copy a payload's adapters into the model; every name and shape is checked first
        (a bad payload changes nothing)."""
        pairs, scale = _modules(adapter_entries(payload)[1])
        if set(pairs) != set(self.layers):
            raise KeyError(f"the payload adapts {sorted(set(pairs) ^ set(self.layers))[:5]} "
                           "differently from this model")
        if not math.isclose(scale, self.scale, rel_tol=1e-6):
            raise ValueError(f"adapter scale {scale} != this model's {self.scale}")
        for name, (a, b) in pairs.items():
            layer = self.layers[name]
            for t, p in ((a, layer.lora_A[_ADAPTER].weight), (b, layer.lora_B[_ADAPTER].weight)):
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: adapter shape {tuple(t.shape)} != "
                                     f"{tuple(p.shape)}")
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                layer = self.layers[name]
                layer.lora_A[_ADAPTER].weight.copy_(a)
                layer.lora_B[_ADAPTER].weight.copy_(b)

    def merged_weights(self, groups: list[list[str]]) -> dict[str, Tensor]:
        """Whole merged weights as the base model names them (CPU copies), a tied weight once;
        ``groups``: the wrapped model's tied groups (`tied_groups`)."""
        state = self.model.state_dict()
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for group in groups:
                name = group[0]
                if any(part in name for part in (".lora_A.", ".lora_B.")):
                    continue
                clean = self.clean_name(name)
                module = clean.removesuffix(".weight")
                layer = self.layers.get(module) if clean.endswith(".weight") else None
                tensor = state[name].detach()
                if layer is not None:
                    tensor = merged(tensor, layer.lora_A[_ADAPTER].weight,
                                    layer.lora_B[_ADAPTER].weight, self.scale)
                out[clean] = tensor.to("cpu", copy=True).contiguous()
        return out

    def save_adapter(self, directory: str | os.PathLike[str]) -> None:
        """peft's files (``adapter_model.safetensors``, ``adapter_config.json``)."""
        self.peft.save_pretrained(str(directory))


def payload_from_dir(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The adapter payload of an adapter `LoraPolicy.save_adapter` wrote."""
    from safetensors.torch import load_file

    src = Path(directory)
    config = json.loads((src / "adapter_config.json").read_text())
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    out: dict[str, Tensor] = {SCALE_KEY: torch.tensor([scale], dtype=torch.float32)}
    for key, tensor in load_file(str(src / "adapter_model.safetensors")).items():
        name = key.removeprefix(_PEFT_PREFIX).removesuffix(".weight")
        if not (name.endswith(_A) or name.endswith(_B)):
            raise ValueError(f"{src}: {key!r} is not a LoRA matrix")
        out[name] = tensor
    _modules(out)
    return out


class BaseCopy:
    """A rollout engine's base weights of the adapted modules, which adapter payloads merge
    into. ``targets``: the engine's own weight tensors by name, holding the base weights now
    (they are copied the first time a payload adapts them)."""

    def __init__(self, targets: Mapping[str, Tensor]) -> None:
        self._targets = targets
        self._base: dict[str, Tensor] = {}

    def plan(self, payload: Mapping[str, Tensor]) -> list[tuple[str, Tensor, Tensor, float]]:
        """Checks a payload against the weights: (weight name, A, B, scale) per module."""
        weights, adapter = adapter_entries(payload)
        if weights:
            raise ValueError(f"an adapter payload with whole weights too: {sorted(weights)[:3]}")
        pairs, scale = _modules(adapter)
        plan = []
        for module, (a, b) in pairs.items():
            name = f"{module}.weight"
            target = self._targets.get(name)
            if target is None:
                raise KeyError(f"adapter for unknown weight {name!r}")
            if (b.shape[0], a.shape[1]) != tuple(target.shape):
                raise ValueError(f"{name}: adapter makes {(b.shape[0], a.shape[1])}, the weight "
                                 f"is {tuple(target.shape)}")
            plan.append((name, a, b, scale))
        return plan

    def apply(self, plan: list[tuple[str, Tensor, Tensor, float]]) -> None:
        """Each planned weight becomes its base plus the adapter; a weight adapted before but
        not now goes back to its base."""
        planned = {name for name, *_ in plan}
        with torch.no_grad():
            for name, a, b, scale in plan:
                target = self._targets[name]
                base = self._base.setdefault(name, target.detach().clone())
                target.copy_(merged(base, a, b, scale))
            for name, base in self._base.items():
                if name not in planned:
                    self._targets[name].copy_(base)
