"""The reward role: score each row's decoded response against its dataset example.

Per row: the response ids are decoded with the policy's tokenizer (special tokens skipped, so
the EOS that ends a response is not part of the text), the example is looked up by the row's
dataset position, and `workers.roles.reward_runner.RewardRunner` calls the reward function with
``(prompt, response, answer=...)``: the user's, or a reward model or judge served in this
process (`workers.roles.factory` builds them; both score a whole task per call).

Guarantees: ``run`` returns one finite float per row whatever the reward function does; a
sample whose call failed (raised, timed out, returned garbage) gets 0.0, one whose grader output
was unparsable (a judge's verdict without a score) its fallback reward, and either is counted in
the metrics (``reward_failed`` and ``reward_failed_<kind>``) and named in the report (``failed``:
its rows and one error per kind, which the controller counts for the step that trains them);
the first error of a task is logged.

An evaluation task (``params["eval"]``) names positions of the held-out split
(``eval_dataset``), scored the same way.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog
import torch

from flowrl import messages as m
from flowrl.data import Dataset
from workers.roles.reward_runner import RewardRunner, RewardSample
from workers.runtime import RoleOutput

__all__ = ["RewardRole"]

log = structlog.get_logger("flowrl.reward")


class RewardRole:
    #: scores text: new policy versions do not concern it
    loads_weights = False

    def __init__(self, runner: RewardRunner, tokenizer: Any, dataset: Dataset, *,
                 eval_dataset: Dataset | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.eval_dataset = eval_dataset

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        dataset = self.dataset
        if task["params"].get("eval") is not None:
            if self.eval_dataset is None:
                raise ValueError("an evaluation task, but this worker has no held-out split")
            dataset = self.eval_dataset
        positions = [int(p) for p in inputs["prompt"]]
        responses = inputs["response_ids"]
        texts = self.tokenizer.batch_decode([r.tolist() for r in responses],
                                            skip_special_tokens=True)
        samples = []
        for pos, text in zip(positions, texts, strict=True):
            ex = dataset.at(pos)
            samples.append(RewardSample(ex.prompt, text, {"answer": ex.answer}))
        results = await self.runner.score(samples)
        rewards = [r.reward for r in results]
        failed = Counter(r.kind for r in results if not r.ok)
        metrics = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_failed": float(sum(failed.values())),
            **{f"reward_failed_{kind}": float(n) for kind, n in failed.items()},
        }
        named: dict[str, m.FailedRows] = {}
        for i, r in enumerate(results):
            if not r.ok:
                named.setdefault(r.kind or "error", {"rows": [], "error": r.error or ""})[
                    "rows"].append(i)
        first = next((r for r in results if not r.ok), None)
        if first is not None:
            log.warning("reward function failed", task=task["task_id"],
                        failed=int(metrics["reward_failed"]), samples=len(results),
                        error=first.error)
        return RoleOutput(fields={"reward": rewards}, metrics=metrics, failed=named)

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None
