"""A child process's traceback reaches the controller's log as one ``error`` record, and its
exception is what the child is said to have died of (`Child.last_error`).

Real child processes (``python -c``) under the real `flowrl.procs.Supervisor`; the records are
the ones its relay emits (captured with structlog's test helper)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
from structlog.testing import capture_logs

from flowrl.logs import traceback_exception
from flowrl.procs import Child, Supervisor

CHAINED = '''
import json, sys
print(json.dumps({"event": "loading the model", "level": "info"}), file=sys.stderr)
def load():
    raise KeyError("config.json")
try:
    load()
except KeyError as e:
    raise ValueError("model directory /models/x is empty") from e
'''

# What a worker's TaskGroup prints (an exception group, a message on two lines).
GROUP = '''
import asyncio
async def role():
    raise RuntimeError("dataset /data/x.jsonl has no usable row\\nfirst rows: keys ['q']")
async def main():
    async with asyncio.TaskGroup() as tg:
        tg.create_task(role())
asyncio.run(main())
'''

# A traceback printed by code that goes on (and logs a record after it).
HANDLED = '''
import json, sys, traceback
try:
    1 / 0
except ZeroDivisionError:
    traceback.print_exc()
print(json.dumps({"event": "carrying on", "level": "info"}), file=sys.stderr)
'''


async def _run(code: str) -> tuple[list[dict[str, Any]], Child, int]:
    exited: asyncio.Future[tuple[Child, int]] = asyncio.get_running_loop().create_future()
    sup = Supervisor(lambda child, code: exited.set_result((child, code)))
    with capture_logs() as records:
        await sup.spawn("worker.0", [sys.executable, "-c", code])
        child, rc = await asyncio.wait_for(exited, 30)
    return [r for r in records if r.get("process") == "worker.0"], child, rc


async def test_a_traceback_is_one_error_record_and_the_reason_a_child_died() -> None:
    records, child, rc = await _run(CHAINED)
    assert rc == 1
    assert [(r["log_level"], r["event"]) for r in records] == [
        ("info", "loading the model"),
        ("error", "ValueError: model directory /models/x is empty")]
    text = records[1]["traceback"]
    assert text.startswith("Traceback (most recent call last):")
    assert "KeyError: 'config.json'" in text
    assert "The above exception was the direct cause" in text
    assert text.endswith("ValueError: model directory /models/x is empty")
    assert child.last_error == "ValueError: model directory /models/x is empty"


async def test_an_exception_group_is_one_record_naming_the_inner_exception() -> None:
    records, child, _ = await _run(GROUP)
    (record,) = records
    assert record["log_level"] == "error"
    assert record["event"] == "RuntimeError: dataset /data/x.jsonl has no usable row"
    assert "ExceptionGroup: unhandled errors in a TaskGroup" in record["traceback"]
    assert "first rows: keys ['q']" in record["traceback"]  # the message's second line too
    assert child.last_error == record["event"]


async def test_a_record_after_a_printed_traceback_ends_it() -> None:
    records, child, rc = await _run(HANDLED)
    assert rc == 0
    assert [(r["log_level"], r["event"]) for r in records] == [
        ("error", "ZeroDivisionError: division by zero"), ("info", "carrying on")]
    assert child.last_error == "ZeroDivisionError: division by zero"


async def test_a_traceback_is_emitted_when_the_child_pauses_not_when_it_exits() -> None:
    # The child prints a traceback, then goes quiet until killed: the record comes meanwhile.
    code = ("import time, traceback\n"
            "try:\n    raise OSError('disk gone')\nexcept OSError:\n    traceback.print_exc()\n"
            "time.sleep(120)\n")
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()
    sup = Supervisor(lambda child, rc: exited.set_result(rc))
    emitted = asyncio.Event()

    def spy(_logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("process") == "worker.1" and method == "error":
            emitted.set()
        return event

    with capture_logs(processors=[spy]):
        child = await sup.spawn("worker.1", [sys.executable, "-c", code])
        try:
            await asyncio.wait_for(emitted.wait(), 30)
            assert not exited.done()
        finally:
            sup.kill(child.pid)
            await asyncio.wait_for(exited, 30)


@pytest.mark.parametrize(("lines", "exception"), [
    (["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
      "    f()", "ValueError: bad", "second line of the message"], "ValueError: bad"),
    (["Traceback (most recent call last):", "SyntaxError: invalid syntax"],
     "SyntaxError: invalid syntax"),
    (["  + Exception Group Traceback (most recent call last):",
      '  |   File "x.py", line 3, in main', "  | ExceptionGroup: errors (1 sub-exception)",
      "  +-+---------------- 1 ----------------", "    | Traceback (most recent call last):",
      '    |   File "x.py", line 2, in f', "    | KeyError: 'a'",
      "    +------------------------------------"], "KeyError: 'a'"),
])
def test_the_exception_a_traceback_ends_with(lines: list[str], exception: str) -> None:
    assert traceback_exception(lines) == exception


def test_a_record_line_is_never_mistaken_for_a_traceback() -> None:
    line = json.dumps({"event": "Traceback (most recent call last):", "level": "warning"})
    assert traceback_exception([line]) == line
