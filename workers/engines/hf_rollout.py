"""Rollout on Hugging Face transformers: a batched, KV-cached sampling loop of our own.

`HFRolloutEngine` left-pads the prompts, runs one prefill and then one forward per new token
over a `DynamicCache`, samples with temperature / top-k / top-p, and records the logprob of
every sampled token under the tempered model distribution (see `protocols`). Rows that stop
leave the batch (their cache rows are dropped), so a long tail costs only its own rows.
Position ids follow the attention mask, so a left-padded row sees exactly the positions it
would see alone, and the trainer's right-padded recomputation matches it.

It is the built-in engine that runs anywhere torch runs (CPU, CUDA, NPU); vLLM is the
production engine. Not thread-safe: one call at a time, as the protocol says.

It also loads adapter payloads (`workers.engines.lora`) of a policy trained with LoRA: it
keeps a copy of the base weights of the adapted modules (the first payload takes it, from the
weights the engine was built with) and serves each version's merged weights.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from workers.devices import pick_device
from workers.engines.lora import BaseCopy, is_adapter_payload
from workers.engines.protocols import (
    FinishReason,
    Generation,
    SamplingParams,
    counter_uniforms,
    stream_keys_of,
    token_logprobs,
)
from workers.engines.tied_weights import tied_groups

__all__ = [
    "HFRolloutEngine",
    "load_causal_lm",
    "load_pretrained",
    "new_cache",
    "quiet_transformers",
]


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def quiet_transformers() -> None:
    """Turn off transformers' progress bars (process-wide): worker logs are line-oriented."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    hf_logging.disable_progress_bar()


