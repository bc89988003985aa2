"""Simulated roles: real runtime, real transport, modelled compute.

Each role waits as long as its cost model says and writes fields of the right shapes and dtypes,
so a simulated run exercises the controller, scheduler, store and weight sync exactly as a real
one does. It answers capacity questions ("what does staleness 2 buy with 64 rollout workers?")
without a model or an accelerator.

Cost model (all times in seconds):

- rollout of one group of ``n`` responses: response lengths are drawn i.i.d. from a lognormal
  distribution, ``round(exp(N(log_mean, log_sigma)))`` clipped to ``[1, max_new_tokens]``; the
  group is decoded as one batch, so it takes ``rollout_base_s + max(lengths) *
  rollout_token_s``: the long tail of one response holds up its whole group;
- reward, reference, critic: ``<role>_token_s`` per response token of the micro-batch (the
  critic's values are 0, so its advantages and returns are the reward on every token);
- train: ``train_token_s`` per token of the micro-batch, plus ``train_step_s`` for the optimizer
  step that ends a global batch; that step publishes ``weight_numel`` float32 weights.

With ``episode_turns > 0`` each response is a multi-turn episode with tool calls, run by the
real episode rollout role on a decode loop of modelled cost (``workers.sim_episode``, which
states that model); ``partial`` is the recipe's ``rollout.partial``.

With ``trace`` (a recorded run's trace file, `flowrl.run_trace`), task times, response lengths
and weight loads are drawn from that run instead (`flowrl.trace_costs`, every time multiplied by
``trace_stretch``); a role the trace has no task of keeps the model above.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from flowrl import messages as m
from workers.runtime import Role, RoleOutput
from workers.sim_cost import SimCost


def _lengths_of(values: list[Any]) -> list[int]:
    return [int(t.numel()) for t in values]


class Overhead:
    """What a worker spends on a task besides its role's work: reading the inputs, writing
    the outputs, the report and the next poll.

    A recorded task's time includes it, and so does a replayed one's, so a replay waits the
    recorded time less this. It is the gap between one task's end and the next one's start
    while tasks queue (the low end of the recent gaps: a longer gap is a wait for work).
    """

    KEEP = 64

    def __init__(self) -> None:
        self._gaps: collections.deque[float] = collections.deque(maxlen=self.KEEP)
        self._ended = 0.0

    def started(self) -> float:
        now = time.perf_counter()
        if self._ended:
            self._gaps.append(now - self._ended)
        return self.estimate()

    def ended(self) -> None:
        self._ended = time.perf_counter()

    def estimate(self) -> float:
        if len(self._gaps) < 4:
            return 0.0
        return sorted(self._gaps)[len(self._gaps) // 5]


async def _work(role: str, rows: int, rng: random.Random, cost: SimCost, modelled: float,
                overhead: Overhead, *, step_end: bool = False) -> None:
    """Wait as long as the trace says a task of ``role`` takes (less the worker's own
    overhead, which the recorded time includes), else ``modelled`` seconds."""
    replay = cost.replay()
    drawn = None if replay is None else replay.task_s(role, rows, rng, step_end=step_end)
    spent = overhead.started()
    try:
        await asyncio.sleep(modelled if drawn is None else max(0.0, drawn - spent))
    finally:
        overhead.ended()


class SimRollout:
    """Generates ``group size`` responses per prompt; the row's version is the served one."""

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost
        self.rng = random.Random(seed)
        self.version = 0
        self.overhead = Overhead()

    def _length(self) -> int:
        c = self.cost
        replay = c.replay()
        recorded = None if replay is None else replay.length(self.rng)
        if recorded is not None:
            return max(1, min(c.max_new_tokens, recorded))
        draw = round(math.exp(self.rng.gauss(c.log_mean, c.log_sigma)))
        return max(1, min(c.max_new_tokens, draw))

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        c = self.cost
        version = self.version
        lengths = [self._length() for _ in task["rows"]]
        await _work("rollout", len(lengths), self.rng, c,
                    c.rollout_base_s + max(lengths) * c.rollout_token_s, self.overhead)
        prompt = torch.zeros(c.prompt_len, dtype=torch.int64)
        return RoleOutput(
            fields={
                "prompt_ids": [prompt for _ in lengths],
                "response_ids": [torch.ones(n, dtype=torch.int64) for n in lengths],
                "rollout_logprobs": [torch.full((n,), -1.0) for n in lengths],
            },
            lengths=lengths,
            version=version,
            metrics={"tokens": float(sum(lengths))},
        )

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        replay = self.cost.replay()
        recorded = None if replay is None else replay.sync_s(self.rng)
        wait = self.cost.weight_load_s if recorded is None else recorded
        if wait:
            await asyncio.sleep(wait)
        self.version = version


