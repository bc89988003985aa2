"""What a run needs to continue after its controller died: the run state saved with each
checkpoint, and finding the newest complete one.

A checkpoint directory ``{output}/step_N`` is written by the trainer (weights, HF config,
tokenizer, optimizer state) before it reports step N; once the controller has committed step N
it adds ``run_state.json`` (atomically), so a directory with that file is complete and
consistent. The state says which dataset positions are trained: every one below
``trained_below`` plus ``trained_above``; positions admitted up to ``admitted_to`` but not
trained (in flight when the controller died) are redone first on resume, in order.

``groups_trained`` counts trained groups, so ``groups_trained == trained_below +
len(trained_above)`` proves no position was trained twice.

A state file is checked before anything is built from it (`RunState.from_json`,
`latest_checkpoint`): a state that is not one the controller could have written is refused
with ValueError naming the file, never half used: its version must match its ``step_N``
directory, every position in ``trained_above`` must lie in ``[trained_below, admitted_to)``
once, ``groups_trained`` must count them, and the positions to redo and ``trained_above``
are bounded (`MAX_TRACKED`; a real run holds at most its staleness window of groups there), so
a corrupted range such as ``admitted_to = 10**18`` is refused instead of exhausting memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_TRACKED",
    "STATE_FILE",
    "RunState",
    "TrainedPositions",
    "checkpoint_dirs",
    "latest_checkpoint",
    "prune_checkpoints",
    "write_state",
]

STATE_FILE = "run_state.json"
_STEP_DIR = re.compile(r"step_(\d+)")
#: the most positions a state may list in ``trained_above``, and the most it may leave to redo
#: (admitted, not trained). A run holds at most its staleness window of groups in either, a few
#: thousand at most; past this a state is corrupted, and using it would exhaust memory.
MAX_TRACKED = 1 << 20
# Integers the controller writes stay far below this (the wire's bound on positions too).
_MAX_INT = 1 << 62
# A state of MAX_TRACKED positions of 19 digits, with room to spare.
_MAX_FILE_BYTES = 64 << 20


class TrainedPositions:
    """The set of trained dataset positions, kept as a prefix and a small sparse tail.

    Positions train roughly in order (the tail holds at most what the staleness window lets
    run ahead), so memory stays bounded however long the run.
    """

    def __init__(self, below: int = 0, above: Iterable[int] = (), count: int | None = None) -> None:
        """``count``: positions trained so far, duplicates included (default: the set's size)."""
        self.below = below
        self.above: set[int] = set(above)
        self.count = below + len(self.above) if count is None else count
        self._compact()

    def add(self, position: int) -> bool:
        """Mark ``position`` trained; False when it already was."""
        if position < self.below or position in self.above:
            return False
        self.above.add(position)
        self.count += 1
        self._compact()
        return True

    def __contains__(self, position: int) -> bool:
        return position < self.below or position in self.above

    def _compact(self) -> None:
        while self.below in self.above:
            self.above.remove(self.below)
            self.below += 1


@dataclass(frozen=True)
class RunState:
    """The controller's side of a checkpoint (see the module docstring)."""

    version: int
    trained_below: int
    trained_above: list[int] = field(default_factory=list)
    admitted_to: int = 0
    groups_trained: int = 0

    def redo(self) -> list[int]:
        """Positions admitted before the checkpoint but not trained: resumed first."""
        done = set(self.trained_above)
        return [p for p in range(self.trained_below, self.admitted_to) if p not in done]

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> RunState:
        keys = {"version", "trained_below", "trained_above", "admitted_to", "groups_trained"}
        if not isinstance(data, dict) or set(data) != keys:
            raise ValueError(f"{source}: expected an object with keys {sorted(keys)}")
        ints = ("version", "trained_below", "admitted_to", "groups_trained")
        if not all(type(data[k]) is int and 0 <= data[k] < _MAX_INT for k in ints) or not (
            isinstance(data["trained_above"], list)
            and all(type(p) is int for p in data["trained_above"])
        ):
            raise ValueError(f"{source}: {sorted(ints)} must be non-negative integers below "
                             f"2**62 and trained_above a list of integers")
        state = cls(**data)
        problem = state._inconsistency()
        if problem is not None:
            raise ValueError(f"{source}: not a run state the controller writes: {problem}")
        return state

    def _inconsistency(self) -> str | None:
        """Why this state cannot be one the controller wrote (see the module doc), or None."""
        below, above, to = self.trained_below, self.trained_above, self.admitted_to
        if below > to:
            return f"trained_below ({below}) is past admitted_to ({to})"
        if len(above) > MAX_TRACKED:
            return f"trained_above lists {len(above)} positions (at most {MAX_TRACKED})"
        if len(set(above)) != len(above):
            return "trained_above lists a position twice"
        if above and not (below <= min(above) and max(above) < to):
            return (f"trained_above has positions outside [trained_below, admitted_to) = "
                    f"[{below}, {to})")
        if to - below - len(above) > MAX_TRACKED:
            return (f"{to - below - len(above)} positions between trained_below ({below}) and "
                    f"admitted_to ({to}) are left to redo (at most {MAX_TRACKED})")
        if self.groups_trained != below + len(above):
            return (f"groups_trained ({self.groups_trained}) is not trained_below + "
                    f"len(trained_above) ({below + len(above)})")
        return None


def write_state(step_dir: Path, state: RunState) -> None:
    """Write ``step_dir/run_state.json`` atomically (a reader sees all of it or nothing)."""
    tmp = step_dir / f".{STATE_FILE}.partial"
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, step_dir / STATE_FILE)


