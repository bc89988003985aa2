"""The narrow seams between flowrl roles and compute engines.

A rollout engine generates responses and takes new weights; a trainer engine computes per-token
logprobs, accumulates gradients, steps its optimizer and exports weights. Roles code against
these protocols only, so an engine (HF transformers, vLLM, a user's own) is swapped without
touching the roles.

The logprob contract, shared by every engine:
- A reported logprob is ``log_softmax(logits / T)[token]`` in float32, where ``T`` is the
  sampling temperature (``T = 1`` when sampling greedily, ``temperature == 0``). It is the
  logprob under the tempered *model* distribution, before top-k / top-p truncation (vLLM's
  "raw" mode, verl's actor convention), so a trainer that computes `token_logprobs` at the same
  temperature gets the same number up to kernel rounding, and importance ratios between rollout
  and training policies are well defined.
- `token_logprobs` below is the reference definition; engines use it or match it.

Engine-native weight paths: besides `RolloutEngine.load_weights` (a name → tensor mapping, e.g.
views over a shared-memory segment), an engine may implement
``load_weights_from(source: str | os.PathLike | object, version: int) -> None`` for its own fast
path (a safetensors directory, a CUDA/NPU IPC handle, an NCCL broadcast group). Roles check for
it with ``hasattr`` and fall back to `load_weights`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "FinishReason",
    "Generation",
    "LossFn",
    "RolloutEngine",
    "SamplingParams",
    "SequenceBatch",
    "TrainerEngine",
    "TrainerState",
    "counter_uniforms",
    "mix_seed",
    "stream_keys_of",
    "token_logprobs",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``n`` responses per prompt; ``top_k = 0`` and ``top_p = 1`` disable them.

    ``temperature == 0`` is greedy decoding. ``seed`` makes one `generate` call reproducible on
    its own (same prompts, weights and device → same tokens); with ``seed=None`` the engine's
    own generator advances, so a sequence of calls is reproducible from the engine's seed.
    Generation stops at the model's EOS token(s), at any of ``stop_token_ids``, and at the
    token that completes any of the ``stop`` strings in the decoded response.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    #: one seed per prompt: response j of prompt i draws its tokens from a stream keyed by
    #: (``prompt_seeds[i]``, j, token index) alone, so a prompt samples the same responses from
    #: the same weights whatever else shares its batch and whichever worker runs it (a redone
    #: task repeats itself). Overrides ``seed`` and the engine's generator.
    prompt_seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.prompt_seeds is not None:
            object.__setattr__(self, "prompt_seeds", tuple(int(x) for x in self.prompt_seeds))


@dataclass(frozen=True)
class Generation:
    """One response. Results come prompt-major: prompt i's n responses are at i*n .. i*n+n-1.

    ``response_ids`` (int64, 1-D) includes the stop token (or the token completing a stop
    string) when ``finish_reason == "stop"``, so training teaches the policy to stop.
    ``logprobs`` (float32, same length) follows the module's logprob contract. ``version`` is
    the weight version that produced it (its last token); ``token_versions`` (int32, same
    length), when the engine records it, the version that produced each token.
    """

    prompt_index: int
    response_ids: Tensor
    logprobs: Tensor
    finish_reason: FinishReason
    version: int
    token_versions: Tensor | None = None


@dataclass(frozen=True)
class SequenceBatch:
    """Prompt+response rows for scoring or training, right-padded to a common length.

    input_ids: [B, L] int64. attention_mask: [B, L], 1 on real tokens.
    response_mask: [B, L] bool, True where ``input_ids[b, t]`` is a response token to score
    and train on. span_mask: [B, L] bool, True on every token after the prompt (the row's
    ``response_ids``), None when it equals ``response_mask``. They differ for a multi-turn
    trajectory: tokens inserted between the policy's turns (tool results, environment
    messages) are in the span and in the context, but are not trained.
    Every row needs at least one token before its first response token.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    span_mask: Tensor | None = None

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got {tuple(shape)}")
        if self.attention_mask.shape != shape or self.response_mask.shape != shape:
            raise ValueError("input_ids, attention_mask and response_mask shapes differ")
        if self.span_mask is not None and self.span_mask.shape != shape:
            raise ValueError("input_ids and span_mask shapes differ")

    @classmethod
    def from_rows(
        cls,
        prompts: Sequence[Sequence[int] | Tensor],
        responses: Sequence[Sequence[int] | Tensor],
        *,
        pad_token_id: int = 0,
        loss_masks: Sequence[Sequence[bool] | Tensor] | None = None,
    ) -> SequenceBatch:
        """Concatenate each prompt with its response and right-pad. ``loss_masks`` (one per
        row, aligned with its response): which response tokens are trained; None: all."""
        if len(prompts) != len(responses):
            raise ValueError("prompts and responses differ in length")
        if loss_masks is not None and len(loss_masks) != len(responses):
            raise ValueError("loss_masks and responses differ in length")
        pairs = [(torch.as_tensor(p, dtype=torch.long), torch.as_tensor(r, dtype=torch.long))
                 for p, r in zip(prompts, responses, strict=True)]
        width = max((len(p) + len(r) for p, r in pairs), default=0)
        ids = torch.full((len(pairs), width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(pairs), width), dtype=torch.long)
        resp = torch.zeros((len(pairs), width), dtype=torch.bool)
        for i, (p, r) in enumerate(pairs):
            if len(p) == 0:
                raise ValueError(f"row {i}: empty prompt")
            ids[i, : len(p)] = p
            ids[i, len(p) : len(p) + len(r)] = r
            attn[i, : len(p) + len(r)] = 1
            resp[i, len(p) : len(p) + len(r)] = True
        if loss_masks is None:
            return cls(ids, attn, resp)
        train = torch.zeros_like(resp)
        for i, ((p, r), lm) in enumerate(zip(pairs, loss_masks, strict=True)):
            lm_t = torch.as_tensor(lm, dtype=torch.bool)
            if lm_t.shape != r.shape:
                raise ValueError(f"row {i}: loss mask of {tuple(lm_t.shape)} for "
                                 f"{len(r)} response tokens")
            train[i, len(p) : len(p) + len(r)] = lm_t
        return cls(ids, attn, train, resp)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def span(self) -> Tensor:
        """[B, L] bool: the tokens after each row's prompt (``span_mask`` or the response)."""
        return self.response_mask if self.span_mask is None else self.span_mask

    def to(self, device: torch.device) -> SequenceBatch:
        return SequenceBatch(
            self.input_ids.to(device), self.attention_mask.to(device),
            self.response_mask.to(device),
            None if self.span_mask is None else self.span_mask.to(device))

    def response_values(self, per_token: Tensor) -> list[Tensor]:
        """Split a [B, L] per-token tensor into each row's values over its response span
        (1-D, in order, aligned with ``response_ids``; 0 on tokens not trained)."""
        mask = self.response_mask.to(per_token.device)
        if self.span_mask is None:
            return [per_token[b][mask[b]] for b in range(per_token.shape[0])]
        span = self.span_mask.to(per_token.device)
        values = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype,
                                                          device=per_token.device))
        return [values[b][span[b]] for b in range(per_token.shape[0])]

    def per_token(self, values: Sequence[Tensor], name: str) -> Tensor:
        """Per-row 1-D values aligned with each row's response span laid onto [B, L] float32
        (0 off the span and on tokens not trained): the inverse of `response_values`."""
        span = self.span
        counts = span.sum(dim=-1).tolist()
        for i, (v, n) in enumerate(zip(values, counts, strict=True)):
            if v.numel() != n:
                raise ValueError(f"row {i}: {name} has {v.numel()} values for {n} response "
                                 "tokens")
        out = torch.zeros(span.shape, dtype=torch.float32)
        if values:
            # Boolean-mask assignment fills row-major, and each row's span positions are in
            # order, so the concatenated rows land exactly on their tokens.
            out[span.cpu()] = torch.cat([v.reshape(-1).to(torch.float32) for v in values])
        if self.span_mask is not None:
            out = out.masked_fill(~self.response_mask.cpu(), 0.0)
        return out