class SimReward:
    """A reward that depends on the response length, so groups have non-zero variance."""

    #: serves no policy (see `workers.runtime.Role`)
    loads_weights = False

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost
        self.rng = random.Random(seed)
        self.overhead = Overhead()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        lengths = _lengths_of(inputs["response_ids"])
        await _work("reward", len(lengths), self.rng, self.cost,
                    sum(lengths) * self.cost.reward_token_s, self.overhead)
        return RoleOutput(fields={"reward": [1.0 / (1 + n) for n in lengths]})

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


class SimReference:
    #: serves no policy (see `workers.runtime.Role`)
    loads_weights = False

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost
        self.rng = random.Random(seed)
        self.overhead = Overhead()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        lengths = _lengths_of(inputs["response_ids"])
        await _work("reference", len(lengths), self.rng, self.cost,
                    sum(lengths) * self.cost.reference_token_s, self.overhead)
        return RoleOutput(fields={"ref_logprobs": [torch.full((n,), -1.0) for n in lengths]})

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


class SimCritic:
    """PPO's critic: values, advantages and returns per response token."""

    #: serves no policy (see `workers.runtime.Role`)
    loads_weights = False

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost
        self.rng = random.Random(seed)
        self.overhead = Overhead()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        lengths = _lengths_of(inputs["response_ids"])
        await _work("critic", len(lengths), self.rng, self.cost,
                    sum(lengths) * self.cost.critic_token_s, self.overhead)
        rewards = [float(r) for r in inputs["reward"]]
        return RoleOutput(fields={
            "values": [torch.zeros(n) for n in lengths],
            "advantages": [torch.full((n,), r) for n, r in zip(lengths, rewards, strict=True)],
            "returns": [torch.full((n,), r) for n, r in zip(lengths, rewards, strict=True)],
        })

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


class SimTrainer:
    """Accumulates micro-batches; the one that ends a step publishes version + 1."""

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost
        self.version = 0
        self.rng = random.Random(seed)
        self.overhead = Overhead()

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        c = self.cost
        tokens = sum(_lengths_of(inputs["response_ids"]))
        step_end = bool(task["params"].get("step_end"))
        await _work("train", len(task["rows"]), self.rng, c,
                    tokens * c.train_token_s + (c.train_step_s if step_end else 0.0),
                    self.overhead, step_end=step_end)
        out = RoleOutput(fields={}, metrics={"tokens": float(tokens)})
        if step_end:
            self.version += 1
            out.version = self.version
            out.weights = {"w": torch.full((c.weight_numel,), float(self.version))}
        return out

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        # A restarted trainer resumes at the published version (its last weights).
        self.version = max(self.version, version)


def sim_rollout(cost: SimCost, seed: int) -> Role:
    """A simulated rollout worker: single-turn groups, or episodes (``episode_turns > 0``)."""
    if cost.episode_turns > 0:
        from workers.sim_episode import sim_episode_role  # loads the episode machinery

        return sim_episode_role(cost, seed)
    return SimRollout(cost, seed)


SIM_ROLES: dict[str, Callable[[SimCost, int], Role]] = {
    "rollout": sim_rollout,
    "reward": SimReward,
    "reference": SimReference,
    "critic": SimCritic,
    "train": SimTrainer,
}
