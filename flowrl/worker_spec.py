"""What a worker process is told: one typed spec, validated where it is built and on arrival.

A recipe compiles its engines' settings once into an `EngineSpec` (`flowrl.recipe.Recipe.
engine_spec`); a `PipelineSpec` carries it in its JSON form (``engine_config``), or a simulation's
cost model. Each worker process gets a `WorkerSpec`: its `ProcessSpec` (what the controller
decides: role, name, workers hosted, capacity, threads, seed, heartbeat and weight-sync
deadline, engine settings) and its `Endpoints` (where it meets the run, known on its node). The
process reads it from a file (`flowrl.worker_launch`), never from its command line.

Guarantees:

- Defaults are stated once: the recipe's (its sections), or here for what no recipe sets. The
  worker side reads fields, never ``get(key, default)``.
- Every model forbids unknown keys and is frozen; a malformed spec is a ValidationError naming
  the field, before any model is loaded.
- Nothing is sent that the worker side never reads: every field of these models is read by
  `workers.main` or by the roles' factory (`tests/test_worker_spec.py` checks it).

Imports pydantic and the standard library only, so `workers` and node agents may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_DP_TIMEOUT_S",
    "DEFAULT_EXPORT_BUCKET_BYTES",
    "AlgorithmSpec",
    "ArithmeticDataSpec",
    "ColocatedSpec",
    "CorrectionName",
    "CriticSpec",
    "DataParallelSpec",
    "Endpoints",
    "EngineSpec",
    "EvalDataSpec",
    "FileDataSpec",
    "JudgeSpec",
    "LoraSpec",
    "ModelSpec",
    "PolicyLossAgg",
    "PolicyLossName",
    "ProcessSpec",
    "ResumeSpec",
    "RewardModelSpec",
    "RewardSpec",
    "RolloutSpec",
    "SamplingSpec",
    "TrainerSpec",
    "WorkerSpec",
    "engine_spec",
]

#: how long one collective (or the rendezvous) of data-parallel trainer ranks may wait.
DEFAULT_DP_TIMEOUT_S = 600.0
#: the size of one bucket of a data-parallel trainer's weight export (a model up to it: one).
DEFAULT_EXPORT_BUCKET_BYTES = 256 << 20


PolicyLossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""Loss aggregation as `flowrl.algorithms.compute_policy_loss` spells it."""

PolicyLossName = Literal["ppo_clip", "gspo", "cispo"]
"""The policy objective (`flowrl.algorithms.PolicyLoss`)."""

CorrectionName = Literal["tis", "seq_tis", "mis", "icepop"]
"""The rollout correction (`flowrl.algorithms.CorrectionKind`)."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
"""A model's weights and compute; ``auto`` is bfloat16 where the device supports it."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class LoraSpec(_Spec):
    """Low-rank adapters on the policy (`workers.engines.lora`)."""

    rank: int = Field(ge=1)
    alpha: int = Field(ge=1)
    dropout: float = Field(ge=0.0, lt=1.0)
    #: module names or suffixes, or ``all-linear``.
    target_modules: tuple[str, ...] | Literal["all-linear"]
    #: what a new version publishes: ``adapter`` (the adapters alone: the rollout engine
    #: merges them into its copy of the base weights) or ``merged`` (whole weights, for an
    #: engine that loads only those; the adapters ride along for trainers that join).
    sync: Literal["adapter", "merged"]


class ModelSpec(_Spec):
    #: a local model directory (the launcher resolves ``tiny`` before workers start).
    path: str
    #: resuming: the initial policy, which the reference and the critic start from.
    reference_path: str | None = None
    #: None: full fine-tuning.
    lora: LoraSpec | None = None


class ArithmeticDataSpec(_Spec):
    kind: Literal["arithmetic"]
    count: int
    max_operand: int
    seed: int
    max_prompt_tokens: int
    #: prompts go through the tokenizer's chat template (`flowrl.prompts`).
    chat_template: bool = False
    system_prompt: str | None = None


class FileDataSpec(_Spec):
    kind: Literal["jsonl", "parquet"]
    path: str
    prompt_key: str
    answer_key: str
    prompt_template: str
    max_prompt_tokens: int
    chat_template: bool = False
    system_prompt: str | None = None


class EvalDataSpec(_Spec):
    """The held-out evaluation split (`flowrl.data.hold_out`)."""

    prompts: int = Field(ge=1)
    #: a file of ``data.kind`` read like the data file; None: held out from the data.
    path: str | None = None


