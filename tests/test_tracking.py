"""Experiment tracking (`flowrl.tracking`) against the real libraries: TensorBoard's event files,
a W&B offline run's record file and an MLflow file store are read back after a run's step
lines, recipe and summary went in; a tracker that fails is logged once and dropped while the
others go on; a missing library is named with its extra before anything starts; the recipe
field names itself when wrong; and one launch tracks with all three.

Each library test skips when its library is absent (the ``dev`` extra installs all three).
Nothing reaches a network: W&B runs offline, MLflow writes a local file store, and each keeps
its files (and W&B its settings and caches) under ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from flowrl.recipe import Recipe, RolloutConfig
from flowrl.recipe.inputs import InputError
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.run import run_recipe
from flowrl.run_output import OutputInUse, claim, recipe_record
from flowrl.tracking import Status, TrackedRun, Tracking, status_of

ROOT = Path(__file__).resolve().parents[1]
SIM_RECIPE = str(ROOT / "recipes" / "sim_grpo.py")

RECIPE = recipe_record(Recipe(steps=2, rollout=RolloutConfig(engine="sim"), output="out",
                              tracking=("tensorboard", "wandb", "mlflow")))
# Step-log lines as the controller makes them: lists, None and flags are not plotted.
STEPS: list[dict[str, Any]] = [
    {"step": 1, "reward_mean": 0.25, "samples": 8, "served_versions": [0], "train_loss": None,
     "train_final_saved": False},
    {"step": 2, "reward_mean": 0.5, "samples": 8, "served_versions": [1], "train_loss": -0.5,
     "train_final_saved": True},
]
SUMMARY: dict[str, Any] = {"steps": 2, "version": 2, "wall_s": 1.5, "staleness": {"0": 16},
                           "output": "out", "final_model": None}


def _track(names: tuple[Any, ...], out: Path, status: Status = "finished",
           steps: list[dict[str, Any]] = STEPS) -> None:
    tracking = Tracking(names, TrackedRun("run00001", out, RECIPE))
    for entry in steps:
        tracking.step(entry)
    tracking.summary(SUMMARY)
    tracking.close(status)


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local MLflow file store (MLflow 3 asks for the opt-in to keep using one)."""
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    return uri


def _wandb_env(tmp_path: Path) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wb"),
            "WANDB_CONFIG_DIR": str(tmp_path / "wb-config"),
            "WANDB_CACHE_DIR": str(tmp_path / "wb-cache"),
            "WANDB_DATA_DIR": str(tmp_path / "wb-data")}


# ---- reading back what each library wrote ---------------------------------------------------


