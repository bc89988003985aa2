"""Structured logs for every flowrl process (structlog).

Pretty console lines on a terminal, JSON lines otherwise; always on stderr, so stdout stays for
results (progress lines, JSON summaries). Each line carries the context bound with `bind`
(run id, role, worker id, policy version). Child processes write JSON lines to a pipe; the
controller re-emits them through its own logger, tagged with the child's name (`relay`); a
Python traceback a child prints (plain lines, not a record) is re-emitted as one ``error`` record
(`ChildLines`).

Light on purpose (structlog only): worker processes import it too.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
from typing import Any

import structlog

LEVEL_ENV = "FLOWRL_LOG_LEVEL"
FORMAT_ENV = "FLOWRL_LOG_FORMAT"  # "json" or "console"; default: console on a TTY


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is written, not when logging was set
    up: a caller that swaps stderr (a notebook cell's capture, a test's) and later closes its
    stream must not leave every later line writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


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
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
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


# A traceback's first line: Python's own, or an exception group's (indented, after "+").
_TRACEBACK_START = re.compile(r"^(?:Traceback|\s*\+ Exception Group Traceback) "
                              r"\(most recent call last\):")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# A line inside an exception group's box: "  | text" (the text as in a plain traceback).
_BOXED = re.compile(r"^\s*\| ?(.*)$")
#: lines of one traceback kept from its start, and from its end (where the exception is)
TRACEBACK_HEAD, TRACEBACK_TAIL = 40, 200


class ChildLines:
    """One child's output, line by line, re-emitted through this process's logger (`relay`).

    A Python traceback is not a log record but plain lines (an uncaught exception, a
    ``traceback.print_exc()``); they are gathered from the traceback's first line until the
    next record, the end of the output, or `flush` (the caller's pause), and re-emitted as one
    ``error`` record: its event the exception (``ValueError: boom``), its ``traceback`` the
    whole text (a very long one keeps its first `TRACEBACK_HEAD` and last `TRACEBACK_TAIL`
    lines).
    """

    def __init__(self, child: str) -> None:
        self.child = child
        self._head: list[str] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=TRACEBACK_TAIL)
        self._cut = 0

    @property
    def pending(self) -> bool:
        """Whether a traceback is being gathered (the caller flushes it after a pause)."""
        return bool(self._head)

    def feed(self, line: str) -> str | None:
        """Take one output line; what the last error record emitted says (its event and error,
        `relay`'s answer), or None when no error record was emitted."""
        text = line.rstrip("\n")
        if self._head:
            if _is_record(text):  # the traceback has ended
                return _later(self.flush(), relay(self.child, text))
            if _TRACEBACK_START.match(text) and not self._after_chaining():
                flushed = self.flush()
                self._head.append(text)
                return flushed
            self._add(text)
            return None
        if _TRACEBACK_START.match(text):
            self._head.append(text)
            return None
        return relay(self.child, text)

    def flush(self) -> str | None:
        """Emit the traceback gathered so far as one error record; its exception, or None when
        none was being gathered."""
        if not self._head:
            return None
        lines = self._head
        if self._cut:
            lines = [*lines, f"... ({self._cut} lines left out)"]
        lines = [*lines, *self._tail]
        self._head, self._cut = [], 0
        self._tail.clear()
        while lines and not lines[-1].strip():
            lines.pop()
        exception = traceback_exception(lines)
        _relay_log.error(exception, process=self.child, traceback="\n".join(lines))
        return exception

    def _add(self, text: str) -> None:
        if len(self._head) < TRACEBACK_HEAD:
            self._head.append(text)
            return
        if len(self._tail) == self._tail.maxlen:
            self._cut += 1
        self._tail.append(text)

    def _after_chaining(self) -> bool:
        """Whether the last line that is not blank says the next traceback is chained."""
        last = next((t for t in reversed([*self._head, *self._tail]) if t.strip()), "")
        return last.startswith(_CHAINED)


def traceback_exception(lines: list[str]) -> str:
    """The exception a traceback ends with (``ValueError: boom``): the last unindented line
    that follows a frame's indented lines (continuation lines of a message that spans several
    are not it); inside an exception group's box, the innermost exception printed last."""
    found = ""
    prev_indented = False
    for raw in lines:
        boxed = _BOXED.match(raw)
        text = boxed.group(1) if boxed else raw
        if not text.strip() or (text.lstrip().startswith(("+", "-")) and not boxed):
            continue  # blank, or a group's box drawing
        indented = text[0].isspace()
        if (not indented and prev_indented and not _TRACEBACK_START.match(text)
                and not text.startswith(_CHAINED)):
            found = text.strip()
        prev_indented = indented or bool(_TRACEBACK_START.match(text))
    return found or (lines[-1].strip() if lines else "")


def _is_record(text: str) -> bool:
    """Whether a line is a log record (a JSON object), not a line of a traceback."""
    if not text.startswith("{"):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _later(first: str | None, second: str | None) -> str | None:
    return second if second is not None else first
