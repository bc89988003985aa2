"""Tools and episode limits: tools run in real sandbox processes; every way a tool can fail is
an error observation the episode goes on from, counted per task; episodes past their turn or
token limit are ended and counted; no sandbox outlives its pool."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic import ValidationError

from flowrl.control.reports import TaskReport
from flowrl.control.step_metrics import StageMetrics
from flowrl.data import Example, arithmetic
from flowrl.episode import EpisodeLimitReached, Policy, ToolResult
from flowrl.index import Task
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.recipe.inputs import InputError, check_inputs
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines import HFRolloutEngine, SamplingParams
from workers.engines.hf_continuous import ContinuousBatcher
from workers.roles.episode_rollout import EpisodeRolloutRole
from workers.roles.factory import load_tokenizer
from workers.tool_pool import ToolPool, ToolPoolError

set_threads(1)

TOOLS_FILE = '''
import asyncio, atexit, os, pathlib, signal, time

HERE = pathlib.Path(__file__)

def _ended(*_):
    # A sandbox that exits or is terminated (its pipe closed, its parent dead) was not killed
    # by its pool, which only ever SIGKILLs.
    HERE.with_suffix(".ended").touch()
    os._exit(0)

atexit.register(_ended)
signal.signal(signal.SIGTERM, _ended)

def add(a, b):
    return a + b

async def add_later(a, b):
    await asyncio.sleep(0)
    return {"sum": a + b}

def raises(**_):
    raise ZeroDivisionError("no")

def hangs(**_):
    HERE.with_suffix(".hanging").touch()
    time.sleep(600)

def hog(**_):
    return len(bytearray(1 << 30))

def garbage(**_):
    return object()

def chatty(**_):
    print("not a frame" * 1000)
    return "quiet"

def crashes(**_):
    os._exit(3)

def exits(**_):
    raise SystemExit(0)
'''
TIMEOUT_S = 4.0  # generous: a call that answers must never time out on busy cores


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.py"
    path.write_text(TOOLS_FILE)
    return path


def _refs(path: Path, *names: str) -> dict[str, str]:
    return {n: f"{path}:{n}" for n in names}


ALL = ("add", "add_later", "raises", "hangs", "hog", "garbage", "chatty", "crashes", "exits")


def _pool(path: Path, workers: int = 1) -> ToolPool:
    return ToolPool(_refs(path, *ALL), workers=workers, timeout_s=TIMEOUT_S, memory_mb=256)


def _sandboxes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE and "workers.tool_sandbox" in p.cmdline()]


async def test_every_failing_tool_is_an_error_observation_and_the_pool_serves_on(
    tools_file: Path,
) -> None:
    pool = _pool(tools_file)
    try:
        assert not _sandboxes()  # started lazily
        assert await pool.call("add", {"a": 2, "b": 3}) == ToolResult(ok=True, text="5")
        assert await pool.call("add_later", {"a": 2, "b": 3}) == ToolResult(
            ok=True, text='{"sum": 5}')
        assert await pool.call("chatty", {}) == ToolResult(ok=True, text="quiet")
        assert pool.started == 1  # one process served every good call
        expected = {"raises": ("raised", "ZeroDivisionError: no"),
                    "exits": ("raised", "SystemExit"),
                    "hangs": ("timeout", "ran past rollout.tool_timeout_s"),
                    "hog": ("memory", "out of memory"),
                    "garbage": ("garbage", "returned a object, not a JSON value"),
                    "crashes": ("crashed", "exited (code 3)"),
                    "nope": ("unknown", "no tool named 'nope'")}
        for name, (kind, says) in expected.items():
            started = pool.started
            result = await pool.call(name, {"x": 1})
            assert not result.ok
            assert result.kind == kind, result
            assert result.error is not None
            assert says in result.error
            assert result.text == f"error: {result.error}"
            # The next call is served, by a fresh process where the last one was killed.
            assert await pool.call("add", {"a": 1, "b": 1}) == ToolResult(ok=True, text="2")
            replaced = kind in ("timeout", "memory", "crashed")
            assert pool.started == started + (1 if replaced else 0), name
            assert len(_sandboxes()) == 1
        with pytest.raises(TypeError, match="arguments must be"):
            await pool.call("add", {"a": object(), "b": 1})
    finally:
        await pool.aclose()
    assert not _sandboxes()
    with pytest.raises(ToolPoolError, match="closed"):
        await pool.call("add", {"a": 1, "b": 1})


async def test_a_tool_that_cannot_load_stops_the_pool_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import no_such_module\ndef f():\n    return 1\n")
    pool = ToolPool({"f": f"{tmp_path / 'broken.py'}:f"}, workers=1, timeout_s=TIMEOUT_S)
    with pytest.raises(ToolPoolError, match="No module named 'no_such_module'"):
        await pool.call("f", {})
    await pool.aclose()
    assert not _sandboxes()


SCRIPT = """
import asyncio, os, pathlib, sys
from workers.tool_pool import ToolPool