def save_beside_checkpoint(output: str | os.PathLike[str], state: RunState) -> bool:
    """Complete the trainer's checkpoint of ``state.version`` under ``output`` with ``state``,
    when the trainer wrote one (False when it did not)."""
    step_dir = Path(output) / f"step_{state.version}"
    if not step_dir.is_dir():
        return False
    write_state(step_dir, state)
    return True


def checkpoint_dirs(output: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The ``step_N`` directories under ``output``, complete or not, as (N, path), newest
    first."""
    return sorted(((int(m.group(1)), p) for p in Path(output).iterdir()
                   if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()), reverse=True)


def prune_checkpoints(output: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete the ``step_N`` directories older than the newest ``keep`` complete checkpoints
    under ``output``; returns what was deleted. The newest complete one (what `--resume` uses)
    is always kept, and so is every ``step_N`` newer than the oldest kept one (one the
    controller has not completed yet). A directory is renamed aside before it is deleted, so a
    deletion cut short never leaves a half-deleted ``step_N``."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(output)
    steps = checkpoint_dirs(root)
    complete = [n for n, p in steps if (p / STATE_FILE).is_file()]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    gone = []
    for n, path in steps:
        if n < oldest_kept:
            trash = root / f".{path.name}.removing"
            shutil.rmtree(trash, ignore_errors=True)
            path.rename(trash)
            shutil.rmtree(trash)
            gone.append(path)
    return gone


def latest_checkpoint(output: str | os.PathLike[str]) -> tuple[Path, RunState]:
    """The newest complete checkpoint under ``output`` (or ``output`` itself when it is one)."""
    root = Path(output)
    if (root / STATE_FILE).is_file():
        candidates = [root]
    elif root.is_dir():
        candidates = [p for _, p in checkpoint_dirs(root) if (p / STATE_FILE).is_file()]
    else:
        raise FileNotFoundError(f"--resume: {root} does not exist")
    if not candidates:
        raise FileNotFoundError(
            f"--resume: no complete checkpoint under {root} (a step_N directory with "
            f"{STATE_FILE}; checkpoints need output and checkpoint_every)")
    path = candidates[0]
    source = str(path / STATE_FILE)
    try:
        with open(path / STATE_FILE, "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
        if len(raw) > _MAX_FILE_BYTES:
            raise ValueError(f"larger than {_MAX_FILE_BYTES >> 20} MiB")
        data = json.loads(raw)
    except (OSError, ValueError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise ValueError(f"{source}: {exc}") from None
    state = RunState.from_json(data, source=source)
    step = _STEP_DIR.fullmatch(path.name)
    if step is not None and int(step.group(1)) != state.version:
        raise ValueError(f"{source}: its version ({state.version}) is not its checkpoint's "
                         f"step ({path.name}): the state belongs to another checkpoint")
    return path, state
