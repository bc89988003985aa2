"""`bench/learning.py` without training: its arguments, its summary, its CPU load."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import psutil
import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "learning.py"
_SPEC = importlib.util.spec_from_file_location("bench_learning", _PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
learning = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_learning"] = learning
_SPEC.loader.exec_module(learning)

pytestmark = pytest.mark.timeout(60)


def test_defaults_and_quick() -> None:
    args = learning.parse([])
    assert (args.seeds, args.modes, args.load_procs, args.steps) == (
        [0, 1, 2, 3, 4], ["quiet", "loaded"], 2, None)
    quick = learning.parse(["--quick"])
    assert quick.seeds == [0]
    assert quick.modes == ["quiet", "loaded"]
    assert learning.parse(["--quick", "--seeds", "3,4", "--modes", "loaded"]).seeds == [3, 4]


@pytest.mark.parametrize("argv", [["--modes", "busy"], ["--seeds", "a"], ["--seeds", "-1"],
                                  ["--load-procs", "-1"], ["--steps", "5"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        learning.parse(argv)
    assert e.value.code == 2


def test_summary_of_hand_made_runs() -> None:
    runs = [
        {"mode": "quiet", "reward_first": 0.4, "reward_final": 0.9, "train_s": 40.0},
        {"mode": "quiet", "reward_first": 0.5, "reward_final": 0.8, "train_s": 50.0},
        {"mode": "loaded", "reward_first": 0.45, "reward_final": 0.95, "train_s": 90.0},
    ]
    out = learning._summary(runs, target=0.85)
    assert out["reward_final_min"] == 0.8
    assert out["reward_final_mean"] == pytest.approx(0.8833, abs=1e-4)
    assert out["reward_first_mean"] == pytest.approx(0.45)
    assert (out["train_s_mean"], out["train_s_max"]) == (60.0, 90.0)
    assert (out["learned"], out["runs_n"]) == (2, 3)
    assert (out["reward_final_min_quiet"], out["reward_final_min_loaded"]) == (0.8, 0.95)


def test_cpu_load_runs_busy_processes_and_stops_them() -> None:
    with learning.cpu_load(2):
        me = psutil.Process()
        spinners = [p for p in me.children() if learning._SPIN in " ".join(p.cmdline())]
        assert len(spinners) == 2
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                p.cpu_times().user > 0.05 for p in spinners):
            time.sleep(0.05)  # waiting on the spinners' CPU time, there is no event for it
        assert all(p.cpu_times().user > 0.05 for p in spinners)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in spinners)
    with learning.cpu_load(0):
        assert not psutil.Process().children()


def test_versions_name_the_libraries() -> None:
    assert set(learning.versions()) == {"python", "torch", "transformers", "tokenizers"}
