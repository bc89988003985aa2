"""``python -m flowrl.cleanup``: remove what dead flowrl runs left in /dev/shm and /tmp.

By default it removes shared-memory segments whose owner (the node store process named in the
segment's name) is dead, run directories (``/tmp/flowrl-<run_id>``) whose marked owners are all
dead, and empty unmarked run directories older than ``--grace`` seconds (what a run killed
while starting leaves). ``--all`` also removes ``flowrl-*`` segments that name no owner and
unmarked run directories with no live socket or segment inside (older than ``--grace``
seconds, so a run that is just starting is spared). Anything a live process owns is never
touched. Prints one line per removed path.
"""

from __future__ import annotations

import argparse

from transport import shm


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowrl.cleanup", description=__doc__)
    p.add_argument(
        "--all",
        action="store_true",
        help="also remove segments and run directories that name no owner",
    )
    p.add_argument("--run-id", help="only this run's segments and run directory")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="spare unmarked run directories younger than this (default: 30)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    removed = shm.sweep(unowned=args.all, run_id=args.run_id, grace_s=args.grace)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("nothing to remove")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
