"""Prompt datasets: a built-in arithmetic task and local JSONL and Parquet files.

Pure Python (no torch) so both the controller and workers import it. The controller hands out
dataset *positions*; a worker turns a position into a prompt and its reference answer. Positions
past the end wrap around (epochs), reshuffled per epoch with the dataset's seed, so every worker
maps a position to the same example without any coordination.

A malformed row is skipped and counted, not fatal (`Dataset.skipped` tells how many): a line that
is not valid UTF-8 JSON, a value that is not an object, a missing prompt or answer key, a prompt
that is not a non-blank string, an answer that is neither a string nor a number (a Parquet row's
null counts as missing), or a prompt or answer that is not text (a lone surrogate, escaped as
``\\ud800`` in the JSON, is valid JSON but encodes to nothing a tokenizer or the wire accepts).
A file with no usable row raises ValueError; so does a Parquet file that is not one, or one
without the prompt or answer column, naming the file. Parquet needs
``pyarrow`` (the ``parquet`` extra), imported only when such a file is read.

A prompt template (``"Question: {prompt}\nAnswer:"``) wraps each prompt; ``{prompt}`` is replaced
literally, so other braces in the template (``\\boxed{}``) need no escaping.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
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


PROMPT_PLACEHOLDER = "{prompt}"


def check_template(template: str) -> str:
    """``template`` when it contains ``{prompt}``; ValueError otherwise."""
    if PROMPT_PLACEHOLDER not in template:
        raise ValueError(f"the prompt template must contain {PROMPT_PLACEHOLDER}")
    return template


def jsonl(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
          template: str = PROMPT_PLACEHOLDER, seed: int = 0) -> Dataset:
    """The rows of a JSON-lines file; malformed rows are skipped and counted (module doc)."""
    check_template(template)
    with open(path, "rb") as f:
        return _dataset(_json_lines(f), prompt_key, answer_key, template, seed)


def parquet(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
            template: str = PROMPT_PLACEHOLDER, seed: int = 0) -> Dataset:
    """The rows of a Parquet file (its prompt and answer columns only); malformed rows are
    skipped and counted (module doc)."""
    check_template(template)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} (data.kind 'parquet') needs pyarrow: pip install 'flowrl[parquet]'"
        ) from None
    try:
        table = pq.read_table(path, columns=[prompt_key, answer_key])
    except (OSError, ValueError, KeyError) as e:  # pyarrow's errors subclass these
        raise ValueError(f"{path}: not a Parquet file with columns {prompt_key!r} and "
                         f"{answer_key!r} ({e})") from None
    rows = (row for batch in table.to_batches() for row in batch.to_pylist())
    return _dataset(rows, prompt_key, answer_key, template, seed)


_MALFORMED = object()  # a row that could not even be parsed


def _json_lines(f: Iterable[bytes]) -> Iterator[object]:
    for raw in f:
        if not raw.strip():
            continue
        try:
            yield json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            yield _MALFORMED


def _dataset(rows: Iterable[object], prompt_key: str, answer_key: str, template: str,
             seed: int) -> Dataset:
    examples: list[Example] = []
    skipped = 0
    for row in rows:
        example = _example(row, prompt_key, answer_key, template)
        if example is None:
            skipped += 1
        else:
            examples.append(example)
    return Dataset(examples, seed=seed, skipped=skipped)


def _example(row: object, prompt_key: str, answer_key: str, template: str) -> Example | None:
    if not isinstance(row, dict):
        return None
    prompt, answer = row.get(prompt_key), row.get(answer_key)
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    # bool is an int subclass, but True is no answer anyone means.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return None
    if not _is_text(prompt) or not _is_text(str(answer)):
        return None
    return Example(template.replace(PROMPT_PLACEHOLDER, prompt), str(answer))


def _is_text(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (JSON's ``\\ud800`` escapes decode to lone
    surrogates, which do not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    """The first number in ``text`` (what numeric-answer checkers compare), or None."""
    match = _NUMBER.search(text.replace(",", ""))
    return match.group(0) if match else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (GSM8K-style answers end with it), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None
