"""Prompts through the chat template (``data.chat_template``, ``data.system_prompt``) and
periodic evaluation (``eval``): the held-out split, the rounds the controller schedules as
rollout and reward work, and what a run records of them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowrl.control.evaluation import EVAL_STAGE, SCORE_STAGE, EvalJob, Evaluation
from flowrl.control.reports import TaskReport
from flowrl.controller import Controller
from flowrl.data import Dataset, Example, arithmetic, hold_out, jsonl
from flowrl.graph import StageSpec
from flowrl.monitor.metrics import ControllerMetrics
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.prompts import NoChatTemplate, prompt_messages
from flowrl.recipe import (
    AlgorithmConfig,
    ArithmeticConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    Recipe,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.recipe.inputs import InputError, check_inputs
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.run import run_recipe
from flowrl.run_output import recipe_record, resume_changes
from flowrl.tiny_model import build_tiny_model
from transport.codec import HANDLE_EXT
from transport.handles import Handle, handle_to_wire
from workers.roles.factory import data_splits, make_hf_role
from workers.roles.rollout import RolloutRole

# ---- the held-out split ---------------------------------------------------------------------


def test_arithmetic_held_out_prompts_are_never_in_the_training_data() -> None:
    data = arithmetic(4096, max_operand=5, seed=0)  # 36 distinct prompts, each many times
    train, held = hold_out(data, 8, seed=3)
    assert len(held) == 8
    assert len({e.prompt for e in held.examples}) == 8
    assert not {e.prompt for e in held.examples} & {e.prompt for e in train.examples}
    assert len({e.prompt for e in train.examples}) == 36 - 8
    # every position of a long run maps to a training example
    assert not any(train.at(p).prompt in {e.prompt for e in held.examples}
                   for p in range(3 * len(train)))
    again_train, again_held = hold_out(arithmetic(4096, max_operand=5, seed=0), 8, seed=3)
    assert again_held.examples == held.examples  # the same on every worker
    assert again_train.examples == train.examples


def test_a_held_out_file_removes_its_prompts_from_training(tmp_path: Path) -> None:
    rows = [{"q": f"question {i}", "a": str(i)} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "test.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [rows[3], {"q": "new", "a": "1"}, rows[3]]))
    train_file = jsonl(tmp_path / "train.jsonl", prompt_key="q", answer_key="a")
    test_file = jsonl(tmp_path / "test.jsonl", prompt_key="q", answer_key="a")
    train, held = hold_out(train_file, 2, source=test_file)
    assert [e.prompt for e in held.examples] == ["question 3", "new"]
    assert "question 3" not in {e.prompt for e in train.examples}
    assert len(train) == 9
    with pytest.raises(ValueError, match=r"eval\.prompts = 3, but eval\.path has 2 distinct"):
        hold_out(train_file, 3, source=test_file)


def test_holding_out_every_prompt_is_refused() -> None:
    data = Dataset([Example("1+1=", "2"), Example("1+1=", "2"), Example("2+2=", "4")])
    with pytest.raises(ValueError, match="would hold out every prompt"):
        hold_out(data, 2)


def test_the_eval_section_is_checked_naming_the_field(tmp_path: Path) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text("from flowrl import Recipe, RolloutConfig\n"
                      "recipe = Recipe(steps=2, rollout=RolloutConfig(engine='sim'))\n")
    with pytest.raises(RecipeError, match=r"eval\.prompts: 36 would hold out every prompt"):
        load_recipe(recipe, ["eval.every=1", "eval.prompts=36",
                             "data.arithmetic.max_operand=5"])
    with pytest.raises(RecipeError, match=r"eval\.path: not used with data\.kind 'arithmetic'"):
        load_recipe(recipe, ["eval.every=1", "eval.path=x.jsonl"])
    with pytest.raises(RecipeError, match=r"eval\.every"):
        load_recipe(recipe, ["eval.every=0"])
    ok = load_recipe(recipe, ["eval.every=2", "eval.prompts=4", "eval.sampled=3"])
    assert ok.eval == EvalConfig(every=2, prompts=4, sampled=3)
    assert ok.to_pipeline().eval == ok.eval.model_dump(mode="json")


def test_resume_refuses_a_changed_held_out_split(tmp_path: Path) -> None:
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.py"
    plain = load_recipe(recipe, [])
    held = load_recipe(recipe, ["eval.every=50", "eval.prompts=8"])
    fixed, other = resume_changes(recipe_record(plain), recipe_record(held))
    # the training data would change
    assert fixed == ["eval.path ((absent) → null)", "eval.prompts ((absent) → 8)"]
    fixed, other = resume_changes(recipe_record(held), recipe_record(
        load_recipe(recipe, ["eval.every=20", "eval.prompts=8", "eval.sampled=2"])))
    assert fixed == []
    assert other == ["eval.every (50 → 20)", "eval.sampled (4 → 2)"]


# ---- rounds (the pure part) -----------------------------------------------------------------

ROLLOUT = StageSpec("rollout", needs=("prompt",),
                    produces=("prompt_ids", "response_ids", "rollout_logprobs"),
                    group_level=True)
REWARD = StageSpec("reward", needs=("prompt", "response_ids"), produces=("reward",))


def _handle(i: int) -> Any:
    """A well-formed handle, told apart by its offset (of a zero-byte row: no memory)."""
    wire = handle_to_wire(Handle("node0", "", i * 8, "int64", (0,)))
    assert wire.code == HANDLE_EXT
    return wire


def _report(task_id: int, fields: dict[str, list[Any]], version: int | None = None,
            failed: dict[str, tuple[tuple[int, ...], str]] | None = None) -> TaskReport:
    n = len(next(iter(fields.values())))
    return TaskReport("w", task_id, fields, [1] * n, version, {}, {}, failed or {})


def _run_job(ev: Evaluation, job: EvalJob, rewards: list[float], *, version: int = 2,
             counter: list[int]) -> list[Any]:
    """Generate and score ``job`` as workers would; the handles freed."""
    task, params = ev.start(job, "rollout-0")
    assert params["eval"] == job.mode
    assert task.stage == EVAL_STAGE
    assert task.handles["prompt"] == job.row_positions()
    n = len(task.rows)
    hs = {f: [_handle(next(_ids(counter))) for _ in range(n)]
          for f in ("prompt_ids", "response_ids", "rollout_logprobs")}
    freed = ev.reported(task.id, _report(task.id, hs, version), now=1.0)
    assert sorted(map(repr, freed)) == sorted(
        map(repr, hs["prompt_ids"] + hs["rollout_logprobs"]))
    score = ev.next_job(SCORE_STAGE)
    assert score is job
    task, _ = ev.start(score, "reward-0")
    assert task.handles["response_ids"] == hs["response_ids"]
    return ev.reported(task.id, _report(task.id, {"reward": rewards}), now=2.0) + freed


def _ids(counter: list[int]) -> Any:
    counter[0] += 1
    yield counter[0]


def test_rounds_come_every_n_steps_and_at_the_last_and_score_as_configured() -> None:
    ev = Evaluation(EvalConfig(every=2, prompts=3, sampled=2, prompts_per_task=2,
                               correct_reward=1.0), generate=ROLLOUT, score=REWARD)
    ev.last_step = 5
    lines: list[dict[str, Any]] = []
    ev.on_record.append(lines.append)
    ev.committed(1, now=0.0)
    assert ev.idle
    assert ev.next_job(EVAL_STAGE) is None
    ev.committed(2, now=0.0)
    assert not ev.idle
    jobs = []
    while (job := ev.next_job(EVAL_STAGE)) is not None:
        assert ev.min_version(job) == 2  # only a worker serving step 2's weights or later
        jobs.append(job)
        ev.start(job, "rollout-0")  # taken ...
        break
    # ... and given back by a failure: it is retried first
    assert ev.failed(next(iter(ev._running))) == []
    counter = [0]
    rewards = {("greedy", (0, 1)): [1.0, 0.0], ("greedy", (2,)): [1.0],
               ("sampled", (0, 1)): [1.0, 1.0, 0.5, 0.0], ("sampled", (2,)): [0.2, 1.0]}
    freed: list[Any] = []
    while (job := ev.next_job(EVAL_STAGE)) is not None:
        freed += _run_job(ev, job, rewards[(job.mode, job.positions)], counter=counter)
    assert ev.idle
    assert len(freed) == 3 * (3 + 3 * 2)  # every handle written is freed
    [line] = lines
    assert line["step"] == 2
    assert line["eval/greedy_accuracy"] == pytest.approx(2 / 3)
    assert line["eval/greedy_reward"] == pytest.approx(2 / 3)
    assert line["eval/sampled_accuracy"] == pytest.approx(3 / 6)
    assert line["eval/sampled_reward"] == pytest.approx(3.7 / 6)
    assert line["eval/versions"] == [2]
    assert line["eval/prompts"] == 3
    assert line["eval/samples"] == 2
    ev.committed(4, now=0.0)
    ev.committed(5, now=0.0)  # the last step, though not a multiple of every
    assert {j.round.step for j in ev._queues[EVAL_STAGE]} == {4, 5}


def test_a_job_that_keeps_failing_gives_its_round_up_and_frees_what_it_holds() -> None:
    ev = Evaluation(EvalConfig(every=1, prompts=2, sampled=0, prompts_per_task=1),
                    generate=ROLLOUT, score=REWARD)
    lines: list[dict[str, Any]] = []
    ev.on_record.append(lines.append)
    ev.committed(1, now=0.0)
    first = ev.next_job(EVAL_STAGE)
    assert first is not None
    task, _ = ev.start(first, "rollout-0")
    hs = {f: [_handle(i)] for i, f in enumerate(ROLLOUT.produces)}
    ev.reported(task.id, _report(task.id, hs, 1), now=1.0)  # generated, waits to be scored
    for _ in range(3):
        job = ev.next_job(EVAL_STAGE)
        assert job is not None
        task, _ = ev.start(job, "rollout-0")
        freed = ev.failed(task.id)
    assert repr(freed) == repr([hs["response_ids"][0]])  # the scored job's responses
    assert ev.idle
    assert ev.next_job(SCORE_STAGE) is None
    assert lines == [{"step": 1, "eval/prompts": 2,
                      "eval/failed": "eval failed 3 times: task failed"}]


# ---- a run with simulated workers -----------------------------------------------------------

FAST = {
    "prompt_len": 8, "max_new_tokens": 16, "log_mean": 2.0, "log_sigma": 0.5,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0001, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}


def _sim(eval_settings: dict[str, Any]) -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=2, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=2, per_process=2), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=2, groups_per_step=2, max_staleness=1, engine="sim", engine_config=FAST,
        store_capacity_bytes=32 << 20, heartbeat_s=0.5, heartbeat_timeout_s=10.0,
        eval=EvalConfig.model_validate(eval_settings).model_dump(mode="json"))


@pytest.mark.timeout(90)
async def test_a_run_evaluates_every_n_steps_and_at_its_end_as_rollout_work() -> None:
    spec = _sim({"every": 2, "prompts": 3, "sampled": 2, "prompts_per_task": 2})
    seen: list[dict[str, Any]] = []
    async with Controller(spec) as ctl:
        ctl.on_eval.append(seen.append)
        out = await ctl.run(steps=5, timeout_s=60)
        spans = list(ctl.events.spans)
        status = ctl.status()
        log = list(ctl.eval_log)
        assert seen == log
        scraped = {s.name: s.value for f in text_string_to_metric_families(
            ControllerMetrics(ctl).render().decode()) for s in f.samples}
        # A run stopped early does not wait for the round of its last step.
        more = asyncio.ensure_future(ctl.run(steps=100, timeout_s=60))
        await ctl.wait_for(lambda: ctl.version >= 6)
        ctl.stop()
        assert (await more)["version"] < 105
        assert ctl.evaluation is not None
        assert ctl.evaluation.idle
    assert [line["step"] for line in log] == [2, 4, 5]
    for line in log:  # the simulated reward is 1/(1 + length): never correct
        assert line["eval/greedy_accuracy"] == 0.0
        assert 0.0 < line["eval/greedy_reward"] < 1.0
        assert "eval/sampled_accuracy" in line
        assert min(line["eval/versions"]) >= line["step"]
    assert out["eval/step"] == 5
    assert out["eval/greedy_accuracy"] == 0.0
    # /metrics: the last round's accuracies
    assert status["last_eval"] == log[-1]
    assert scraped["flowrl_eval_greedy_accuracy_ratio"] == 0.0
    assert scraped["flowrl_eval_sampled_accuracy_ratio"] == log[-1]["eval/sampled_accuracy"]
    # nothing of the evaluation was trained, and its memory is all given back
    assert out["samples"] == 5 * 2 * 2
    assert out["rows_trained_twice"] == 0
    assert status["errors"] == []
    roles = {(s.stage, s.role) for s in spans if s.stage in (EVAL_STAGE, SCORE_STAGE)}
    assert roles == {(EVAL_STAGE, "rollout"), (SCORE_STAGE, "reward")}
    trained = {s.task for s in spans if s.role == "train"}
    assert not trained & {s.task for s in spans if s.stage in (EVAL_STAGE, SCORE_STAGE)}


# ---- prompts through the chat template, and a real run that evaluates ------------------------

SYSTEM = "Answer with the number only."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("eval") / "tiny", vocab_size=300, hidden=32,
                            layers=1, heads=2, kv_heads=1, max_positions=96)  # 80 + 4 tokens


def _recipe(model: Path, **changes: Any) -> Recipe:
    return Recipe(
        steps=4, model=ModelConfig(path=str(model)),
        data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5), max_prompt_tokens=80,
                        chat_template=True, system_prompt=SYSTEM),
        algorithm=AlgorithmConfig(group_size=2), rollout=RolloutConfig(max_new_tokens=4),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=2),
        eval=EvalConfig(every=2, prompts=4, sampled=2, prompts_per_task=2), **changes)


async def test_prompts_are_the_tokenizers_chat_template_with_the_system_prompt(
    tiny: Path,
) -> None:
    config = _recipe(tiny).engine_config()
    role = make_hf_role("rollout", config, seed=0)
    assert isinstance(role, RolloutRole)
    tok = role.tokenizer
    train, held = data_splits(config)
    assert held is not None
    out = await role.run(_task(2, [7, 7]), {"prompt": [3, 3]})
    prompt = train.at(3).prompt
    want = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [t.tolist() for t in out.fields["prompt_ids"]] == [list(want)] * 2
    text = tok.decode(want)
    assert text.startswith(f"system: {SYSTEM}\nuser: {prompt}\n")
    assert text.endswith("assistant: ")
    assert prompt_messages(prompt, None) == [{"role": "user", "content": prompt}]
    # An evaluation task answers a held-out prompt greedily: the same answer every time.
    greedy = [await role.run(_task(1, [0], {"eval": "greedy"}), {"prompt": [1]})
              for _ in range(2)]
    assert tok.decode(greedy[0].fields["prompt_ids"][0].tolist()).startswith(
        f"system: {SYSTEM}\nuser: {held.at(1).prompt}\n")
    first, again = (g.fields["response_ids"][0].tolist() for g in greedy)
    assert first == again


def _task(rows: int, row_groups: list[int], params: dict[str, Any] | None = None) -> Any:
    return {"task_id": 1, "stage": "rollout", "rows": list(range(rows)),
            "groups": sorted(set(row_groups)), "row_groups": row_groups, "inputs": {},
            "params": params or {}}


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field(
    tiny: Path, tmp_path: Path,
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).write_bytes(f.read_bytes())
    recipe = _recipe(bare)
    with pytest.raises(NoChatTemplate, match=(
            rf"data\.chat_template: the tokenizer of {bare} has no chat template \(no "
            rf"'chat_template' in {bare}/tokenizer_config\.json")):
        make_hf_role("rollout", recipe.engine_config(), seed=0)
    with pytest.raises(InputError) as found:  # the launcher's check, before any process
        check_inputs(recipe)
    assert found.value.field == "data.chat_template"
    with pytest.raises(ValueError, match=r"system_prompt: needs chat_template = true"):
        DataConfig(system_prompt=SYSTEM)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_run_records_its_evaluations_in_the_step_log_and_summary(
    tiny: Path, tmp_path: Path,
) -> None:
    recipe = _recipe(tiny, output=tmp_path / "run", max_staleness=1, tracking=("tensorboard",))
    shown: list[dict[str, Any]] = []
    held_prompts: set[str] = set()
    trained: list[str] = []

    def watch(ctl: Controller) -> None:
        ctl.on_step.append(lambda e: trained.extend(
            train.at(p).prompt for p in range(4 * 2) if p in ctl.ledger.trained_positions))

    train, held = data_splits(recipe.engine_config())
    assert held is not None
    held_prompts = {e.prompt for e in held.examples}
    summary = await run_recipe(recipe, monitor=False, on_eval=shown.append, on_start=watch)
    assert summary["version"] == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval/prompts" in x]
    assert [x["step"] for x in evals] == [2, 4]
    assert evals == shown
    for x in evals:
        assert 0.0 <= x["eval/greedy_accuracy"] <= 1.0
        assert 0.0 <= x["eval/sampled_accuracy"] <= 1.0
        assert x["eval/prompts"] == 4
        assert x["eval/samples"] == 2
        assert min(x["eval/versions"]) >= x["step"]
    assert [x["step"] for x in lines if "eval/prompts" not in x] == [1, 2, 3, 4]
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["eval/step"] == 4
    # the trackers get each round at the step it evaluated
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/greedy_accuracy")] == [
        (x["step"], pytest.approx(x["eval/greedy_accuracy"])) for x in evals]
    assert saved["eval/greedy_accuracy"] == evals[-1]["eval/greedy_accuracy"]
    assert trained  # positions were trained, none of them a held-out prompt
    assert not set(trained) & held_prompts
