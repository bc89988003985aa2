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
A file with no usable row raises ValueError naming the file, the keys a row needs and what its
first rows hold; so does a Parquet file that is not one, or one without the prompt or answer
column, naming the columns it has. `first_example` reads no further than the first usable row
(the launcher's check before workers start). Parquet needs ``pyarrow`` (the ``parquet`` extra),
imported only when such a file is read.

A prompt template (``"Question: {prompt}\nAnswer:"``) wraps each prompt; ``{prompt}`` is replaced
literally, so other braces in the template (``\\boxed{}``) need no escaping.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def hold_out(data: Dataset, prompts: int, *, source: Dataset | None = None,
             seed: int = 0) -> tuple[Dataset, Dataset]:
    """``(train, evaluation)``: a held-out evaluation split of ``prompts`` distinct prompts and
    the training data without them.

    The evaluation split is the first ``prompts`` distinct prompts of ``source`` (a file of
    its own) in its order, or, without one, ``prompts`` distinct prompts of ``data`` drawn
    with ``seed``. Every example of ``data`` whose prompt is in the split (every copy of it) is
    left out of training, so no evaluation prompt is ever trained on. ValueError when the
    split would leave no training example or ``source`` has fewer distinct prompts than asked.
    """
    if prompts < 1:
        raise ValueError(f"eval.prompts must be >= 1, got {prompts}")
    if source is not None:
        distinct = distinct_examples(source.examples)
        if len(distinct) < prompts:
            raise ValueError(f"eval.prompts = {prompts}, but eval.path has {len(distinct)} "
                             "distinct prompts")
        chosen = distinct[:prompts]
    else:
        distinct = distinct_examples(data.examples)
        if len(distinct) <= prompts:
            raise ValueError(f"eval.prompts = {prompts} would hold out every prompt of the "
                             f"training data ({len(distinct)} distinct): hold out fewer, or "
                             "give eval.path")
        order = list(range(len(distinct)))
        random.Random(seed * 1_000_003 + 7).shuffle(order)
        chosen = [distinct[i] for i in sorted(order[:prompts])]
    held = {e.prompt for e in chosen}
    train = [e for e in data.examples if e.prompt not in held]
    if not train:
        raise ValueError(f"every prompt of the training data is among the {prompts} "
                         "evaluation prompts (eval.path): nothing is left to train on")
    return (Dataset(train, seed=data.seed, skipped=data.skipped),
            Dataset(chosen, seed=data.seed, skipped=0 if source is None else source.skipped))


def distinct_examples(examples: Sequence[Example]) -> list[Example]:
    """The first example of each prompt, in order."""
    seen: dict[str, Example] = {}
    for e in examples:
        seen.setdefault(e.prompt, e)
    return list(seen.values())


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
        return _dataset(path, _json_lines(f), prompt_key, answer_key, template, seed)


def parquet(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
            template: str = PROMPT_PLACEHOLDER, seed: int = 0) -> Dataset:
    """The rows of a Parquet file (its prompt and answer columns only); malformed rows are
    skipped and counted (module doc)."""
    check_template(template)
    return _dataset(path, _parquet_rows(path, prompt_key, answer_key), prompt_key, answer_key,
                    template, seed)


def first_example(path: str | Path, *, kind: str, prompt_key: str = "prompt",
                  answer_key: str = "answer", template: str = PROMPT_PLACEHOLDER) -> Example:
    """The first usable example of a ``jsonl`` or ``parquet`` file, reading no further; the
    errors of `jsonl` and `parquet` when there is none."""
    check_template(template)
    shown: list[str] = []
    with contextlib.ExitStack() as stack:
        for row in _rows_of(stack, path, kind, prompt_key, answer_key):
            example = _example(row, prompt_key, answer_key, template)
            if example is not None:
                return example
            if len(shown) < SHOWN_ROWS:
                shown.append(_show_row(row, prompt_key, answer_key))
    raise _no_usable_row(path, prompt_key, answer_key, shown)


def scan(path: str | Path, *, kind: str, prompt_key: str = "prompt", answer_key: str = "answer",
         template: str = PROMPT_PLACEHOLDER, every: int = 10_000,
         seen: Callable[[int], None] | None = None) -> tuple[int, int]:
    """The usable examples and the skipped rows of a ``jsonl`` or ``parquet`` file, read through
    without keeping them (what the launcher says before the workers load it); ``seen(rows)``
    is called every ``every`` rows read (it may raise to stop the scan). The errors of
    `jsonl` and `parquet` when there is no usable row."""
    check_template(template)
    usable = skipped = 0
    shown: list[str] = []
    with contextlib.ExitStack() as stack:
        for n, row in enumerate(_rows_of(stack, path, kind, prompt_key, answer_key), 1):
            if _example(row, prompt_key, answer_key, template) is not None:
                usable += 1
            else:
                skipped += 1
                if len(shown) < SHOWN_ROWS:
                    shown.append(_show_row(row, prompt_key, answer_key))
            if seen is not None and n % every == 0:
                seen(n)
    if not usable:
        raise _no_usable_row(path, prompt_key, answer_key, shown)
    return usable, skipped


def _rows_of(stack: contextlib.ExitStack, path: str | Path, kind: str, prompt_key: str,
             answer_key: str) -> Iterable[object]:
    """The rows of a ``jsonl`` or ``parquet`` file (a JSON-lines file is closed with
    ``stack``)."""
    if kind == "jsonl":
        return _json_lines(stack.enter_context(open(path, "rb")))
    if kind == "parquet":
        return _parquet_rows(path, prompt_key, answer_key)
    raise ValueError(f"no file kind {kind!r}; have 'jsonl' and 'parquet'")


def _parquet_rows(path: str | Path, prompt_key: str, answer_key: str) -> Iterator[object]:
    """The rows of a Parquet file's prompt and answer columns, a batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} (data.kind 'parquet') needs pyarrow: pip install 'flowrl[parquet]'"
        ) from None
    try:
        file = pq.ParquetFile(path)
        columns = file.schema_arrow.names
    except (OSError, ValueError, KeyError) as e:  # pyarrow's errors subclass these
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    missing = [k for k in (prompt_key, answer_key) if k not in columns]
    if missing:
        raise ValueError(f"{path}: no column {' or '.join(map(repr, missing))} (the prompt and "
                         f"answer keys); its columns are {_listed(columns)}")
    for batch in file.iter_batches(columns=[prompt_key, answer_key]):
        yield from batch.to_pylist()


_MALFORMED = object()  # a row that could not even be parsed
#: rows an error about a file without a usable row describes
SHOWN_ROWS = 3


def _json_lines(f: Iterable[bytes]) -> Iterator[object]:
    for raw in f:
        if not raw.strip():
            continue
        try:
            yield json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            yield _MALFORMED


def _dataset(path: str | Path, rows: Iterable[object], prompt_key: str, answer_key: str,
             template: str, seed: int) -> Dataset:
    examples: list[Example] = []
    shown: list[str] = []
    skipped = 0
    for row in rows:
        example = _example(row, prompt_key, answer_key, template)
        if example is None:
            skipped += 1
            if len(shown) < SHOWN_ROWS:
                shown.append(_show_row(row, prompt_key, answer_key))
        else:
            examples.append(example)
    if not examples:
        raise _no_usable_row(path, prompt_key, answer_key, shown)
    return Dataset(examples, seed=seed, skipped=skipped)


def _no_usable_row(path: str | Path, prompt_key: str, answer_key: str,
                   shown: list[str]) -> ValueError:
    found = "; ".join(shown) if shown else "the file has no rows"
    return ValueError(
        f"{path}: no usable example: a row needs {prompt_key!r} (non-blank text) and "
        f"{answer_key!r} (text or a number); its first rows: {found}")


def _show_row(row: object, prompt_key: str, answer_key: str) -> str:
    """What a row that is no example holds, in a few words (its keys and the kinds of its
    values, never the values)."""
    if row is _MALFORMED:
        return "a line that is not JSON (or not UTF-8)"
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    if prompt_key not in row or answer_key not in row:
        return f"keys {_listed(list(row))}"
    return (f"{prompt_key!r} is {_kind_of(row[prompt_key])}, {answer_key!r} is "
            f"{_kind_of(row[answer_key])}")


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, str):
        return ("blank text" if not value.strip() else
                "text" if _is_text(value) else "text with unpaired surrogates")
    return "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"


def _listed(keys: list[Any], most: int = 12) -> str:
    shown = ", ".join(repr(k)[:40] for k in keys[:most])
    return f"[{shown}{', ...' if len(keys) > most else ''}]"


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
