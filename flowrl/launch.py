"""``python -m flowrl.launch RECIPE.py [--set K=V ...] [--steps N] [--output DIR] [--resume DIR]
[--overwrite] [--record-trace FILE]``

Validates the recipe before anything starts (a wrong field fails naming the field and the
file), builds the tiny model if the recipe asks for one, starts the controller with its node
agent and workers, prints one progress line per optimizer step (and per evaluation round), a
JSON summary at the end and, last, where the final model was saved. Results go to the output
directory (`flowrl.run_output`): the recipe's ``output``, ``--output``, the run resumed, or else a
fresh ``runs/<YYYYmmdd-HHMMSS>-<recipe file stem>-<run id>/`` under the current directory.
Heavy imports (torch, transformers) happen only after the arguments and recipe are checked, so
``--help`` and recipe errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.staleness import describe_staleness

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from flowrl.controller import Controller
    from flowrl.interrupts import Interrupts
    from flowrl.progress import Progress
    from flowrl.recipe import Recipe

EXIT_RECIPE = 2
EXIT_RUN = 1
EXIT_INTERRUPTED = 130


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m flowrl.launch",
        description="Run an RL post-training recipe with the flowrl controller.",
    )
    p.add_argument("recipe", help="a recipe file (defines `recipe = Recipe(...)`)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set trainer.lr=1e-4 (repeatable)")
    p.add_argument("--steps", type=int,
                   help="optimizer steps of the run (overrides `steps`)")
    p.add_argument("--output", metavar="DIR",
                   help="directory for the run's results: final model, checkpoints, step log, "
                        "summary (overrides `output`; default: a new runs/<time>-<recipe>-<run "
                        "id>/ here)")
    p.add_argument("--monitor-port", type=int, metavar="PORT",
                   help="HTTP monitor port (overrides `monitor.port`; default: a free port)")
    p.add_argument("--no-monitor", action="store_true", help="run without the HTTP monitor")
    p.add_argument("--resume", metavar="DIR",
                   help="continue a run from the newest complete checkpoint in DIR (its "
                        "output directory); --steps stays the run's total")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an output directory that holds another run's results, "
                        "removing them")
    p.add_argument("--record-trace", metavar="FILE",
                   help="write the run's trace (task times, response lengths, weight syncs) to "
                        "FILE when it ends, for the planner: python -m flowrl.plan FILE")
    return p.parse_args(argv)


def _format_step(entry: dict[str, Any]) -> str:
    reward = entry.get("reward_mean")
    served = ",".join(str(v) for v in entry.get("served_versions", []))
    loss = entry.get("train_loss")
    failed = int(entry.get("reward_failed") or 0)
    staleness = describe_staleness(entry["staleness_mean"], entry["staleness_max"],
                                   entry.get("max_staleness"))
    return (
        f"step {entry['step']:>4}  reward {'   -  ' if reward is None else f'{reward:6.3f}'}"
        f"  samples/s {entry['samples_per_s']:7.1f}"
        f"  {staleness}"
        f"  served v{served}"
        + ("" if loss is None else f"  loss {loss:+.4f}")
        + (f"  reward failed {failed}" if failed else "")
        + (f"\n      {entry['stability']}" if entry.get("stability") else "")
    )


def _format_eval(line: dict[str, Any]) -> str:
    """An evaluation round's progress line."""
    if "eval/failed" in line:
        return f"eval {line['step']:>4}  not evaluated: {line['eval/failed']}"
    sampled = line.get("eval/sampled_accuracy")
    return (
        f"eval {line['step']:>4}  greedy accuracy {line['eval/greedy_accuracy']:.3f} "
        f"(reward {line['eval/greedy_reward']:.3f})"
        + ("" if sampled is None else
           f"  sampled accuracy {sampled:.3f} (reward {line['eval/sampled_reward']:.3f}, "
           f"{line['eval/samples']} per prompt)")
        + f"  on {line['eval/prompts']} held-out prompts"
    )


def _announce_monitor(ctl: Controller) -> None:
    """Print where the monitor listens; a generated token is shown (nobody else knows it),
    a token from the recipe never is."""
    mon = ctl.monitor
    if mon is None:
        return
    token = mon.token.get_secret_value() if mon.token_generated else "(monitor.token of the recipe)"
    print(f"monitor {mon.url}  control token {token}\n"
          f"        watch: python -m flowrl.monitor {mon.url}", flush=True)


def _outcome(summary: dict[str, Any], recipe: Recipe) -> tuple[str, int]:
    """The launcher's last line (where the final model is) and its exit code."""
    final, out = summary.get("final_model"), summary.get("output")
    if final is not None:
        return f"model saved to {final}", 0
    if recipe.rollout.engine == "sim":
        return f"results saved to {out} (a simulated run trains no model)", 0
    if summary["version"] < recipe.steps:
        return (f"no final model: the run stopped at step {summary['version']} of "
                f"{recipe.steps}; results saved to {out}"), 0
    return f"error: the final model was not saved to {out} (the log says why)", EXIT_RUN


