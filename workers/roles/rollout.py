"""The rollout role: dataset positions in, sampled responses with their logprobs out.

For one task (one or more whole groups), every row's ``prompt`` input is a dataset position,
shared by the rows of its group. The role turns each group's position into prompt text
(`flowrl.data.Dataset.at`), tokenizes it, keeps the last ``max_prompt_tokens`` tokens (the end
of a prompt is where the question and the answer cue are), and samples the group's ``n``
responses in one engine call (one call per distinct group size; normally exactly one).

Guarantees:
- Per row: ``prompt_ids`` (int64), ``response_ids`` (int64) and ``rollout_logprobs`` (float32,
  the engine's logprob contract) are 1-D and ``len(response_ids) == len(rollout_logprobs)``;
  ``lengths`` are the response lengths; rows of one group share one ``prompt_ids``.
- ``version`` is the weight version the engine served for the whole task: generation and
  `load_version` never overlap (a lock, on top of the runtime's safe-point rule).
- Sampling is reproducible per group: a group's responses are drawn from streams keyed by
  the run's seed and the group's dataset position (`SamplingParams.prompt_seeds`), so the same
  weights sample the same responses whichever worker runs the group, whatever else shares its
  batch, and when a failed task is redone.
- Generation and weight loading run in a thread, so the worker's heartbeats and store I/O go
  on meanwhile.

Prompts are encoded by `flowrl.prompts.encode_prompt`: as plain text, or through the tokenizer's
chat template (``chat_template``, with ``system_prompt``); a tokenizer without a template is
refused when the role is built.

Evaluation tasks (``params["eval"]``: ``"greedy"`` or ``"sampled"``, see
`flowrl.control.evaluation`) take their positions in the held-out split (``eval_dataset``),
decode greedily (temperature 0) or with the run's sampling, and return the same fields;
the controller only scores them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from flowrl import messages as m
from flowrl.data import Dataset
from flowrl.prompts import check_chat_template, encode_prompt
from workers.engines.protocols import Generation, RolloutEngine, SamplingParams, mix_seed
from workers.runtime import RoleOutput

__all__ = ["RolloutRole", "group_rows"]


def group_rows(row_groups: Sequence[int]) -> dict[int, list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    out: dict[int, list[int]] = {}
    for i, g in enumerate(row_groups):
        out.setdefault(int(g), []).append(i)
    return out


_ENCODED_MAX = 4096  # prompts whose token ids a rollout role keeps


class RolloutRole:
    """Samples ``n`` responses per prompt group with a `RolloutEngine`."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        dataset: Dataset,
        sampling: SamplingParams,
        *,
        max_prompt_tokens: int,
        sample_seed: int = 0,
        chat_template: bool = False,
        system_prompt: str | None = None,
        eval_dataset: Dataset | None = None,
    ) -> None:
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        if chat_template:
            check_chat_template(tokenizer)
        self.engine = engine
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.eval_dataset = eval_dataset
        self.sampling = sampling
        self.max_prompt_tokens = max_prompt_tokens
        self.sample_seed = sample_seed
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self._lock = asyncio.Lock()  # the engine serves one call at a time
        # Every epoch asks for the same prompts again, and tokenizing runs on the worker's
        # event loop: keep the token ids of recent prompts.
        self._encode = functools.lru_cache(maxsize=_ENCODED_MAX)(self._tokenize)

    def prompt_ids(self, position: int, *, split: Dataset | None = None
                   ) -> tuple[list[int], bool]:
        """The token ids of the prompt at ``position`` (of the training data, or of
        ``split``) and whether they were truncated."""
        ids = list(self._encode((split or self.dataset).at(position).prompt))
        if not ids:
            raise ValueError(f"the prompt at dataset position {position} encodes to no tokens")
        if len(ids) > self.max_prompt_tokens:
            return ids[-self.max_prompt_tokens :], True
        return ids, False

    def _tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(encode_prompt(self.tokenizer, text, chat_template=self.chat_template,
                                   system_prompt=self.system_prompt))

    def _eval_mode(self, task: m.TaskMsg) -> tuple[Dataset | None, SamplingParams]:
        """The split and sampling of ``task``: the training data and the run's sampling, or
        for an evaluation task the held-out split, greedy or sampled."""
        mode = task["params"].get("eval")
        if mode is None:
            return None, self.sampling
        if self.eval_dataset is None:
            raise ValueError("an evaluation task, but this worker has no held-out split")
        if mode not in ("greedy", "sampled"):
            raise ValueError(f"unknown evaluation mode {mode!r}")
        greedy = replace(self.sampling, temperature=0.0)
        return self.eval_dataset, greedy if mode == "greedy" else self.sampling

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        split, sampling = self._eval_mode(task)
        positions = [int(p) for p in inputs["prompt"]]
        groups = group_rows(task["row_groups"])
        if len(positions) != len(task["row_groups"]):
            raise ValueError(f"{len(positions)} prompt values for {len(task['row_groups'])} rows")
        prompts: dict[int, list[int]] = {}
        seeds: dict[int, int] = {}
        truncated = 0
        for gid, rows in groups.items():
            shared = {positions[r] for r in rows}
            if len(shared) != 1:
                raise ValueError(f"group {gid} mixes dataset positions {sorted(shared)}")
            prompts[gid], cut = self.prompt_ids(positions[rows[0]], split=split)
            seeds[gid] = mix_seed(self.sample_seed, positions[rows[0]])
            truncated += cut
        async with self._lock:
            t0 = time.perf_counter()
            gens, version = await asyncio.to_thread(self._generate, groups, prompts, seeds,
                                                    sampling)
            gen_s = time.perf_counter() - t0

        n_rows = len(positions)
        prompt_t = {gid: torch.tensor(ids, dtype=torch.int64) for gid, ids in prompts.items()}
        out_prompt: list[Any] = [None] * n_rows
        out_resp: list[Any] = [None] * n_rows
        out_lps: list[Any] = [None] * n_rows
        clipped = 0
        for gid, rows in groups.items():
            for r, g in zip(rows, gens[gid], strict=True):
                out_prompt[r] = prompt_t[gid]
                out_resp[r] = g.response_ids.to(torch.int64)
                out_lps[r] = g.logprobs.to(torch.float32)
                clipped += g.finish_reason == "length"
        lengths = [int(t.numel()) for t in out_resp]
        tokens = float(sum(lengths))
        return RoleOutput(
            fields={"prompt_ids": out_prompt, "response_ids": out_resp,
                    "rollout_logprobs": out_lps},
            lengths=lengths,
            version=version,
            metrics={"tokens": tokens, "gen_s": gen_s,
                     "tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
                     "clipped": float(clipped), "prompts_truncated": float(truncated)},
        )

    def _generate(
        self, groups: dict[int, list[int]], prompts: dict[int, list[int]], seeds: dict[int, int],
        sampling: SamplingParams,
    ) -> tuple[dict[int, list[Generation]], int]:
        """Each group's generations (in row order) and the version that produced them."""
        by_size: dict[int, list[int]] = {}
        for gid, rows in groups.items():
            by_size.setdefault(len(rows), []).append(gid)
        out: dict[int, list[Generation]] = {}
        for n, gids in by_size.items():
            params = replace(sampling, n=n, prompt_seeds=tuple(seeds[g] for g in gids))
            gens = self.engine.generate([prompts[g] for g in gids], params)
            for i, gid in enumerate(gids):
                out[gid] = gens[i * n : (i + 1) * n]
        return out, self.engine.version

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if not weights:  # joining at a version without its weights: nothing to load
            return
        async with self._lock:
            await asyncio.to_thread(self.engine.load_weights, weights, version, shared=True)
