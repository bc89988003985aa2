"""Recipes: the typed, validated description of one RL run.

A `Recipe` is a frozen pydantic model made of small sections (model, data, algorithm, rollout,
reward, trainer, monitor, sim, placement). Defaults make the common case short::

    recipe = Recipe(
        steps=200,
        model=ModelConfig(path="/models/qwen2.5-0.5b"),
        data=DataConfig(kind="jsonl", path="data/gsm8k.jsonl"),
        reward=RewardConfig(fn="my_rewards:score"),
    )

Guarantees:

- Every section forbids unknown keys and checks bounds and cross-field rules at construction; a
  rule violation is a ``recipe_rule`` error whose context names the field (`flowrl.recipe_file`
  turns errors into messages naming the file and the dotted field path).
- A constructed recipe is immutable and always compiles: `Recipe.to_pipeline` returns a valid
  `PipelineSpec` whose ``engine_config`` is plain JSON (it travels on worker command lines).
- The monitor token is a `SecretStr`: it is never shown by ``repr``/``str``/``model_dump_json``,
  input values are hidden in validation errors, and it is never put in ``engine_config``.
- Filesystem checks (model directory, data file, reward file) run only for local placement on
  one node with a real engine, where the controller's filesystem is the workers' filesystem.
- ``placement.roles`` names only roles the run has, each with at least one node; nodes other
  than the controller's need ``placement.cluster`` (with a key file) unless Ray places them.
- Data-parallel trainer ranks run on one node unless ``placement.cluster.trainer_rendezvous``
  is ``cluster`` (an unauthenticated, unencrypted rendezvous: trusted fabrics only).

Imports nothing heavy (pydantic and the standard library), so `workers` may import it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from flowrl.messages import DataPlane, TrainerRendezvous
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages, ppo_stages

__all__ = [
    "LOSS_AGG_ALGORITHM_NAMES",
    "TINY_MODEL",
    "AlgorithmConfig",
    "ArithmeticConfig",
    "ClusterSettings",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "MonitorConfig",
    "PlacementConfig",
    "RayConfig",
    "RayResources",
    "Recipe",
    "RewardConfig",
    "RolloutConfig",
    "SimConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "callable_ref",
    "check_fn_ref",
]

TINY_MODEL = "tiny"
"""`ModelConfig.path` value that builds a tiny Qwen2 model locally instead of loading one."""

DEFAULT_TIS_CAP = 2.0
"""Truncated-importance-sampling cap used when samples may be stale (mirrors
``flowrl.algorithms.DEFAULT_TIS_CAP``; this module may not import torch)."""

LossAggName = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

LOSS_AGG_ALGORITHM_NAMES: dict[str, str] = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
"""Recipe spelling → the spelling `flowrl.algorithms.compute_policy_loss` takes (verl's)."""


def _fspath(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


_PathText = Annotated[str, BeforeValidator(_fspath)]
"""A filesystem path kept as text (``"tiny"`` is not a path); accepts `pathlib.Path`."""


def _rule(field: str, message: str) -> PydanticCustomError:
    """A cross-field rule violation; ``ctx["field"]`` is the field path below the model."""
    return PydanticCustomError(
        "recipe_rule", "{field}: {message}", {"field": field, "message": message}
    )


class _Section(BaseModel):
    # hide_input_in_errors: a rejected monitor token must not appear in an error message, and
    # nested sections are reported with the outer model's setting, so every section hides input.
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        hide_input_in_errors=True,
        use_attribute_docstrings=True,
        coerce_numbers_to_str=True,
    )


# ---- model --------------------------------------------------------------------------------------


class TinyModelConfig(_Section):
    """A tiny Qwen2 model built locally (no model hub): ``workers.tiny_model.build_tiny_model``."""

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
    """Language-modelling steps on the synthetic corpus before RL; 0 keeps random weights."""
    seed: int = Field(default=0, ge=0)
    """Seed of the corpus, tokenizer and weights (the build is deterministic)."""
    corpus: Literal["mixed", "arithmetic"] = "mixed"
    """Synthetic corpus of the tokenizer and the warm-up: ``mixed`` (arithmetic lines, words
    and pseudo-words) or ``arithmetic`` (only ``a<op>b=c`` lines with single-digit operands)."""

    @model_validator(mode="after")
    def _shapes(self) -> TinyModelConfig:
        if self.hidden % self.heads:
            raise _rule("hidden", f"{self.hidden} does not divide by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise _rule("heads", f"{self.heads} does not divide by kv_heads={self.kv_heads}")
        return self


class ModelConfig(_Section):
    """The policy model (also the reference model when the KL term is on)."""

    path: _PathText = Field(default=TINY_MODEL, min_length=1)
    """A local Hugging Face model directory, or ``"tiny"`` to build a tiny Qwen2 model."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Settings of the tiny model; only used when `path` is ``"tiny"``."""

    @model_validator(mode="after")
    def _tiny_only_for_tiny(self) -> ModelConfig:
        if "tiny" in self.model_fields_set and self.path != TINY_MODEL:
            raise _rule("tiny", f"tiny-model settings given but path is {self.path!r}, not 'tiny'")
        return self


# ---- data ---------------------------------------------------------------------------------------


class ArithmeticConfig(_Section):
    """The built-in synthetic task: prompts such as ``"12+7="`` whose exact answer is ``"19"``."""

    max_operand: int = Field(default=20, ge=1, le=10**9)
    """Operands are drawn uniformly from ``0..max_operand``."""
    count: int = Field(default=4096, ge=1, le=10**8)
    """Number of distinct prompts in the dataset."""
    seed: int = Field(default=0, ge=0)
    """Seed of the prompt generator."""


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (set to None)
        return False


class DataConfig(_Section):
    """Where prompts (and the answers the reward function checks) come from."""

    kind: Literal["arithmetic", "jsonl", "parquet"] = "arithmetic"
    """``arithmetic`` (built in, synthetic), or a ``jsonl`` / ``parquet`` file of rows."""
    path: _PathText | None = None
    """The data file; required for ``jsonl`` and ``parquet``, not allowed for ``arithmetic``."""
    prompt_key: str = Field(default="prompt", min_length=1)
    """Column holding the prompt text."""
    answer_key: str = Field(default="answer", min_length=1)
    """Column passed to the reward function as its ``answer`` keyword."""
    prompt_template: str = "{prompt}"
    """Text around each prompt of a ``jsonl`` / ``parquet`` file; ``{prompt}`` (required) is
    replaced by the row's prompt, other braces are kept as written."""
    max_prompt_tokens: int = Field(default=256, ge=1, le=1 << 20)
    """Prompts longer than this (in tokens) are dropped from the dataset."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Settings of the ``arithmetic`` task."""

    @model_validator(mode="after")
    def _kind_matches(self) -> DataConfig:
        if self.kind == "arithmetic":
            if self.path is not None:
                raise _rule("path", "not used by kind 'arithmetic'; set kind='jsonl' or 'parquet'")
        else:
            if self.path is None:
                raise _rule("path", f"required when kind is {self.kind!r}")
            if "arithmetic" in self.model_fields_set:
                raise _rule("arithmetic", f"settings given but kind is {self.kind!r}")
        if "{prompt}" not in self.prompt_template:
            raise _rule("prompt_template", "must contain {prompt} (where the prompt goes)")
        if self.kind == "arithmetic" and "prompt_template" in self.model_fields_set:
            raise _rule("prompt_template", "not used by kind 'arithmetic'")
        if self.kind == "parquet" and not _importable("pyarrow"):
            raise _rule("kind", "'parquet' needs pyarrow: pip install 'flowrl[parquet]'")
        return self


# ---- algorithm ----------------------------------------------------------------------------------


class AlgorithmConfig(_Section):
    """The RL objective: advantage estimator, clipping, KL, loss aggregation, corrections."""

    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    """Advantage estimator: GRPO, Dr. GRPO (no std normalisation), RLOO, REINFORCE++, PPO."""
    group_size: int = Field(default=4, ge=1, le=1024)
    """Responses sampled per prompt (the group whose rewards form the baseline)."""
    kl_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of the KL(π‖π_ref) loss term; 0 disables it and the reference stage."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020); k3 is GRPO's."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """PPO ratio clip below 1: ratios under ``1 - clip_low`` are clipped."""
    clip_high: float | None = Field(default=None, ge=0.0, le=10.0)
    """Ratio clip above 1 (DAPO's clip-higher uses 0.28); None means the same as `clip_low`."""
    loss_agg: LossAggName = "token_mean"
    """How per-token losses become one number: over all tokens, per sequence then averaged, or
    per-sequence sums over a fixed token budget (Dr. GRPO)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and sample replacements
    (DAPO)."""
    entropy_coef: float = Field(default=0.0, ge=0.0, le=1.0)
    """Weight of an entropy bonus (``loss −= entropy_coef · agg(entropy)``), the entropy
    estimated from the sampled tokens (`flowrl.algorithms.sampled_entropy`). It keeps a policy
    from collapsing onto one answer per prompt before it has found the right one; 0 disables
    it."""
    tis_cap: float | Literal["auto"] | None = "auto"
    """Truncated importance-sampling cap for stale samples; ``"auto"`` means 2.0 when
    ``max_staleness > 0`` and off otherwise, None turns it off (see `Recipe.tis_cap`)."""

    @field_validator("tis_cap")
    @classmethod
    def _positive_cap(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not (v > 0.0 and math.isfinite(v)):
            raise ValueError(f"must be a positive finite number, 'auto' or None, got {v}")
        return v

    @model_validator(mode="after")
    def _groups(self) -> AlgorithmConfig:
        if self.name in ("grpo", "dr_grpo", "rloo") and self.group_size < 2:
            raise _rule("group_size", f"{self.name} needs groups of at least 2 responses")
        if self.dynamic_sampling and self.group_size < 2:
            raise _rule("dynamic_sampling", "needs group_size >= 2 (a group of one is always "
                        "dropped)")
        return self

    @property
    def clip_high_resolved(self) -> float:
        """`clip_high`, or `clip_low` when it is None."""
        return self.clip_low if self.clip_high is None else self.clip_high


# ---- rollout ------------------------------------------------------------------------------------


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
    stop: tuple[str, ...] = ()
    """Strings that end a response (besides the model's end-of-sequence token)."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads per rollout worker process (DESIGN §7)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and compute of the rollout engine; ``auto`` is bfloat16 where the worker's device
    supports it (CUDA with bf16, NPU), else float32. The trainer keeps float32 weights; they are
    cast when loaded into the engine."""

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


# ---- reward -------------------------------------------------------------------------------------


def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _is_dotted_name(s: str) -> bool:
    return bool(s) and all(p.isidentifier() for p in s.split("."))


def callable_ref(fn: Callable[..., Any]) -> str:
    """A reference worker processes can resolve: ``module:qualname`` or ``/abs/file.py:name``.

    An importable module is preferred. A function defined in a file run as a script or as a
    recipe (``runpy``: no importable module) is referred to by its file, which the worker
    executes as a module. Lambdas, nested functions and callable objects cannot be located and
    raise ValueError.
    """
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        raise ValueError(f"cannot locate {fn!r} from another process; give a module-level "
                         "function or a 'module:function' string")
    if "<" in qualname:
        raise ValueError(f"{qualname!r} is a lambda or a nested function; worker processes "
                         "can only load module-level functions")
    mod = sys.modules.get(module)
    spec = getattr(mod, "__spec__", None)
    if mod is not None and spec is not None and _lookup(mod, qualname) is fn:
        return f"{spec.name if module == '__main__' else module}:{qualname}"
    code = getattr(fn, "__code__", None)
    filename = getattr(code, "co_filename", "")
    globals_ = getattr(fn, "__globals__", {})
    if (filename.endswith(".py") and Path(filename).is_file() and "." not in qualname
            and globals_.get(qualname) is fn):
        return f"{Path(filename).resolve()}:{qualname}"
    raise ValueError(f"cannot locate {module}.{qualname} from another process: its module is "
                     "not importable and it is not defined at the top of a .py file")


def check_fn_ref(ref: str) -> tuple[str, str]:
    """Split ``"module:function"`` or ``"path/file.py:function"`` into (target, name).

    Checks the syntax only (no import); ValueError says what is wrong.
    """
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not _is_dotted_name(name):
        raise ValueError(f"{ref!r} is not 'module:function' or 'path/to/file.py:function'")
    if not target.endswith(".py") and not _is_dotted_name(target):
        raise ValueError(f"{target!r} is neither a dotted module name nor a .py file")
    return target, name


class RewardConfig(_Section):
    """The reward function and the workers that call it."""

    fn: str | Callable[..., Any] = "workers.roles.reward:exact_match"
    """``"module:function"``, ``"path/to/file.py:function"``, or a module-level function.
    Per sample: ``fn(prompt, response, **row_meta) -> float`` (row_meta holds ``answer``);
    batched: ``fn(prompts, responses, metas) -> list[float]``. Sync or async."""
    batched: bool = False
    """Call `fn` once per micro-batch with lists instead of once per sample."""
    timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Per call; a call that takes longer scores 0 and is counted as failed."""
    workers: int = Field(default=1, ge=1, le=1024)
    """Reward worker processes."""
    concurrency: int = Field(default=8, ge=1, le=1024)
    """Calls in flight per worker (also the size of its thread pool for sync functions)."""

    @field_validator("fn")
    @classmethod
    def _locatable(cls, v: str | Callable[..., Any]) -> str | Callable[..., Any]:
        try:
            if isinstance(v, str):
                check_fn_ref(v)
            else:
                callable_ref(v)
        except ValueError as e:
            raise ValueError(str(e)) from None
        return v

    @field_serializer("fn", when_used="json")
    def _fn_as_ref(self, v: str | Callable[..., Any]) -> str:
        return self.ref

    @property
    def ref(self) -> str:
        """`fn` as a reference string that worker processes resolve."""
        return self.fn if isinstance(self.fn, str) else callable_ref(self.fn)


# ---- trainer ------------------------------------------------------------------------------------


_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class TrainerConfig(_Section):
    """The optimizer (AdamW) and how a global batch is split."""

    lr: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """AdamW moment decay rates."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip; None disables it."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: ``constant``, or ``cosine`` decay to ``lr * min_lr_ratio`` at the
    run's last step (``steps``; a resumed run continues the same curve)."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Where ``cosine`` ends, as a fraction of ``lr``."""
    groups_per_step: int = Field(default=8, ge=1, le=1 << 20)
    """Prompts (groups) per optimizer step: the global batch is ``groups_per_step *
    group_size`` responses."""
    micro_batch_groups: int = Field(default=1, ge=1, le=1 << 20)
    """Groups per forward/backward pass (gradient accumulation within a step)."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads per trainer rank."""
    ranks: int = Field(default=1, ge=1, le=4096)
    """Data-parallel trainer processes on the controller's node (gloo on CPUs, NCCL/HCCL on
    devices): each trains a token-balanced share of every step and the ranks take each
    optimizer step together (`flowrl.dp`, `workers.roles.dp_trainer`)."""
    sharding: Literal["replicate", "fsdp2"] = "replicate"
    """How the ranks hold the model: ``replicate``, every rank a whole copy of the parameters,
    gradients and optimizer state (gradients all-reduced once per step); ``fsdp2``, each rank
    a 1/ranks shard of all three (torch FSDP2 ``fully_shard`` per decoder layer: parameters
    gathered for each pass, gradients reduce-scattered after it), for models whose training
    state does not fit one device."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """With ``sharding="fsdp2"``: the dtype passes compute in (FSDP2 mixed precision: shards
    and optimizer stay float32, parameters are gathered in this dtype, gradients reduced in
    float32); ``bfloat16`` halves gather traffic and activation memory on GPUs and NPUs."""

    @model_validator(mode="after")
    def _micro_fits(self) -> TrainerConfig:
        if self.micro_batch_groups > self.groups_per_step:
            raise _rule("micro_batch_groups", f"{self.micro_batch_groups} is larger than "
                        f"groups_per_step={self.groups_per_step}")
        if self.micro_batch_groups * self.ranks > self.groups_per_step:
            raise _rule("micro_batch_groups", f"{self.micro_batch_groups} groups per micro-batch "
                        f"on ranks={self.ranks} need groups_per_step >= "
                        f"{self.micro_batch_groups * self.ranks} (every rank trains a share of "
                        f"every step), got {self.groups_per_step}")
        if self.compute_dtype != "float32" and self.sharding != "fsdp2":
            raise _rule("compute_dtype", f"{self.compute_dtype!r} is FSDP2 mixed precision: "
                        f"set sharding='fsdp2' (got {self.sharding!r})")
        if self.sharding != "replicate" and self.ranks < 2:
            raise _rule("sharding", f"{self.sharding!r} shards the model over trainer ranks; "
                        f"set ranks >= 2 (got {self.ranks})")
        return self


# ---- critic -------------------------------------------------------------------------------------


class CriticConfig(_Section):
    """PPO's value model (``algorithm.name="ppo"``): the policy's backbone plus a scalar head.

    One critic worker scores every row (values, GAE advantages, returns) and learns from them,
    one AdamW step per ``trainer.groups_per_step * algorithm.group_size`` rows it has scored
    (see ``workers.roles.critic``). It is a single worker because its weights are state: two
    independent critics would each see part of the rows and disagree."""

    lr: float = Field(default=1e-5, gt=0.0, le=1.0)
    """Learning rate of the critic (constant)."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay (matrices only)."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip of the critic; None disables it."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE discount per response token."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE lambda: 1 gives Monte-Carlo returns minus the value, 0 one-step TD errors."""
    value_clip: float | None = Field(default=0.2, gt=0.0)
    """PPO value clip around the values a row was scored with; binds only in passes after the
    first (`epochs` > 1). None turns it off."""
    epochs: int = Field(default=1, ge=1, le=64)
    """Critic passes (and optimizer steps) per batch; passes after the first replay the batch
    kept in the critic's memory."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads of the critic process."""


# ---- monitor, simulation, placement --------------------------------------------------------------


_MIN_TOKEN_CHARS = 16


class MonitorConfig(_Section):
    """The controller's HTTP monitor (status, metrics, dashboard)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """Bind address; anything but loopback requires a `token`."""
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """TCP port; None picks a free one (printed at start)."""
    token: SecretStr | None = None
    """Bearer token (16+ characters) for control actions and for any access off loopback.
    Never printed."""

    @field_validator("token")
    @classmethod
    def _strong_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < _MIN_TOKEN_CHARS:
            raise ValueError(f"must be at least {_MIN_TOKEN_CHARS} characters long")
        return v

    @model_validator(mode="after")
    def _remote_needs_token(self) -> MonitorConfig:
        if not _is_loopback(self.host) and self.token is None:
            raise _rule("token", f"required when the monitor binds to {self.host!r} "
                        "(not loopback)")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SimConfig(_Section):
    """Modelled costs of simulated workers (``rollout.engine="sim"``); see ``workers.sim``.

    Mirrors ``workers.sim.SimCost`` except its length cap, which is `RolloutConfig.max_new_tokens`.
    """

    prompt_len: int = Field(default=64, ge=1, le=1 << 20)
    """Tokens per simulated prompt."""
    log_mean: float = Field(default=math.log(96), ge=0.0, le=20.0)
    """Mean of log(response length)."""
    log_sigma: float = Field(default=1.0, ge=0.0, le=10.0)
    """Standard deviation of log(response length)."""
    rollout_base_s: float = Field(default=0.002, ge=0.0)
    """Fixed cost of generating one group."""
    rollout_token_s: float = Field(default=0.0001, ge=0.0)
    """Decode cost per token of a group's longest response."""
    reward_token_s: float = Field(default=0.000002, ge=0.0)
    """Reward cost per response token."""
    reference_token_s: float = Field(default=0.00001, ge=0.0)
    """Reference-model cost per response token."""
    train_token_s: float = Field(default=0.00001, ge=0.0)
    """Forward+backward cost per response token."""
    train_step_s: float = Field(default=0.01, ge=0.0)
    """Optimizer step cost."""
    critic_token_s: float = Field(default=0.00001, ge=0.0)
    """Critic cost per response token (values, GAE and its own backward; PPO only)."""
    weight_numel: int = Field(default=1 << 16, ge=1, le=1 << 34)
    """float32 weights published after each step (weight-sync traffic)."""


CONTROLLER_NODE = "node0"
"""The controller's own node; `PlacementConfig.roles` may name it (its processes run there)."""

ROLES = ("rollout", "reward", "reference", "critic", "train")
"""Every worker role a recipe may run (which ones a recipe runs: `Recipe.roles`)."""

class _FrozenDict(dict[str, Any]):
    """A dict that cannot change and hashes by content, so a frozen recipe stays hashable."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("recipe mappings are immutable")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen
    __ior__ = _frozen

    def __copy__(self) -> _FrozenDict:
        return self  # immutable: a copy would be the same

    def __deepcopy__(self, memo: dict[int, Any]) -> _FrozenDict:
        return self


def _freeze(v: dict[str, Any]) -> dict[str, Any]:
    return _FrozenDict(v)


_NODE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class ClusterSettings(_Section):
    """Where the controller meets the node agents of other nodes (``flowrl.node.ClusterConfig``);
    every tcp link is encrypted with the run's CurveZMQ keys (but see `data_plane`)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """Address the controller binds and agents connect to."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the controller's endpoint; 0 picks a free one (logged at start)."""
    keys_file: _PathText | None = None
    """Where the controller writes the run's fresh keys (mode 0600; the file must not exist) for
    agents started by hand; Ray-placed agents get them from the controller directly."""
    join_timeout_s: float = Field(default=120.0, gt=0.0, le=86400.0)
    """How long the start waits for every agent to join."""
    data_plane: DataPlane = "encrypted"
    """How sample bytes travel between nodes. ``encrypted``: over CurveZMQ, like every other
    link. ``plaintext``: the sample bytes of cross-node store reads travel unencrypted (anyone
    on the network path can read, or alter, them), for trusted fabrics (InfiniBand/RoCE inside a
    datacenter, where NCCL traffic is unencrypted too) on which encryption would bound the
    read rate. Those read requests remain authenticated with the run's keys (a peer without
    them gets nothing and can change nothing; a captured request cannot be replayed), and all
    other traffic (controller links, store bookkeeping, puts and frees) stays CurveZMQ. Nodes'
    clocks must agree within 30 s."""
    trainer_rendezvous: TrainerRendezvous = "node"
    """Where data-parallel trainer ranks (``trainer.ranks > 1``) meet. ``node``: a file in their
    node's run directory, so ``placement.roles.train`` names one node. ``cluster``: the ranks
    may run on several nodes and meet in a torch.distributed TCPStore the controller hosts on
    `host`. The rendezvous and the collectives between the ranks (gloo, NCCL) are then neither
    authenticated nor encrypted (torch.distributed): anyone who reaches the store's port or the
    ranks' links can read, disturb or join the training group. For trusted fabrics only; the
    ranks' interface is the environment's (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``)."""


class RayResources(_Section):
    """What a node agent's Ray actor requests; the node's workers run inside that reservation
    (with ``num_gpus``, Ray's ``CUDA_VISIBLE_DEVICES`` reaches them)."""

    num_cpus: float = Field(default=1.0, ge=0.0)
    """CPUs reserved for the node's agent and workers."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs reserved for the node's workers."""
    resources: Annotated[dict[str, float], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Custom resources, e.g. ``{"NPU": 8}`` or a label that pins the agent to one Ray node."""

    @field_validator("resources")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, n in v.items() if not k or not n >= 0.0)
        if bad:
            raise ValueError(f"resources need a name and an amount >= 0: {bad}")
        return v


class RayConfig(_Section):
    """Ray placement (``placement.kind="ray"``): one node agent per node as a Ray actor."""

    address: str | None = None
    """``ray.init`` address (``"auto"``, ``"ray://host:10001"``); None joins the cluster Ray
    finds (``RAY_ADDRESS``) or starts a local one. Unused when Ray is already initialized."""
    agent: RayResources = Field(default_factory=RayResources)
    """What every agent's actor requests, unless `nodes` says otherwise for its node."""
    nodes: Annotated[dict[str, RayResources], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Per node name: what that node's actor requests instead of `agent`."""


class PlacementConfig(_Section):
    """Where processes run and how the controller watches them."""

    kind: Literal["local", "ray"] = "local"
    """``local``: the controller starts its own node's processes, and the agents of other nodes
    `roles` names are started by hand (``python -m flowrl.node``); ``ray``: those agents are
    started as Ray actors (`ray`)."""
    nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes (one node agent and one shared-memory store each); local placement has one. With
    `roles`, implied by it: leave it out."""
    roles: Annotated[dict[str, tuple[str, ...]], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Role → the nodes its processes run on (process ``p`` on ``nodes[p % len(nodes)]``); a
    role not named runs on the controller's node (``"node0"``)."""
    cluster: ClusterSettings | None = None
    """Where agents of other nodes meet the controller; required when `roles` names another
    node and `kind` is ``local``."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray placement settings; only with ``kind="ray"``."""
    store_capacity_mb: int = Field(default=1024, ge=1, le=1 << 24)
    """Shared-memory sample store per node, in MiB."""
    heartbeat_timeout_s: float = Field(default=10.0, ge=3.0, le=3600.0)
    """A worker silent this long is declared dead (heartbeats are sent every second)."""
    max_restarts: int = Field(default=3, ge=0, le=10_000)
    """Restarts of one worker process after it died (after 0.5 s, doubling per death, at most
    30 s); one more death stops the run. Data-parallel trainer ranks restart as one group,
    counted once per restart of the group."""

    @model_validator(mode="after")
    def _local_is_one_node(self) -> PlacementConfig:
        if self.kind == "local" and self.nodes != 1 and not self.roles:
            raise _rule("nodes", f"local placement runs on one node, got nodes={self.nodes}")
        return self

    @model_validator(mode="after")
    def _roles_and_nodes(self) -> PlacementConfig:
        for role, nodes in self.roles.items():
            if role not in ROLES:
                raise _rule(f"roles.{role}", f"unknown role; roles are {', '.join(ROLES)}")
            if not nodes:
                raise _rule(f"roles.{role}", "empty node list (leave the role out to run it on "
                            "the controller's node)")
            bad = [n for n in nodes if not n or not set(n) <= _NODE_CHARS or len(n) > 64]
            if bad:
                raise _rule(f"roles.{role}", f"bad node names {bad}: use 1-64 letters, digits, "
                            "'_', '.' or '-'")
        if self.roles and "nodes" in self.model_fields_set:
            raise _rule("nodes", "implied by roles; leave it out")
        if self.kind != "ray" and "ray" in self.model_fields_set:
            raise _rule("ray", f"Ray settings given but kind is {self.kind!r}, not 'ray'")
        unknown = sorted(set(self.ray.nodes) - set(self.remote_nodes))
        if unknown:
            raise _rule(f"ray.nodes.{unknown[0]}", f"not a node roles places on (have "
                        f"{self.remote_nodes})")
        if self.kind == "local" and self.remote_nodes:
            if self.cluster is None:
                raise _rule("cluster", f"required: roles places processes on "
                            f"{self.remote_nodes}, whose agents meet the controller there")
            if self.cluster.keys_file is None:
                raise _rule("cluster.keys_file", "required: agents started by hand read the "
                            "run's keys from it")
        return self

    @property
    def remote_nodes(self) -> list[str]:
        """The nodes `roles` names other than the controller's, sorted."""
        return sorted({n for nodes in self.roles.values() for n in nodes} - {CONTROLLER_NODE})


# ---- the recipe ---------------------------------------------------------------------------------


class Recipe(_Section):
    """One RL run. Only `steps` is required; `to_pipeline` compiles it for the controller."""

    steps: int = Field(ge=1, le=10**9)
    """Optimizer steps to run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy (and reference) model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompt dataset."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RL objective."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """PPO's value model; only with ``algorithm.name="ppo"``."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation engine and sampling."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward function."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimizer and batch sizes."""
    max_staleness: int = Field(default=0, ge=0, le=64)
    """Policy versions a sample may lag behind the trainer; 0 is synchronous on-policy."""
    seed: int = Field(default=0, ge=0)
    """Seed of sampling, data order and simulated costs."""
    output: Path | None = None
    """Run directory for checkpoints and logs; None writes nothing."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (and at the end); 0 never. Needs `output`."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """The HTTP monitor."""
    sim: SimConfig = Field(default_factory=SimConfig)
    """Simulated costs; only with ``rollout.engine="sim"``."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Process placement."""

    @model_validator(mode="after")
    def _cross_section(self) -> Recipe:
        sim = self.rollout.engine == "sim"
        if "sim" in self.model_fields_set and not sim:
            raise _rule("sim", f"simulated costs given but rollout.engine is "
                        f"{self.rollout.engine!r}, not 'sim'")
        if "critic" in self.model_fields_set and self.algorithm.name != "ppo":
            raise _rule("critic", f"critic settings given but algorithm.name is "
                        f"{self.algorithm.name!r}, not 'ppo'")
        if self.checkpoint_every and self.output is None:
            raise _rule("checkpoint_every", "needs output (a directory to write checkpoints to)")
        if sim and self.trainer.ranks > 1:
            raise _rule("trainer.ranks", "simulated trainers do not all-reduce; data-parallel "
                        "ranks need rollout.engine 'hf' or 'vllm'")
        cluster = self.placement.cluster
        if (self.trainer.ranks > 1 and len(set(self.placement.roles.get("train", ()))) > 1
                and (cluster is None or cluster.trainer_rendezvous != "cluster")):
            raise _rule("placement.roles.train", "data-parallel trainer ranks meet through a "
                        "file in their node's run directory: place them on one node, or set "
                        "placement.cluster.trainer_rendezvous = 'cluster' to let them meet "
                        "across nodes (unauthenticated, unencrypted: trusted fabrics only)")
        if not sim and self.model.path == TINY_MODEL:
            longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
            if longest > self.model.tiny.max_positions:
                raise _rule("rollout.max_new_tokens", f"data.max_prompt_tokens + "
                            f"rollout.max_new_tokens = {longest} exceeds "
                            f"model.tiny.max_positions = {self.model.tiny.max_positions}")
        unrun = sorted(set(self.placement.roles) - set(self.roles))
        if unrun:
            raise _rule(f"placement.roles.{unrun[0]}", f"this run has no {unrun[0]} workers "
                        f"(its roles: {', '.join(self.roles)})")
        if not sim and self.placement.kind == "local" and not self.placement.remote_nodes:
            self._check_local_paths()
        return self

    def _check_local_paths(self) -> None:
        if self.model.path != TINY_MODEL and not (Path(self.model.path) / "config.json").is_file():
            raise _rule("model.path", f"{self.model.path!r} is not a model directory "
                        "(no config.json in it)")
        if self.data.path is not None and not Path(self.data.path).is_file():
            raise _rule("data.path", f"no such file: {self.data.path!r}")
        if isinstance(self.reward.fn, str):
            target, _ = check_fn_ref(self.reward.fn)
            if target.endswith(".py") and not Path(target).is_file():
                raise _rule("reward.fn", f"no such file: {target!r}")

    @property
    def tis_cap(self) -> float | None:
        """The resolved TIS cap: `AlgorithmConfig.tis_cap`, with ``"auto"`` → 2.0 when
        ``max_staleness > 0``, else None (off)."""
        cap = self.algorithm.tis_cap
        if cap == "auto":
            return DEFAULT_TIS_CAP if self.max_staleness > 0 else None
        assert not isinstance(cap, str)
        return cap

    @property
    def roles(self) -> tuple[str, ...]:
        """The worker roles this run has (the pools of `to_pipeline`)."""
        return tuple(r for r in ROLES if (r != "reference" or self.uses_reference)
                     and (r != "critic" or self.uses_critic))

    @property
    def uses_critic(self) -> bool:
        """Whether the run has a critic stage (PPO)."""
        return self.algorithm.name == "ppo"

    @property
    def uses_reference(self) -> bool:
        """Whether the run has a reference stage (the KL term is on)."""
        return self.algorithm.kl_coef > 0.0

    # ---- compilation --------------------------------------------------------------------------

    def to_pipeline(self) -> PipelineSpec:
        """The controller's view: stages, worker pools, bounds and the engines' configuration."""
        sim = self.rollout.engine == "sim"
        group = self.algorithm.group_size
        reference = self.uses_reference
        # Simulated workers are coroutines that only sleep: many share one process.
        rollout_per_process = self.rollout.workers if sim else 1
        reward_per_process = self.reward.workers if sim else 1
        # A reward task is one rollout task's rows; enough tasks per worker to keep
        # `concurrency` calls busy.
        reward_rows = group * self.rollout.groups_per_task
        reward_capacity = max(1, math.ceil(self.reward.concurrency / reward_rows))
        pools = [
            PoolSpec("rollout", count=self.rollout.workers, per_process=rollout_per_process,
                     threads=self.rollout.threads),
            PoolSpec("reward", count=self.reward.workers, per_process=reward_per_process,
                     capacity=reward_capacity),
        ]
        if reference:
            pools.append(PoolSpec("reference", count=1, threads=self.rollout.threads))
        if self.uses_critic:
            pools.append(PoolSpec("critic", count=1, threads=self.critic.threads))
        pools.append(PoolSpec("train", count=self.trainer.ranks, threads=self.trainer.threads))
        pools = [dataclasses.replace(p, nodes=self.placement.roles.get(p.role, ()))
                 for p in pools]
        stages = ppo_stages if self.uses_critic else grpo_stages
        return PipelineSpec(
            stages=stages(group_size=group, train_micro_groups=self.trainer.micro_batch_groups,
                          rollout_micro_groups=self.rollout.groups_per_task,
                          reward_micro_batch=reward_rows, reference=reference),
            pools=tuple(pools),
            group_size=group,
            groups_per_step=self.trainer.groups_per_step,
            max_staleness=self.max_staleness,
            engine=self.rollout.engine,
            engine_config=self.sim_cost() if sim else self.engine_config(),
            store_capacity_bytes=self.placement.store_capacity_mb << 20,
            heartbeat_timeout_s=self.placement.heartbeat_timeout_s,
            max_restarts=self.placement.max_restarts,
            output=(str(self.output) if self.output is not None and self.checkpoint_every
                    and not sim else None),
            seed=self.seed,
        )

    def sim_cost(self) -> dict[str, Any]:
        """The ``workers.sim.SimCost`` field values of this recipe."""
        return {**self.sim.model_dump(mode="json"), "max_new_tokens": self.rollout.max_new_tokens}

    def engine_config(self) -> dict[str, Any]:
        """Plain-JSON settings real-engine workers need (no monitor secrets, resolved values)."""
        a = self.algorithm
        return {
            "model": self.model.model_dump(mode="json"),
            "data": self.data.model_dump(mode="json"),
            "algorithm": {
                "name": a.name,
                "group_size": a.group_size,
                "kl_coef": a.kl_coef,
                "kl_estimator": a.kl_estimator,
                "entropy_coef": a.entropy_coef,
                "clip_low": a.clip_low,
                "clip_high": a.clip_high_resolved,
                "loss_agg": LOSS_AGG_ALGORITHM_NAMES[a.loss_agg],
                "dynamic_sampling": a.dynamic_sampling,
                "tis_cap": self.tis_cap,
            },
            "sampling": {
                "n": a.group_size,
                "temperature": self.rollout.temperature,
                "top_p": self.rollout.top_p,
                "max_new_tokens": self.rollout.max_new_tokens,
                "stop": list(self.rollout.stop),
            },
            "rollout": {"dtype": self.rollout.dtype},
            "reward": self.reward.model_dump(mode="json", exclude={"workers"}),
            "trainer": self.trainer.model_dump(
                mode="json", exclude={"threads", "ranks", "sharding", "compute_dtype"}),
            **({"data_parallel": {"world": self.trainer.ranks,
                                  "sharding": self.trainer.sharding,
                                  "compute_dtype": self.trainer.compute_dtype}}
               if self.trainer.ranks > 1 else {}),
            **({"critic": self.critic.model_dump(mode="json", exclude={"threads"})}
               if self.uses_critic else {}),
            "max_staleness": self.max_staleness,
            "steps": self.steps,
            "seed": self.seed,
            "output": None if self.output is None else str(self.output),
            "checkpoint_every": self.checkpoint_every,
        }
