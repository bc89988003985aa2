"""A run's output directory: what a run keeps, and the rules that protect it.

Layout (``Recipe.output``)::

    recipe.json     the resolved recipe (every field, defaults included; monitor.token left out)
    metrics.jsonl   the step log, one JSON line per committed step, written as the step commits,
                    and one per evaluation round (``eval/...`` figures of the step it evaluated)
    summary.json    the run's summary, when it ends
    tensorboard/    TensorBoard's event files, with ``tracking`` (`flowrl.tracking`)
    wandb/          W&B's run files, with ``tracking``
    final/          the final model: weights, config and tokenizer (``from_pretrained`` loads it)
    step_N/         checkpoints (``checkpoint_every``; the newest ``keep_last`` of them)
    critic/         PPO's critic save (with checkpoints)

``final`` is its own directory, not the last ``step_N``: its path does not depend on the step
count or on which checkpoints are kept, it holds only what inference needs (no optimizer or
run state), and it is written also when checkpoints are off. The trainer writes it at the run's
last step (`workers.roles.trainer`), built aside and renamed into place.

Guarantees:

- A new run refuses a directory that holds another run's results (`claim`) unless it continues
  that run (``--resume``) or is told to replace them (``--overwrite``, which removes only what
  a run writes, listed above).
- ``--resume`` is refused when the recipe changed a field that resumption cannot change
  (`RESUME_FIXED`: the model, the data and its held-out split, the seed, the algorithm's name
  and group size), naming
  every such field with its old and new value; other changes are allowed and listed
  (`resume_changes`).
- The step log is appended and flushed line by line, so a run that crashes keeps the lines of
  the steps it committed; a resumed run first drops the lines after its checkpoint (those steps
  are trained again).

Imports nothing heavy (the standard library and the recipe model).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import structlog

from flowrl.recipe import Recipe
from flowrl.resume import STATE_FILE, checkpoint_dirs, prune_checkpoints

__all__ = [
    "FINAL_DIR",
    "METRICS_FILE",
    "RECIPE_FILE",
    "RESUME_FIXED",
    "SUMMARY_FILE",
    "TENSORBOARD_DIR",
    "WANDB_DIR",
    "OutputInUse",
    "ResumeMismatch",
    "RunRecord",
    "check_resume",
    "claim",
    "default_output",
    "flat_fields",
    "recipe_record",
    "resume_changes",
    "run_dir_of",
]

log = structlog.get_logger("flowrl.run_output")

FINAL_DIR = "final"
RECIPE_FILE = "recipe.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
#: what trackers write there (`flowrl.tracking`): TensorBoard's event files, and W&B's run
#: files (W&B names its directory ``wandb``; not there when ``WANDB_DIR`` says elsewhere)
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
_RESULT_NAMES = (FINAL_DIR, "critic", RECIPE_FILE, METRICS_FILE, SUMMARY_FILE, TENSORBOARD_DIR,
                 WANDB_DIR)
#: recipe fields (and their subfields) a resumed run may not change: the checkpoint's weights
#: are of this model, its trained dataset positions index this data (less its held-out
#: evaluation prompts) in this seed's order, and its optimizer state and rows are shaped by
#: this objective and group size.
RESUME_FIXED = ("model", "data", "seed", "algorithm.name", "algorithm.group_size",
                "eval.prompts", "eval.path")
# Not compared on resume: where results go and are watched (monitor, trackers), and the run's
# length (which may grow; `flowrl.run.run_recipe` refuses a total the checkpoint already
# reached).
_RESUME_IGNORED = ("output", "monitor", "steps", "checkpoint_every", "keep_last", "tracking")


class OutputInUse(ValueError):
    """The output directory holds another run's results."""


class ResumeMismatch(ValueError):
    """The recipe changed fields that resumption cannot change."""


def default_output(recipe_file: str | os.PathLike[str], run_id: str, *,
                   now: datetime | None = None) -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<recipe file stem>-<run id>`` (relative: under the current
    directory); the launcher's output when neither the recipe nor ``--output`` gives one."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{Path(recipe_file).stem}-{run_id}"


