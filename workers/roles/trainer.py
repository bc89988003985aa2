"""The train role: streamed micro-batches of whole groups → one optimizer step per global batch.

Per micro-batch (task): the rows' prompt+response tokens form a right-padded `SequenceBatch`;
advantages come from the rewards and the rows' groups (``task["row_groups"]``) by the configured
estimator; the policy loss is `flowrl.algorithms.compute_policy_loss` (``ppo_clip``, ``gspo`` or
``cispo``) with ``old_logprobs = logprobs.detach()`` (one update per batch: on-policy ratio 1),
the rollout correction against ``rollout_logprobs`` (truncated importance sampling per token or
sequence, or masking) when it is on for the task, the KL term to ``ref_logprobs`` when
``kl_coef > 0`` (or, with ``kl_in_reward``, ``−kl_coef·KL_t(π_old‖π_ref)`` in every token's
reward before the advantages, and no KL term), and an entropy bonus
(`flowrl.algorithms.sampled_entropy`) when ``entropy_coef > 0``. With ``ppo_epochs > 1`` or
several ``mini_batches``, a micro-batch is instead scored under π_old and kept, and the step's
end runs the updates over the kept ones (`workers.roles.policy_updates`); the step's metrics
are then means over its passes. The task with ``params["step_end"]`` ends the step: the
optimizer steps, the new weights are exported as version + 1 (`RoleOutput.weights`), and a
checkpoint is written every ``checkpoint_every`` steps (and at the last step). At the run's
last step (``steps``) the final model is written to ``{output}/final`` whenever there is an
``output``, checkpoints on or off (`save_final`; the step's metrics say ``final_saved``). A
save's seconds and bytes are metrics too (``checkpoint_s``, ``checkpoint_bytes``, ``final_s``,
``final_bytes``).

Gradient accumulation is exact. The step's loss is ``L = (1/D)·Σ_k S_k``, where ``S_k`` is
micro-batch k's loss computed with ``num_tokens = num_seqs = 1`` — a plain sum over its tokens
(``token-mean``) or over its rows' per-row values (the ``seq-mean`` modes, whose per-row divisor
is the row's own length or the constant ``max_new_tokens``) — and ``D`` is the whole step's
count: response tokens for ``token-mean``, rows with a response token otherwise. ``D`` is known
only when the last micro-batch has arrived, so each backward accumulates ``∇S_k`` and the step's
end multiplies the gradients by ``1/D`` before clipping and stepping:
``∇L = (1/D)·Σ_k ∇S_k``, the gradient of the loss computed on the concatenated batch (up to
float rounding; ``tests/test_roles.py`` checks 1e-6). The KL term is aggregated with the same
counts, so it is exact as well, and so are the group estimators (GRPO, Dr. GRPO, RLOO): a
micro-batch holds whole groups. REINFORCE++ whitens its returns over the micro-batch (the step's
statistics are unknown until its end); with one micro-batch per step it is exact. PPO takes the
per-token ``advantages`` the critic stage wrote (GAE against its values) as they are.

Metrics of the task that ends a step cover the whole step: ``loss`` (L), ``grad_norm`` (before
clipping), ``lr``, ``reward_mean``, ``clip_frac``, ``approx_kl`` (token-weighted means),
``kl`` (the aggregated KL term, when on), ``tis_mean`` (the mean correction weight, when a
correction is on), ``is_masked_frac`` (the share of tokens a masking correction dropped, when
one is on), ``entropy`` (the sampled tokens' mean surprisal), ``mismatch_kl`` (KL of the
sampling policy to the trainer's on the sampled tokens: engine mismatch plus staleness),
``kept_version`` (the weights kept for a rollback, `workers.roles.guard_orders`, once there are
any), ``tokens``, ``seqs``, ``skipped`` (1 when a non-finite gradient skipped the update),
``flat_groups`` (the share of the step's groups whose rewards are all equal: they carry no
group-relative signal, and a share near 1 means the policy has stopped exploring),
``solved_groups`` (with ``reward.max_score`` known: the share of groups whose responses all
scored it; solved, not stuck, though they are flat too),
``token_staleness`` (rows that record each token's policy version, such as episodes: the mean
number of versions between a trained token's and the trainer's).

Multi-turn trajectories (episodes) carry a ``loss_mask``: the tokens inserted between the
policy's turns stay in the context but out of every loss, count and estimator (the
`SequenceBatch`'s ``response_mask`` holds only the policy's tokens), so each algorithm trains
masked multi-turn sequences as it trains single completions.

Compute runs in a thread, one task at a time. `load_version` with no weights means "resume at
this version"; with weights of a newer version it loads them (a trainer joining a running job);
the broadcast of the trainer's own new version (not newer than its own) is ignored.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import structlog
import torch
from torch import Tensor

from flowrl import messages as m
from flowrl.algorithms import (
    DEFAULT_MASK_BOUNDS,
    DEFAULT_TIS_CAP,
    MASKING_KINDS,
    CorrectionKind,
    KLEstimator,
    LossAgg,
    PolicyLoss,
    RolloutCorrection,
    clip_range,
    compute_policy_loss,
    default_tis_cap,
    dr_grpo_advantages,
    filter_groups,
    grpo_advantages,
    kl_estimate,
    reinforce_pp_advantages,
    rloo_advantages,
    sampled_entropy,
)
from flowrl.progress import dir_bytes
from flowrl.worker_spec import EngineSpec
from workers.engines.protocols import SequenceBatch, TrainerEngine, TrainerState
from workers.roles.guard_orders import GuardOrders
from workers.roles.policy_updates import KeptBatch, mini_batch_runs
from workers.roles.train_batch import TrainBatch
from workers.runtime import RoleOutput

__all__ = [
    "AdvantageName", "TrainBatch", "TrainSettings", "TrainerRole", "discard_gradients",
    "scale_gradients",
]

log = structlog.get_logger("flowrl.trainer")

#: how far below ``max_score`` a reward still counts as the maximum (float rewards summed from
#: parts, a judge's parsed score)
_SCORE_EPS = 1e-6

AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"]


@dataclass(frozen=True)
class TrainSettings:
    """The objective and checkpointing of a train role (see `from_config`)."""

    algorithm: AdvantageName = "grpo"
    policy_loss: PolicyLoss = "ppo_clip"
    #: None: the policy loss's own (`flowrl.algorithms.clip_range`).
    clip_low: float | None = None
    clip_high: float | None = None
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    correction: CorrectionKind = "tis"
    #: the cap of ``tis`` / ``seq_tis``: a cap, None (off), or ``auto``: on (`DEFAULT_TIS_CAP`)
    #: for the tasks trained while ``max_staleness > 0`` is in force
    #: (``params["max_staleness"]``; it may change mid-run).
    tis_cap: float | Literal["auto"] | None = None
    #: the bounds of ``mis`` / ``icepop``: as `tis_cap` (``auto``: `DEFAULT_MASK_BOUNDS`).
    mask_bounds: tuple[float, float] | Literal["auto"] | None = None
    #: weight of the entropy bonus (`flowrl.algorithms.sampled_entropy`); 0 turns it off.
    entropy_coef: float = 0.0
    #: the KL to the reference as ``−kl_coef·KL_t(π_old‖π_ref)`` in every token's reward,
    #: before the advantage estimator, instead of a loss term (PPO's advantages carry it from
    #: the critic stage).
    kl_in_reward: bool = False
    #: passes over each step's batch, and optimizer updates per pass (`workers.roles.
    #: policy_updates`); 1 and 1: one update per step, streamed.
    ppo_epochs: int = 1
    mini_batches: int = 1
    #: the sampling temperature: logprobs are computed under the same tempered distribution.
    temperature: float = 1.0
    #: Dr. GRPO's constant per-row divisor (the generation budget); needed by
    #: ``seq-mean-token-sum-norm`` so every micro-batch divides alike.
    max_new_tokens: int | None = None
    output: Path | None = None
    checkpoint_every: int = 0
    #: the highest score the reward gives (``reward.max_score``; None: not known): a flat group
    #: at it is solved rather than stuck (``solved_groups``).
    max_score: float | None = None
    #: the run's last step: the final model is written there (and a checkpoint, when they are
    #: on).
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in get_args(AdvantageName):
            raise ValueError(f"algorithm.name: {self.algorithm!r} is not supported by the "
                             f"trainer; use one of {get_args(AdvantageName)}")
        if self.loss_agg not in get_args(LossAgg):
            raise ValueError(f"algorithm.loss_agg: unknown mode {self.loss_agg!r}")
        if self.policy_loss not in get_args(PolicyLoss):
            raise ValueError(f"algorithm.policy_loss: unknown policy loss {self.policy_loss!r}; "
                             f"use one of {get_args(PolicyLoss)}")
        if self.correction not in get_args(CorrectionKind):
            raise ValueError(f"algorithm.correction: unknown correction {self.correction!r}; "
                             f"use one of {get_args(CorrectionKind)}")
        # Bad clip ranges, caps and bounds fail here, on construction, not at the first task.
        try:
            clip_range(self.policy_loss, self.clip_low, self.clip_high)
        except ValueError as e:
            raise ValueError(f"algorithm.clip_low / clip_high: {e}") from None
        self.correction_at(1)
        if self.loss_agg == "seq-mean-token-sum-norm" and not self.max_new_tokens:
            raise ValueError("seq-mean-token-sum-norm needs max_new_tokens (a constant divisor)")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"need ppo_epochs >= 1 and mini_batches >= 1, got "
                             f"{self.ppo_epochs}, {self.mini_batches}")
        if self.kl_in_reward and not self.kl_coef > 0:
            raise ValueError("algorithm.kl_in_reward: folds kl_coef·KL into the rewards; "
                             "set kl_coef > 0")

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> TrainSettings:
        """From a worker's `EngineSpec`."""
        a = spec.algorithm
        return cls(
            algorithm=a.name, policy_loss=a.policy_loss, clip_low=a.clip_low,
            clip_high=a.clip_high, loss_agg=a.loss_agg, kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, correction=a.correction,
            tis_cap=a.tis_cap, mask_bounds=a.mask_bounds, kl_in_reward=a.kl_in_reward,
            ppo_epochs=spec.trainer.ppo_epochs, mini_batches=spec.trainer.mini_batches,
            temperature=spec.sampling.temperature, max_new_tokens=spec.sampling.max_new_tokens,
            output=None if spec.output is None else Path(spec.output),
            checkpoint_every=spec.checkpoint_every, steps=spec.steps,
            max_score=spec.reward.max_score,
        )

    def correction_at(self, max_staleness: int | None) -> RolloutCorrection | None:
        """The rollout correction of a task trained while ``max_staleness`` is in force (None:
        off): `correction` with its `tis_cap` or `mask_bounds`, ``auto`` on exactly when rows
        may be stale (`default_tis_cap`). ValueError when ``auto`` meets a task that does not
        say (the controller always does)."""
        truncates = self.correction not in MASKING_KINDS
        setting = self.tis_cap if truncates else self.mask_bounds
        name = "tis_cap" if truncates else "mask_bounds"
        if setting == "auto":
            if max_staleness is None:
                raise ValueError(f"{name} 'auto' needs the task's params['max_staleness']")
            if default_tis_cap(max_staleness) is None:
                return None
            setting = DEFAULT_TIS_CAP if truncates else DEFAULT_MASK_BOUNDS
        if setting is None:
            return None
        try:
            if isinstance(setting, tuple):
                return RolloutCorrection(self.correction, bounds=setting)
            assert not isinstance(setting, str)
            return RolloutCorrection(self.correction, cap=setting)
        except ValueError as e:
            raise ValueError(f"algorithm.{name}: {e}") from None

    @property
    def count_tokens(self) -> bool:
        """Whether the step's divisor counts tokens (token-mean) rather than sequences."""
        return self.loss_agg == "token-mean"

    @property
    def keeps_batches(self) -> bool:
        """Whether a step takes several updates, over the micro-batches it keeps."""
        return self.ppo_epochs * self.mini_batches > 1

    @property
    def kl_loss_coef(self) -> float:
        """The weight of the KL loss term (0 when the KL is in the rewards)."""
        return 0.0 if self.kl_in_reward else self.kl_coef


