"""The ``trainer`` section: the optimizer, batch sizes, PPO epochs and mini-batches, and
data-parallel ranks."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from flowrl.recipe.section import _rule, _Section
from flowrl.worker_spec import DEFAULT_EXPORT_BUCKET_BYTES

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
    """Linear learning-rate warm-up, in steps (global batches: every update of a step, see
    `ppo_epochs`, runs at that step's rate)."""
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
    ppo_epochs: int = Field(default=1, ge=1, le=64)
    """Passes over each global batch (PPO's epochs). With more than one pass or update, the
    trainer keeps the step's micro-batches, scores them once under the policy before its first
    update (π_old: the importance ratio's denominator, so later updates clip), and at the
    step's end runs ``ppo_epochs`` passes of `mini_batch_groups` updates; the new weights are
    published once, after the last."""
    mini_batch_groups: int | None = Field(default=None, ge=1, le=1 << 20)
    """Groups per optimizer update within a pass (PPO's mini-batch; verl's
    ``ppo_mini_batch_size``, in prompts): a pass takes ``groups_per_step / mini_batch_groups``
    updates. It must divide `groups_per_step` and be a multiple of `micro_batch_groups`. None:
    the whole batch, one update per pass."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads per trainer rank."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them: less activation memory for about one more forward per micro-batch; the same loss
    and gradients."""
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
    export_bucket_mb: float = Field(default=DEFAULT_EXPORT_BUCKET_BYTES / (1 << 20), gt=0.0,
                                    le=1 << 20)
    """With ``ranks > 1``: the size of one bucket when rank 0 publishes a new version (MiB).
    The weights are gathered whole one bucket at a time, written into the node's store and
    dropped before the next (`workers.resharding`), so publishing holds one bucket beyond the
    store's copy instead of a second whole model. A model up to this size is one bucket.
    Colocated FSDP2 ranks load their rollout engines with the same buckets, in place."""

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
        mini = self.mini_batch_groups
        if mini is not None and (mini > self.groups_per_step or self.groups_per_step % mini):
            raise _rule("mini_batch_groups", f"{mini} does not divide groups_per_step="
                        f"{self.groups_per_step} (a pass is groups_per_step / mini_batch_groups "
                        "updates)")
        if mini is not None and mini % self.micro_batch_groups:
            raise _rule("mini_batch_groups", f"{mini} is not a multiple of micro_batch_groups="
                        f"{self.micro_batch_groups} (an update trains whole micro-batches)")
        if self.updates_per_step > 1 and self.ranks > 1:
            raise _rule("ppo_epochs" if self.ppo_epochs > 1 else "mini_batch_groups",
                        f"several updates per step (ppo_epochs={self.ppo_epochs}, "
                        f"{self.mini_batches} mini-batches) need ranks=1, got {self.ranks}")
        if self.compute_dtype != "float32" and self.sharding != "fsdp2":
            raise _rule("compute_dtype", f"{self.compute_dtype!r} is FSDP2 mixed precision: "
                        f"set sharding='fsdp2' (got {self.sharding!r})")
        if self.sharding != "replicate" and self.ranks < 2:
            raise _rule("sharding", f"{self.sharding!r} shards the model over trainer ranks; "
                        f"set ranks >= 2 (got {self.ranks})")
        return self

    @property
    def mini_batches(self) -> int:
        """Optimizer updates per pass over a global batch."""
        return self.groups_per_step // (self.mini_batch_groups or self.groups_per_step)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per step: `ppo_epochs` passes of `mini_batches`."""
        return self.ppo_epochs * self.mini_batches