class AlgorithmSpec(_Spec):
    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"]
    kl_coef: float
    kl_estimator: Literal["k1", "k2", "k3"]
    #: the KL in the rewards (before the advantages) instead of a loss term.
    kl_in_reward: bool
    entropy_coef: float
    policy_loss: PolicyLossName
    clip_low: float
    clip_high: float
    loss_agg: PolicyLossAgg
    correction: CorrectionName
    #: a cap, None (off), or ``auto``: resolved per train task from the staleness in force.
    tis_cap: float | Literal["auto"] | None
    #: ``(low, high)``, None (off), or ``auto``: as `tis_cap`, for the masking corrections.
    mask_bounds: tuple[float, float] | Literal["auto"] | None


class SamplingSpec(_Spec):
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...]


class RolloutSpec(_Spec):
    dtype: Dtype
    #: the episode function (``module:function`` or ``/path/file.py:function``); None: one
    #: completion per response.
    episode: str | None = None
    #: serve each episode an OpenAI-compatible endpoint on loopback.
    endpoint: bool = False
    #: tool name -> reference, and how the tool sandboxes run (`workers.tool_pool`).
    tools: dict[str, str] = Field(default_factory=dict)
    tool_workers: int = Field(default=2, ge=1)
    tool_timeout_s: float = Field(default=10.0, gt=0)
    tool_memory_mb: int | None = None
    #: the episodes' limits (`flowrl.episode.Policy`); None: none.
    max_turns: int | None = None
    max_episode_tokens: int | None = None
    #: interruptible generation: new weights are loaded while episodes run (needs ``episode``).
    partial: bool = False


class RewardModelSpec(_Spec):
    #: a local sequence-classification model directory (the launcher resolves ``tiny``).
    path: str
    max_length: int = Field(ge=2)
    batch_size: int = Field(ge=1)
    dtype: Dtype


class JudgeSpec(_Spec):
    #: a local causal LM directory; None: the policy's initial model.
    path: str | None
    template: str
    parse: Literal["number", "yes_no"]
    min_score: float
    max_score: float
    default: float
    max_new_tokens: int = Field(ge=1)
    max_prompt_tokens: int = Field(ge=1)
    stop: tuple[str, ...]
    engine: Literal["hf", "vllm"]
    dtype: Dtype


class RewardSpec(_Spec):
    """Exactly one of `fn`, `model` and `judge`."""

    #: ``module:function`` or ``/path/file.py:function``.
    fn: str | None
    batched: bool
    timeout_s: float
    concurrency: int
    model: RewardModelSpec | None = None
    judge: JudgeSpec | None = None
    #: the highest score the reward gives (`flowrl.recipe.reward.RewardConfig.max_score`).
    max_score: float | None = None

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        if sum(x is not None for x in (self.fn, self.model, self.judge)) != 1:
            raise ValueError("exactly one of fn, model and judge")
        return self


class TrainerSpec(_Spec):
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float | None
    warmup_steps: int
    lr_schedule: Literal["constant", "cosine"]
    min_lr_ratio: float
    #: passes over each global batch, and optimizer updates per pass.
    ppo_epochs: int = Field(ge=1)
    mini_batches: int = Field(ge=1)
    gradient_checkpointing: bool = False


class CriticSpec(_Spec):
    lr: float
    weight_decay: float
    grad_clip: float | None
    gamma: float
    lam: float
    value_clip: float | None
    epochs: int
    #: rows per critic optimizer step (the actor's global batch).
    rows_per_step: int


class DataParallelSpec(_Spec):
    """The trainer ranks' group; each rank's number is its process index."""

    world: int = Field(ge=2)
    sharding: Literal["replicate", "fsdp2"]
    compute_dtype: Literal["float32", "bfloat16"]
    #: rank 0 publishes a version in buckets of about this many bytes (`workers.resharding`).
    export_bucket_bytes: int = Field(default=DEFAULT_EXPORT_BUCKET_BYTES, ge=1)
    timeout_s: float = Field(default=DEFAULT_DP_TIMEOUT_S, gt=0.0)
    #: ranks on several nodes: the controller's rendezvous store, ``host:port``; "" on one node.
    store: str = ""
    #: restarts of the group before this one (it meets anew each time).
    generation: int = Field(default=0, ge=0)


class ResumeSpec(_Spec):
    checkpoint: str
    version: int = Field(ge=0)


