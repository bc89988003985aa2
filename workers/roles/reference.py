"""The reference role: logprobs of each response under the frozen initial policy.

The engine is the trainer's own engine class, loaded from the same model directory and never
stepped, so at version 0 its numbers are exactly the trainer's. Per row, ``ref_logprobs`` is a
1-D float32 tensor aligned with ``response_ids`` (entry t is the logprob of response token t
given the prompt and the response before it), at the sampling temperature (the engines' logprob
contract), so the KL term compares like with like.

Guarantees: new policy versions never reach it (`load_version` ignores them); scoring runs in a
thread, one call at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch import Tensor

from flowrl import messages as m
from workers.engines.protocols import SequenceBatch, TrainerEngine
from workers.runtime import RoleOutput

__all__ = ["ReferenceRole"]


class ReferenceRole:
    #: the reference policy is frozen at version 0
    loads_weights = False

    def __init__(self, engine: TrainerEngine, *, temperature: float, pad_token_id: int) -> None:
        self.engine = engine
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self._lock = asyncio.Lock()  # the engine serves one call at a time

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        async with self._lock:
            rows = await asyncio.to_thread(self._score, inputs["prompt_ids"],
                                           inputs["response_ids"])
        return RoleOutput(fields={"ref_logprobs": rows},
                          metrics={"tokens": float(sum(int(r.numel()) for r in rows))})

    def _score(self, prompts: list[Tensor], responses: list[Tensor]) -> list[Tensor]:
        batch = SequenceBatch.from_rows(prompts, responses, pad_token_id=self.pad_token_id)
        lps = self.engine.logprobs(batch, temperature=self.temperature)
        return [v.to(torch.float32).contiguous() for v in batch.response_values(lps)]

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None  # the reference policy is frozen
