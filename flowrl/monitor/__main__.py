"""``python -m flowrl.monitor URL [--once] [--interval S]`` — a live terminal view of a run.

Reads the monitor's ``/status`` once per interval (default 1 s) and redraws a compact view:
trainer version and throughput, the last step's training figures, stages with queue depths,
workers with their state, the staleness histogram, store usage and recent errors. ``--once``
prints one snapshot and exits. Ctrl-C exits cleanly (status 0), and so does the view when the
run ends: once it has read the run, a monitor that refuses connections has closed with its run,
and the view says at which step (other read errors are shown and retried). A monitor bound off
loopback needs its token: pass it in the ``FLOWRL_MONITOR_TOKEN`` environment variable (a
command-line argument would show in ``ps``). Exit status: 0, or 1 when the monitor cannot be
read (``--once``) or refuses the token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from flowrl.staleness import describe_staleness

TOKEN_ENV = "FLOWRL_MONITOR_TOKEN"
_STATE_STYLE = {"busy": "green", "queued": "yellow", "idle": "dim"}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowrl.monitor",
                                description="Live terminal view of a flowrl controller.")
    p.add_argument("url", help="the monitor's URL, as the launcher prints it")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    return p.parse_args(argv)


def status_url(url: str) -> str:
    base = url.split("#", 1)[0].rstrip("/")
    return base if base.endswith("/status") else base + "/status"


class ErrorAnswer(OSError):
    """The monitor answered with an HTTP error; ``str`` says which and the monitor's reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status


