"""A generative judge: a response's reward is the score a causal LM writes about it.

`Judge` fills its template with each sample's prompt, response and reference answer
(`fill_template`), has a `workers.engines.protocols.RolloutEngine` (the HF engine on any torch
device, or vLLM) write a verdict for each, greedily, in one engine call per reward task, and
reads a score from each verdict (`parse_verdict`):

- ``number``: the verdict's first number, if it lies in ``[min_score, max_score]``, scaled to
  0..1 (``"7/10"`` reads 7; ``"12"`` on a 0..10 scale reads nothing);
- ``yes_no``: a verdict whose first word is yes scores 1.0, no 0.0 (any case).

A verdict nothing can be read from is `workers.roles.reward_runner.Unparsable` with the
configured default reward, so the reward runner counts it (kind ``unparsable``) and the run goes
on. `workers.roles.reward_runner.RewardRunner` calls a judge as a batched reward function, in a
thread.

Guarantees: verdicts are reproducible (greedy decoding); one engine call at a time (a lock);
a judge prompt longer than ``max_prompt_tokens`` tokens keeps its end (the response and the
cue to answer).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from workers.engines.protocols import RolloutEngine, SamplingParams
from workers.roles.reward_runner import Unparsable

__all__ = ["PLACEHOLDERS", "Judge", "fill_template", "parse_verdict"]

#: what a template may name; each is replaced literally, other braces stay as written.
PLACEHOLDERS = ("prompt", "response", "answer")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)")
_FIRST_WORD = re.compile(r"\W*([^\W\d_]+)")

ParseKind = Literal["number", "yes_no"]


def fill_template(template: str, values: Mapping[str, str]) -> str:
    """``template`` with each placeholder replaced by its value in one pass, so a response
    that itself contains ``{prompt}`` stays as written."""
    return _PLACEHOLDER.sub(lambda m: values[m[1]], template)


def parse_verdict(text: str, kind: ParseKind, *, min_score: float = 0.0,
                  max_score: float = 10.0) -> float | None:
    """The reward a verdict gives (0..1), or None when it gives none (see the module doc)."""
    if kind == "yes_no":
        word = _FIRST_WORD.match(text)
        answer = word[1].lower() if word else ""
        return 1.0 if answer == "yes" else 0.0 if answer == "no" else None
    found = _NUMBER.search(text)
    if found is None:
        return None
    x = float(found[0])
    if not min_score <= x <= max_score:
        return None
    return (x - min_score) / (max_score - min_score)


class Judge:
    """A batched reward function backed by a generating engine (see the module docstring)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        template: str,
        parse: ParseKind,
        min_score: float,
        max_score: float,
        default: float,
        max_new_tokens: int,
        max_prompt_tokens: int,
        stop: tuple[str, ...],
    ) -> None:
        if "{response}" not in template:
            raise ValueError("the judge template must contain {response}")
        if not max_score > min_score:
            raise ValueError(f"max_score ({max_score}) must be above min_score ({min_score})")
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.parse = parse
        self.min_score = min_score
        self.max_score = max_score
        self.default = default
        self.max_prompt_tokens = max_prompt_tokens
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)
        self._wanted = (f"a number in [{min_score:g}, {max_score:g}]" if parse == "number"
                        else "yes or no as its first word")
        self._lock = threading.Lock()

    def judge_prompts(
        self, prompts: Sequence[str], responses: Sequence[str],
        metas: Sequence[Mapping[str, Any]],
    ) -> list[str]:
        """The judge's prompt text for each sample."""
        return [fill_template(self.template, {"prompt": p, "response": r,
                                              "answer": str(m.get("answer", ""))})
                for p, r, m in zip(prompts, responses, metas, strict=True)]

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str],
        metas: Sequence[Mapping[str, Any]],
    ) -> list[float | Unparsable]:
        texts = self.judge_prompts(prompts, responses, metas)
        ids = [list(self.tokenizer(t).input_ids)[-self.max_prompt_tokens:] for t in texts]
        with self._lock:
            generations = self.engine.generate(ids, self.sampling)
        verdicts = self.tokenizer.batch_decode(
            [g.response_ids.tolist() for g in generations], skip_special_tokens=True)
        out: list[float | Unparsable] = []
        for verdict in verdicts:
            score = parse_verdict(verdict, self.parse, min_score=self.min_score,
                                  max_score=self.max_score)
            out.append(score if score is not None else Unparsable(
                self.default, f"no score in the judge's verdict {verdict[:80]!r} (expected "
                              f"{self._wanted})"))
        return out