async def _stoppable(run: Coroutine[Any, Any, dict[str, Any]], progress: Progress,
                     interrupts: Interrupts, recipe: Recipe) -> dict[str, Any]:
    """``run``, stopped in order on Ctrl-C (its task cancelled: the controller stops its
    workers, then the node agent and its shared memory go); a second Ctrl-C stops at once
    (`Interrupts.force`) and exits with the last line."""
    import asyncio
    import os
    import signal

    me = asyncio.current_task()
    assert me is not None
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        if interrupts.stopping:
            interrupts.force()
            print(_interrupted(progress, recipe, interrupts), file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        interrupts.stopping = True
        progress.line("stop", "stopping while " + (progress.doing or "starting")
                      + "; press Ctrl-C again to stop at once")
        me.cancel()

    loop.add_signal_handler(signal.SIGINT, interrupted)
    try:
        return await run
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _interrupted(progress: Progress, recipe: Recipe, interrupts: Interrupts) -> str:
    """The last line of a run stopped by a signal: what it did, what it saved and where."""
    from flowrl.resume import STATE_FILE, checkpoint_dirs

    how = ("stopped at once" if interrupts.forced else "interrupted" if interrupts.stopping
           else "terminated")
    out = recipe.output
    if progress.doing != "training":
        return (f"{how} while {progress.doing or 'starting'}: nothing was trained or saved"
                + ("" if out is None or not out.is_dir() else f"; results in {out}"))
    said = f"{how} at step {progress.step} of {progress.steps}"
    if out is None:
        return f"{said}: nothing saved"
    complete = [p for _, p in checkpoint_dirs(out) if (p / STATE_FILE).is_file()]
    final = [s.path for s in progress.saves if s.what == "final model"]
    if final:
        return f"{said}: final model saved to {final[-1]}; results in {out}"
    if complete:
        return (f"{said}: newest checkpoint {complete[0]} (continue with --resume {out}); "
                f"results in {out}")
    return f"{said}: no checkpoint saved (checkpoint_every is {recipe.checkpoint_every}); " \
           f"results in {out}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the run started (loading the recipe, imports)
        print("interrupted before the run started: nothing was done", file=sys.stderr,
              flush=True)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from flowrl.recipe_file import RecipeError, apply_overrides, load_recipe
    from flowrl.run_output import OutputInUse, ResumeMismatch, default_output, run_dir_of
    from transport.endpoints import new_run_id

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    if args.output is not None:
        overrides.append(f"output={args.output}")
    if args.monitor_port is not None:
        overrides.append(f"monitor.port={args.monitor_port}")
    if args.resume is not None and args.output is None:
        # later checkpoints go on beside it, in its run directory
        overrides.append(f"output={run_dir_of(args.resume)}")
    run_id = new_run_id()
    try:
        recipe = load_recipe(args.recipe, overrides, on_note=lambda n: print(n, flush=True))
        if recipe.output is None:
            recipe = apply_overrides(
                recipe, [(("output",), str(default_output(args.recipe, run_id)))],
                file=args.recipe)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RECIPE
    resume = None
    if args.resume is not None:
        from flowrl.resume import latest_checkpoint

        try:
            resume, state = latest_checkpoint(args.resume)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_RECIPE
        print(f"resuming from {resume} (step {state.version}; {len(state.redo())} prompt "
              f"groups in flight are redone)", flush=True)

    import asyncio
    import json

    from flowrl.interrupts import Interrupts
    from flowrl.lifecycle import run_loop
    from flowrl.logs import configure
    from flowrl.progress import Progress

    configure()

    from flowrl.recipe.inputs import InputError
    from flowrl.run import run_recipe

    progress, interrupts = Progress(), Interrupts()
    progress.steps = recipe.steps

    def show_step(entry: dict[str, Any]) -> None:
        print(_format_step(entry), flush=True)

    def show_eval(line: dict[str, Any]) -> None:
        print(_format_eval(line), flush=True)

    try:
        summary = run_loop(_stoppable(run_recipe(
            recipe, on_step=show_step, monitor=not args.no_monitor,
            on_start=_announce_monitor, resume=resume, run_id=run_id,
            overwrite=args.overwrite, progress=progress, interrupts=interrupts,
            on_eval=show_eval,
            record_trace=None if args.record_trace is None else Path(args.record_trace)),
            progress, interrupts, recipe))
    except (OutputInUse, ResumeMismatch) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RECIPE
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C; SIGTERM cancels the run
        print(_interrupted(progress, recipe, interrupts), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except InputError as exc:  # found before any process started, like a recipe error
        print(f"error: {args.recipe}: {exc}", file=sys.stderr)
        return EXIT_RECIPE
    except Exception as exc:  # the run's own error, already logged with its context
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUN
    print(json.dumps(summary, default=str))
    if args.record_trace is not None:
        print(f"trace saved to {args.record_trace} (plan with: python -m flowrl.plan "
              f"{args.record_trace} --set max_staleness=0,1,2)", flush=True)
    line, code = _outcome(summary, recipe)
    print(line, file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

