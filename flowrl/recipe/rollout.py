"""The ``rollout`` section: the generation engine and how it samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator

from flowrl.recipe.reward import callable_ref, check_fn_ref
from flowrl.recipe.section import _Section, _StopStrings


class RolloutConfig(_Section):
    """The generation engine and how it samples."""

    engine: Literal["hf", "vllm", "sim"] = "hf"
    """``hf`` (transformers, runs on a CPU), ``vllm``, or ``sim`` (modelled cost, no model)."""
    workers: int = Field(default=1, ge=1, le=4096)
    """Rollout engine instances."""
    groups_per_task: int = Field(default=1, ge=1, le=4096)
    """Prompt groups sampled in one engine call (one rollout task; its reward task is as
    large). Bigger tasks batch better and cost less orchestration per sample; smaller ones
    stream to the trainer sooner."""
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 is greedy decoding."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1 disables it."""
    max_new_tokens: int = Field(default=256, ge=1, le=1 << 20)
    """Longest response; with ``engine="sim"`` also the simulated length cap."""
    stop: _StopStrings = ()
    """Strings that end a response (besides the model's end-of-sequence token)."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads per rollout worker process (one by default, so that rollout and training
    processes overlap on few cores instead of fighting over them)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and compute of the rollout engine; ``auto`` is bfloat16 where the worker's device
    supports it (CUDA with bf16, NPU), else float32. The trainer keeps float32 weights; they are
    cast when loaded into the engine."""
    episode: str | Callable[..., Any] | None = None
    """An episode function, ``"module:function"``, ``"path/to/file.py:function"`` or a
    module-level ``async def episode(policy, example)``: each response of a group is one run of
    it (a multi-turn agent loop against `flowrl.episode.Policy`), which scores itself, so the run
    has no reward workers. None: one completion per response, scored by ``reward``. Needs
    ``engine = "hf"``."""
    partial: bool = False
    """Interruptible generation (needs ``episode``): a rollout worker that learns of a new policy
    version loads it at the next decode step instead of waiting for its running episodes, and
    continues every running sequence under it, its tokens kept (each records the version that
    produced it). A row's version, for the staleness bound, is its oldest token's."""

    @field_validator("episode")
    @classmethod
    def _locatable(cls, v: str | Callable[..., Any] | None) -> str | Callable[..., Any] | None:
        try:
            if isinstance(v, str):
                check_fn_ref(v)
            elif v is not None:
                callable_ref(v)
        except ValueError as e:
            raise ValueError(str(e)) from None
        return v

    @field_serializer("episode", when_used="json")
    def _episode_as_ref(self, v: str | Callable[..., Any] | None) -> str | None:
        return self.episode_ref

    @property
    def episode_ref(self) -> str | None:
        """`episode` as a reference worker processes resolve; None without one."""
        if self.episode is None:
            return None
        return self.episode if isinstance(self.episode, str) else callable_ref(self.episode)
