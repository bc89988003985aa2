"""What the controller runs: the stage graph, the worker pools and the run's bounds.

Plain frozen dataclasses with no heavy imports; recipes (validated user configuration) compile
into a `PipelineSpec`, and tests and benchmarks build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from flowrl.graph import StageGraph, StageSpec

#: fields every GRPO-style dataflow uses; the data source provides only ``prompt``.
SOURCE_FIELDS = ("prompt",)


@dataclass(frozen=True)
class PoolSpec:
    """A pool of identical workers serving one role."""

    role: str
    count: int = 1
    #: workers hosted by one process (simulated workers are cheap; real engines use 1).
    per_process: int = 1
    #: tasks one worker runs concurrently.
    capacity: int = 1
    #: torch threads per worker process (few, so rollout and training overlap, not fight).
    threads: int = 1
    #: nodes the pool's processes run on, process ``p`` on ``nodes[p % len(nodes)]``; empty:
    #: the controller's node. Another node needs its agent (``python -m flowrl.node``).
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineSpec:
    stages: tuple[StageSpec, ...]
    pools: tuple[PoolSpec, ...]
    #: responses per prompt (the GRPO/RLOO group).
    group_size: int = 4
    #: prompt groups per optimizer step (the global batch).
    groups_per_step: int = 8
    max_staleness: int = 0
    #: worker implementation: "sim" (modelled cost) or a real engine name.
    engine: str = "sim"
    engine_config: dict[str, Any] = field(default_factory=dict)
    store_capacity_bytes: int = 1 << 30
    #: admission pauses while the store is fuller than this share of its capacity.
    store_high_water: float = 0.8
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    #: tasks assigned to a worker beyond its capacity, so the next one is already waiting when
    #: it finishes; small, because an assigned task cannot move to a less loaded worker.
    prefetch: int = 1
    #: a micro-batch whose task fails this many times stops the run with the last error.
    max_task_failures: int = 3
    #: a stage (the reward function) that fails on more than this share of a step's samples
    #: for ``max_failure_steps`` steps in a row stops the run with its error
    #: (`flowrl.control.step_metrics.FailureBudget`); 1.0 never stops it.
    max_failure_share: float = 0.5
    max_failure_steps: int = 3
    #: a worker process that dies is restarted after ``restart_backoff_s * 2**(n-1)`` seconds
    #: (at most 30 s), at most this many times; one more death stops the run with the exit code.
    max_restarts: int = 3
    restart_backoff_s: float = 0.5
    #: a worker that has not fetched and loaded a new version this long after reaching a safe
    #: point reports it (naming itself and the version) and its process is restarted.
    weight_sync_timeout_s: float = 60.0
    #: the run's checkpoint directory: the controller completes each ``step_N`` the trainer
    #: writes there with its run state (`flowrl.resume`), so the run can be resumed.
    output: str | None = None
    seed: int = 0
    #: the stability guard's settings (a recipe's ``stability`` section as JSON); None runs
    #: no guard
    stability: dict[str, Any] | None = None
    #: periodic evaluation (a recipe's ``eval`` section as JSON); None evaluates nothing
    eval: dict[str, Any] | None = None
    #: colocated placement: each train process also hosts a rollout worker (the rollout pool
    #: starts no process of its own); they generate with the trainer's weights and take turns
    colocated: bool = False
    #: colocated placement: the trainer still writes each version into the store (what a
    #: restarted process joins from); False: its weights are held once
    keep_weight_copy: bool = True
    #: the agents of nodes other than the controller's dispatch their reward, reference and
    #: critic workers' tasks themselves, under leases (`flowrl.control.node_leases`)
    node_dispatch: bool = False

    def graph(self) -> StageGraph:
        return StageGraph(self.stages, SOURCE_FIELDS)

    def pool(self, role: str) -> PoolSpec | None:
        return next((p for p in self.pools if p.role == role), None)


#: what a rollout of episodes produces besides a completion's fields: per token (aligned with
#: ``response_ids``) the loss mask, the policy version and the turn rewards; the reward, inline.
EPISODE_FIELDS = ("loss_mask", "token_versions", "token_rewards", "reward")


def grpo_stages(
    *, group_size: int, train_micro_groups: int = 1, rollout_micro_groups: int = 1,
    reward_micro_batch: int | None = None, reference: bool = False, episode: bool = False,
) -> tuple[StageSpec, ...]:
    """rollout (per group) → reward (per row) → [reference] → train (per group, streamed).

    A rollout task samples ``rollout_micro_groups`` whole groups; reward and reference tasks
    default to one rollout task's rows. With ``episode``, rollout runs episodes, which score
    themselves: it produces `EPISODE_FIELDS` and there is no reward stage.
    """
    rmb = reward_micro_batch or group_size * rollout_micro_groups
    produced = ("prompt_ids", "response_ids", "rollout_logprobs")
    stages = [
        StageSpec("rollout", needs=("prompt",),
                  produces=produced + (EPISODE_FIELDS if episode else ()),
                  micro_batch=rollout_micro_groups, group_level=True),
    ]
    if not episode:
        stages.append(StageSpec("reward", needs=("prompt", "response_ids"), produces=("reward",),
                                micro_batch=rmb))
    train_needs = ["prompt_ids", "response_ids", "rollout_logprobs", "reward"]
    if episode:
        train_needs += ["loss_mask", "token_versions"]
    if reference:
        stages.append(StageSpec("reference", needs=("prompt_ids", "response_ids"),
                                produces=("ref_logprobs",), micro_batch=rmb))
        train_needs.append("ref_logprobs")
    stages.append(StageSpec("train", needs=tuple(train_needs), micro_batch=train_micro_groups,
                            group_level=True, consumes_version_bound=True))
    return tuple(stages)


#: what the critic stage produces per row (float32, aligned with ``response_ids``).
CRITIC_FIELDS = ("values", "advantages", "returns")


def ppo_stages(
    *, group_size: int, train_micro_groups: int = 1, rollout_micro_groups: int = 1,
    reward_micro_batch: int | None = None, reference: bool = False,
    critic_micro_batch: int | None = None, kl_in_reward: bool = False, episode: bool = False,
) -> tuple[StageSpec, ...]:
    """`grpo_stages` with a critic before train: rollout → reward → [reference] → critic → train.

    The critic (per row) turns ``prompt_ids``, ``response_ids`` and ``reward`` into
    `CRITIC_FIELDS` and learns from them; train also needs ``advantages`` and uses them as
    they are. Critic tasks default to one rollout task's rows. With ``kl_in_reward`` (and the
    reference stage) the critic also needs ``rollout_logprobs`` and ``ref_logprobs``: it puts
    the KL into the rewards. With ``episode`` the critic also reads each row's ``loss_mask``
    and ``token_rewards``.
    """
    if kl_in_reward and not reference:
        raise ValueError("kl_in_reward needs the reference stage (reference=True)")
    *head, train = grpo_stages(
        group_size=group_size, train_micro_groups=train_micro_groups,
        rollout_micro_groups=rollout_micro_groups, reward_micro_batch=reward_micro_batch,
        reference=reference, episode=episode)
    critic_needs: tuple[str, ...] = ("prompt_ids", "response_ids", "reward")
    if kl_in_reward:
        critic_needs += ("rollout_logprobs", "ref_logprobs")
    if episode:
        critic_needs += ("loss_mask", "token_rewards")
    critic = StageSpec("critic", needs=critic_needs,
                       produces=CRITIC_FIELDS,
                       micro_batch=critic_micro_batch or group_size * rollout_micro_groups)
    return (*head, critic, replace(train, needs=(*train.needs, "advantages")))
