"""`bench/device_check.py`, the device readiness check: its dry run on the CPU takes every
path it takes on a device (gloo ranks for NCCL/HCCL ones, vLLM where it imports), and its
verdict fails when a section fails."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # bench/ is not a package the tests' path holds
    sys.path.insert(0, str(_ROOT))
check = importlib.import_module("bench.device_check")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_dry_run_on_the_cpu_passes_every_section_it_can_run() -> None:
    proc = subprocess.run([sys.executable, str(_ROOT / "bench" / "device_check.py"), "--cpu"],
                          capture_output=True, text=True, timeout=220, cwd=_ROOT)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, (proc.stdout[-2000:], proc.stderr[-2000:])  # one JSON line
    result = json.loads(lines[0])
    sections = result["sections"]
    assert proc.returncode == 0, json.dumps(sections)[-3000:]
    assert result["ok"] is True
    assert result["device"] == "cpu"
    assert list(sections) == ["device", "model", "ranks", "vllm", "colocated"]
    for name in ("device", "model", "ranks"):
        assert sections[name]["status"] == "passed", sections[name]
    ranks = sections["ranks"]
    # Two gloo ranks took an FSDP2 step in bfloat16, agreed, and exported in buckets.
    assert ranks["world"] == 2
    assert ranks["backend"] == "gloo"
    assert ranks["buckets"] >= 4
    # vLLM runs where it imports (`make test-vllm`'s venv: generation and reloads pass) and is
    # skipped, saying so, where it does not.
    vllm = sections["vllm"]
    if vllm["status"] != "passed":
        assert vllm["status"] == "skipped", vllm
        assert vllm["reason"].startswith(("vllm does not import", "vllm is not installed"))
    colocated = sections["colocated"]
    assert colocated["status"] == "passed", colocated
    # train → generate → train; optimizer state (two moments) and gradients moved out and back
    assert colocated["switches"] == 3
    assert colocated["moved_mb"] > 0
    assert colocated["tokens"] > 0
    # vLLM colocated runs on the vllm section's engine; on the CPU it has no sleep mode.
    if vllm["status"] == "passed":
        assert colocated["vllm"]["sleeps"] is False
        assert colocated["vllm"]["freed_mb"] == 0
        assert colocated["vllm"]["changed"] is True
    else:
        assert colocated["vllm"].startswith("skipped: no vLLM engine")


def _ctx(tmp_path: Path, left_s: float = 60.0) -> Any:
    return check.Context(device="cpu", count=0, deadline=time.monotonic() + left_s,
                         tmp=tmp_path)


def test_a_failed_section_is_reported_and_fails_the_check(tmp_path: Path) -> None:
    def broken(ctx: Any) -> dict[str, Any]:
        raise RuntimeError("the collective hung")

    def fine(ctx: Any) -> dict[str, Any]:
        return {"x": 1}

    def absent(ctx: Any) -> dict[str, Any]:
        raise check.Skip("no vllm")

    def unbuilt(ctx: Any) -> dict[str, Any]:
        raise check.NotBuilt("not in this build")

    sections = {"a": check.run_section("a", fine, _ctx(tmp_path)),
                "b": check.run_section("b", absent, _ctx(tmp_path)),
                "c": check.run_section("c", unbuilt, _ctx(tmp_path))}
    assert [s["status"] for s in sections.values()] == ["passed", "skipped", "not built"]
    assert sections["a"]["x"] == 1
    assert check.exit_code(sections) == 0
    sections["d"] = check.run_section("d", broken, _ctx(tmp_path))
    assert sections["d"]["status"] == "failed"
    assert "RuntimeError: the collective hung" in sections["d"]["error"]
    assert check.exit_code(sections) == 1
    # A section that would start past the budget is skipped, not started.
    late = check.run_section("e", broken, _ctx(tmp_path, left_s=1.0))
    assert late["status"] == "skipped"
    assert "out of time" in late["reason"]
