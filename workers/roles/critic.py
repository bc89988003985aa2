"""The critic role of PPO: values, GAE advantages and returns per row; the critic trains itself.

Per task (a micro-batch of rows with ``prompt_ids``, ``response_ids`` and ``reward``):

1. one forward of the value model with gradients gives per-token values ``V`` (`ValueModel`
   aligns token t's value with the state before it);
2. the outcome reward sits on each row's last response token (`token_level_rewards`; an
   episode's ``token_rewards`` instead, and only the policy's tokens of a multi-turn
   trajectory, its ``loss_mask``, are valued and credited), and with
   ``algorithm.kl_in_reward`` every response token's reward gets ``−kl_coef·KL_t`` (KL of the
   sampling policy, ``rollout_logprobs``, to the reference, ``ref_logprobs``: the trainer's
   π_old does not exist yet when the critic scores a row); GAE with
   the recipe's ``gamma`` and ``lam`` over the detached ``V`` gives advantages ``A`` and returns
   ``R = A + V`` (`gae_advantages`, not whitened: the stream never holds a whole global batch,
   and per-micro-batch statistics would distort small micro-batches; the value baseline already
   centres the advantages);
3. the clipped value loss ``½·max((V − R)², (V_old + clip(V − V_old, ±value_clip) − R)²)``,
   summed over the micro-batch's tokens, is back-propagated into the accumulated gradients;
4. fields ``values``, ``advantages`` and ``returns`` are returned, one float32 1-D tensor per
   row aligned with ``response_ids``; the train stage uses ``advantages`` as they are.

Stepping. The role counts the rows it has learned from. Once the count reaches
``rows_per_step`` (the actor's global batch, ``groups_per_step * group_size``), the gradients
are divided by the tokens accumulated since the last step (a token mean over the critic's
batch), clipped, and AdamW steps; the count restarts at 0. The rule depends only on the order in
which the role receives rows, never on timing or on the actor's step boundaries: a critic step
may cover rows of two actor steps when micro-batches arrive partly filled. With ``epochs > 1``
the role keeps the batch's sequences, scoring-time values and returns, and after that step runs
``epochs − 1`` more passes over them, each ending in a step; only there does ``value_clip``
bind (in the first pass ``V`` equals ``V_old``).

Failures. The actor's exactly-once step commit is the controller's and is not touched; the
critic is a learned baseline whose training is at-least-once:

- a task that raises inside the role before its backward adds nothing; its rows are requeued
  and scored again;
- a task that fails after the role returned (writing its fields or reporting them) has already
  been learned from; its rows come back and are learned from a second time;
- a train step aborted by the controller redoes its rows with the advantages already stored:
  the critic does not see them again; rows dropped as stale after scoring stay learned from;
- a restarted critic process starts again from its run's last save (below), else from its
  initial weights (the model directory's backbone and the seeded head); gradients accumulated
  and not yet stepped, and steps after the save, are lost.

Checkpoints. With the run's ``output`` and ``checkpoint_every``, the critic writes its weights
and optimizer state to ``{output}/critic`` every ``checkpoint_every`` critic steps, replacing the
previous save (`save_checkpoint`; `critic_checkpoint` finds it even if a save was cut short).
A run resumed from ``{output}/step_N`` (``flowrl.launch --resume``) starts its critic from there
(`workers.roles.factory`): the critic's newest save, at most ``checkpoint_every`` critic steps
apart from the policy checkpoint, since the two step on their own. A critic process restarted
within a run starts from that run's newest save (a save records its run id: another run's
save in the same directory is never loaded without ``--resume``).

Compute runs in a thread, one task at a time. New policy versions do not concern the critic.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

from flowrl import messages as m
from flowrl.algorithms import (
    KLEstimator,
    gae_advantages,
    kl_estimate,
    token_level_rewards,
    value_loss,
)
from flowrl.worker_spec import EngineSpec
from workers.engines.protocols import SequenceBatch
from workers.engines.value_model import ValueModelEngine
from workers.runtime import RoleOutput

__all__ = ["CRITIC_DIR", "CriticRole", "CriticSettings", "critic_checkpoint", "critic_targets"]

log = structlog.get_logger("flowrl.critic")

#: where in a run's output directory the critic keeps its newest save
CRITIC_DIR = "critic"
_OLD = ".critic.old"  # the previous save, while a new one replaces it


_RUN_FILE = "run.json"  # in a save: the run that wrote it


def critic_checkpoint(output: Path, *, run_id: str | None = None) -> Path | None:
    """The critic's newest complete save under a run's ``output`` directory, if any; with
    ``run_id``, only a save that run wrote."""
    for name in (CRITIC_DIR, _OLD):  # the old one only exists mid-replacement
        found = output / name
        if (found / _RUN_FILE).is_file() and (found / "trainer_state.json").is_file():
            if run_id is None or _saved_by(found) == run_id:
                return found
            return None
    return None


def _saved_by(save: Path) -> str | None:
    try:
        meta = json.loads((save / _RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    run = meta.get("run_id") if isinstance(meta, dict) else None
    return run if isinstance(run, str) else None


@dataclass(frozen=True)
class CriticSettings:
    """GAE and the critic's own schedule (see `from_config`)."""

    #: rows learned from per critic optimizer step (the actor's global batch).
    rows_per_step: int
    gamma: float = 1.0
    lam: float = 0.95
    #: PPO's value clip around the scoring-time values; None turns it off.
    value_clip: float | None = 0.2
    #: passes over each batch; passes after the first replay it at step end.
    epochs: int = 1
    #: the run's output directory, and how many critic steps apart to save there (0: never).
    output: Path | None = None
    checkpoint_every: int = 0
    #: the run the saves belong to (a restarted critic process loads only its own run's save)
    run_id: str | None = None
    #: the KL in the rewards (``algorithm.kl_in_reward``): every token's reward gets
    #: ``−kl_coef·KL_t(π_rollout‖π_ref)``; 0: off.
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"

    def __post_init__(self) -> None:
        if self.rows_per_step < 1:
            raise ValueError(f"rows_per_step must be >= 1, got {self.rows_per_step}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"need 0 <= gamma, lam <= 1, got {self.gamma}, {self.lam}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    @classmethod
    def from_spec(cls, spec: EngineSpec, *, run_id: str | None = None) -> CriticSettings:
        """From a worker's `EngineSpec` (its ``critic`` section; ValueError without one);
        ``run_id`` is the run the saves belong to."""
        c = spec.critic
        if c is None:
            raise ValueError("critic: the config has no critic section (algorithm.name is not "
                             "'ppo')")
        a = spec.algorithm
        return cls(rows_per_step=c.rows_per_step, gamma=c.gamma, lam=c.lam,
                   value_clip=c.value_clip, epochs=c.epochs,
                   output=None if spec.output is None else Path(spec.output),
                   checkpoint_every=spec.checkpoint_every, run_id=run_id,
                   kl_coef=a.kl_coef if a.kl_in_reward else 0.0, kl_estimator=a.kl_estimator)


def critic_targets(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float,
    kl: Tensor | None = None, kl_coef: float = 0.0, token_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns) ``[B, L]`` of outcome rewards ``[B]`` under values ``[B, L]``;
    ``token_rewards`` ``[B, L]`` (an episode's per-turn rewards) replace the outcome reward on
    each row's last token when given; with per-token ``kl`` ``[B, L]``, every token's reward
    gets ``−kl_coef·kl_t``."""
    per_token = token_level_rewards(rewards, mask, kl=kl, kl_coef=kl_coef,
                                    per_token=token_rewards)
    return gae_advantages(per_token, values, mask, gamma=gamma, lam=lam, whiten=False)


@dataclass
class _Batch:
    """What the critic keeps of a micro-batch for replay passes (``epochs > 1``)."""

    seqs: SequenceBatch
    old_values: Tensor  # [B, L] on the CPU
    returns: Tensor  # [B, L] on the CPU


class CriticRole:
    """Serves the critic stage with one `ValueModelEngine`; see the module docstring."""

    #: its own value model; new policy versions do not concern it
    loads_weights = False

    def __init__(
        self, engine: ValueModelEngine, settings: CriticSettings, *, pad_token_id: int
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.pad_token_id = pad_token_id
        self._rows = 0  # rows learned from since the last step
        self._tokens = 0  # their response tokens
        self._loss = 0.0  # their summed value loss
        self._replay: list[_Batch] = []
        self._lock = asyncio.Lock()  # one task at a time on the engine

    @property
    def steps(self) -> int:
        """Critic optimizer steps taken."""
        return self.engine.step

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        async with self._lock:
            return await asyncio.to_thread(
                self.learn, inputs["prompt_ids"], inputs["response_ids"], inputs["reward"],
                rollout_logprobs=inputs.get("rollout_logprobs"),
                ref_logprobs=inputs.get("ref_logprobs"),
                loss_masks=inputs.get("loss_mask"), token_rewards=inputs.get("token_rewards"))

    def learn(
        self, prompts: Sequence[Tensor], responses: Sequence[Tensor], rewards: Sequence[Any], *,
        rollout_logprobs: Sequence[Tensor] | None = None,
        ref_logprobs: Sequence[Tensor] | None = None,
        loss_masks: Sequence[Tensor] | None = None,
        token_rewards: Sequence[Tensor] | None = None,
    ) -> RoleOutput:
        """Score one micro-batch, accumulate its value-loss gradient, step when due; with the
        KL in the rewards, from its sampling and reference log-probabilities.

        Multi-turn rows (``loss_masks``: the policy's tokens) are valued and credited on the
        policy's tokens only (GAE carries across inserted ones); ``token_rewards`` (aligned with
        the responses) replace the outcome reward on the last token."""
        s = self.settings
        seqs = SequenceBatch.from_rows(prompts, responses, pad_token_id=self.pad_token_id,
                                       loss_masks=loss_masks)
        per_token = None if token_rewards is None else seqs.per_token(token_rewards,
                                                                      "token_rewards")
        r = torch.tensor([float(x) for x in rewards], dtype=torch.float32)
        kl: Tensor | None = None
        if s.kl_coef:
            if rollout_logprobs is None or ref_logprobs is None:
                raise ValueError("the KL in the rewards needs rollout_logprobs and ref_logprobs")
            mask = seqs.response_mask
            kl = kl_estimate(seqs.per_token(rollout_logprobs, "rollout_logprobs"),
                             seqs.per_token(ref_logprobs, "ref_logprobs"), mask, s.kl_estimator)
        tokens = seqs.num_response_tokens
        if tokens == 0:
            empty = [torch.zeros(len(x), dtype=torch.float32) for x in responses]
            self._rows += len(prompts)
            metrics = self._maybe_step()
            return RoleOutput(fields={"values": empty, "advantages": list(empty),
                                      "returns": list(empty)}, metrics=metrics)
        out: dict[str, Tensor] = {}

        def loss_fn(values: Tensor, batch: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
            mask = batch.response_mask
            old = values.detach()
            adv, ret = critic_targets(
                r.to(old.device), old, mask, gamma=s.gamma, lam=s.lam,
                kl=None if kl is None else kl.to(old.device), kl_coef=s.kl_coef,
                token_rewards=None if per_token is None else per_token.to(old.device))
            out.update(values=old.cpu(), advantages=adv.cpu(), returns=ret.cpu())
            return value_loss(values, old, ret, mask, clip_eps=s.value_clip,
                              loss_agg="token-mean", num_tokens=1.0)

        res = self.engine.train_micro_batch(seqs, loss_fn)
        self._rows += len(prompts)
        self._tokens += tokens
        self._loss += res["loss"]
        if s.epochs > 1:
            self._replay.append(_Batch(seqs, out["values"], out["returns"]))
        fields = {k: [v.contiguous() for v in seqs.response_values(out[k])]
                  for k in ("values", "advantages", "returns")}
        metrics = {"tokens": float(tokens), "vf_loss": res["loss"] / tokens,
                   "value_mean": _mean(out["values"], seqs.response_mask),
                   "return_mean": _mean(out["returns"], seqs.response_mask),
                   "advantage_mean": _mean(out["advantages"], seqs.response_mask)}
        metrics.update(self._maybe_step())
        return RoleOutput(fields=fields, metrics=metrics)

    def _maybe_step(self) -> dict[str, float]:
        if self._rows < self.settings.rows_per_step:
            return {}
        metrics: dict[str, float] = {}
        if self.engine.pending:
            self.engine.scale_gradients(1.0 / self._tokens)
            stats = self.engine.optimizer_step()
            metrics = {"critic_loss": self._loss / self._tokens,
                       "critic_grad_norm": stats["grad_norm"], "critic_skipped": stats["skipped"]}
            for _ in range(self.settings.epochs - 1):
                metrics["critic_loss"] = self._replay_pass()
            metrics["critic_step"] = float(self.engine.step)
            every = self.settings.checkpoint_every
            if self.settings.output is not None and every > 0 and self.engine.step % every == 0:
                try:
                    self.save_checkpoint()
                except OSError as e:  # a full disk must not stop training
                    log.error("critic checkpoint failed", step=self.engine.step, error=repr(e))
                    metrics["critic_checkpoint_failed"] = 1.0
        self._rows = self._tokens = 0
        self._loss = 0.0
        self._replay.clear()
        return metrics

    def _replay_pass(self) -> float:
        """One more pass over the kept batch with the clipped loss; steps; returns the loss."""
        s, loss = self.settings, 0.0
        for b in self._replay:
            def loss_fn(values: Tensor, batch: SequenceBatch,
                        b: _Batch = b) -> tuple[Tensor, dict[str, float]]:
                dev = values.device
                return value_loss(values, b.old_values.to(dev), b.returns.to(dev),
                                  batch.response_mask, clip_eps=s.value_clip,
                                  loss_agg="token-mean", num_tokens=1.0)

            loss += self.engine.train_micro_batch(b.seqs, loss_fn)["loss"]
        self.engine.scale_gradients(1.0 / self._tokens)
        self.engine.optimizer_step()
        return loss / self._tokens

    def save_checkpoint(self) -> Path:
        """Write ``{output}/critic``, replacing the previous save; built aside, so a reader
        finds one complete save at any moment (`critic_checkpoint`)."""
        if self.settings.output is None:
            raise RuntimeError("no output directory configured")
        root = self.settings.output
        root.mkdir(parents=True, exist_ok=True)
        final, tmp, old = root / CRITIC_DIR, root / ".critic.partial", root / _OLD
        shutil.rmtree(tmp, ignore_errors=True)
        self.engine.save(tmp)
        (tmp / _RUN_FILE).write_text(json.dumps({"run_id": self.settings.run_id}) + "\n")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("critic checkpoint", step=self.engine.step, path=str(final))
        return final

    async def load_version(self, version: int, weights: dict[str, Tensor]) -> None:
        return None  # policy versions do not concern the critic


def _mean(x: Tensor, mask: Tensor) -> float:
    return float(x[mask].mean()) if bool(mask.any()) else 0.0
