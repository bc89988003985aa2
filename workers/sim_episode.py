"""Simulated multi-turn episodes: the real episode rollout role on a decode loop of modelled cost.

A simulated rollout worker with ``episode_turns > 0`` (the recipe's ``sim.episode_turns``) is a
real `workers.roles.episode_rollout.EpisodeRolloutRole` on a real
`workers.engines.hf_continuous.ContinuousBatcher`; only the model is modelled: `SimBatch` is
the batcher's decode state whose prefill and decode steps sleep as long as the cost model says
and sample placeholder tokens. So everything ``rollout.partial`` changes is the code real runs
execute: the worker runtime waits for running tasks before a weight load (partial off) or loads
at the next decode step while they run (`ContinuousBatcher.swap`, partial on); each token
records the version whose "logits" it came from; a row's version is its oldest token's; the
controller's staleness gate and weight sync see exactly what they see in a real run.

Episode model (`sim_episode`; all times in seconds, `workers.sim_cost.SimCost` fields):

- turns per episode: uniform in ``1..episode_turns``; every turn but the last ends with a tool
  call that takes ``tool_s`` and inserts ``tool_tokens`` tokens (out of the loss);
- generated tokens per turn: ``round(exp(N(log_mean, log_sigma)))`` clipped to
  ``[1, max_new_tokens]`` (long-tailed with a large ``log_sigma``), sampled by the episode and
  enforced by the batcher as the turn's ``max_new_tokens``;
- a prefill (requests joining the running batch together) costs ``rollout_base_s``; a decode
  step ``rollout_token_s + decode_row_s × running sequences``; a weight load
  ``weight_load_s``; a running batch holds at most ``max_running`` sequences;
- the reward is ``1 / (1 + generated tokens)``, so groups have non-zero variance.

Each worker's decode steps run in a thread of its process's default executor (as the real
batcher's do), one at a time; simulated workers share a process, so building one gives that
executor a thread more (`_thread_per_worker`), and no worker's modelled step waits for a thread.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import torch

from flowrl.episode import ToolResult
from workers.engines.hf_continuous import ContinuousBatcher, RunningBatch, _Seq
from workers.engines.protocols import FinishReason, SamplingParams
from workers.roles.episode_rollout import EpisodeRolloutRole

if TYPE_CHECKING:
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.sim_cost import SimCost
    from workers.tool_pool import ToolPool

__all__ = ["SimBatch", "SimEngine", "sim_episode", "sim_episode_role"]

#: the placeholder token every simulated step samples, and the simulated prompt's token
_TOKEN = 1


class SimEngine:
    """The engine attributes the batcher and the episode role use: the served version, the
    context limit and a weight load of modelled cost."""

    max_positions: int | None = None

    def __init__(self, cost: SimCost) -> None:
        self.cost = cost
        self.version = 0

    def load_weights(self, weights: dict[str, torch.Tensor], version: int, *,
                     shared: bool = False) -> None:
        if self.cost.weight_load_s:
            time.sleep(self.cost.weight_load_s)  # in the batcher's thread, as a real load
        self.version = version


class SimBatch(RunningBatch):
    """`RunningBatch` with modelled compute: sequences, tokens and versions as the real one
    keeps them, sleeps instead of forwards."""

    def __init__(self, engine: SimEngine, cost: SimCost) -> None:
        super().__init__(cast("HFRolloutEngine", engine))
        self.cost = cost

    def _decode(self, rows: int) -> None:
        time.sleep(self.cost.rollout_token_s + self.cost.decode_row_s * rows)

    def admit(self, seqs: Sequence[_Seq]) -> None:
        if not seqs:
            return
        time.sleep(self.cost.rollout_base_s)
        for s in seqs:
            s.logits_version = self.engine.version
        self.seqs.extend(seqs)

    def refresh(self, *, rebuild_kv: bool = False) -> None:
        if not self.seqs:
            return
        if rebuild_kv:
            time.sleep(self.cost.rollout_base_s)
        self._decode(len(self.seqs))  # each row's last position computed again
        for s in self.seqs:
            s.logits_version = self.engine.version

    def drop(self, rows: Sequence[int]) -> None:
        gone = set(rows)
        self.seqs = [s for i, s in enumerate(self.seqs) if i not in gone]

    def step(self) -> list[tuple[_Seq, FinishReason]]:
        if not self.seqs:
            return []
        ended: list[tuple[_Seq, FinishReason]] = []
        kept: list[_Seq] = []
        for s in self.seqs:
            s.tokens.append(_TOKEN)
            s.logprobs.append(-1.0)
            s.versions.append(s.logits_version)
            if len(s.tokens) >= s.params.max_new_tokens:
                ended.append((s, "length"))
            else:
                kept.append(s)
        self.seqs = kept
        if kept:
            self._decode(len(kept))
            for s in kept:
                s.logits_version = self.engine.version
        return ended

    def reset(self) -> list[_Seq]:
        seqs, self.seqs = self.seqs, []
        return seqs


class _SimTokenizer:
    """Decodes every token to nothing: simulated episodes read no text."""

    chat_template = None

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return ""


class _SimTools:
    """Tool calls of modelled latency (`EpisodeRolloutRole`'s tool pool)."""

    def __init__(self, cost: SimCost) -> None:
        self.cost = cost

    async def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(self.cost.tool_s)
        return ToolResult(ok=True, text="")

    async def aclose(self) -> None:
        return None


class _SimDataset:
    def at(self, position: int) -> int:
        return position


def sim_episode(cost: SimCost, rng: random.Random) -> Any:
    """The episode function of the cost model (see the module docstring); ``rng`` draws its
    turns and lengths."""

    def length() -> int:
        draw = round(math.exp(rng.gauss(cost.log_mean, cost.log_sigma)))
        return max(1, min(cost.max_new_tokens, draw))

    async def episode(policy: Any, example: Any) -> float:
        turns = rng.randint(1, cost.episode_turns)
        policy.add([_TOKEN] * cost.prompt_len)
        generated = 0
        for turn in range(turns):
            out = await policy.generate(max_new_tokens=length())
            generated += len(out.token_ids)
            if turn < turns - 1:
                await policy.call_tool("sim")
                policy.add([_TOKEN] * cost.tool_tokens)
        return 1.0 / (1 + generated)

    return episode


#: simulated episode workers built on each event loop
_HOSTED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


def _thread_per_worker() -> None:
    """Size the running loop's default executor for one more worker's decode loop, on top of
    the default's ``min(32, cpus + 4)`` (threads start only when used)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # built outside a loop: its thread is the default executor's
        return
    hosted = _HOSTED[loop] = _HOSTED.get(loop, 0) + 1
    spare = min(32, (os.cpu_count() or 1) + 4)
    loop.set_default_executor(ThreadPoolExecutor(max_workers=hosted + spare,
                                                 thread_name_prefix="sim-decode"))


def sim_episode_role(cost: SimCost, seed: int) -> EpisodeRolloutRole:
    """A simulated rollout worker that runs episodes (``cost.episode_turns > 0``). The casts
    stand the modelled engine, dataset and tools in for the real ones: each has exactly the
    attributes the batcher and the role use."""
    _thread_per_worker()
    engine = SimEngine(cost)
    batcher = ContinuousBatcher(cast("HFRolloutEngine", engine), max_running=cost.max_running,
                                batch=SimBatch(engine, cost))
    return EpisodeRolloutRole(
        batcher, _SimTokenizer(), cast(Any, _SimDataset()),
        SamplingParams(max_new_tokens=cost.max_new_tokens), sim_episode(cost, random.Random(seed)),
        episode_name="sim_episode", sample_seed=seed,
        tools=cast("ToolPool", _SimTools(cost)), interruptible=cost.partial)
