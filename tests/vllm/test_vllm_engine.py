"""`VLLMRolloutEngine` against real vLLM (CPU build) on tiny Qwen2 models.

Runs only where vLLM is installed (``make test-vllm`` builds ``.venv-vllm``); the main suite
skips it. One in-process engine serves the suite (`conftest.py`: vLLM allows one per process);
tests that change its weights put the original weights back.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    # vLLM's import warns about torch APIs it touches; not this suite's concern.
    warnings.simplefilter("ignore")
    # The version check also skips where `import vllm` finds only this directory (a namespace
    # package when tests/ is on sys.path and vLLM is not installed).
    vllm = pytest.importorskip("vllm", minversion="0.32")

import torch

from workers.engines import (
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    SequenceBatch,
    TorchTrainerEngine,
)
from workers.engines.vllm_rollout import VLLMRolloutEngine, checkpoint_shapes

ROOT = Path(__file__).resolve().parents[2]
PAD = 1
PROMPTS = [[18, 19, 12, 24, 30], [21, 22, 11, 20, 30, 18, 20, 22, 23, 24, 25], [5], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
# Measured: vLLM's and the trainer's float32 logprobs of the same tokens differ by <= 1e-6.
LOGPROB_TOL = 1e-4


def greedy_ids(engine: RolloutEngine) -> list[list[int]]:
    return [g.response_ids.tolist() for g in engine.generate(PROMPTS, GREEDY)]


def test_is_a_rollout_engine(engine: VLLMRolloutEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    assert engine.version == 3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_samples_n_per_prompt_with_the_trainers_logprobs(
    engine: VLLMRolloutEngine, trainer: TorchTrainerEngine, temperature: float
) -> None:
    n, steps = 3, 16
    params = SamplingParams(temperature=temperature, max_new_tokens=steps, n=n)
    gens = engine.generate(PROMPTS, params)
    assert [g.prompt_index for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for g in gens:
        assert g.response_ids.dtype == torch.int64
        assert g.response_ids.dim() == 1
        assert g.logprobs.dtype == torch.float32
        assert g.logprobs.shape == g.response_ids.shape
        assert 1 <= len(g.response_ids) <= steps
        assert g.finish_reason == ("length" if len(g.response_ids) == steps else "stop")
        assert bool(torch.isfinite(g.logprobs).all())
        assert bool((g.logprobs <= 0).all())
        assert g.version == 3
    # Sampling, not copying: a prompt's three responses are not all the same.
    assert any(len({tuple(g.response_ids.tolist()) for g in gens[i * n : i * n + n]}) > 1
               for i in range(len(PROMPTS)))
    batch = SequenceBatch.from_rows([PROMPTS[g.prompt_index] for g in gens],
                                    [g.response_ids for g in gens], pad_token_id=PAD)
    expected = batch.response_values(trainer.logprobs(batch, temperature=temperature))
    worst = max(float((g.logprobs - e).abs().max()) for g, e in zip(gens, expected, strict=True))
    assert worst < LOGPROB_TOL


def test_greedy_matches_the_hf_engine(engine: VLLMRolloutEngine, model_dir: Path,
                                      trainer: TorchTrainerEngine) -> None:
    hf = HFRolloutEngine(model_dir, device="cpu")
    assert greedy_ids(engine) == greedy_ids(hf)
    # n greedy responses are n copies; logprobs untempered (T = 1 when greedy).
    gens = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=6, n=2))
    assert len(gens) == 4
    assert gens[0].response_ids.tolist() == gens[1].response_ids.tolist()
    batch = SequenceBatch.from_rows([PROMPTS[g.prompt_index] for g in gens],
                                    [g.response_ids for g in gens], pad_token_id=PAD)
    expected = batch.response_values(trainer.logprobs(batch, temperature=1.0))
    for g, e in zip(gens, expected, strict=True):
        assert torch.allclose(g.logprobs, e, atol=LOGPROB_TOL, rtol=0)


def test_stop_token_ends_the_response_and_is_kept(engine: VLLMRolloutEngine) -> None:
    free = engine.generate(PROMPTS, GREEDY)
    stop_id = free[0].response_ids[3].item()  # the 4th greedy token of prompt 0
    gens = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12,
                                                   stop_token_ids=(stop_id,)))
    g = gens[0]
    first = free[0].response_ids.tolist().index(stop_id)
    assert g.finish_reason == "stop"
    assert g.response_ids.tolist() == free[0].response_ids.tolist()[: first + 1]
    assert len(g.logprobs) == first + 1


def test_stop_string_ends_at_the_token_completing_it(
    engine: VLLMRolloutEngine, model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop=("e",), n=8, seed=7)
    gens = engine.generate(PROMPTS[:2], params)
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped, "no response produced an 'e' in 24 tokens"
    for g in stopped:
        ids = g.response_ids.tolist()
        assert "e" in tok.decode(ids)
        assert "e" not in tok.decode(ids[:-1])
        assert len(g.logprobs) == len(ids)
    for g in gens:
        if g.finish_reason == "length":
            assert "e" not in tok.decode(g.response_ids.tolist())


def test_serves_calls_from_other_threads(engine: VLLMRolloutEngine) -> None:
    """Roles call the engine from asyncio's executor threads, which start with their own
    OpenMP thread count."""
    expected = greedy_ids(engine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(greedy_ids, engine).result(timeout=60) == expected
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        gens = pool.submit(engine.generate, PROMPTS, SamplingParams(n=2)).result(timeout=60)
    assert len(gens) == 2 * len(PROMPTS)


def test_seeds_make_sampling_reproducible(engine: VLLMRolloutEngine) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=11)
    a = [g.response_ids.tolist() for g in engine.generate(PROMPTS, params)]
    b = [g.response_ids.tolist() for g in engine.generate(PROMPTS, params)]
    assert a == b
    seeded = SamplingParams(temperature=1.0, max_new_tokens=10, n=2,
                            prompt_seeds=(2**64 - 5, 1, 2, 3))
    c = [g.response_ids.tolist() for g in engine.generate(PROMPTS, seeded)]
    d = [g.response_ids.tolist() for g in engine.generate(PROMPTS, seeded)]
    assert c == d
    assert c != a
    with pytest.raises(ValueError, match="prompt_seeds"):
        engine.generate(PROMPTS[:1], seeded)


@pytest.mark.usefixtures("restore")
def test_reload_serves_the_new_weights_and_version(
    engine: VLLMRolloutEngine, other_dir: Path, other_weights: dict[str, torch.Tensor],
    model_dir: Path,
) -> None:
    before = greedy_ids(engine)
    expected = greedy_ids(HFRolloutEngine(other_dir, device="cpu"))
    assert before != expected
    engine.load_weights(other_weights, 7)
    assert engine.version == 7
    assert greedy_ids(engine) == expected
    assert {g.version for g in engine.generate(PROMPTS, GREEDY)} == {7}
    # A tied weight may come under the head's name instead of the embedding's.
    original = TorchTrainerEngine(model_dir, device="cpu").export_weights()
    original["lm_head.weight"] = original.pop("model.embed_tokens.weight")
    engine.load_weights(original, 8)
    assert engine.version == 8
    assert greedy_ids(engine) == before


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda w: w.update({"model.extra.weight": torch.zeros(2)}), KeyError, "unknown"),
        (lambda w: w.pop("model.norm.weight"), KeyError, "missing"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(3)}), ValueError, "shape"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(128, dtype=torch.int64)}),
         ValueError, "floating"),
    ],
    ids=["unknown-name", "missing-name", "wrong-shape", "integer-dtype"],
)
def test_a_bad_state_is_refused_and_the_engine_serves_on(
    engine: VLLMRolloutEngine, other_weights: dict[str, torch.Tensor], change: Any,
    error: type[Exception], match: str,
) -> None:
    before = greedy_ids(engine)
    bad = dict(other_weights)
    change(bad)
    with pytest.raises(error, match=match):
        engine.load_weights(bad, 9)
    assert engine.version == 3
    assert greedy_ids(engine) == before


@pytest.mark.usefixtures("restore")
def test_a_reload_failing_inside_vllm_restores_the_checkpoint(
    engine: VLLMRolloutEngine, other_weights: dict[str, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = greedy_ids(engine)
    engine.load_weights(other_weights, 5)
    assert greedy_ids(engine) != before
    # Get a wrong shape past the engine's own checks, as a vLLM-side failure.
    bad = [(n, t[:1] if n == "model.layers.1.mlp.up_proj.weight" else t)
           for n, t in engine.plan_weights(other_weights)]
    monkeypatch.setattr(engine, "plan_weights", lambda state: bad)
    with pytest.raises(RuntimeError, match="serves version 3"):
        engine.load_weights(other_weights, 6)
    assert engine.version == 3
    assert greedy_ids(engine) == before


def test_checkpoint_shapes_reads_headers(model_dir: Path,
                                         weights: dict[str, torch.Tensor]) -> None:
    shapes = checkpoint_shapes(model_dir)
    assert shapes == {n: tuple(t.shape) for n, t in weights.items()}
    with pytest.raises(ValueError, match="safetensors"):
        checkpoint_shapes(model_dir / "nowhere")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_rollout_on_vllm(tmp_path: Path) -> None:
    """Two GRPO steps of the tiny recipe with rollout.engine=vllm: rollout on vLLM, weights
    from the trainer each step, everything else on torch."""
    steps = 2
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.launch", "recipes/tiny_cpu.py", "--steps", str(steps),
         "--no-monitor", "--output", str(tmp_path / "run"), "--set", "rollout.engine=vllm",
         "--set", "model.tiny.pretrain_steps=0",
         "--set", "trainer.groups_per_step=2", "--set", "trainer.micro_batch_groups=1",
         "--set", "algorithm.group_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
             "FLOWRL_LOG_FORMAT": "json"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == steps, done.stdout
    summary = json.loads(lines[-2])  # the last line says where the model is
    assert summary["version"] == steps
    assert summary["samples"] == steps * 2 * 4