def _tensorboard(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def _tb_text(events: Any, tag: str) -> str:
    (event,) = events.Tensors(f"{tag}/text_summary")
    text: str = event.tensor_proto.string_val[0].decode()
    return text


def _tb_json(events: Any, tag: str) -> Any:
    text = _tb_text(events, tag)
    assert text.startswith("```json\n"), text
    assert text.endswith("\n```"), text
    return json.loads(text[8:-4])


def _wandb_records(file: Path) -> Iterator[Any]:
    """The records of a W&B run file: a 7-byte header, then a LevelDB-style log (32 KiB blocks
    of chunks, each with a checksum, a length and a type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_run(wandb_dir: Path) -> dict[str, Any]:
    """What a W&B offline run holds: its name and project, config, history per step, summary
    and exit code."""
    (file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    found: dict[str, Any] = {"history": {}, "summary": {}, "config": {}, "exit_code": None}
    for record in _wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["name"], found["project"] = record.run.display_name, record.run.project
            found["config"].update({u.key: json.loads(u.value_json)
                                    for u in record.run.config.update if u.key != "_wandb"})
        elif kind == "history":
            found["history"][record.history.step.num] = {
                ".".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item}
        elif kind == "summary":
            found["summary"].update({".".join(u.nested_key) or u.key: json.loads(u.value_json)
                                     for u in record.summary.update})
        elif kind == "exit":
            found["exit_code"] = record.exit.exit_code
    return found


def _mlflow_run() -> tuple[Any, Any]:
    """The one run of the ``flowrl`` experiment, and the client that reads it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("flowrl")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def _mlflow_history(client: Any, run: Any, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def _mlflow_json(client: Any, run: Any, path: str, into: Path) -> Any:
    return json.loads(Path(client.download_artifacts(run.info.run_id, path, str(into)))
                      .read_text())


# ---- each library ---------------------------------------------------------------------------


def test_tensorboard_event_files_hold_the_steps_recipe_and_summary(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _track(("tensorboard",), tmp_path)
    events = _tensorboard(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(2, -0.5)]
    assert set(events.Tags()["scalars"]) == {
        "reward_mean", "samples", "train_loss", "summary/steps", "summary/version",
        "summary/wall_s", "summary/staleness.0"}
    assert [(e.step, e.value) for e in events.Scalars("summary/staleness.0")] == [(2, 16.0)]
    assert _tb_json(events, "recipe") == RECIPE
    assert _tb_json(events, "summary") == SUMMARY
    assert _tb_text(events, "status") == "finished"


def test_a_resumed_run_hides_the_tensorboard_steps_it_trains_again(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _track(("tensorboard",), tmp_path, status="killed")  # steps 1 and 2
    resumed = Tracking(("tensorboard",), TrackedRun("run00002", tmp_path, RECIPE, resumed_at=1))
    resumed.step({"step": 2, "reward_mean": 0.125})
    resumed.step({"step": 3, "reward_mean": 1.0})
    resumed.close("finished")
    events = _tensorboard(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (1, 0.25), (2, 0.125), (3, 1.0)]


def test_the_trackers_files_are_the_runs_results(tmp_path: Path) -> None:
    """A new run does not write over them unasked; ``--overwrite`` removes them."""
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "wandb").mkdir()
    with pytest.raises(OutputInUse, match=r"\(tensorboard, wandb\)"):
        claim(out)
    claim(out, overwrite=True)
    assert list(out.iterdir()) == []


def test_a_wandb_offline_run_holds_the_steps_recipe_and_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    for name, value in _wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    try:
        _track(("wandb",), tmp_path / "out", status="killed")
    finally:
        wandb.teardown()  # this process's W&B service ends with it
    run = _wandb_run(tmp_path / "wb")  # WANDB_DIR, not the output directory
    assert not (tmp_path / "out").exists()
    assert (run["name"], run["project"]) == ("run00001", "flowrl")
    assert run["config"] == RECIPE
    history = {step: {k: v for k, v in row.items() if not k.startswith("_")}
               for step, row in run["history"].items()}
    assert history == {1: {"reward_mean": 0.25, "samples": 8.0},
                       2: {"reward_mean": 0.5, "samples": 8.0, "train_loss": -0.5}}
    assert {k: v for k, v in run["summary"].items() if k.startswith("summary/")} == {
        "summary/steps": 2, "summary/version": 2, "summary/wall_s": 1.5,
        "summary/staleness.0": 16, "summary/output": "out", "summary/final_model": None}
    assert run["exit_code"] == 130  # killed, as the launcher exits


def test_an_mlflow_file_store_holds_the_steps_recipe_and_summary(
        tmp_path: Path, mlflow_store: str) -> None:
    _track(("mlflow",), tmp_path / "out", status=status_of(RuntimeError("the run failed")))
    client, run = _mlflow_run()
    assert run.info.run_name == "run00001"
    assert run.info.status == "FAILED"
    assert run.data.tags["flowrl.output"] == str(tmp_path / "out")
    assert _mlflow_history(client, run, "reward_mean") == [(1, 0.25), (2, 0.5)]
    assert _mlflow_history(client, run, "summary/version") == [(2, 2.0)]
    assert "served_versions" not in run.data.metrics
    params = run.data.params
    assert (params["steps"], params["rollout.engine"], params["trainer.lr"]) == (
        "2", "sim", json.dumps(RECIPE["trainer"]["lr"]))
    assert _mlflow_json(client, run, "recipe.json", tmp_path) == RECIPE
    assert _mlflow_json(client, run, "summary.json", tmp_path) == SUMMARY


def test_evaluation_rounds_go_to_the_trackers_at_the_step_they_evaluated(
        tmp_path: Path, mlflow_store: str) -> None:
    """A round ends after later steps were sent; its numbers keep their own step."""
    pytest.importorskip("tensorboard")
    tracking = Tracking(("tensorboard", "mlflow"), TrackedRun("run00001", tmp_path, RECIPE))
    for entry in STEPS:
        tracking.step(entry)
    tracking.eval({"step": 1, "eval/prompts": 4, "eval/greedy_accuracy": 0.25,
                   "eval/sampled_accuracy": 0.5, "eval/versions": [1, 2]})
    tracking.eval({"step": 2, "eval/prompts": 4, "eval/failed": "eval failed 3 times"})
    tracking.close("finished")
    events = _tensorboard(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("eval/greedy_accuracy")] == [(1, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/prompts")] == [(1, 4.0), (2, 4.0)]
    client, run = _mlflow_run()
    assert _mlflow_history(client, run, "eval/sampled_accuracy") == [(1, 0.5)]
    assert "eval/versions" not in run.data.metrics


def test_an_interrupted_run_ends_killed_and_a_failed_one_failed() -> None:
    import asyncio

    assert status_of(None) == "finished"
    assert status_of(asyncio.CancelledError()) == "killed"
    assert status_of(KeyboardInterrupt()) == "killed"
    assert status_of(RuntimeError()) == "failed"


# ---- failures ---------------------------------------------------------------------------------


def test_a_tracker_that_raises_is_logged_once_and_dropped_while_the_others_go_on(
        tmp_path: Path, mlflow_store: str) -> None:
    pytest.importorskip("tensorboard")
    # MLflow refuses a metric name over 250 characters; TensorBoard takes it.
    steps = [STEPS[0], {**STEPS[1], "x" * 300: 1.0}, {"step": 3, "reward_mean": 0.75}]
    with capture_logs() as logs:
        _track(("mlflow", "tensorboard"), tmp_path, steps=steps)
    said = [(r["log_level"], r["tracker"]) for r in logs if r["event"].startswith("tracking")]
    assert said == [("error", "mlflow")]
    assert "exceeds the maximum length" in logs[0]["error"]
    events = _tensorboard(tmp_path / "tensorboard")
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert _tb_json(events, "summary") == SUMMARY
    client, run = _mlflow_run()
    assert _mlflow_history(client, run, "reward_mean") == [(1, 0.25)]
    assert run.info.status == "FAILED"  # ended when it was dropped


def test_a_tracker_that_cannot_start_is_dropped_and_the_others_go_on(
        tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "424242")  # no such experiment
    with capture_logs() as logs:
        _track(("mlflow", "tensorboard"), tmp_path)
    said = [(r["event"], r["tracker"]) for r in logs if r["event"].startswith("tracking")]
    assert said == [("tracking: mlflow could not start and is dropped; the run goes on "
                     "without it", "mlflow")]
    events = _tensorboard(tmp_path / "tensorboard")
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]


async def test_a_missing_library_is_named_with_its_extra_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    recipe = Recipe(steps=1, rollout=RolloutConfig(engine="sim"), output=tmp_path / "run",
                    tracking="wandb")
    with pytest.raises(InputError) as caught:
        await run_recipe(recipe, monitor=False)
    assert str(caught.value) == ("tracking: 'wandb' needs the wandb package, which is not "
                                 "installed: pip install 'flowrl[wandb]'")
    assert not (tmp_path / "run").exists()


def test_the_tracking_field_names_itself_when_wrong() -> None:
    assert Recipe(steps=1, output="o", tracking="mlflow").tracking == ("mlflow",)
    cases = {
        '["tensorbord"]': r"tracking\.0: .*'tensorboard', 'wandb' or 'mlflow'",
        '["wandb", "wandb"]': r"tracking: .*'wandb' listed more than once",
    }
    for value, said in cases.items():
        with pytest.raises(RecipeError, match=rf"sim_grpo\.py.*{said}"):
            load_recipe(SIM_RECIPE, [f"tracking={value}", "output=o"])
    with pytest.raises(RecipeError, match=r"sim_grpo\.py.*tracking: needs output"):
        load_recipe(SIM_RECIPE, ["tracking=tensorboard"])


# ---- a launch ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_launch_tracks_its_steps_recipe_and_summary_in_all_three(
        tmp_path: Path, mlflow_store: str) -> None:
    for library in ("tensorboard", "wandb"):
        pytest.importorskip(library)
    out = tmp_path / "run"
    env = {**os.environ, **_wandb_env(tmp_path)}  # and the MLflow store's
    env.pop("WANDB_PROJECT", None)
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.launch", SIM_RECIPE, "--steps", "3", "--no-monitor",
         "--output", str(out), "--set", 'tracking=["tensorboard", "wandb", "mlflow"]',
         "--set", "rollout.workers=2", "--set", "rollout.max_new_tokens=32",
         "--set", "algorithm.group_size=4", "--set", "trainer.groups_per_step=2",
         "--set", "trainer.micro_batch_groups=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [(line["step"], line["reward_mean"]) for line in lines]
    assert [step for step, _ in rewards] == [1, 2, 3]
    recipe = json.loads((out / "recipe.json").read_text())
    summary = json.loads((out / "summary.json").read_text())

    events = _tensorboard(out / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (s, pytest.approx(r)) for s, r in rewards]
    assert _tb_json(events, "recipe") == recipe
    assert _tb_json(events, "summary") == summary

    run = _wandb_run(tmp_path / "wb")
    assert run["config"] == recipe
    assert {s: row["reward_mean"] for s, row in run["history"].items()} == dict(rewards)
    assert run["summary"]["summary/version"] == 3
    assert run["exit_code"] == 0

    client, tracked = _mlflow_run()
    assert tracked.info.status == "FINISHED"
    assert _mlflow_history(client, tracked, "reward_mean") == [
        (s, pytest.approx(r)) for s, r in rewards]
    assert _mlflow_json(client, tracked, "summary.json", tmp_path / "dl") == summary
