"""The rollout role with episodes: each row of a task is one run of the recipe's episode function.

For one task (whole groups of rows sharing a dataset position, as in `workers.roles.rollout`),
the role runs every row's episode concurrently (`flowrl.episode.run_episode`): the episode gets a
`flowrl.episode.Policy` handle and the dataset example, and its generation requests go to one
batcher (`workers.engines.batching.RequestBatcher`: `workers.engines.hf_continuous` on the HF
engine, `workers.engines.vllm_continuous` on vLLM), which batches the requests of all episodes
(of this task and of any other task the worker runs at once) into one running batch.

Per row it writes the trajectory as the policy produced it:
``prompt_ids`` (int64), ``response_ids`` (int64: generated and inserted tokens, in order),
``loss_mask`` (bool: True on generated tokens), ``rollout_logprobs`` (float32, 0 on inserted
tokens), ``token_versions`` (int32: the policy version of each generated token, -1 on inserted
ones), ``token_rewards`` (float32: each turn's reward on its last token when the episode gave
per-turn rewards, else the episode's reward on its last generated token) and ``reward`` (the
episode's reward, inline). All per-token fields are aligned with ``response_ids``.

Sampling is reproducible per episode: turn k of episode j of the group at dataset position p
samples from a stream keyed by (run seed, p, j, k), whatever else shares the engine's batch.

Tools run in a `workers.tool_pool.ToolPool` of sandbox processes, started on the first call
and killed by `EpisodeRolloutRole.aclose`; the episode reaches them through
`flowrl.episode.Policy.call_tool`. Besides the generation figures, a task reports
``tool_calls``, ``tool_errors_<kind>`` per failure kind and ``episodes_cut_turns`` /
``episodes_cut_tokens`` (episodes ended by ``rollout.max_turns`` / ``max_episode_tokens``).
With ``endpoint`` (``rollout.endpoint``) the worker serves an OpenAI-compatible endpoint on
loopback (`workers.openai_endpoint`), started with its first task; each episode gets its own
base URL and API key (``policy.openai_client()``), valid while it runs.

Interruptible (``interruptible``, the recipe's ``rollout.partial``): a new policy version is
loaded while episodes run, at the next decode step (`RequestBatcher.swap`), and every running
sequence continues under it with its tokens kept; the worker runtime does not wait for the
running tasks. A row's tokens may then carry several versions; the task's version is its oldest
token's, and ``interrupted_episodes`` counts the rows whose tokens span more than one version.

An episode that raises fails the task (the controller redoes its rows, and stops the run with
the error after ``max_task_failures``); the first error names the episode function.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from flowrl import messages as m
from flowrl.data import Dataset
from flowrl.episode import (
    EpisodeFn,
    Generated,
    Policy,
    Trajectory,
    run_episode,
)
from flowrl.reward_fn import describe_error
from workers.engines.batching import RequestBatcher
from workers.engines.protocols import SamplingParams, mix_seed
from workers.openai_endpoint import OpenAIEndpoint
from workers.roles.rollout import group_rows
from workers.runtime import RoleOutput
from workers.tool_pool import ToolPool

#: the failure kinds of a tool call (`flowrl.episode.ToolResult.kind`), each reported per task
TOOL_ERROR_KINDS = ("raised", "timeout", "memory", "garbage", "crashed", "unknown")

__all__ = ["EpisodeFailed", "EpisodeRolloutRole", "trajectory_fields"]


class EpisodeFailed(RuntimeError):
    """An episode raised; the message names the function, the row and the error."""


def trajectory_fields(trajectories: Sequence[Trajectory]) -> dict[str, list[Any]]:
    """The store fields of trajectories (rows in order); see the module docstring."""
    out: dict[str, list[Any]] = {k: [] for k in (
        "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_versions",
        "token_rewards", "reward")}
    for t in trajectories:
        if t.reward is None:
            raise ValueError("a trajectory without a reward")
        out["prompt_ids"].append(torch.tensor(t.prompt_ids, dtype=torch.int64))
        out["response_ids"].append(torch.tensor(t.response_ids, dtype=torch.int64))
        out["loss_mask"].append(torch.tensor(t.loss_mask, dtype=torch.bool))
        out["rollout_logprobs"].append(torch.tensor(t.logprobs, dtype=torch.float32))
        out["token_versions"].append(torch.tensor(t.versions, dtype=torch.int32))
        rewards = torch.zeros(len(t.response_ids), dtype=torch.float32)
        per_turn = t.turn_rewards if t.turn_rewards is not None else [t.reward]
        ends = t.turn_ends if t.turn_rewards is not None else t.turn_ends[-1:]
        for end, r in zip(ends, per_turn, strict=True):
            rewards[end - 1] = r
        out["token_rewards"].append(rewards)
        out["reward"].append(t.reward)
    return out


class EpisodeRolloutRole:
    """Runs a task's episodes concurrently on one `RequestBatcher`."""

    def __init__(
        self,
        batcher: RequestBatcher,
        tokenizer: Any,
        dataset: Dataset,
        sampling: SamplingParams,
        episode: EpisodeFn,
        *,
        episode_name: str = "episode",
        sample_seed: int = 0,
        endpoint: bool = False,
        tools: ToolPool | None = None,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        interruptible: bool = False,
    ) -> None:
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.sampling = sampling
        self.episode = episode
        self.episode_name = episode_name
        self.sample_seed = sample_seed
        self.endpoint: OpenAIEndpoint | None = None
        if endpoint:
            self.endpoint = OpenAIEndpoint(temperature=sampling.temperature,
                                           top_p=sampling.top_p)
        self.tools = tools
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        #: read by the worker runtime: load new versions without waiting for running tasks
        self.interruptible = interruptible

    def _policy(self, position: int, index: int) -> Policy:
        base = self.sampling

        async def generate(context: Sequence[int], *, stream_key: int,
                           max_new_tokens: int | None, stop: tuple[str, ...] | None
                           ) -> Generated:
            params = replace(base, n=1, seed=None, prompt_seeds=None,
                             max_new_tokens=max_new_tokens or base.max_new_tokens,
                             stop=base.stop if stop is None else stop)
            g = await self.batcher.generate(context, params, stream_key=stream_key)
            versions = (g.token_versions.tolist() if g.token_versions is not None
                        else [g.version] * len(g.response_ids))
            return Generated(g.response_ids.tolist(), g.logprobs.tolist(), versions,
                             g.finish_reason)

        return Policy(generate, self.tokenizer,
                      stream_seed=mix_seed(self.sample_seed, position, index),
                      max_context=self.batcher.engine.max_positions,
                      tools=None if self.tools is None else self.tools.call,
                      max_turns=self.max_turns, max_tokens=self.max_tokens,
                      max_new_tokens=base.max_new_tokens)

    async def _one(self, row: int, position: int, index: int
                   ) -> tuple[Trajectory, collections.Counter[str]]:
        """The row's trajectory and its tool figures (``calls`` and failures by kind)."""
        example = self.dataset.at(position)
        policy = self._policy(position, index)
        if self.endpoint is not None:
            policy.endpoint = self.endpoint.open(policy)
        try:
            trajectory = await run_episode(self.episode, policy, example)
        except Exception as e:
            raise EpisodeFailed(f"episode {self.episode_name} (row {row}, dataset position "
                                f"{position}): {describe_error(e)}") from e
        finally:
            if policy.endpoint is not None and self.endpoint is not None:
                self.endpoint.close(policy.endpoint)
        tools = collections.Counter(policy.tool_errors)
        tools["calls"] = policy.tool_calls
        return trajectory, tools

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        positions = [int(p) for p in inputs["prompt"]]
        if len(positions) != len(task["row_groups"]):
            raise ValueError(f"{len(positions)} prompt values for {len(task['row_groups'])} rows")
        jobs: list[tuple[int, int, int]] = []  # (row, position, index in its group)
        for gid, rows in group_rows(task["row_groups"]).items():
            shared = {positions[r] for r in rows}
            if len(shared) != 1:
                raise ValueError(f"group {gid} mixes dataset positions {sorted(shared)}")
            jobs.extend((r, positions[r], j) for j, r in enumerate(rows))
        if self.endpoint is not None:
            await self.endpoint.start()
        stats = self.batcher.stats
        forwards, carried = stats.forwards, stats.rows
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            running = {row: tg.create_task(self._one(row, pos, j)) for row, pos, j in jobs}
        gen_s = time.perf_counter() - t0
        trajectories = [running[r].result()[0] for r in range(len(positions))]
        tools = sum((running[r].result()[1] for r in range(len(positions))),
                    collections.Counter[str]())
        cut = collections.Counter(t.cut for t in trajectories)
        fields = trajectory_fields(trajectories)
        versions = [v for t in trajectories for v in t.versions if v >= 0]
        generated = float(len(versions))
        forwards = stats.forwards - forwards
        return RoleOutput(
            fields=fields,
            lengths=[len(t.response_ids) for t in trajectories],
            # The row's version is its oldest token's: the staleness bound holds for each.
            version=min(versions) if versions else self.batcher.engine.version,
            metrics={
                "episodes": float(len(trajectories)),
                "turns": float(sum(t.turns for t in trajectories)),
                "tokens": generated,
                "inserted_tokens": float(sum(len(t.response_ids) for t in trajectories)
                                         - generated),
                "gen_s": gen_s,
                "tokens_per_s": generated / gen_s if gen_s > 0 else 0.0,
                "batch_rows_mean": (stats.rows - carried) / forwards if forwards else 0.0,
                # counted into the step log (occupancy over a step, whatever its tasks)
                "decode_forwards": float(forwards),
                "decode_rows": float(stats.rows - carried),
                "tool_calls": float(tools["calls"]),
                **{f"tool_errors_{k}": float(tools[k]) for k in TOOL_ERROR_KINDS},
                "episodes_cut_turns": float(cut["turns"]),
                "episodes_cut_tokens": float(cut["tokens"]),
                "interrupted_episodes": float(sum(
                    len({v for v in t.versions if v >= 0}) > 1 for t in trajectories)),
            },
        )

    async def aclose(self) -> None:
        """Stop serving the endpoint and kill the tool sandboxes (the worker is stopping; its
        process ending stops them too)."""
        if self.endpoint is not None:
            await self.endpoint.aclose()
        if self.tools is not None:
            await self.tools.aclose()

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        """Load ``version``; returns how many running sequences continue under it (only an
        interruptible role loads while sequences run)."""
        if not weights:  # joining at a version without its weights: nothing to load
            return 0
        engine = self.batcher.engine

        def load() -> None:
            engine.load_weights(weights, version, shared=True)

        if self.interruptible:
            return await self.batcher.swap(load)
        await self.batcher.exclusive(load)
        return 0
