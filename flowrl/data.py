"""Prompt datasets: a built-in arithmetic task and local JSONL files.

Pure Python (no torch) so both the controller and workers import it. The controller hands out
dataset *positions*; a worker turns a position into a prompt and its reference answer. Positions
past the end wrap around (epochs), reshuffled per epoch with the dataset's seed, so every worker
maps a position to the same example without any coordination.

A malformed row (not an object, or missing the prompt or answer key) is skipped and counted, not
fatal; `skipped` tells how many.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Example:
    prompt: str
    answer: str


class Dataset:
    def __init__(self, examples: Sequence[Example], *, seed: int = 0, skipped: int = 0) -> None:
        if not examples:
            raise ValueError("the dataset has no usable example")
        self.examples = list(examples)
        self.seed = seed
        self.skipped = skipped
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def at(self, position: int) -> Example:
        """The example at a global position (epoch = position // len, reshuffled per epoch)."""
        epoch, i = divmod(position, len(self.examples))
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: positions advance monotonically
        return self.examples[order[i]]


def arithmetic(count: int = 1000, *, max_operand: int = 20, seed: int = 0) -> Dataset:
    """Sums ``a+b=`` with ``0 <= a, b <= max_operand``; the answer is the exact integer."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        examples.append(Example(f"{a}+{b}=", str(a + b)))
    return Dataset(examples, seed=seed)


def jsonl(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
          seed: int = 0) -> Dataset:
    examples: list[Example] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                examples.append(Example(str(row[prompt_key]), str(row[answer_key])))
            except (ValueError, KeyError, TypeError):
                skipped += 1
    return Dataset(examples, seed=seed, skipped=skipped)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    """The first number in ``text`` (what numeric-answer checkers compare), or None."""
    match = _NUMBER.search(text.replace(",", ""))
    return match.group(0) if match else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (GSM8K-style answers end with it), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None