def fetch(url: str, *, token: str | None, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(status_url(url), headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            data: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # the monitor's own words ("invalid token"), if any
        with exc:
            reason = exc.read(200).decode(errors="replace").strip()
        raise ErrorAnswer(exc.code, reason or str(exc.reason)) from None
    return data


def closed(exc: BaseException) -> bool:
    """Whether a read failed because nothing listens at the monitor's address any more."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, ConnectionRefusedError)


def ended_line(st: dict[str, Any]) -> str:
    """What the view prints when the run it watched is gone; ``st``: its last status."""
    trainer = st.get("trainer") or {}
    version, target = int(st.get("version") or 0), int(trainer.get("steps_target") or 0)
    run = f"run {st.get('run_id', '?')}"
    if target and version >= target:
        return f"{run} finished: step {version} of {target}; its monitor closed"
    # The last read may predate the last steps (the monitor closes as the run returns).
    of = f" of {target}" if target else ""
    return (f"{run} ended (last seen at step {version}{of}); its monitor closed; the "
            "launcher's output says how it ended")


def _bytes(n: Any) -> str:
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def render(st: dict[str, Any]) -> RenderableType:
    reward = st.get("reward_mean")
    lag = st.get("loop_lag") or {}
    store = st.get("store") or {}
    head = Text.assemble(
        ("flowrl ", "bold"), (f"run {st.get('run_id', '?')}  ", ""),
        (f"version {st.get('version', 0)}  ", "bold cyan"),
        ("PAUSED  " if st.get("paused") else "running  ", "bold red" if st.get("paused")
         else "green"),
        f"max_staleness {st.get('max_staleness', 0)}  ",
        f"samples/s {float(st.get('throughput', {}).get('last_step_samples_per_s') or 0):.1f}  ",
        f"reward {'-' if reward is None else f'{reward:.3f}'}  ",
        f"loop lag {float(lag.get('last_ms') or 0):.1f} ms",
    )
    if store:
        head.append(f"  store {_bytes(store.get('used_bytes'))} / "
                    f"{_bytes(store.get('capacity_bytes'))}")

    stages = Table(title="stages", title_justify="left", expand=False)
    for col in ("stage", "role", "queue", "tasks", "formed", "ready", "waiting", "in flight",
                "done", "stale"):
        stages.add_column(col, justify="left" if col in ("stage", "role") else "right")
    for name, s in (st.get("stages") or {}).items():
        stages.add_row(name, str(s.get("role", "")), *(str(s.get(k, 0)) for k in (
            "queue_depth", "in_flight", "formed", "ready", "waiting", "in_flight_rows", "done",
            "stale")))

    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "role", "node", "state", "version", "in flight", "done", "failed",
                "running"):
        workers.add_column(col, justify="right" if col in (
            "version", "in flight", "done", "failed") else "left")
    for w in st.get("workers") or []:
        state = str(w.get("state", ""))
        running = ", ".join(f"{t['stage']}#{t['task']}" for t in w.get("tasks", [])
                            if t.get("running_s") is not None)
        workers.add_row(str(w["id"]), str(w["role"]), str(w["node"]),
                        Text(state, style=_STATE_STYLE.get(state, "")), str(w["version"]),
                        str(w["in_flight"]), str(w["done"]), str(w["failed"]), running or "-")

    hist = st.get("staleness_histogram") or {}
    total = sum(hist.values()) or 1
    staleness = Text("staleness  ")
    for k, v in hist.items():
        staleness.append(f"{k}: {v} ({100 * v / total:.0f}%)  ")
    if not hist:
        staleness.append("no sample trained yet", style="dim")
    parts: list[RenderableType] = [head]
    if st.get("last_step"):
        parts.append(_last_step(st["last_step"]))
    parts += [stages, workers, staleness]
    for e in list(st.get("errors") or [])[-3:]:
        parts.append(Text(f"error {e.get('worker', '')}: {e.get('error', '')}"[:200],
                          style="red"))
    return Group(*parts)


def _last_step(e: dict[str, Any]) -> Text:
    """The last committed step's training figures (those its line has)."""
    line = Text(f"step {e.get('step', '?')}  ", style="bold")
    for key, label, fmt in (("train_loss", "loss", "+.4f"), ("train_kl", "kl", ".4f"),
                            ("train_mismatch_kl", "mismatch kl", ".4f"),
                            ("train_entropy", "entropy", ".3f"),
                            ("train_grad_norm", "grad norm", ".3f"), ("train_lr", "lr", ".2e"),
                            ("train_clip_frac", "clipped", ".3f"),
                            ("reward_std", "reward std", ".3f"),
                            ("response_length_mean", "length", ".1f")):
        value = e.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            line.append(f"{label} {value:{fmt}}  ")
    if "staleness_mean" in e:
        line.append(describe_staleness(float(e["staleness_mean"]), int(e["staleness_max"]),
                                       e.get("max_staleness")))
    if e.get("reward_failed"):
        line.append(f"  reward failed {int(e['reward_failed'])}", style="red")
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # Ctrl-C ends the view even when started from a script's background job, which starts
    # its children with SIGINT ignored (Python then installs no handler of its own).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    token = os.environ.get(TOKEN_ENV)
    console = Console()
    if args.once:
        try:
            console.print(render(fetch(args.url, token=token, timeout=args.timeout)))
        except (OSError, ValueError) as exc:
            print(f"error: cannot read {status_url(args.url)}: {exc}", file=sys.stderr)
            return 1
        return 0
    last: dict[str, Any] | None = None  # the run's last status read
    try:
        with Live(Text("connecting…"), console=console, auto_refresh=False) as live:
            while True:
                try:
                    last = fetch(args.url, token=token, timeout=args.timeout)
                    view = render(last)
                except (OSError, ValueError) as exc:
                    if last is not None and closed(exc):
                        break
                    if isinstance(exc, ErrorAnswer) and exc.status == 401:  # no retry helps
                        print(f"error: {status_url(args.url)}: {exc} (the token is read from "
                              f"{TOKEN_ENV})", file=sys.stderr)
                        return 1
                    view = Text(f"cannot read {status_url(args.url)}: {exc}", style="red")
                live.update(view, refresh=True)
                # A plain CLI reading a remote endpoint: the interval is the point, not a wait.
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    assert last is not None
    print(ended_line(last), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