def advantages(
    name: AdvantageName, batch: TrainBatch, *, old_logprobs: Tensor | None = None,
    kl_coef: float = 0.0, kl_estimator: KLEstimator = "k3",
) -> Tensor:
    """[B] (group estimators) or [B, L] (REINFORCE++, PPO) advantages of a micro-batch.

    With ``kl_coef`` the KL is in the rewards (verl's ``use_kl_in_reward``): every response
    token's reward gets ``−kl_coef·KL_t``, ``KL_t`` the ``kl_estimator`` estimate of
    KL(π_old‖π_ref) from ``old_logprobs`` and the batch's ``ref_logprobs``. A group estimator
    then sees ``r − kl_coef·Σ_t KL_t`` per row, REINFORCE++ the per-token rewards. PPO's
    advantages come from the critic stage as they are (it folds the KL in there)."""
    r, g = batch.rewards, batch.group_ids
    if name == "ppo":
        if batch.advantages is None:
            raise ValueError("ppo trains on the critic's advantages; the task carries none")
        return batch.advantages
    mask = batch.seqs.response_mask
    if kl_coef:
        if old_logprobs is None or batch.ref_logprobs is None:
            raise ValueError("the KL in the rewards needs old_logprobs and ref_logprobs")
        if name == "reinforce_pp":
            return reinforce_pp_advantages(r, mask, old_logprobs=old_logprobs,
                                           ref_logprobs=batch.ref_logprobs, kl_coef=kl_coef,
                                           kl_estimator=kl_estimator, group_ids=g)
        kl = kl_estimate(old_logprobs, batch.ref_logprobs, mask, kl_estimator)
        r = r - kl_coef * kl.sum(dim=-1).to(r.dtype)
    if name == "grpo":
        return grpo_advantages(r, g)
    if name == "dr_grpo":
        return dr_grpo_advantages(r, g)
    if name == "rloo":
        return rloo_advantages(r, g)
    return reinforce_pp_advantages(r, mask, group_ids=g)


