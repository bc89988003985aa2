"""The ``rollout`` section: the generation engine and how it samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_serializer, field_validator

from flowrl.recipe.placement import _freeze
from flowrl.recipe.reward import callable_ref, locatable
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
    endpoint: bool = False
    """Serve each episode an OpenAI-compatible endpoint on loopback (``/v1/chat/completions``,
    ``/v1/completions``; `flowrl.episode.Policy.openai_client`), so that agent code written for
    the ``openai`` client runs as an episode; needs ``episode``."""
    tools: Annotated[dict[str, str | Callable[..., Any]], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Tools an episode calls by name (``await policy.call_tool(name, **args)``): name →
    ``"module:function"``, ``"path/to/file.py:function"`` or a module-level function, sync or
    async, returning a string or another JSON value. They run in sandbox processes, never in
    the rollout worker; a failed call is an error observation the episode shows the policy."""
    tool_workers: int = Field(default=2, ge=1, le=256)
    """Tool sandbox processes per rollout worker (tool calls that run at once)."""
    tool_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Longest tool call; a call past it has its sandbox killed and replaced."""
    tool_memory_mb: int | None = Field(default=1024, ge=64, le=1 << 22)
    """Address space of a tool sandbox process (``RLIMIT_AS``: the interpreter and the tools'
    modules count); None: unlimited."""
    max_turns: int | None = Field(default=None, ge=1, le=1 << 20)
    """Generated turns per episode; a turn beyond it ends the episode (see `max_episode_tokens`).
    None: no limit."""
    max_episode_tokens: int | None = Field(default=None, ge=1, le=1 << 24)
    """Tokens per episode after its prompt (generated and inserted); turns are cut to what is
    left, and a turn or insertion beyond it ends the episode. An episode ended by a limit keeps
    its trajectory and scores what it says (it may catch `flowrl.episode.EpisodeLimitReached`),
    else 0. None: no limit."""
    partial: bool = False
    """Interruptible generation (needs ``episode``): a rollout worker that learns of a new policy
    version loads it at the next decode step instead of waiting for its running episodes, and
    continues every running sequence under it, its tokens kept (each records the version that
    produced it). A row's version, for the staleness bound, is its oldest token's."""
    tasks_per_worker: int | Literal["auto"] = 1
    """Rollout tasks one episode rollout worker runs at once (each ``groups_per_task`` groups),
    their episodes all in its engine's one running batch, so that the batch does not drain to a
    group's long tail at every task's end. ``"auto"``: enough to fill the running batch
    (``sim.max_running`` in simulation, else `flowrl.episode.MAX_RUNNING` sequences), but no
    more than the run has groups in flight per worker (``(max_staleness + 1) ×
    groups_per_step`` over ``workers``). Episodes only: single-completion rollout (no
    ``episode``) runs one task at a time, and ``"auto"`` is then 1."""

    @field_validator("tasks_per_worker")
    @classmethod
    def _tasks_in_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 4096:
            raise ValueError(f"must be 'auto' or an integer in 1..4096, got {v}")
        return v

    @field_validator("episode")
    @classmethod
    def _locatable(cls, v: str | Callable[..., Any] | None) -> str | Callable[..., Any] | None:
        return locatable(v)

    @field_validator("tools")
    @classmethod
    def _tools_locatable(cls, v: dict[str, str | Callable[..., Any]]
                         ) -> dict[str, str | Callable[..., Any]]:
        for name, ref in v.items():
            if not name:
                raise ValueError("a tool needs a name")
            try:
                locatable(ref)
            except ValueError as e:
                raise ValueError(f"tool {name!r}: {e}") from None
        return v

    @field_serializer("tools", when_used="json")
    def _tools_as_refs(self, v: dict[str, str | Callable[..., Any]]) -> dict[str, str]:
        return self.tool_refs

    @field_serializer("episode", when_used="json")
    def _episode_as_ref(self, v: str | Callable[..., Any] | None) -> str | None:
        return self.episode_ref

    @property
    def episode_ref(self) -> str | None:
        """`episode` as a reference worker processes resolve; None without one."""
        if self.episode is None:
            return None
        return self.episode if isinstance(self.episode, str) else callable_ref(self.episode)

    @property
    def tool_refs(self) -> dict[str, str]:
        """`tools` as references worker processes resolve."""
        return {name: ref if isinstance(ref, str) else callable_ref(ref)
                for name, ref in self.tools.items()}