LossFn = Callable[[Tensor, SequenceBatch], Tensor | tuple[Tensor, Mapping[str, float]]]
"""``loss_fn(logprobs [B, L] float32 with grad, batch) -> loss`` or ``(loss, metrics)``.

Extra per-row inputs (advantages, old or reference logprobs) travel in the closure."""


@dataclass(frozen=True)
class TrainerState:
    """Optimizer checkpoint: flat CPU tensors plus JSON-able metadata; no pickle involved."""

    tensors: dict[str, Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | Path) -> Path:
        """Write ``optimizer.safetensors`` and ``trainer_state.json`` into ``directory``."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()},
                  str(out / "optimizer.safetensors"))
        (out / "trainer_state.json").write_text(json.dumps(self.meta, indent=1) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> TrainerState:
        from safetensors.torch import load_file

        src = Path(directory)
        tensors = load_file(str(src / "optimizer.safetensors"))
        meta = json.loads((src / "trainer_state.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"{src / 'trainer_state.json'}: expected a JSON object")
        return cls(dict(tensors), meta)


_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF


def mix_seed(*keys: int) -> int:
    """A well-mixed 64-bit seed from integers (splitmix64 chained over ``keys``).

    How a run derives a prompt's sampling stream from its own seed and the prompt's dataset
    position (`SamplingParams.prompt_seeds`); any engine or test can reproduce it.
    """
    x = 0x9E3779B97F4A7C15
    for k in keys:
        x = (x ^ (int(k) & _M64)) + 0x9E3779B97F4A7C15 & _M64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
        x ^= x >> 31
    return x


def _fmix32(h: Tensor) -> Tensor:
    # murmur3's finalizer on values in [0, 2**32) held in int64: products wrap, the mask keeps
    # the low 32 bits exact, and shifts of non-negative values are logical.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def counter_uniforms(stream_keys: Tensor, step: int | Tensor) -> Tensor:
    """Uniforms in (0, 1), shape [B, 1], float64: a pure function of each row's key and ``step``.

    ``stream_keys`` [B, 2] int64 holds each row's 64-bit stream key as two 32-bit halves
    (`stream_keys_of`). Counter-based, so a row's draws do not depend on the batch it is in;
    32 bits per draw. ``step``: one for all rows, or [B] int64, each row's own (rows that joined
    a running batch at different times).
    """
    lo, hi = stream_keys[:, 0], stream_keys[:, 1]
    t = (step * 0x9E3779B9 + 0x7F4A7C15) & _M32
    h = _fmix32(_fmix32(lo ^ t) ^ hi)
    h = _fmix32(h ^ ((hi * 0x27D4EB2F + t) & _M32))
    return ((h.to(torch.float64) + 0.5) / 4294967296.0).unsqueeze(-1)


def stream_keys_of(prompt_seeds: Sequence[int], n: int, device: torch.device) -> Tensor:
    """[len(prompt_seeds) * n, 2] stream keys, prompt-major: response j of prompt i."""
    keys = [mix_seed(s, j) for s in prompt_seeds for j in range(n)]
    return torch.tensor([[k & _M32, k >> 32] for k in keys], dtype=torch.int64, device=device)


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / T)`` at ``token_ids``, in float32. ``T <= 0`` counts as 1.

    logits: [..., V]; token_ids: [...] → [...].
    """
    x = logits.float()
    if temperature > 0.0 and temperature != 1.0:
        x = x / temperature
    picked = x.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses with the weights of one policy version.

    Calls are not concurrent: a worker runs `generate` and `load_weights` one at a time
    (weights change only between requests).
    """

    @property
    def version(self) -> int:
        """The weight version currently loaded."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """``len(prompts) * params.n`` generations, prompt-major."""
        ...

    def load_weights(
        self, state: Mapping[str, Tensor], version: int, *, shared: bool = False
    ) -> None:
        """Replace every weight with ``state`` (names as in ``export_weights``; a tied weight
        may appear under either of its names) and serve ``version`` from now on. All names
        and shapes are checked before anything is written; a bad state leaves the engine as
        it was.

        ``shared``: the tensors are a version published in the node store, read-only,
        unchanged and alive until this engine has loaded another version; an engine may serve
        from them in place instead of copying them (and must not write into them).

        A policy trained with LoRA may publish adapters (`workers.engines.lora`): alone, to an
        engine that merges them into its base weights (`HFRolloutEngine`), or beside merged
        whole weights, which an engine that loads only those takes, leaving the adapters."""
        ...


@runtime_checkable
class TrainerEngine(Protocol):
    """Owns the trainable policy and its optimizer."""

    @property
    def step(self) -> int:
        """Steps applied so far (the learning-rate schedule's place)."""
        ...

    def logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0) -> Tensor:
        """[B, L] float32 logprobs of each response token given its prefix; 0 elsewhere."""
        ...

    def train_micro_batch(
        self,
        batch: SequenceBatch,
        loss_fn: LossFn,
        *,
        loss_scale: float = 1.0,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Forward, ``loss_fn``, backward of ``loss * loss_scale`` into the accumulated
        gradients (``loss_scale`` is the micro-batch's share of the step, e.g. 1/k)."""
        ...

    def optimizer_step(self, *, advance: bool = True) -> dict[str, float]:
        """Clip, step, zero the gradients; returns grad_norm, lr, step, skipped. ``advance``
        False keeps the schedule's place: an update before the last of a step's several
        (PPO epochs and mini-batches) runs at the same rate as the last."""
        ...

    def join_at(self, steps: int) -> None:
        """Continue the learning-rate schedule after ``steps`` optimizer steps taken by a
        predecessor (a trainer started within a run, joining at the run's version)."""
        ...

    def export_weights(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """A snapshot of the weights: contiguous CPU tensors, a tied weight once."""
        ...

    def state_dict(self) -> TrainerState:
        """Optimizer and schedule state (the weights go through `save_pretrained`)."""
        ...

    def load_state_dict(self, state: TrainerState) -> None: ...

    def save_pretrained(
        self, directory: str | Path, *, state_dict: Mapping[str, Tensor] | None = None
    ) -> Path:
        """Weights (safetensors), HF config and tokenizer, loadable by ``from_pretrained``;
        ``state_dict``: the weights to write instead of the model's own (a sharded model's
        whole tensors, gathered beforehand)."""
        ...