def scale_gradients(engine: TrainerEngine, factor: float) -> None:
    """Multiply the engine's accumulated gradients by ``factor``.

    Uses the engine's ``scale_gradients(factor)`` when it has one, else its torch ``model``.
    """
    method = getattr(engine, "scale_gradients", None)
    if callable(method):
        method(factor)
        return
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{type(engine).__name__} has neither scale_gradients() nor a torch model")
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def set_lr_scale(engine: TrainerEngine, scale: float) -> None:
    """Have the engine's optimizer steps use its schedule's rate times ``scale`` (an engine
    without an ``lr_scale`` can only run at 1)."""
    if hasattr(engine, "lr_scale"):
        engine.lr_scale = scale
    elif scale != 1.0:
        raise TypeError(f"{type(engine).__name__} cannot scale its learning rate")


def discard_gradients(engine: TrainerEngine) -> None:
    """Drop the engine's accumulated gradients (its ``discard_gradients()`` when it has one,
    else its torch ``model``'s ``zero_grad``)."""
    method = getattr(engine, "discard_gradients", None)
    if callable(method):
        method()
        return
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{type(engine).__name__} has neither discard_gradients() nor a torch "
                        "model")
    model.zero_grad(set_to_none=True)


@dataclass
class _Step:
    """What the micro-batches of the current step have accumulated (sums, see module doc)."""

    step: int | None = None  # the controller's step number of these micro-batches
    attempt: int = 0  # the controller's attempt at that step (bumped when a step is redone)
    micro_batches: int = 0
    loss: float = 0.0
    kl: float = 0.0
    tokens: int = 0
    seqs: int = 0
    rows: int = 0
    reward: float = 0.0
    clip: float = 0.0  # Σ clip_frac · tokens
    approx_kl: float = 0.0  # Σ approx_kl · tokens
    tis: float = 0.0  # Σ tis_mean · tokens
    tis_tokens: int = 0  # tokens of the micro-batches trained with a correction on
    masked: float = 0.0  # Σ is_masked_frac · tokens
    mask_tokens: int = 0  # tokens of the micro-batches trained with a masking correction on
    entropy: float = 0.0  # Σ entropy · tokens
    mismatch_kl: float = 0.0  # Σ KL(sampling policy ‖ trainer) · tokens
    groups: int = 0
    flat_groups: int = 0  # groups whose rewards are all equal (no group-relative signal)
    solved_groups: int = 0  # flat groups at the reward's maximum (`TrainSettings.max_score`)
    token_lag: float = 0.0  # Σ (trainer version − the version that generated the token)
    lag_tokens: int = 0  # tokens whose generating version is known


