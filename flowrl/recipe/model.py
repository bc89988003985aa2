"""The ``model`` section: the policy model, a local directory or a tiny Qwen2 built here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flowrl.recipe.section import _PathText, _rule, _Section

TINY_MODEL = "tiny"
"""`ModelConfig.path` value that builds a tiny Qwen2 model locally instead of loading one."""


class TinyModelConfig(_Section):
    """A tiny Qwen2 model built locally (no model hub): ``flowrl.tiny_model.build_tiny_model``."""

    hidden: int = Field(default=128, ge=8, le=4096)
    """Hidden size; must divide by `heads`."""
    layers: int = Field(default=4, ge=1, le=64)
    """Transformer layers."""
    heads: int = Field(default=4, ge=1, le=64)
    """Attention heads; must divide by `kv_heads`."""
    kv_heads: int = Field(default=2, ge=1, le=64)
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = Field(default=1024, ge=300, le=65536)
    """Upper bound on the byte-level BPE vocabulary trained on the synthetic corpus."""
    max_positions: int = Field(default=512, ge=16, le=32768)
    """Longest prompt + response the model accepts."""
    pretrain_steps: int = Field(default=0, ge=0, le=100_000)
    """Language-modelling steps on the synthetic corpus before RL; 0 keeps random weights.
    With `pretrain_until`, the most steps the warm-up runs."""
    pretrain_until: float | None = Field(default=None, gt=0.0, le=1.0)
    """End the warm-up once the model answers this share of the corpus's distinct
    ``question=answer`` lines exactly (greedily; checked every 100 steps), instead of after a
    fixed number of steps: how fast the model learns its facts depends on the CPU's kernels,
    so a target gives models built on different CPUs about the same knowledge. None: run
    `pretrain_steps`. Without warm-up steps (`pretrain_steps` 0) there is nothing to end."""
    seed: int = Field(default=0, ge=0)
    """Seed of the corpus, tokenizer and weights (the build is deterministic)."""
    corpus: Literal["mixed", "arithmetic", "tool_calls"] = "mixed"
    """Synthetic corpus of the tokenizer and the warm-up: ``mixed`` (arithmetic lines, words
    and pseudo-words), ``arithmetic`` (only ``a<op>b=c`` lines with single-digit operands) or
    ``tool_calls`` (two-digit sums answered directly or with a calculator call:
    ``flowrl.tiny_model.tool_call_line``)."""

    @model_validator(mode="after")
    def _shapes(self) -> TinyModelConfig:
        if self.hidden % self.heads:
            raise _rule("hidden", f"{self.hidden} does not divide by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise _rule("heads", f"{self.heads} does not divide by kv_heads={self.kv_heads}")
        return self


LORA_ALL_LINEAR: Literal["all-linear"] = "all-linear"
"""`LoraConfig.target_modules` value: every linear layer but the output head."""


class LoraConfig(_Section):
    """Low-rank adapters on the policy (the ``peft`` library, ``pip install 'flowrl[lora]'``):
    only the adapters train; rollout engines get the adapter (HF) or merged weights (vLLM)."""

    rank: int = Field(default=16, ge=1, le=4096)
    """Rank ``r`` of each adapter's two matrices."""
    alpha: int = Field(default=32, ge=1, le=1 << 20)
    """Scale numerator: an adapter adds ``(alpha / rank) * B @ A`` to its weight."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input in training passes (scoring never drops out)."""
    target_modules: tuple[str, ...] | Literal["all-linear"] = LORA_ALL_LINEAR
    """Module names (or name suffixes) that get adapters, e.g. ``("q_proj", "v_proj")``;
    ``"all-linear"``: every linear layer but the output head."""

    @model_validator(mode="after")
    def _targets(self) -> LoraConfig:
        if not isinstance(self.target_modules, str) and (
                not self.target_modules or any(not t for t in self.target_modules)):
            raise _rule("target_modules", "name at least one module (or 'all-linear')")
        return self


class ModelConfig(_Section):
    """The policy model (also the reference model when the KL term is on)."""

    path: _PathText = Field(default=TINY_MODEL, min_length=1)
    """A local Hugging Face model directory, or ``"tiny"`` to build a tiny Qwen2 model."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Settings of the tiny model; only used when `path` is ``"tiny"``."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of every weight; None: full fine-tuning."""

    @model_validator(mode="after")
    def _tiny_only_for_tiny(self) -> ModelConfig:
        if "tiny" in self.model_fields_set and self.path != TINY_MODEL:
            raise _rule("tiny", f"tiny-model settings given but path is {self.path!r}, not 'tiny'")
        return self