async def main():
    tools = pathlib.Path(sys.argv[1])
    pool = ToolPool({"hangs": f"{tools}:hangs"}, workers=1, timeout_s=600)
    call = asyncio.create_task(pool.call("hangs", {}))
    while not tools.with_suffix(".hanging").exists():  # the sandbox is inside the call
        await asyncio.sleep(0.01)
    print(next(iter(pool._busy)).proc.pid, flush=True)
    os._exit(0)  # a worker killed in the middle of a call, its pool never closed

asyncio.run(main())
"""


async def test_a_sandbox_in_a_hung_call_dies_with_its_worker_process(tools_file: Path) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SCRIPT, str(tools_file),
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    # Its tool sleeps for 600 s: only the parent-death signal ends it now, which may already
    # have happened by the time the pid is read back.
    with contextlib.suppress(psutil.NoSuchProcess):
        await asyncio.to_thread(psutil.Process(int(out)).wait, 60)
    assert tools_file.with_suffix(".ended").exists()


# -- episodes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tools") / "tiny", hidden=32, layers=1,
                            heads=2, kv_heads=1, vocab_size=300, max_positions=512)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


def _role(model_dir: Path, tokenizer: Any, fn: Any, *, tools: ToolPool | None = None,
          max_turns: int | None = None, max_tokens: int | None = None) -> EpisodeRolloutRole:
    engine = HFRolloutEngine(model_dir, device="cpu", seed=0, version=0)
    return EpisodeRolloutRole(ContinuousBatcher(engine), tokenizer, arithmetic(16),
                              SamplingParams(temperature=1.0, max_new_tokens=4), fn,
                              sample_seed=3, tools=tools, max_turns=max_turns,
                              max_tokens=max_tokens)


def _task(rows: int) -> tuple[Any, dict[str, Any]]:
    return {"task_id": 1, "row_groups": [0] * rows, "params": {}}, {"prompt": [5] * rows}


SEEN: list[list[ToolResult]] = []


async def tool_user(policy: Policy, example: Example) -> float:
    """Calls each failing tool between turns and shows the policy what came back."""
    policy.add(example.prompt)
    await policy.generate(max_new_tokens=2)
    results = []
    for name in ("add_later", "raises", "hangs", "hog", "garbage"):
        result = await policy.call_tool(name, a=1, b=2)
        results.append(result)
        policy.add(result.text)
        await policy.generate(max_new_tokens=2)
    SEEN.append(results)
    return 1.0


async def test_an_episode_sees_tool_errors_goes_on_and_its_task_counts_them(
    model_dir: Path, tokenizer: Any, tools_file: Path
) -> None:
    SEEN.clear()
    pool = _pool(tools_file, workers=2)
    role = _role(model_dir, tokenizer, tool_user, tools=pool)
    try:
        out = await role.run(*_task(2))
    finally:
        await role.aclose()
    assert not _sandboxes()
    assert out.fields["reward"] == [1.0, 1.0]
    assert out.metrics["turns"] == 12.0  # every episode went on past every failure
    assert out.metrics["tool_calls"] == 10.0
    for kind in ("raised", "timeout", "memory", "garbage"):
        assert out.metrics[f"tool_errors_{kind}"] == 2.0, kind
    assert out.metrics["tool_errors_crashed"] == out.metrics["tool_errors_unknown"] == 0.0
    assert [r.ok for r in SEEN[0]] == [True, False, False, False, False]
    for row in range(2):
        # What the tools said was inserted (in the context, out of the loss).
        ids = out.fields["response_ids"][row].tolist()
        mask = out.fields["loss_mask"][row].tolist()
        inserted = [t for t, trained in zip(ids, mask, strict=True) if not trained]
        expected = [t for r in SEEN[row] for t in tokenizer(r.text,
                                                            add_special_tokens=False).input_ids]
        assert inserted == expected


async def test_an_episode_without_tools_cannot_call_one(tokenizer: Any) -> None:
    async def generate(*_: Any, **__: Any) -> Any:
        raise AssertionError("not reached")

    policy = Policy(generate, tokenizer, stream_seed=0)
    with pytest.raises(Exception, match=r"this run has no tools: .*rollout\.tools"):
        await policy.call_tool("add", a=1, b=2)


async def forever(policy: Policy, example: Example) -> None:
    """Never ends by itself: only a limit stops it."""
    policy.add(example.prompt)
    while True:
        await policy.generate(max_new_tokens=3)
        policy.add(" and")


async def scores_its_cut(policy: Policy, example: Example) -> float:
    policy.add(example.prompt)
    try:
        while True:
            await policy.generate(max_new_tokens=3)
    except EpisodeLimitReached as e:
        return 0.5 if e.limit == "turns" else 0.25


async def test_episodes_past_their_turn_or_token_limit_are_ended_and_counted(
    model_dir: Path, tokenizer: Any
) -> None:
    out = await _role(model_dir, tokenizer, forever, max_turns=3).run(*_task(2))
    assert out.fields["reward"] == [0.0, 0.0]  # cut without a reward of its own: 0
    assert out.metrics["turns"] == 6.0
    assert out.metrics["episodes_cut_turns"] == 2.0
    assert out.metrics["episodes_cut_tokens"] == 0.0

    out = await _role(model_dir, tokenizer, scores_its_cut, max_turns=2).run(*_task(2))
    assert out.fields["reward"] == [0.5, 0.5]  # it caught the limit and scored itself
    assert out.metrics["episodes_cut_turns"] == 2.0

    out = await _role(model_dir, tokenizer, forever, max_tokens=10).run(*_task(2))
    assert out.fields["reward"] == [0.0, 0.0]
    assert out.metrics["episodes_cut_tokens"] == 2.0
    assert out.metrics["episodes_cut_turns"] == 0.0
    for ids in out.fields["response_ids"]:
        assert len(ids) <= 10


# -- the recipe and the step log -------------------------------------------------------------


def test_the_recipe_names_tools_and_limits(tmp_path: Path, tools_file: Path) -> None:
    episode = tmp_path / "episode.py"
    episode.write_text("async def run(policy, example):\n    return 1.0\n")
    rollout = RolloutConfig(episode=f"{episode}:run", tools=_refs(tools_file, "add"),
                            tool_workers=3, tool_timeout_s=1.5, tool_memory_mb=200,
                            max_turns=4, max_episode_tokens=99)
    spec = Recipe(steps=1, rollout=rollout).engine_spec().rollout
    assert spec.tools == {"add": f"{tools_file}:add"}
    assert (spec.tool_workers, spec.tool_timeout_s, spec.tool_memory_mb) == (3, 1.5, 200)
    assert (spec.max_turns, spec.max_episode_tokens) == (4, 99)
    with pytest.raises(ValidationError, match=r"rollout\.tools: only episodes call tools"):
        Recipe(steps=1, rollout=RolloutConfig(tools=_refs(tools_file, "add")))
    with pytest.raises(ValidationError, match=r"rollout\.max_turns: only episodes"):
        Recipe(steps=1, rollout=RolloutConfig(max_turns=2))
    with pytest.raises(ValidationError, match="tool 'add': 'nope' is not 'module:function'"):
        RolloutConfig(episode=f"{episode}:run", tools={"add": "nope"})
    with pytest.raises(ValidationError, match=r"rollout\.tools\.x: no such file"):
        Recipe(steps=1, rollout=RolloutConfig(episode=f"{episode}:run",
                                              tools={"x": f"{tmp_path / 'none.py'}:f"}))
    with pytest.raises(InputError, match=r"rollout\.tools\.add: tool 'add' .* has no 'missing'"):
        check_inputs(Recipe(steps=1, rollout=RolloutConfig(
            episode=f"{episode}:run", tools={"add": f"{tools_file}:missing"})))


def _report(metrics: dict[str, float]) -> TaskReport:
    return TaskReport("w", 1, {}, [], 0, metrics, {})


def test_the_step_log_sums_the_rollout_tasks_tool_and_cut_counts() -> None:
    stages = StageMetrics()
    task = Task(id=1, stage="rollout", rows=(0,), groups=(0,), row_groups=(0,), worker="w",
                handles={},
                lengths=(1,), versions=(0,), tokens=1)
    stages.fold(task, _report({"tool_calls": 3.0, "tool_errors_timeout": 1.0,
                               "episodes_cut_turns": 1.0, "turns": 9.0}))
    stages.fold(task, _report({"tool_calls": 2.0, "tool_errors_timeout": 0.0,
                               "episodes_cut_turns": 2.0, "tool_errors_memory": math.nan}))
    out, _ = stages.take([], lambda _: True)
    assert out == {"rollout_tool_calls": 5.0, "rollout_tool_errors_timeout": 1.0,
                   "rollout_episodes_cut_turns": 3.0, "rollout_turns": 9.0}
    assert stages.take([], lambda _: True)[0] == {}  # since the last step only


# -- a run ---------------------------------------------------------------------------------

RUN_EPISODE = '''
async def calc(policy, example):
    policy.add(example.prompt)
    await policy.generate(max_new_tokens=3)
    result = await policy.call_tool("add", a=1, b=2)
    policy.add(result.text)
    await policy.generate(max_new_tokens=3)
    broken = await policy.call_tool("raises")
    policy.add(broken.text)
    while True:
        await policy.generate(max_new_tokens=2)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_run_calls_tools_and_logs_their_counts(tmp_path: Path, tools_file: Path) -> None:
    from flowrl.controller import Controller

    (tmp_path / "episode.py").write_text(RUN_EPISODE)
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=64)
    steps = 2
    r = Recipe(
        steps=steps, model=ModelConfig(path=str(model)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=2),
        rollout=RolloutConfig(episode=f"{tmp_path / 'episode.py'}:calc", max_new_tokens=8,
                              tools=_refs(tools_file, "add", "raises"), max_turns=4),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=2),
    )
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=90)
    assert out["version"] == steps
    # The stopping worker killed its sandboxes (none was left to exit by itself).
    assert not tools_file.with_suffix(".ended").exists()
    calls = sum(e.get("rollout_tool_calls", 0.0) for e in ctl.step_log)
    raised = sum(e.get("rollout_tool_errors_raised", 0.0) for e in ctl.step_log)
    cut = sum(e.get("rollout_episodes_cut_turns", 0.0) for e in ctl.step_log)
    assert calls >= 2 * 2 * steps  # every episode of every step called both tools
    assert raised == calls / 2
    assert cut == calls / 2
    for entry in ctl.step_log:
        assert math.isfinite(entry["train_loss"])
