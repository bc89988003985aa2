"""The GSM8K recipe: its numeric-answer checker, its dataset, its inputs and a real 2-step run.

The run is ``python -m flowrl.launch recipes/gsm8k.py`` as a subprocess, on a tiny model built
into a temporary directory and a five-row JSONL file of GSM8K rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from flowrl.data import jsonl, parquet
from flowrl.recipe import Recipe, RolloutConfig
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.run import compile_recipe
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_spec import EngineSpec
from workers.roles.builtin_rewards import (
    final_number,
    gsm8k_gold,
    gsm8k_numeric,
    gsm8k_numeric_batch,
)
from workers.roles.factory import dataset_from_config, rollout_dtype
from workers.roles.reward_runner import resolve_reward_fn

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/gsm8k.py"

ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of "
                 "babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10"},
    {"question": "A shop had 1,500 apples and sold 1,266. How many are left?",
     "answer": "1,500 - 1,266 = 234\n#### 234"},
    {"question": "The temperature was 3 degrees and fell by 10. What is it now?",
     "answer": "3 - 10 = -7\n#### -7"},
    {"question": "A pen costs $3.50. What do two pens cost?", "answer": "2 * 3.5 = 7\n#### 7"},
]


# ---- the checker ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("#### 42", "#### 42", 1.0),
    ("Let me think. 40 + 2 = 42\n#### 42", "so 42\n#### 42", 1.0),
    ("\\boxed{42}", "#### 42", 1.0),
    ("The final answer is \\boxed{ 42 }.", "#### 42", 1.0),
    ("So the answer is $\\boxed{\\$1,000}$", "#### 1000", 1.0),
    ("The answer is 1,234.", "#### 1234", 1.0),
    ("The answer is: 1234", "#### 1,234", 1.0),
    ("The answer is -7.", "#### -7", 1.0),
    ("It fell to \u22127 degrees", "#### -7", 1.0),
    ("Two pens cost $7.00", "#### 7", 1.0),
    ("It costs 3.50", "#### 3.5", 1.0),
    ("It costs $3.5", "#### 3.50", 1.0),
    ("Half is .5", "#### 0.5", 1.0),
    ("10 - 3 = 7", "#### 7", 1.0),
    ("She had 5 apples and ate 2, so 3 are left.", "#### 3", 1.0),
    ("It is 50%", "#### 50", 1.0),
    ("#### 72\nQuestion: what about 13?", "#### 72", 1.0),  # the marked answer wins
    ("\\boxed{8}, the answer is 9, and 10", "#### 8", 1.0),  # boxed before "answer is"
    ("The answer is 9, then 10", "#### 9", 1.0),  # "answer is" before the last number
    # wrong
    ("#### 43", "#### 42", 0.0),
    ("#### 42 ... #### 43", "#### 42", 0.0),  # the last marked answer counts
    ("The answer is 7", "#### -7", 0.0),
    ("3.51", "#### 3.5", 0.0),
    ("420", "#### 42", 0.0),
    ("4.2", "#### 42", 0.0),
    ("x42", "#### 42", 0.0),  # part of a word, not a number
    ("I don't know", "#### 42", 0.0),
    ("", "#### 42", 0.0),
    ("42", "no number here", 0.0),
    ("42", "", 0.0),
])
def test_gsm8k_numeric_hand_cases(response: str, answer: str, reward: float) -> None:
    assert gsm8k_numeric("q", response, answer=answer) == reward


@pytest.mark.parametrize(("text", "value"), [
    ("#### 42", Decimal(42)),
    ("1,234,567", Decimal(1234567)),
    ("-0.25", Decimal("-0.25")),
    ("v2 and x3", None),
    ("no digits", None),
    ("12,34", Decimal(34)),  # not a thousands group: two numbers, the last is 34
])
def test_final_number(text: str, value: Decimal | None) -> None:
    assert final_number(text) == value


def test_gold_is_the_number_after_the_last_marker() -> None:
    assert gsm8k_gold("48/2 = 24 clips. 48+24 = 72\n#### 72") == 72
    assert gsm8k_gold("#### 1,000") == 1000
    assert gsm8k_gold(18) == 18  # a bare number (a numeric JSON answer)
    assert gsm8k_gold("#### none") is None


def test_batched_checker_matches_the_per_sample_one() -> None:
    responses = ["#### 72", "\\boxed{10}", "The answer is 233.", "-7", "7.0"]
    metas = [{"answer": r["answer"]} for r in ROWS]
    prompts = [str(r["question"]) for r in ROWS]
    assert gsm8k_numeric_batch(prompts, responses, metas) == [1.0, 1.0, 0.0, 1.0, 1.0]
    ref = "workers.roles.builtin_rewards:gsm8k_numeric_batch"
    assert resolve_reward_fn(ref) is gsm8k_numeric_batch


# ---- the dataset ---------------------------------------------------------------------------------


def test_malformed_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    good = [json.dumps(r) for r in ROWS[:2]]
    bad = [
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"answer": "#### 1"}),  # no question
        json.dumps({"question": "q?"}),  # no answer
        json.dumps({"question": 5, "answer": "#### 5"}),  # question not a string
        json.dumps({"question": "   ", "answer": "#### 5"}),  # blank question
        json.dumps({"question": "q?", "answer": None}),
        json.dumps({"question": "q?", "answer": True}),
        json.dumps({"question": "q?", "answer": {"n": 1}}),
        # Valid JSON, but a lone surrogate is no text: it cannot be encoded (UTF-8, tokenizers).
        json.dumps({"question": "q\ud800?", "answer": "#### 1"}),
        json.dumps({"question": "q?", "answer": "#### \udfff"}),
    ]
    lines = [good[0], *bad, "", good[1]]
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe not utf-8\n")
    data = jsonl(path, prompt_key="question", answer_key="answer", template="Q: {prompt}\nA:")
    assert len(data) == 2
    assert data.skipped == len(bad) + 1
    assert sorted(e.prompt for e in data.examples) == sorted(
        f"Q: {r['question']}\nA:" for r in ROWS[:2])
    # A numeric answer is kept as text.
    path.write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
    assert jsonl(path, prompt_key="question").examples[0].answer == "2"
    # A file with no usable row is an error, not an empty dataset.
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="no usable example"):
        jsonl(path)


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)  # several row groups
    return path


def test_parquet_rows_are_read_and_malformed_ones_skipped(tmp_path: Path) -> None:
    bad = [
        {"question": None, "answer": "#### 1"},  # a null question
        {"question": "   ", "answer": "#### 5"},  # blank
        {"question": "q?", "answer": None},  # a null answer
    ]
    path = write_parquet(tmp_path / "rows.parquet", [ROWS[0], *bad, *ROWS[1:]])
    data = parquet(path, prompt_key="question", answer_key="answer", template="Q: {prompt}\nA:")
    assert len(data) == len(ROWS)
    assert data.skipped == len(bad)
    assert sorted(e.prompt for e in data.examples) == sorted(
        f"Q: {r['question']}\nA:" for r in ROWS)
    assert {e.answer for e in data.examples} == {r["answer"] for r in ROWS}
    # Numeric answers are kept as text, as from JSONL.
    numbers = write_parquet(tmp_path / "n.parquet", [{"prompt": "1+1?", "answer": 2}])
    assert parquet(numbers).examples[0].answer == "2"
    # A missing column and a file that is not Parquet are errors naming the file.
    with pytest.raises(ValueError, match=r"rows\.parquet.*'nope'"):
        parquet(path, prompt_key="nope")
    text = tmp_path / "text.parquet"
    text.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match=r"text\.parquet: not a Parquet file"):
        parquet(text)


def test_parquet_without_pyarrow_fails_in_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "rows.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what Python does for a missing package
    with pytest.raises(ValueError, match=r"kind[\s\S]*pip install 'flowrl\[parquet\]'"):
        Recipe.model_validate({"steps": 1, "data": {"kind": "parquet", "path": str(path)}})
    with pytest.raises(ImportError, match=r"rows\.parquet.*flowrl\[parquet\]"):
        parquet(path)


def test_template_needs_the_prompt_placeholder(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        jsonl(path, prompt_key="question", template="no placeholder")
    with pytest.raises(ValueError, match="prompt_template"):
        Recipe.model_validate({"steps": 1, "data": {"kind": "jsonl", "path": str(path),
                                                    "prompt_template": "{question}"}})
    # Other braces are kept as written.
    data = jsonl(path, prompt_key="question", template="\\boxed{} {prompt}")
    assert data.examples[0].prompt.startswith("\\boxed{} Natalia")


def test_auto_dtype_is_float32_on_a_cpu() -> None:
    cpu = torch.device("cpu")
    def spec(**rollout: Any) -> EngineSpec:
        return Recipe(steps=1, rollout=RolloutConfig(**rollout)).engine_spec()

    assert rollout_dtype(spec(dtype="auto"), cpu) == torch.float32
    assert rollout_dtype(spec(dtype="bfloat16"), cpu) == torch.bfloat16
    assert rollout_dtype(spec(), cpu) == torch.float32  # the recipe's default


# ---- the recipe ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gsm8k") / "tiny")


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def data_kind_file(request: pytest.FixtureRequest, data_file: Path) -> tuple[str, Path]:
    """The GSM8K rows as each supported file kind."""
    if request.param == "jsonl":
        return "jsonl", data_file
    return "parquet", write_parquet(data_file.with_suffix(".parquet"), ROWS)


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOWRL_MODEL", raising=False)
    monkeypatch.delenv("FLOWRL_DATA", raising=False)


@pytest.mark.usefixtures("no_env")
def test_recipe_validates_and_compiles(model_dir: Path, data_kind_file: tuple[str, Path]) -> None:
    kind, data_file = data_kind_file
    recipe = load_recipe(ROOT / RECIPE, [f"model.path={model_dir}", f"data.path={data_file}",
                                         f"data.kind={kind}"])
    assert recipe.algorithm.group_size == 8
    assert recipe.algorithm.kl_coef == 0.0
    assert not recipe.uses_reference
    assert recipe.max_staleness == 1
    assert recipe.rollout.max_new_tokens >= 512
    assert recipe.rollout.dtype == "auto"
    spec = compile_recipe(recipe)
    assert [s.name for s in spec.stages] == ["rollout", "reward", "train"]
    config = json.loads(json.dumps(spec.engine_config))  # plain JSON, as workers receive it
    assert config["model"]["path"] == str(model_dir)
    dataset = dataset_from_config(config)
    assert len(dataset) == len(ROWS)
    assert dataset.skipped == 0
    fn = resolve_reward_fn(config["reward"]["fn"])
    assert config["reward"]["batched"]
    for example in dataset.examples:
        assert example.prompt.startswith("Question: ")
        assert example.prompt.endswith("Answer:")
        gold = example.answer.rpartition("####")[2].strip()
        assert fn([example.prompt] * 2, [f"so #### {gold}", "#### 99999"],
                  [{"answer": example.answer}] * 2) == [1.0, 0.0]


@pytest.mark.usefixtures("no_env")
def test_paths_from_the_environment_and_set_wins(
    model_dir: Path, data_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOWRL_MODEL", str(model_dir))
    monkeypatch.setenv("FLOWRL_DATA", str(tmp_path / "elsewhere.jsonl"))
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(ROOT / RECIPE)  # the environment's data file does not exist
    assert dict(excinfo.value.problems) == {
        "data.path": f"no such file: {str(tmp_path / 'elsewhere.jsonl')!r}"}
    recipe = load_recipe(ROOT / RECIPE, [f"data.path={data_file}"])
    assert (recipe.model.path, recipe.data.path) == (str(model_dir), str(data_file))


@pytest.mark.usefixtures("no_env")
def test_missing_inputs_name_the_field_and_both_ways_to_give_it(data_file: Path) -> None:
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(ROOT / RECIPE, [f"data.path={data_file}"])
    assert excinfo.value.file.endswith(RECIPE)
    ((field, message),) = excinfo.value.problems
    assert field == "model.path"
    assert "--set model.path=" in message
    assert "FLOWRL_MODEL" in message


# ---- the launch CLI ------------------------------------------------------------------------------


def _launch(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("FLOWRL_MODEL", "FLOWRL_DATA")}
    return subprocess.run(
        [sys.executable, "-m", "flowrl.launch", RECIPE, *args], cwd=ROOT, capture_output=True,
        text=True, timeout=timeout, env={**clean, **env}, check=False,
    )


def test_a_missing_data_file_fails_fast_naming_field_and_file(
    model_dir: Path, tmp_path: Path,
) -> None:
    missing = tmp_path / "nope" / "gsm8k.jsonl"
    t0 = time.perf_counter()
    done = _launch("--set", f"model.path={model_dir}", "--set", f"data.path={missing}",
                   env={}, timeout=30.0)
    elapsed = time.perf_counter() - t0
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert RECIPE in done.stderr
    assert "data.path" in done.stderr
    assert str(missing) in done.stderr
    # Nothing heavy was imported, let alone a process started (torch alone takes seconds).
    assert elapsed < 5.0, f"took {elapsed:.1f}s"


def _run_ids(stderr: str) -> set[str]:
    ids = set()
    for line in stderr.splitlines():
        try:
            record: Any = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("run_id"), str):
            ids.add(record["run_id"])
    return ids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_steps_through_the_launch_cli_leave_nothing_behind(
    model_dir: Path, data_kind_file: tuple[str, Path], tmp_path: Path,
) -> None:
    kind, data_file = data_kind_file
    steps = 2
    done = _launch(
        "--steps", str(steps), "--no-monitor", "--output", str(tmp_path / "run"),
        "--set", f"model.path={model_dir}", "--set", f"data.path={data_file}",
        "--set", f"data.kind={kind}",
        "--set", "rollout.max_new_tokens=8", "--set", "data.max_prompt_tokens=64",
        "--set", "trainer.groups_per_step=2", "--set", "trainer.micro_batch_groups=1",
        env={"FLOWRL_LOG_FORMAT": "json"}, timeout=270.0,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == steps, done.stdout
    summary = json.loads(lines[-2])  # the last line says where the model is
    assert summary["version"] == steps
    assert summary["samples"] == steps * 2 * 8
    assert summary["rows_trained_twice"] == 0

    (run_id,) = _run_ids(done.stderr)
    assert not Path(f"/tmp/flowrl-{run_id}").exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"flowrl-{run_id}")]
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if run_id in (p.info["cmdline"] or [])]
    assert left == []