def load_causal_lm(
    model_dir: str | os.PathLike[str],
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` offline, on ``device`` in ``dtype``, eval mode.

    Eval mode turns dropout off for good: rollout, scoring and training must compute the same
    function for importance ratios to mean anything.
    """
    return load_pretrained("AutoModelForCausalLM", model_dir, device=device, dtype=dtype,
                           attn_implementation=attn_implementation)


def load_pretrained(
    auto_class: str,
    model_dir: str | os.PathLike[str],
    *,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
) -> Any:
    """``transformers.<auto_class>.from_pretrained`` offline, on ``device`` in ``dtype``, in
    eval mode (dropout off)."""
    import transformers

    quiet_transformers()
    kwargs: dict[str, Any] = {"local_files_only": True}
    kwargs["dtype" if _transformers_version() >= (4, 56) else "torch_dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model: Any = getattr(transformers, auto_class).from_pretrained(Path(model_dir), **kwargs)
    model.to(device)
    model.eval()
    return model


class _ForwardNames:
    """Keyword names of a model's forward, which moved between transformers releases."""

    def __init__(self, model: Any) -> None:
        params = inspect.signature(model.forward).parameters
        self.cache = "cache" if "cache" in params else "past_key_values"
        self.keep = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None
        )


def new_cache(model: Any) -> Any:
    """An empty `DynamicCache` for ``model`` (its constructor changed across releases)."""
    from transformers import DynamicCache

    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=model.config)
    return DynamicCache()


def _eos_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


# Nucleus candidates are first sought among the top _FAST_K tokens: torch's CPU sort of a whole
# vocabulary costs ~50 us per row (1024 tokens), topk(64) a small fraction of it, and a trained
# policy's nucleus is nearly always that small. Rows are widened to a full sort only if needed.
_FAST_K = 64


def _pick(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw from unnormalised ``probs`` [B, K] with uniforms ``u`` [B, 1].

    The CDF is float64 where the device has it (cpu, cuda) so rounding cannot bias a large
    vocabulary; if rounding ever lands on a zero-mass entry, the row takes its argmax.
    """
    wide = torch.float64 if probs.device.type in ("cpu", "cuda") else torch.float32
    cdf = probs.to(wide).cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u.to(wide) * cdf[:, -1:], right=True)
    idx = idx.clamp_(max=probs.shape[-1] - 1).squeeze(-1)
    zero = probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(zero, probs.argmax(dim=-1), idx)


def _sample(logits: Tensor, params: SamplingParams, u: Tensor | None) -> tuple[Tensor, Tensor]:
    """Next tokens [B] and their logprobs [B] (logprob contract: tempered, untruncated).

    Sampling is exact for temperature, top-k (renormalised) and top-p (computed on the top-k
    distribution, as HF and vLLM do); one uniform number per row (``u`` [B, 1]; None when
    greedy) drives the draw.
    """
    logits = logits.float()
    if params.temperature == 0.0 or u is None:
        tokens = logits.argmax(dim=-1)
        return tokens, token_logprobs(logits, tokens, 1.0)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    vocab = scaled.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not top_k and params.top_p >= 1.0:
        tokens = _pick(scaled.softmax(dim=-1), u)
        return tokens, token_logprobs(scaled, tokens, 1.0)

    if top_k:
        vals, order = torch.topk(scaled, top_k, dim=-1)
        norm = torch.logsumexp(vals, dim=-1, keepdim=True)
    else:
        norm = torch.logsumexp(scaled, dim=-1, keepdim=True)
        vals, order = torch.topk(scaled, min(_FAST_K, vocab), dim=-1)
        if bool(((vals - norm).exp().sum(dim=-1) < params.top_p).any()):
            vals, order = torch.sort(scaled, dim=-1, descending=True)
    probs = (vals - norm).exp()
    if params.top_p < 1.0:
        # Drop a candidate once the mass before it reaches top_p; the first always stays.
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p, 0.0)
    idx = _pick(probs, u)
    tokens = order.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return tokens, token_logprobs(scaled, tokens, 1.0)


def _servable_in_place(target: Tensor, source: Tensor) -> bool:
    return (source.dtype == target.dtype and source.device == target.device
            and source.is_contiguous())


class HFRolloutEngine:
    """`RolloutEngine` over a transformers causal LM, with our own KV-cached decode loop."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        attn_implementation: str | None = None,
        version: int = 0,
        model: Any = None,
    ) -> None:
        """``model``: generate with this module (a colocated trainer's, eval mode) instead of
        loading one from ``model_dir``; its device and dtype are then the engine's."""
        self.device = pick_device(device)
        self.model_dir = Path(model_dir)
        self._tokenizer: Any = None  # loaded on first use of stop strings
        self.model = model if model is not None else load_causal_lm(
            model_dir, device=self.device, dtype=dtype, attn_implementation=attn_implementation
        )
        self._names = _ForwardNames(self.model)
        self._eos = _eos_ids(self.model)
        pad = getattr(self.model.config, "pad_token_id", None)
        self._pad = int(pad) if pad is not None else min(self._eos, default=0)
        self._max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._groups = tied_groups(self.model)
        # The model's own tensors, looked up once: walking the module tree for a state dict
        # costs more than copying a small model's weights, and load_weights runs every step.
        self._targets: dict[str, Tensor] = self.model.state_dict(keep_vars=True)
        self._known = {name for group in self._groups for name in group}
        self._version = version
        self._borrowing = False  # the weights are views of a shared version (load_weights)
        #: base weights that adapter payloads merge into; None once whole weights were loaded
        self._base: BaseCopy | None = BaseCopy(self._targets)

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_positions(self) -> int | None:
        """The model's longest context (prompt and generated tokens), when its config says."""
        return self._max_positions

    @property
    def stop_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids: generation always stops at them."""
        return frozenset(self._eos)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def forward_names(self) -> _ForwardNames:
        """The cache and logits-to-keep keyword names of the model's forward."""
        return self._names

    def text_tokenizer(self) -> Any:
        """The model directory's tokenizer (loaded on first use: only stop strings need it)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        return self._tokenizer

    # -- weights ---------------------------------------------------------------------------

    def load_weights(
        self, state: Mapping[str, Tensor], version: int, *, shared: bool = False
    ) -> None:
        if is_adapter_payload(state):
            self._load_adapter(state, version)
            return
        params = self._targets
        unknown = set(state) - self._known
        if unknown:
            raise KeyError(f"unknown weight names: {sorted(unknown)[:5]}")
        plan: list[tuple[Tensor, Tensor]] = []
        for group in self._groups:
            source = next((state[n] for n in group if n in state), None)
            if source is None:
                raise KeyError(f"missing weight: {group[0]}")
            target = params[group[0]]
            if tuple(source.shape) != tuple(target.shape):
                raise ValueError(
                    f"{group[0]}: shape {tuple(source.shape)} != {tuple(target.shape)}"
                )
            plan.append((target, source))
        # A shared version of our dtype and device is served in place: no copy, and no second
        # copy of the weights in this process. All or nothing, so the model never mixes both.
        borrow = shared and all(_servable_in_place(t, s) for t, s in plan)
        with torch.no_grad():
            for target, source in plan:
                if borrow:
                    target.data = source
                elif self._borrowing:  # our tensors are the store's (read-only): own new ones
                    target.data = source.to(target.device, target.dtype, copy=True)
                else:
                    target.copy_(source)
        self._borrowing = borrow
        self._base = None
        self._version = version

    @property
    def weight_targets(self) -> Mapping[str, Tensor]:
        """The model's own tensors by state-dict name (a tied weight under each of its names):
        what an in-place load copies into (`workers.resharding.copy_into`)."""
        return self._targets

    def serve_in_place(self, version: int) -> None:
        """The model's own tensors hold ``version`` now (a colocated trainer stepped them):
        serve it, with nothing to load."""
        self._base = None
        self._version = version

    def _load_adapter(self, payload: Mapping[str, Tensor], version: int) -> None:
        if self._base is None:
            raise ValueError("an adapter payload needs the base weights this engine was built "
                             "with, and it has loaded whole weights since")
        self._base.apply(self._base.plan(payload))  # checked in full before anything changes
        self._version = version

    # -- generation ------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        width = max(len(p) for p in prompts)
        if self._max_positions is not None and width + params.max_new_tokens > self._max_positions:
            raise ValueError(
                f"prompt ({width}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"model's {self._max_positions} positions"
            )
        gen = self._gen
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        keys: Tensor | None = None
        if params.prompt_seeds is not None:
            if len(params.prompt_seeds) != len(prompts):
                raise ValueError(f"{len(params.prompt_seeds)} prompt_seeds for "
                                 f"{len(prompts)} prompts")
            keys = stream_keys_of(params.prompt_seeds, params.n, self.device)
        stop = torch.tensor(sorted(self._eos | set(params.stop_token_ids)), dtype=torch.long,
                            device=self.device)
        kwargs: dict[str, Any] = {self._names.cache: new_cache(self.model), "use_cache": True}
        if self._names.keep is not None:
            kwargs[self._names.keep] = 1
        logits, mask, next_pos = self._prefill(prompts, width, params.n, kwargs)

        batch, steps = logits.shape[0], params.max_new_tokens
        out_tokens = torch.zeros((batch, steps), dtype=torch.long, device=self.device)
        out_lps = torch.zeros((batch, steps), dtype=torch.float32, device=self.device)
        lengths = [steps] * batch
        reasons: list[FinishReason] = ["length"] * batch
        # active[j] = the output row that row j of the (shrinking) decode batch belongs to.
        active = torch.arange(batch, device=self.device)
        for t in range(steps):
            u: Tensor | None = None
            if params.temperature > 0.0:
                u = (counter_uniforms(keys, t) if keys is not None else
                     torch.rand((logits.shape[0], 1), generator=gen, device=self.device))
            tokens, lps = _sample(logits, params, u)
            out_tokens[active, t] = tokens
            out_lps[active, t] = lps
            done = torch.isin(tokens, stop)
            if params.stop:
                done |= self._completes_stop_string(out_tokens, active, t, params.stop)
            if bool(done.any()):
                for r in active[done].tolist():
                    lengths[r], reasons[r] = t + 1, "stop"
                if t == steps - 1 or bool(done.all()):
                    break
                # Finished rows leave the batch, cache included: the tail costs only itself.
                keep = (~done).nonzero().squeeze(-1)
                kwargs[self._names.cache].batch_select_indices(keep)
                active, tokens = active[keep], tokens[keep]
                if keys is not None:
                    keys = keys[keep]
                mask, next_pos = mask[keep], next_pos[keep]
            elif t == steps - 1:
                break
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = self.model(
                input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=next_pos, **kwargs
            ).logits[:, -1, :]
            next_pos = next_pos + 1

        tokens_cpu, lps_cpu = out_tokens.cpu(), out_lps.cpu()
        return [
            Generation(
                prompt_index=i // params.n,
                response_ids=tokens_cpu[i, : lengths[i]].clone(),
                logprobs=lps_cpu[i, : lengths[i]].clone(),
                finish_reason=reasons[i],
                version=self._version,
            )
            for i in range(batch)
        ]

    def _completes_stop_string(
        self, out_tokens: Tensor, active: Tensor, t: int, stops: tuple[str, ...]
    ) -> Tensor:
        """Rows whose response text now contains a stop string (checked every step, so the
        first hit is the token that completes it)."""
        tokenizer = self.text_tokenizer()
        # Every token decodes to at least one byte: this many tokens cover any stop string.
        window = max(len(s.encode()) for s in stops)
        tails = out_tokens[active, max(0, t + 1 - window) : t + 1].tolist()
        texts = tokenizer.batch_decode(
            tails, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        hits = [any(s in text for s in stops) for text in texts]
        return torch.tensor(hits, dtype=torch.bool, device=self.device)

    def _prefill(
        self, prompts: Sequence[Sequence[int]], width: int, n: int, kwargs: dict[str, Any]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run the left-padded prompts once, then fan each out to its n sampling rows.

        Returns last-position logits [B*n, V], the attention mask [B*n, width] and the next
        position ids [B*n, 1]; the cache in ``kwargs`` holds B*n rows, prompt-major.
        """
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs
        ).logits[:, -1, :]
        next_pos = positions[:, -1:] + 1
        if n > 1:
            kwargs[self._names.cache].batch_repeat_interleave(n)
            logits, mask, next_pos = (
                x.repeat_interleave(n, dim=0) for x in (logits, mask, next_pos)
            )
        return logits, mask, next_pos