class EngineSpec(_Spec):
    """What real-engine (``hf``, ``vllm``) workers are configured with."""

    model: ModelSpec
    data: Annotated[ArithmeticDataSpec | FileDataSpec, Field(discriminator="kind")]
    algorithm: AlgorithmSpec
    sampling: SamplingSpec
    rollout: RolloutSpec
    reward: RewardSpec
    trainer: TrainerSpec
    #: the held-out evaluation split, when the run evaluates (``eval``).
    eval: EvalDataSpec | None = None
    #: PPO only.
    critic: CriticSpec | None = None
    #: ``trainer.ranks > 1`` only.
    data_parallel: DataParallelSpec | None = None
    resume: ResumeSpec | None = None
    #: the run's last step: the learning-rate schedule's end, where the trainer writes the
    #: final model (and a checkpoint, when checkpoints are on).
    steps: int
    seed: int
    #: the run's output directory (`flowrl.run_output`): the final model and checkpoints.
    output: str | None
    checkpoint_every: int

    @property
    def start_version(self) -> int:
        """The policy version the model path holds: 0, or the checkpoint's when resuming."""
        return 0 if self.resume is None else self.resume.version


def engine_spec(config: EngineSpec | Mapping[str, Any]) -> EngineSpec:
    """``config`` as an `EngineSpec`, validated when given in its JSON form."""
    return config if isinstance(config, EngineSpec) else EngineSpec.model_validate(config)


#: a cost (a number), the trace file to draw costs from (a path, or None), or per-role
#: factors (``trace_stretch``)
_SimValue = int | float | str | dict[str, float] | None


class ColocatedSpec(_Spec):
    """A trainer process's second worker under colocated placement: the rollout engine that
    serves the trainer's weights (`workers.colocated`)."""

    role: Literal["rollout"]
    #: tasks the rollout worker runs concurrently.
    capacity: int = Field(ge=1)
    #: the trainer still writes each version into the store (what a restarted process joins
    #: from); False: the weights exist once, and the process cannot be restarted.
    keep_weight_copy: bool


class ProcessSpec(_Spec):
    """One worker process, as the controller decides it (the same on every node)."""

    #: ``<role>.<index>``; also names its spec file.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]+\.[0-9]+$", max_length=64)
    role: str = Field(min_length=1)
    #: workers hosted by the process.
    count: int = Field(ge=1)
    #: tasks one worker runs concurrently.
    capacity: int = Field(ge=1)
    threads: int = Field(ge=1)
    seed: int = Field(ge=0)
    heartbeat_s: float = Field(gt=0.0)
    #: how long the process's workers may take to fetch and load one policy version.
    weight_sync_timeout_s: float = Field(gt=0.0)
    engine: Literal["sim", "hf", "vllm"]
    #: real engines: their settings.
    config: EngineSpec | None = None
    #: ``engine="sim"``: the cost model (``workers.sim.SimCost`` fields).
    sim: dict[str, _SimValue] | None = None
    #: colocated placement (a trainer process): the rollout worker it hosts as well.
    colocated: ColocatedSpec | None = None
    #: the secret a process that cannot start reports its error with (``start_failed``,
    #: before it has a worker's token); fresh for every start.
    start_token: str = Field(min_length=16, max_length=128, repr=False)

    @model_validator(mode="after")
    def _engine_settings(self) -> ProcessSpec:
        if (self.engine == "sim") != (self.sim is not None) or (
                self.engine == "sim") == (self.config is not None):
            raise ValueError(f"engine {self.engine!r} takes "
                             f"{'sim costs' if self.engine == 'sim' else 'an engine config'}"
                             " and nothing else")
        if self.colocated is not None and (self.role != "train" or self.count != 1
                                           or self.engine == "sim"):
            raise ValueError("a colocated rollout worker lives in a process of one trainer "
                             "with a real engine (hf or vllm)")
        return self


class Endpoints(_Spec):
    """Where a worker process meets its run: known on the node it runs on."""

    run_id: str = Field(min_length=1)
    node: str = Field(min_length=1)
    controller: str = Field(min_length=1)
    broadcast: str = Field(min_length=1)
    #: this node's store server.
    store: str = Field(min_length=1)
    #: other nodes' store servers, by node.
    peers: dict[str, str] = Field(default_factory=dict)
    #: where its workers poll for tasks, when not the controller: its node agent's dispatch
    #: (`flowrl.node_dispatch`)
    tasks: str | None = None
    #: where ``served`` goes: the node agent's relay (`flowrl.node_relay`); "": the controller
    relay: str = ""


class WorkerSpec(_Spec):
    """Everything a worker process is told (`flowrl.worker_launch` hands it over)."""

    process: ProcessSpec
    endpoints: Endpoints
