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
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from typing import Any

import torch

from flowrl import messages as m
from workers.runtime import Role, RoleOutput
from workers.sim_cost import SimCost


def _lengths_of(values: list[Any]) -> list[int]:
    return [int(t.numel()) for t in values]


class SimRollout:
    """Generates ``group size`` responses per prompt; the row's version is the served one."""

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost
        self.rng = random.Random(seed)
        self.version = 0

    def _length(self) -> int:
        c = self.cost
        draw = round(math.exp(self.rng.gauss(c.log_mean, c.log_sigma)))
        return max(1, min(c.max_new_tokens, draw))

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        c = self.cost
        version = self.version
        lengths = [self._length() for _ in task["rows"]]
        await asyncio.sleep(c.rollout_base_s + max(lengths) * c.rollout_token_s)
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
        if self.cost.weight_load_s:
            await asyncio.sleep(self.cost.weight_load_s)
        self.version = version


class SimReward:
    """A reward that depends on the response length, so groups have non-zero variance."""

    #: serves no policy (see `workers.runtime.Role`)
    loads_weights = False

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        lengths = _lengths_of(inputs["response_ids"])
        await asyncio.sleep(sum(lengths) * self.cost.reward_token_s)
        return RoleOutput(fields={"reward": [1.0 / (1 + n) for n in lengths]})

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


class SimReference:
    #: serves no policy (see `workers.runtime.Role`)
    loads_weights = False

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        lengths = _lengths_of(inputs["response_ids"])
        await asyncio.sleep(sum(lengths) * self.cost.reference_token_s)
        return RoleOutput(fields={"ref_logprobs": [torch.full((n,), -1.0) for n in lengths]})

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


class SimCritic:
    """PPO's critic: values, advantages and returns per response token."""

    #: serves no policy (see `workers.runtime.Role`)
    loads_weights = False

    def __init__(self, cost: SimCost, seed: int) -> None:
        self.cost = cost

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        lengths = _lengths_of(inputs["response_ids"])
        await asyncio.sleep(sum(lengths) * self.cost.critic_token_s)
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

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        c = self.cost
        tokens = sum(_lengths_of(inputs["response_ids"]))
        await asyncio.sleep(tokens * c.train_token_s)
        out = RoleOutput(fields={}, metrics={"tokens": float(tokens)})
        if task["params"].get("step_end"):
            await asyncio.sleep(c.train_step_s)
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