def recipe_record(recipe: Recipe) -> dict[str, Any]:
    """The recipe as ``recipe.json`` holds it: every field, the monitor token left out."""
    return recipe.model_dump(mode="json", exclude={"monitor": {"token"}})


def run_dir_of(path: str | os.PathLike[str]) -> Path:
    """The run directory of ``path``: itself, or its parent when it is one checkpoint (a
    directory with the run state, as ``--resume`` accepts)."""
    p = Path(path)
    return p.parent if (p / STATE_FILE).is_file() else p


def _results_in(out: Path) -> list[str]:
    """What a run wrote in ``out`` (checkpoints numerically, then the other results)."""
    steps = [p.name for _, p in reversed(checkpoint_dirs(out))]
    return steps + [n for n in _RESULT_NAMES if (out / n).exists()]


def _named(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                      else "")


def claim(out: Path, *, resume: str | os.PathLike[str] | None = None,
          overwrite: bool = False) -> None:
    """Make ``out`` this run's: refuse (`OutputInUse`) a directory holding another run's
    results, unless ``resume`` continues the run of ``out`` or ``overwrite`` is given (its
    results are then removed)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputInUse(f"output {out} exists and is not a directory")
    found = _results_in(out)
    if not found:
        return
    if resume is not None and run_dir_of(resume).resolve() == out.resolve():
        return
    if overwrite:
        for name in found:
            _remove(out / name)
        log.warning("previous results removed (--overwrite)", output=str(out),
                    removed=_named(found))
        return
    raise OutputInUse(f"output {out} holds another run's results ({_named(found)}): continue "
                      f"that run with --resume {out}, or replace its results with --overwrite")


def _remove(path: Path) -> None:
    """Remove a result; a directory is renamed aside first, so a removal cut short never
    leaves a half-deleted directory under its own name."""
    if path.is_dir() and not path.is_symlink():
        trash = path.with_name(f".{path.name}.removing")
        shutil.rmtree(trash, ignore_errors=True)
        path.rename(trash)
        shutil.rmtree(trash)
    else:
        path.unlink()


def flat_fields(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists are values)."""
    if not isinstance(data, Mapping) or not data:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flat_fields(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(f"{p}.") for p in prefixes)


def _shown(value: Any, most: int = 60) -> str:
    text = json.dumps(value) if value is not _ABSENT else "(absent)"
    return text if len(text) <= most else f"{text[:most - 3]}..."


_ABSENT = object()


