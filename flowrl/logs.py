"""Structured logs for every flowrl process (structlog).

Pretty console lines on a terminal, JSON lines otherwise; always on stderr, so stdout stays for
results (progress lines, JSON summaries). Each line carries the context bound with `bind`
(run id, role, worker id, policy version). Child processes write JSON lines to a pipe; the
controller re-emits them through its own logger, tagged with the child's name (`relay`).

Light on purpose (structlog only): worker processes import it too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import structlog

LEVEL_ENV = "FLOWRL_LOG_LEVEL"
FORMAT_ENV = "FLOWRL_LOG_FORMAT"  # "json" or "console"; default: console on a TTY


def configure(*, level: str | None = None, json_lines: bool | None = None) -> None:
    """Set up structlog for this process (idempotent; safe to call again with new settings)."""
    name = (level or os.environ.get(LEVEL_ENV) or "info").upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {name!r} (from ${LEVEL_ENV} or --log-level)")
    if json_lines is None:
        fmt = os.environ.get(FORMAT_ENV)
        json_lines = fmt == "json" if fmt else not sys.stderr.isatty()
    renderer: Any = (structlog.processors.JSONRenderer() if json_lines
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if json_lines else "%H:%M:%S"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def bind(**context: Any) -> None:
    """Add context (run_id, role, worker, version, ...) to every later line of this process."""
    structlog.contextvars.bind_contextvars(**context)


_relay_log = structlog.get_logger("flowrl.child")


def relay(child: str, line: str) -> str | None:
    """Re-emit one output line of a child process through this process's logger; return what
    it says when it is an error line (its event, and its ``error`` field if any), else None."""
    text = line.rstrip("\n")
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        _relay_log.info(text, process=child)
        return None
    event = str(record.pop("event", ""))
    level = str(record.pop("level", "info"))
    record.pop("timestamp", None)
    record.setdefault("process", child)
    method = getattr(_relay_log, level, None)
    if not callable(method):
        method = _relay_log.info
    try:
        method(event, **record)
    except Exception:  # a child's odd line must never take the relay down
        _relay_log.info(text, process=child)
    if level not in ("error", "critical"):
        return None
    error = record.get("error")
    return event if error is None else f"{event}: {error}"