class TrainerRole:
    """Streams micro-batches into one `TrainerEngine`; see the module docstring."""

    def __init__(
        self, engine: TrainerEngine, settings: TrainSettings, *, pad_token_id: int,
        version: int = 0,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.pad_token_id = pad_token_id
        self.version = version
        self._step = _Step()
        #: the step's micro-batches, kept when it takes several updates
        self._kept: list[KeptBatch] = []
        self._lock = asyncio.Lock()  # one task (or weight load) at a time on the engine
        #: whether a step's end exports the new weights (a data-parallel group exports once,
        #: from rank 0: `workers.roles.dp_trainer`).
        self.exports_weights = True
        #: the stability guard's orders: learning-rate scale, weights kept, rollbacks
        self.orders = GuardOrders()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        async with self._lock:
            return await asyncio.to_thread(self._train, task, inputs)

    def _train(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        batch = TrainBatch.from_inputs(inputs, task["row_groups"],
                                       pad_token_id=self.pad_token_id)
        params = task["params"]
        step, attempt = params.get("step"), params.get("attempt", 0)
        if self._step.micro_batches and attempt != self._step.attempt:
            # The controller gave this step back (a micro-batch failed) and redoes all of it:
            # what the failed attempt accumulated must not count twice.
            log.warning("step redone: dropping the gradients of its failed attempt",
                        step=step, micro_batches=self._step.micro_batches)
            discard_gradients(self.engine)
            self._step = _Step()
            self._kept = []
        elif self._step.micro_batches and step is not None and step != self._step.step:
            # The controller ends every step with a step_end task; this means one went missing.
            log.warning("micro-batch of another step joins the accumulated gradients",
                        accumulating=self._step.step, task_step=step)
        if self._step.micro_batches == 0:
            self.orders.at_step_start(self.engine, params, version=self.version, load=_load_into)
            set_lr_scale(self.engine, self.orders.lr_scale)
        metrics = self.accumulate(batch,
                                  self.settings.correction_at(params.get("max_staleness")))
        self._step.step = step
        self._step.attempt = attempt
        if not params.get("step_end", False):
            return RoleOutput(fields={}, metrics=metrics)
        return self.finish_step()

    def accumulate(
        self, batch: TrainBatch, correction: RolloutCorrection | None
    ) -> dict[str, float]:
        """Take one micro-batch trained with the rollout ``correction`` (None: off): with one
        update per step, forward and backward of its loss *sum* into the gradients now; with
        several, score it under π_old and keep it for the step's end
        (`workers.roles.policy_updates`)."""
        s = self.settings
        if batch.num_tokens == 0:
            raise ValueError("micro-batch has no response tokens")
        if s.kl_coef and batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 but the task carries no ref_logprobs")
        if s.keeps_batches:
            old = self.engine.logprobs(batch.seqs, temperature=s.temperature)
            self._measure(batch, old)
            self._kept.append(KeptBatch(batch, old, self._advantages(batch, old), correction))
        else:
            self._backward(batch, correction)
        st, tokens = self._step, batch.num_tokens
        st.micro_batches += 1
        st.tokens += tokens
        st.seqs += batch.num_seqs
        st.rows += len(batch.rewards)
        st.reward += float(batch.rewards.sum())
        if batch.token_versions is not None:
            mask = batch.seqs.response_mask
            lag = (self.version - batch.token_versions[mask].to(torch.float64)).sum()
            st.token_lag += float(lag)
            st.lag_tokens += tokens
        kept = filter_groups(batch.rewards, batch.group_ids)
        st.flat_groups += int(kept.dropped_groups.numel())
        if s.max_score is not None and kept.dropped_groups.numel():
            # A flat group's rows all scored alike: any row at the maximum makes it solved.
            at_max = batch.group_ids[batch.rewards >= s.max_score - _SCORE_EPS]
            st.solved_groups += int(torch.isin(kept.dropped_groups, at_max).sum())
        st.groups += int(kept.dropped_groups.numel() + kept.kept_groups.numel())
        return {"tokens": float(tokens), "reward_mean": float(batch.rewards.mean()),
                "micro_batches": float(st.micro_batches)}

    def _advantages(self, batch: TrainBatch, old: Tensor) -> Tensor:
        """The micro-batch's advantages, with the KL in the rewards when it goes there (``old``:
        its π_old log-probabilities)."""
        s = self.settings
        if not s.kl_in_reward:
            return advantages(s.algorithm, batch)
        return advantages(s.algorithm, batch, old_logprobs=old.cpu(), kl_coef=s.kl_coef,
                          kl_estimator=s.kl_estimator)

    def _measure(self, batch: TrainBatch, old: Tensor) -> None:
        """Add the micro-batch's π_old measures to the step: its entropy, the sampling policy's
        KL to it, and with the KL in the rewards its KL to the reference (token sums)."""
        s, st = self.settings, self._step
        with torch.no_grad():
            mask = batch.seqs.response_mask.to(old.device)
            rollout = batch.rollout_logprobs.to(old.device)
            st.entropy += float(-old.masked_fill(~mask, 0.0).sum())
            st.mismatch_kl += float(kl_estimate(rollout, old, mask, "k3").sum())
            if s.kl_in_reward:
                assert batch.ref_logprobs is not None  # checked in accumulate
                ref = batch.ref_logprobs.to(old.device)
                st.kl += float(kl_estimate(old, ref, mask, s.kl_estimator).sum())

    def _backward(
        self, batch: TrainBatch, correction: RolloutCorrection | None,
        kept: KeptBatch | None = None,
    ) -> None:
        """Forward and backward of one micro-batch's loss *sum* into the gradients; π_old and
        the advantages are ``kept``'s, else this forward's (one update per step)."""
        s = self.settings
        adv: Tensor | None = None  # with the KL in the rewards, from this forward's π_old
        if kept is not None:
            adv = kept.advantages
        elif not s.kl_in_reward:
            adv = advantages(s.algorithm, batch)

        def loss_fn(lps: Tensor, seqs: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
            dev = lps.device
            mask = seqs.response_mask
            if kept is None:
                old = lps.detach()
                self._measure(batch, old)
            else:
                old = kept.old_logprobs.to(dev)
            a = self._advantages(batch, old) if adv is None else adv
            return compute_policy_loss(
                lps, old, a.to(dev), mask, policy_loss=s.policy_loss,
                clip_eps_low=s.clip_low, clip_eps_high=s.clip_high, loss_agg=s.loss_agg,
                max_tokens=s.max_new_tokens, num_tokens=1.0, num_seqs=1.0,
                rollout_logprobs=batch.rollout_logprobs.to(dev), correction=correction,
                ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs.to(dev),
                kl_coef=s.kl_loss_coef, kl_estimator=s.kl_estimator,
                entropy=sampled_entropy(lps, mask) if s.entropy_coef else None,
                entropy_coef=s.entropy_coef,
            )

        out = self.engine.train_micro_batch(batch.seqs, loss_fn, temperature=s.temperature)
        st, tokens = self._step, batch.num_tokens
        st.loss += out["loss"]
        st.kl += out.get("kl_loss", 0.0)
        st.clip += out["clip_frac"] * tokens
        st.approx_kl += out["approx_kl"] * tokens
        st.tis += out.get("tis_mean", 0.0) * tokens
        st.tis_tokens += tokens if correction is not None else 0
        st.masked += out.get("is_masked_frac", 0.0) * tokens
        st.mask_tokens += tokens if correction is not None and correction.masks else 0

    def _updates(self) -> dict[str, float]:
        """The step's ``ppo_epochs`` passes over its kept micro-batches, one optimizer update
        per mini-batch; the schedule advances once, with the last. Returns the last update's
        stats, with ``grad_norm`` the updates' mean, ``skipped`` and ``updates`` their
        counts."""
        s = self.settings
        kept, self._kept = self._kept, []
        runs = mini_batch_runs([len(k.batch.rewards) for k in kept], s.mini_batches)
        norms: list[float] = []
        skipped = 0.0
        stats: dict[str, float] = {}
        for epoch in range(s.ppo_epochs):
            for i, run in enumerate(runs):
                part = kept[run]
                for k in part:
                    self._backward(k.batch, k.correction, k)
                count = sum(k.batch.num_tokens if s.count_tokens else k.batch.num_seqs
                            for k in part)
                scale_gradients(self.engine, 1.0 / count)
                if epoch == s.ppo_epochs - 1 and i == len(runs) - 1:
                    stats = self.engine.optimizer_step()
                else:
                    stats = self.engine.optimizer_step(advance=False)
                norms.append(stats["grad_norm"])
                skipped += stats.get("skipped", 0.0)
        return {**stats, "grad_norm": sum(norms) / len(norms), "skipped": skipped,
                "updates": float(len(norms))}

    def finish_step(self) -> RoleOutput:
        """Normalise the accumulated gradients, step (or run the step's updates), export
        version + 1, maybe checkpoint."""
        st, s = self._step, self.settings
        if st.micro_batches == 0:
            raise RuntimeError("step_end without any micro-batch in this step")
        denom = st.tokens if s.count_tokens else st.seqs
        if s.keeps_batches:
            stats = self._updates()
            passes = s.ppo_epochs
        else:
            scale_gradients(self.engine, 1.0 / denom)
            stats = self.engine.optimizer_step()
            passes = 1
        self._step = _Step()
        self.version += 1
        weights, published = self.export_version()
        # The sums of the passes' updates cover the batch `passes` times: their metrics are
        # means over the passes.
        metrics = {
            "loss": st.loss / (denom * passes),
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "skipped": stats.get("skipped", 0.0),
            "reward_mean": st.reward / st.rows,
            "clip_frac": st.clip / (st.tokens * passes),
            "approx_kl": st.approx_kl / (st.tokens * passes),
            "tokens": float(st.tokens),
            "seqs": float(st.seqs),
            "micro_batches": float(st.micro_batches),
            "flat_groups": st.flat_groups / max(1, st.groups),
        }
        if s.max_score is not None:
            metrics["solved_groups"] = st.solved_groups / max(1, st.groups)
        if s.keeps_batches:
            metrics["updates"] = stats["updates"]
        if s.kl_in_reward:  # the mean per-token KL(π_old‖π_ref) the rewards were charged
            metrics["kl"] = st.kl / st.tokens
        elif s.kl_coef:
            metrics["kl"] = st.kl / (denom * passes)
        if st.tis_tokens:
            metrics["tis_mean"] = st.tis / st.tis_tokens
        if st.mask_tokens:
            metrics["is_masked_frac"] = st.masked / st.mask_tokens
        metrics["entropy"] = st.entropy / st.tokens
        metrics["mismatch_kl"] = st.mismatch_kl / st.tokens
        if st.lag_tokens:
            metrics["token_staleness"] = st.token_lag / st.lag_tokens
        if self.orders.kept_version is not None:
            metrics["kept_version"] = float(self.orders.kept_version)
        if self._checkpoint_due():
            try:
                t0 = time.perf_counter()
                _timed(metrics, "checkpoint", self.save_checkpoint(), t0)
            except OSError as e:  # the step is taken and published: a full disk must not undo it
                log.error("checkpoint failed", version=self.version, error=repr(e))
                metrics["checkpoint_failed"] = 1.0
        if self._final_due():
            try:
                t0 = time.perf_counter()
                if _timed(metrics, "final", self.save_final(), t0) is not None:
                    metrics["final_saved"] = 1.0
            except OSError as e:  # as above; the run says that no final model was saved
                log.error("final model not saved", version=self.version, error=repr(e))
                metrics["final_save_failed"] = 1.0
        return RoleOutput(fields={}, version=self.version, metrics=metrics, weights=weights,
                          published=published)

    def export_version(self) -> tuple[dict[str, Tensor] | None, dict[str, list[Any]] | None]:
        """The new version's weights: to publish (`RoleOutput.weights`), or as already
        published (`RoleOutput.published`); (None, None) when this role does not export."""
        return (self.engine.export_weights() if self.exports_weights else None), None

    def _checkpoint_due(self) -> bool:
        s = self.settings
        if s.output is None or s.checkpoint_every <= 0:
            return False
        return self.version % s.checkpoint_every == 0 or self.version == s.steps

    def _final_due(self) -> bool:
        s = self.settings
        return s.output is not None and s.steps is not None and self.version == s.steps

    def save_final(self) -> Path | None:
        """Write the final model to ``{output}/final``: weights, config and tokenizer, what
        ``from_pretrained`` loads (no optimizer state). Built aside and renamed, replacing an
        earlier final model (a resumed run that trained further). Returns its path (None on a
        data-parallel rank that only takes part in the gathers)."""
        return self._write_final()

    def _write_final(self, weights: Mapping[str, Tensor] | None = None) -> Path:
        """`save_final`'s writes; ``weights`` as in `_write_checkpoint`."""
        if self.settings.output is None:
            raise RuntimeError("no output directory configured")
        root = self.settings.output
        root.mkdir(parents=True, exist_ok=True)
        final, tmp, old = root / "final", root / ".final.partial", root / ".final.old"
        shutil.rmtree(tmp, ignore_errors=True)
        self.engine.save_pretrained(tmp, state_dict=weights)
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("final model", version=self.version, path=str(final))
        return final

    def save_checkpoint(self) -> Path | None:
        """Write ``{output}/step_{version}``: weights, config and tokenizer (``save_pretrained``)
        plus the optimizer state. Built aside and renamed, so a directory named ``step_N``
        is always complete. Returns its path (None on a data-parallel rank that only takes
        part in the gathers)."""
        return self._write_checkpoint(self.engine.state_dict())

    def _write_checkpoint(self, state: TrainerState,
                          weights: Mapping[str, Tensor] | None = None) -> Path:
        """`save_checkpoint`'s writes, given the optimizer ``state`` and, when the model's own
        state dict is not what to save (sharded ranks gather it first), its ``weights``."""
        if self.settings.output is None:
            raise RuntimeError("no output directory configured")
        root = self.settings.output
        root.mkdir(parents=True, exist_ok=True)
        final, tmp = root / f"step_{self.version}", root / f".step_{self.version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        self.engine.save_pretrained(tmp, state_dict=weights)
        TrainerState(state.tensors, {**state.meta, "version": self.version}).save(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        log.info("checkpoint", version=self.version, path=str(final))
        return final

    async def load_version(self, version: int, weights: dict[str, Tensor]) -> None:
        if version <= self.version:
            return  # our own step coming back through the broadcast
        if weights:  # joining a running job: its weights, and its place in the schedule
            async with self._lock:
                await asyncio.to_thread(_load_into, self.engine, weights)
            self.engine.join_at(version)
        self.version = version


def _timed(metrics: dict[str, float], what: str, saved: Path | None,
           t0: float) -> Path | None:
    """Add a save's seconds since ``t0`` and bytes to ``metrics`` as ``{what}_s`` and
    ``{what}_bytes`` (the launcher's progress line says them); ``saved`` as it is (None: this
    rank saved nothing)."""
    if saved is not None:
        metrics[f"{what}_s"] = time.perf_counter() - t0
        metrics[f"{what}_bytes"] = float(dir_bytes(saved))
    return saved


def _load_into(engine: TrainerEngine, weights: Mapping[str, Tensor]) -> None:
    """Copy ``weights`` (names as `TrainerEngine.export_weights` gives them) into the model;
    a payload with adapters goes to the engine's ``load_adapter``."""
    from workers.engines.lora import is_adapter_payload

    if is_adapter_payload(weights):
        load_adapter = getattr(engine, "load_adapter", None)
        if not callable(load_adapter):
            raise TypeError(f"{type(engine).__name__} cannot load adapters")
        load_adapter(weights)
        return
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{type(engine).__name__} has no torch model to load weights into")
    from workers.engines.tied_weights import tied_groups

    params = model.state_dict(keep_vars=True)
    missing = [g[0] for g in tied_groups(model) if not any(n in weights for n in g)]
    if missing:
        raise KeyError(f"missing weights: {missing[:5]}")
    for name, value in weights.items():
        if name not in params:
            raise KeyError(f"unknown weight name {name!r}")
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != "
                             f"{tuple(params[name].shape)}")
    from workers.distributed import local_part, shard_like

    with torch.no_grad():
        for name, value in weights.items():
            target = params[name]
            # A sharded parameter (FSDP2) takes this rank's shard of the whole tensor.
            local_part(target).copy_(local_part(shard_like(value, target)))
