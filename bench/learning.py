"""Learning benchmark: does the default recipe (recipes/tiny_cpu.py) learn, every time, and how
accurate is the policy it leaves?

Trains the recipe once per seed on quiet cores and once per seed with CPU-bound processes
beside it (the machine busy with other work, as a shared machine often is), on real processes,
the real tiny model and the real task, evaluates each run's final policy on the task's prompts,
and prints one JSON line. One run's final reward says little: whether a run learns can depend
on the seed and on the timing of the asynchronous pipeline, so this runs many and reports the
worst. With ``--vs-trl``, TRL's ``GRPOTrainer`` trains the same job after each run, under the
same load, and its policy is evaluated the same way.

    python bench/learning.py [--quick] [--seeds 0,1,2,3,4] [--modes quiet,loaded]
                             [--load-procs 2] [--steps N] [--set KEY=VALUE ...]
                             [--eval-samples 32] [--vs-trl] [--trl-threads 1]
                             [--log-dir DIR] [--verbose]

Keys:

- ``runs``: one entry per run: ``seed``, ``mode`` (``quiet`` or ``loaded``), ``reward_first``
  (mean reward of the first 10 steps), ``reward_final`` (of the last 10), ``train_s`` (wall
  seconds of `Controller.run`: first dispatch to last optimizer step, the final checkpoint
  included; process start-up and the model build are not timed), ``samples_per_s``,
  ``zero_loss_steps`` (steps whose training loss was exactly 0:
  every group's responses scored alike, so nothing was learnt), ``flat_groups_final`` (the
  share of groups whose responses all scored alike, over the last 10 steps: near 1 with a low
  reward means the policy stopped exploring before it learnt), ``load_before`` /
  ``load_after`` (the 1-minute load average of the machine before and after the run, beside
  processes included: how quiet "quiet" was), and the final policy's accuracy
  (`bench.task_accuracy.exact_accuracy`, on the run's last checkpoint): ``greedy_exact`` (of
  the task's distinct prompts, 36 for the recipe, how many greedy decoding answers exactly),
  ``sampled_exact`` (the share of ``--eval-samples`` answers per prompt, sampled at the
  recipe's temperature, that are exact) and ``accuracy_gain_per_min`` (``sampled_exact``
  minus the untrained model's, per minute of ``train_s``: accuracy gained per minute of
  training).
- ``initial``: ``greedy_exact`` and ``sampled_exact`` of the untrained model; ``eval_samples``.
- ``reward_final_min``, ``reward_final_mean``, ``reward_first_mean``, ``train_s_mean``,
  ``train_s_max``, ``greedy_exact_min`` / ``_mean``, ``sampled_exact_min`` / ``_mean``,
  ``accuracy_gain_per_min_mean``: over all runs; ``reward_final_min_quiet`` / ``_loaded``,
  ``reward_final_mean_quiet`` / ``_loaded`` and ``sampled_exact_mean_quiet`` / ``_loaded``
  per mode.
- ``learned``: runs whose final reward is at least ``--target`` (default 0.85), and ``runs_n``.
- ``versions``: python, torch, transformers, tokenizers; ``steps``, ``seeds``, ``modes``,
  ``load_procs``, ``cpus``, ``quick``, ``overrides``.
- With ``--vs-trl``: ``trl_runs`` (per run as ``runs``: rewards from TRL's log of every step,
  ``train_s`` the seconds of ``trainer.train()``, ``samples_per_s``, the accuracy keys and the
  load), ``trl`` (the summary keys over them), ``trl_versions`` (trl, transformers, torch,
  accelerate, datasets), ``trl_threads`` (``--trl-threads``, TRL's torch threads); or
  ``trl_skipped`` (trl does not import) or ``trl_error`` (it failed; no further TRL run is
  tried). bench/trl_peer.py says how the job is matched.

The loaded runs start ``--load-procs`` processes that spin on a CPU each (a busy loop, as
``yes > /dev/null``) before the run and stop them after it.

``--quick`` trains one quiet and one loaded run of seed 0, 100 steps each (under 2 minutes on
two cores; the rewards then show the start of learning, not where the recipe ends; TRL's side
takes several minutes more).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.runner import library_versions, run_and_print, seed_list
from bench.task_accuracy import DEFAULT_SAMPLES, exact_accuracy
from flowrl.logs import configure
from flowrl.recipe import Recipe
from flowrl.recipe_file import apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.py"
WINDOW = 10  # steps averaged for the first and final reward
MODES = ("quiet", "loaded")
QUICK_STEPS = 100
DEFAULT_TARGET = 0.85
_SPIN = "while True: pass"


@contextlib.contextmanager
def cpu_load(procs: int) -> Iterator[list[int]]:
    """``procs`` processes that each keep one CPU busy while the block runs; yields their
    pids."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
                for _ in range(procs)]
    try:
        yield [p.pid for p in spinners]
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


