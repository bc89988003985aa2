"""The locally built tiny model: offline loading, determinism, caching, tokenizer, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl.tiny_model
from flowrl.recipe_file import load_recipe
from flowrl.run import prepare_model
from flowrl.tiny_model import (
    KNOWN_EVERY,
    MANIFEST,
    answer_pairs,
    build_tiny_model,
    build_versions,
    known_share,
    synthetic_corpus,
)

torch.set_num_threads(2)

# Small shapes for tests that build several models; the default shape is built once.
SMALL: dict[str, Any] = {"vocab_size": 400, "hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1}
SMALL_SET = [f"model.tiny.{k}={v}" for k, v in SMALL.items()]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_loads_offline_with_auto_classes(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.8e6 < n_params < 1.5e6
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert model.config.vocab_size == len(tok) == 1024
    assert tok.eos_token == "<|endoftext|>"
    assert tok.pad_token == "<|pad|>"
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id


def test_tokenizer_splits_digits_and_matches_raw_tokenizer(tiny_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    ids = tok("12+7=19").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "+", "7", "=", "1", "9"]
    assert tok.decode(ids) == "12+7=19"
    # Whatever class AutoTokenizer picks for a qwen2 model encodes exactly as the trained one.
    for text in [*synthetic_corpus(seed=7, lines=300), "Hello, World! 3.14\nnew line"]:
        assert tok(text).input_ids == raw.encode(text).ids, text
    assert tok("done<|endoftext|>").input_ids[-1] == tok.eos_token_id


def test_build_is_deterministic_and_seed_sensitive(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", **SMALL, seed=3)
    b = build_tiny_model(tmp_path / "b", **SMALL, seed=3)
    c = build_tiny_model(tmp_path / "c", **SMALL, seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json", MANIFEST):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # Building leaves the caller's RNG stream alone.
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_tiny_model(tmp_path / "d", **SMALL, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_cache_reuses_matching_dir_and_rebuilds_on_change(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", **SMALL)
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "m", **SMALL) == out
    assert weights.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no build leftovers

    build_tiny_model(tmp_path / "m", **{**SMALL, "hidden": 64})
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out, local_files_only=True).hidden_size == 64
    # A directory without a manifest (interrupted build) is rebuilt, not trusted.
    (out / MANIFEST).unlink()
    build_tiny_model(tmp_path / "m", **SMALL)
    assert AutoConfig.from_pretrained(out, local_files_only=True).hidden_size == 32


def test_a_model_cached_by_other_library_versions_is_rebuilt(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", **SMALL)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["libraries"] == build_versions()
    assert set(build_versions()) == {"torch", "transformers", "tokenizers"}
    # As if another install (an older transformers) had built and cached it.
    manifest["libraries"] = {**manifest["libraries"], "transformers": "4.45.0"}
    (out / MANIFEST).write_text(json.dumps(manifest))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(tmp_path / "m", **SMALL)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    assert json.loads((out / MANIFEST).read_text())["libraries"] == build_versions()


def test_model_cache_key_includes_library_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    recipe = load_recipe("recipes/tiny_cpu.py", [*SMALL_SET, "model.tiny.pretrain_steps=0"])
    here = prepare_model(recipe)
    assert prepare_model(recipe) == here
    # Without warm-up steps a warm-up target changes nothing, nor does no target: one entry.
    for until in ("null", "0.3"):
        assert prepare_model(load_recipe("recipes/tiny_cpu.py", [
            *SMALL_SET, "model.tiny.pretrain_steps=0", f"model.tiny.pretrain_until={until}"])
        ) == here
    # Only the reported versions differ (the build itself is not what is under test here).
    other = {**build_versions(), "tokenizers": "0.20.0"}
    monkeypatch.setattr(flowrl.tiny_model, "build_versions", lambda: other)
    elsewhere = prepare_model(recipe)
    assert here is not None
    assert elsewhere is not None
    assert elsewhere != here
    assert here.parent == elsewhere.parent
    assert json.loads((elsewhere / MANIFEST).read_text())["libraries"] == other


def test_custom_corpus_and_pretraining_lower_the_loss(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    raw = build_tiny_model(tmp_path / "raw", **SMALL, corpus=corpus)
    warm = build_tiny_model(tmp_path / "warm", **SMALL, corpus=corpus, pretrain_steps=30)

    def lm_loss(path: Path) -> float:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        # Two-digit operands and sums: every line is 8 tokens, no padding needed.
        lines = [f"{a}+{b}={a + b}" for a in (11, 17, 23) for b in (12, 19)]
        ids = torch.tensor([tok(line).input_ids for line in lines])
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    assert lm_loss(warm) < lm_loss(raw) - 0.5


def test_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="heads"):
        build_tiny_model(tmp_path / "x", hidden=30, heads=4)
    with pytest.raises(ValueError, match="empty"):
        build_tiny_model(tmp_path / "x", corpus=[])


@pytest.mark.timeout(90)
def test_cli_builds_a_model(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.tiny_model", str(out), "--hidden", "32", "--layers", "1",
         "--vocab-size", "400"],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert (out / "model.safetensors").is_file()
    assert (out / MANIFEST).is_file()


def test_a_build_says_its_stages_and_an_interrupted_one_leaves_nothing_that_looks_built(
        tmp_path: Path) -> None:
    said: list[tuple[str, dict[str, Any]]] = []
    build_tiny_model(tmp_path / "m", **SMALL, pretrain_steps=2,
                     progress=lambda stage, figures: said.append((stage, figures)))
    assert [stage for stage, _ in said] == ["tokenizer", "model", "warmup", "warmup", "save"]
    assert said[0][1]["tokens"] <= SMALL["vocab_size"]
    assert said[3][1] == {"step": 2, "steps": 2}
    said.clear()
    build_tiny_model(tmp_path / "m", **SMALL, pretrain_steps=2,  # reused: nothing to say
                     progress=lambda stage, figures: said.append((stage, figures)))
    assert said == []

    def ctrl_c(stage: str, figures: dict[str, Any]) -> None:
        if stage == "warmup":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(tmp_path / "cut", **SMALL, pretrain_steps=2, progress=ctrl_c)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no model, no temporary directory


def test_answer_pairs_are_the_distinct_lines_with_an_answer() -> None:
    corpus = ["1+2=3", "a few words", "1+2=3", "4*2=8", "x=", "2+2= CALL add 2 2<|endoftext|>"]
    assert answer_pairs(corpus) == [("1+2=", "3"), ("4*2=", "8")]


@pytest.mark.timeout(120)
def test_a_warm_up_with_a_target_stops_once_the_model_knows_that_share(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = [f"{a}+{b}={a + b}" for a in range(3) for b in range(3)]
    said: list[dict[str, Any]] = []
    out = build_tiny_model(tmp_path / "m", **SMALL, corpus=corpus, pretrain_steps=5000,
                           pretrain_until=1.0,
                           progress=lambda stage, f: said.append(f) if "known" in f else None)
    # Checked every KNOWN_EVERY steps, and stopped at the first check that met the target.
    assert [f["step"] for f in said] == [KNOWN_EVERY * (i + 1) for i in range(len(said))]
    assert said[-1]["known"] == 1.0
    assert all(f["known"] < 1.0 for f in said[:-1])
    assert said[-1]["step"] < 5000
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    pairs = answer_pairs(corpus)
    assert known_share(model, tok, pairs) == 1.0  # what was saved is what was checked
    # Greedy decoding agrees: each question's answer, then the end of text.
    for question, answer in pairs:
        ids = tok(question, return_tensors="pt").input_ids
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=3, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        assert tok.decode(got[0, ids.shape[1]:], skip_special_tokens=True) == answer
    assert json.loads((out / MANIFEST).read_text())["pretrain_until"] == 1.0
    untrained = build_tiny_model(tmp_path / "raw", **SMALL, corpus=corpus)
    assert known_share(AutoModelForCausalLM.from_pretrained(untrained), tok, pairs) < 0.5
    # A fixed-length warm-up's manifest is as before the target existed (caches stay valid).
    fixed = build_tiny_model(tmp_path / "fixed", **SMALL, corpus=corpus, pretrain_steps=2)
    assert "pretrain_until" not in json.loads((fixed / MANIFEST).read_text())


def test_a_warm_up_target_needs_answers_and_without_steps_changes_nothing(
        tmp_path: Path) -> None:
    # No warm-up steps: nothing to end early, the very build (and cache entry) of no warm-up.
    none = build_tiny_model(tmp_path / "none", **SMALL, pretrain_until=0.5)
    assert "pretrain_until" not in json.loads((none / MANIFEST).read_text())
    assert flowrl.tiny_model.is_built(none, **SMALL)
    with pytest.raises(ValueError, match="question=answer"):
        build_tiny_model(tmp_path / "x", **SMALL, corpus=["no answers here"], pretrain_steps=10,
                         pretrain_until=0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        build_tiny_model(tmp_path / "x", **SMALL, pretrain_steps=10, pretrain_until=1.5)


def test_a_build_trains_on_one_thread_and_gives_the_caller_its_threads_back(
        tmp_path: Path) -> None:
    # Its threads would wait on each other with anything else on the cores (5-7 times slower).
    # The caller's count is set here: other modules set theirs when pytest imports them.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[tuple[str, int]] = []
        build_tiny_model(tmp_path / "m", **SMALL, pretrain_steps=2,
                         progress=lambda stage, f: seen.append((stage, torch.get_num_threads())))
        assert seen == [("tokenizer", 2), ("model", 1), ("warmup", 1), ("warmup", 1),
                        ("save", 2)]
        assert torch.get_num_threads() == 2  # the caller's, back

        def ctrl_c(stage: str, figures: dict[str, Any]) -> None:
            if stage == "warmup":
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            build_tiny_model(tmp_path / "cut", **SMALL, pretrain_steps=2, progress=ctrl_c)
        assert torch.get_num_threads() == 2  # back after a build that stopped too
    finally:
        torch.set_num_threads(before)