def resume_changes(saved: Mapping[str, Any],
                   recipe: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The fields where ``recipe`` differs from the ``saved`` one (both as `recipe_record`
    gives them), each as ``"field (old → new)"``: those resumption cannot change
    (`RESUME_FIXED`), and the others (not counting `_RESUME_IGNORED`)."""
    old, new = flat_fields(saved), flat_fields(recipe)
    fixed: list[str] = []
    other: list[str] = []
    for path in sorted(old.keys() | new.keys()):
        before, after = old.get(path, _ABSENT), new.get(path, _ABSENT)
        if before == after or _under(path, _RESUME_IGNORED):
            continue
        said = f"{path} ({_shown(before)} → {_shown(after)})"
        (fixed if _under(path, RESUME_FIXED) else other).append(said)
    return fixed, other


def check_resume(resume: str | os.PathLike[str], recipe: Recipe) -> list[str]:
    """Check ``recipe`` against the one saved in the run directory of ``resume``; raises
    `ResumeMismatch` naming every field resumption cannot change, else returns the other
    changes (empty when the run directory has no ``recipe.json``: a run from before it was
    kept, not checked)."""
    saved_file = run_dir_of(resume) / RECIPE_FILE
    try:
        saved = json.loads(saved_file.read_text())
    except FileNotFoundError:
        log.warning("the recipe is not checked against the resumed run's (it has no "
                    f"{RECIPE_FILE})", resume=str(resume))
        return []
    except (OSError, ValueError) as exc:
        raise ResumeMismatch(f"--resume {resume}: {saved_file} cannot be read: {exc}") from None
    if not isinstance(saved, dict):
        raise ResumeMismatch(f"--resume {resume}: {saved_file} holds no recipe")
    fixed, other = resume_changes(saved, recipe_record(recipe))
    if fixed:
        raise ResumeMismatch(
            f"--resume {resume}: the recipe changed what a resumed run must keep "
            f"({', '.join(RESUME_FIXED)}), against {saved_file}: {'; '.join(fixed)}")
    return other


def _write_json(path: Path, data: Any) -> None:
    """Write ``path`` atomically (a reader sees the old file or the whole new one)."""
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _steps_up_to(metrics: Path, version: int) -> None:
    """Keep the step-log lines of steps up to ``version`` (a resumed run trains the later ones
    again); a line that is not a step's (a torn last line) goes too."""
    if not metrics.is_file():
        return
    kept = []
    for line in metrics.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step <= version:
            kept.append(line + "\n")
    tmp = metrics.with_name(f".{metrics.name}.partial")
    tmp.write_text("".join(kept))
    os.replace(tmp, metrics)


class RunRecord:
    """Writes a run's results into its output directory (see the module docstring): the
    recipe at the start, a step-log line per committed step (`step`, an ``on_step`` callback
    of the controller), the summary at the end (`finish`). ``keep_last`` checkpoints are kept
    after each step. ``resumed_at``: the checkpoint version a resumed run continues from."""

    def __init__(self, out: Path, recipe: Recipe, *, resumed_at: int | None = None) -> None:
        self.out = out
        self.keep_last = recipe.keep_last
        self.resumed_at = resumed_at
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / RECIPE_FILE, recipe_record(recipe))
        metrics = out / METRICS_FILE
        if resumed_at is not None:
            _steps_up_to(metrics, resumed_at)
        else:
            metrics.unlink(missing_ok=True)
        self._metrics: IO[str] | None = open(metrics, "a", encoding="utf-8")  # noqa: SIM115
        self._failed: set[str] = set()

    def step(self, entry: dict[str, Any]) -> None:
        """Append a step's line and flush it; then drop checkpoints beyond ``keep_last`` (the
        controller calls this after it completed the step's checkpoint, if one was written).
        A disk error is logged, never raised into the step's commit."""
        self._guarded("metrics", self._write_line, entry)
        if self.keep_last is not None:
            self._guarded("keep_last", self._prune)

    def eval(self, line: dict[str, Any]) -> None:
        """Append an evaluation round's line (an ``on_eval`` callback of the controller)."""
        self._guarded("metrics", self._write_line, line)

    def _write_line(self, entry: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(entry, default=str) + "\n")
            self._metrics.flush()

    def _prune(self) -> None:
        assert self.keep_last is not None
        for path in prune_checkpoints(self.out, self.keep_last):
            log.info("old checkpoint removed (keep_last)", path=str(path))

    def _guarded(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except OSError as exc:
            if what not in self._failed:  # said once, not on every step
                self._failed.add(what)
                log.error(f"run output: {what} not written", output=str(self.out),
                          error=repr(exc))

    def final_model(self, step_log: list[dict[str, Any]], version: int) -> Path | None:
        """``final/`` when the trainer wrote it at this run's last step (``version``), per the
        step log (the trainer reports ``final_saved``); else None."""
        last = step_log[-1] if step_log else {}
        saved = last.get("step") == version and last.get("train_final_saved")
        return self.out / FINAL_DIR if saved and (self.out / FINAL_DIR).is_dir() else None

    def finish(self, summary: dict[str, Any], step_log: list[dict[str, Any]]) -> dict[str, Any]:
        """The summary with ``output`` and ``final_model`` (a path, or None) added, written
        to ``summary.json``."""
        final = self.final_model(step_log, summary["version"])
        summary = {**summary, "output": str(self.out),
                   "final_model": None if final is None else str(final)}
        self._guarded("summary", _write_json, self.out / SUMMARY_FILE, summary)
        return summary

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