async def run_logged(
    recipe: Recipe, step_log: Path | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run of ``recipe`` through a `Controller`: its summary and step log; with
    ``step_log``, every step's entry is written there as JSON lines."""
    from flowrl.controller import Controller
    from flowrl.run import compile_recipe

    spec = await asyncio.to_thread(compile_recipe, recipe)
    async with Controller(spec) as ctl:
        summary = await ctl.run(recipe.steps)
        log = list(ctl.step_log)
    if step_log is not None:
        text = "".join(json.dumps(e) + "\n" for e in log)
        await asyncio.to_thread(step_log.write_text, text)
    return summary, log


async def train(recipe: Recipe, step_log: Path | None = None) -> dict[str, Any]:
    """One run of ``recipe``: first and final reward, training wall time, zero-loss steps;
    with ``step_log``, every step's entry is written there as JSON lines."""
    summary, log = await run_logged(recipe, step_log)
    rewards = [float(e["reward_mean"]) for e in log if e.get("reward_mean") is not None]
    flat = [float(e["train_flat_groups"]) for e in log if "train_flat_groups" in e]
    return {
        **_rewards(rewards),
        "train_s": round(float(summary["wall_s"]), 1),
        "samples_per_s": round(float(summary["samples_per_s"]), 1),
        "zero_loss_steps": sum(1 for e in log if e.get("train_loss") == 0.0),
        "flat_groups_final": round(statistics.fmean(flat[-WINDOW:]), 3) if flat else None,
    }


def first_and_final(values: list[float]) -> tuple[float, float]:
    """Means of the first and the last `WINDOW` values, rounded as the benchmark reports."""
    return (round(statistics.fmean(values[:WINDOW]), 4),
            round(statistics.fmean(values[-WINDOW:]), 4))


def _rewards(rewards: list[float]) -> dict[str, float]:
    first, final = first_and_final(rewards)
    return {"reward_first": first, "reward_final": final}


def final_policy(output: Path, steps: int) -> Path:
    """The checkpoint a run with ``output`` and ``checkpoint_every=steps`` leaves at its end."""
    path = output / f"step_{steps}"
    if not (path / "config.json").is_file():
        raise RuntimeError(f"the run left no final checkpoint at {path}")
    return path


def checkpointed(recipe: Recipe, output: Path) -> Recipe:
    """``recipe`` writing one checkpoint, its last step's, to ``output``."""
    return apply_overrides(recipe, [(("output",), str(output)),
                                    (("checkpoint_every",), recipe.steps)], file=str(RECIPE))


async def evaluate(model_dir: Path, recipe: Recipe, samples: int, initial: dict[str, Any] | None,
                   train_s: float, *, tokenizer_dir: Path | None = None) -> dict[str, Any]:
    """`exact_accuracy` of a trained policy, with the gain over the untrained model's sampled
    exact-match share per minute of training (``initial`` None: the untrained model itself)."""
    acc = await asyncio.to_thread(exact_accuracy, model_dir, recipe, samples=samples,
                                  tokenizer_dir=tokenizer_dir)
    out = {"greedy_exact": acc["greedy_exact"], "sampled_exact": acc["sampled_exact"]}
    if initial is not None:
        if train_s <= 0:
            raise ValueError(f"train_s must be > 0, got {train_s}")
        gain = acc["sampled_exact"] - initial["sampled_exact"]
        out["accuracy_gain_per_min"] = round(gain / (train_s / 60), 4)
    return out


def versions() -> dict[str, str]:
    return library_versions(("torch", "transformers", "tokenizers"))


def _summary(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    finals = [r["reward_final"] for r in runs]
    out: dict[str, Any] = {
        "reward_final_min": min(finals),
        "reward_final_mean": round(statistics.fmean(finals), 4),
        "reward_first_mean": round(statistics.fmean(r["reward_first"] for r in runs), 4),
        "train_s_mean": round(statistics.fmean(r["train_s"] for r in runs), 1),
        "train_s_max": max(r["train_s"] for r in runs),
        "greedy_exact_min": min(r["greedy_exact"] for r in runs),
        "greedy_exact_mean": round(statistics.fmean(r["greedy_exact"] for r in runs), 2),
        "sampled_exact_min": min(r["sampled_exact"] for r in runs),
        "sampled_exact_mean": round(statistics.fmean(r["sampled_exact"] for r in runs), 4),
        "accuracy_gain_per_min_mean": round(
            statistics.fmean(r["accuracy_gain_per_min"] for r in runs), 4),
        "learned": sum(1 for f in finals if f >= target),
        "runs_n": len(runs),
    }
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            out[f"reward_final_min_{mode}"] = min(r["reward_final"] for r in mine)
            out[f"reward_final_mean_{mode}"] = round(
                statistics.fmean(r["reward_final"] for r in mine), 4)
            out[f"sampled_exact_mean_{mode}"] = round(
                statistics.fmean(r["sampled_exact"] for r in mine), 4)
    return out


async def trl_run(recipe: Recipe, model_dir: Path, samples: int, initial: dict[str, Any],
                  threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the recipe's job (`bench.trl_peer`), evaluated as a flowrl run."""
    from bench.trl_peer import run_trl

    with tempfile.TemporaryDirectory(prefix="flowrl-learning-trl-") as tmp:
        trained = Path(tmp) / "policy"
        run = await asyncio.to_thread(run_trl, recipe, model_dir, recipe.steps, log_every=1,
                                      save_to=trained, threads=threads)
        acc = await evaluate(trained, recipe, samples, initial, run.wall_s,
                             tokenizer_dir=model_dir)
    return {**_rewards(run.rewards), "train_s": round(run.wall_s, 1),
            "samples_per_s": round(run.samples_per_s, 1), **acc}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    overrides = list(args.overrides)
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else None
    if steps is not None:
        overrides.append(f"steps={steps}")
    recipe = load_recipe(RECIPE, overrides)
    from flowrl.run import prepare_model

    model_dir = await asyncio.to_thread(prepare_model, recipe)  # built once, before any run
    if model_dir is None:
        raise SystemExit("the recipe has no model to train (a simulated engine)")
    initial = await evaluate(model_dir, recipe, args.eval_samples, None, 0.0)
    trl: dict[str, Any] = {}
    if args.vs_trl:
        from bench import trl_peer

        why = trl_peer.unavailable()
        trl = {"trl_skipped": why} if why is not None else {"trl_runs": []}
    runs: list[dict[str, Any]] = []
    for mode in args.modes:
        for seed in args.seeds:
            seeded = apply_overrides(recipe, [(("seed",), seed)], file=str(RECIPE))
            path = None if args.log_dir is None else args.log_dir / f"{mode}-{seed}.jsonl"
            with tempfile.TemporaryDirectory(prefix="flowrl-learning-") as tmp:
                with cpu_load(args.load_procs if mode == "loaded" else 0):
                    before = load_average()
                    run = await train(checkpointed(seeded, Path(tmp)), path)
                    after = load_average()
                run.update(await evaluate(final_policy(Path(tmp), seeded.steps), seeded,
                                          args.eval_samples, initial, run["train_s"]))
            runs.append({"seed": seed, "mode": mode, **run,
                         "load_before": before, "load_after": after})
            if args.verbose:
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            if "trl_runs" in trl and "trl_error" not in trl:
                trl = await _trl_beside(trl, seeded, model_dir, args, initial, mode, seed)
    out = {
        "runs": runs,
        **_summary(runs, args.target),
        "initial": initial,
        "eval_samples": args.eval_samples,
        "target": args.target,
        "versions": versions(),
        "steps": recipe.steps,
        "seeds": list(args.seeds),
        "modes": list(args.modes),
        "load_procs": args.load_procs,
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "overrides": list(args.overrides),
    }
    if trl.get("trl_runs"):
        from bench import trl_peer

        trl["trl"] = _summary(trl["trl_runs"], args.target)
        trl["trl_versions"] = trl_peer.versions()
        trl["trl_threads"] = args.trl_threads
    elif "trl_runs" in trl:
        del trl["trl_runs"]  # the first run failed: trl_error says why
    return {**out, **trl}


async def _trl_beside(trl: dict[str, Any], recipe: Recipe, model_dir: Path,
                      args: argparse.Namespace, initial: dict[str, Any], mode: str,
                      seed: int) -> dict[str, Any]:
    """``trl`` with TRL's run of ``recipe`` in ``mode`` added, or ``trl_error`` when it fails
    (no further TRL run is tried then)."""
    from bench.trl_peer import describe_error

    with cpu_load(args.load_procs if mode == "loaded" else 0):
        before = load_average()
        try:
            run = await trl_run(recipe, model_dir, args.eval_samples, initial,
                                args.trl_threads)
        except Exception as e:  # a peer's API drift must not hide our own figures
            return {**trl, "trl_error": describe_error(e)}
        after = load_average()
    run = {"seed": seed, "mode": mode, **run, "load_before": before, "load_after": after}
    if args.verbose:
        print(json.dumps({"trl": run}), file=sys.stderr, flush=True)
    return {**trl, "trl_runs": [*trl["trl_runs"], run]}


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",")]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are {','.join(MODES)}; got {text!r}")
    return modes


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"seed 0, quiet and loaded, {QUICK_STEPS} steps (< 2 min)")
    p.add_argument("--seeds", type=seed_list, metavar="S[,S...]",
                   help="recipe seeds, each run once per mode (default 0,1,2,3,4; 0 with --quick)")
    p.add_argument("--modes", type=_modes, default=list(MODES), metavar="M[,M]",
                   help="quiet, loaded or both (default both)")
    p.add_argument("--load-procs", type=int, default=2, metavar="N",
                   help="CPU-bound processes beside a loaded run (default 2)")
    p.add_argument("--steps", type=int, help="steps per run (default: the recipe's)")
    p.add_argument("--target", type=float, default=DEFAULT_TARGET,
                   help=f"final reward that counts as learned (default {DEFAULT_TARGET})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the recipe, as the launcher's --set")
    p.add_argument("--verbose", action="store_true", help="each run's figures on stderr as it ends")
    p.add_argument("--log-dir", type=Path, metavar="DIR",
                   help="write each run's step log to DIR/MODE-SEED.jsonl")
    p.add_argument("--eval-samples", type=int, default=DEFAULT_SAMPLES, metavar="N",
                   help=f"sampled answers per prompt in the evaluation (default {DEFAULT_SAMPLES})")
    p.add_argument("--vs-trl", action="store_true",
                   help="after each run, TRL's GRPOTrainer on the same job (when importable)")
    p.add_argument("--trl-threads", type=int, default=1, metavar="N",
                   help="torch threads of TRL's runs (default 1: bench/trl_peer.py says why)")
    args = p.parse_args(argv)
    if args.load_procs < 0:
        p.error("--load-procs must be >= 0")
    if args.eval_samples < 1:
        p.error("--eval-samples must be >= 1")
    if args.trl_threads < 1:
        p.error("--trl-threads must be >= 1")
    if args.steps is not None and args.steps < WINDOW:
        p.error(f"--steps must be >= {WINDOW} (the reward windows)")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2, 3, 4]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    configure(level="warning")
    run_and_print(main_async(args))


if __name__ == "__main__":
    main()
