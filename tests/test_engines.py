"""Rollout and trainer engines on a real tiny Qwen2 model: sampling, stops, determinism,
logprob agreement, weight round trips, training, checkpoints."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from flowrl.recipe import ModelConfig, Recipe, TrainerConfig
from flowrl.tiny_model import build_tiny_model
from workers.devices import pick_device, set_threads
from workers.engines import (
    Generation,
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    SequenceBatch,
    TorchTrainerEngine,
    TrainerEngine,
    TrainerState,
)
from workers.engines.hf_rollout import _sample
from workers.engines.protocols import counter_uniforms, mix_seed, stream_keys_of
from workers.roles.factory import make_hf_role
from workers.roles.trainer import TrainerRole

set_threads(2)

PAD = 1
PROMPTS = [[18, 19, 12, 24, 30], [21, 22, 11, 20, 30, 18, 20, 22, 23, 24, 25], [5], [40, 41, 42]]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engines") / "tiny")


@pytest.fixture(scope="session")
def rollout(model_dir: Path) -> HFRolloutEngine:
    """Shared read-only engine: tests that load weights make their own."""
    return HFRolloutEngine(model_dir, device="cpu", seed=0)


@pytest.fixture
def trainer(model_dir: Path) -> TorchTrainerEngine:
    return TorchTrainerEngine(model_dir, lr=1e-3, device="cpu")


def batch_of(gens: list[Generation], prompts: list[list[int]]) -> SequenceBatch:
    return SequenceBatch.from_rows(
        [prompts[g.prompt_index] for g in gens], [g.response_ids for g in gens], pad_token_id=PAD
    )


def nll(lps: Tensor, batch: SequenceBatch) -> Tensor:
    mask = batch.response_mask
    return -(lps * mask).sum() / mask.sum()


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- devices ---------------------------------------------------------------------------------


def test_devices() -> None:
    assert pick_device().type in {"cpu", "cuda", "npu"}
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=">= 1"):
        set_threads(0)


def test_public_api_and_light_import() -> None:
    import subprocess
    import sys

    import workers.engines

    assert set(workers.engines.__all__) == {
        "FinishReason", "Generation", "HFRolloutEngine", "LossFn", "RolloutEngine",
        "SamplingParams", "SequenceBatch", "TorchTrainerEngine", "TrainerEngine",
        "TrainerState", "token_logprobs",
    }
    # The protocols import torch only; the HF engines load transformers on first access.
    code = "import sys, workers.engines; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


# -- rollout -----------------------------------------------------------------------------------


def test_engines_satisfy_protocols(rollout: HFRolloutEngine, trainer: TorchTrainerEngine) -> None:
    assert isinstance(rollout, RolloutEngine)
    assert isinstance(trainer, TrainerEngine)


def test_generation_shapes_and_order(rollout: HFRolloutEngine) -> None:
    params = SamplingParams(max_new_tokens=12, n=3, seed=1)
    gens = rollout.generate(PROMPTS, params)
    assert [g.prompt_index for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for g in gens:
        assert g.response_ids.dtype == torch.long
        assert g.response_ids.dim() == 1
        assert g.logprobs.dtype == torch.float32
        assert g.logprobs.shape == g.response_ids.shape
        assert 1 <= len(g.response_ids) <= 12
        assert bool((g.logprobs <= 0).all())
        assert bool(torch.isfinite(g.logprobs).all())
        assert g.version == rollout.version == 0
        assert (g.finish_reason == "length") == (len(g.response_ids) == 12)
    assert rollout.generate([], params) == []
    # The n samples of one prompt share its prefill but are drawn independently.
    first = [g.response_ids.tolist() for g in gens[:3]]
    assert len({tuple(r) for r in first}) == 3


def test_user_stop_tokens_end_responses_and_are_kept(rollout: HFRolloutEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    full = rollout.generate(PROMPTS[:1], greedy)[0]
    assert full.finish_reason == "length"
    stop_tok = int(full.response_ids[4])
    first = full.response_ids.tolist().index(stop_tok)
    stopped = rollout.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop_tok,))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids.tolist() == full.response_ids[: first + 1].tolist()
    assert torch.allclose(stopped.logprobs, full.logprobs[: first + 1], atol=1e-5)


def test_stop_strings_end_responses_at_the_completing_token(
    model_dir: Path, rollout: HFRolloutEngine
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    full = rollout.generate(PROMPTS[:1], greedy)[0].response_ids.tolist()
    text = str(tok.decode(full))
    # Two characters from the middle of the text: may span a token boundary.
    mid = len(tok.decode(full[:6]))
    stop_str = text[mid - 1 : mid + 1]
    expected = next(k + 1 for k in range(len(full)) if stop_str in tok.decode(full[: k + 1]))
    got = rollout.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12, stop=("@@@", stop_str))
    )[0]
    assert got.finish_reason == "stop"
    assert got.response_ids.tolist() == full[:expected]
    assert stop_str in tok.decode(got.response_ids.tolist())


def test_eos_stops_generation(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir, device="cpu")
    # A zero final norm makes every logit 0, so greedy picks token 0, which is EOS.
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    state["model.norm.weight"].zero_()
    engine.load_weights(state, version=5)
    gens = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    vocab = engine.model.config.vocab_size
    for g in gens:
        assert g.response_ids.tolist() == [0]
        assert g.finish_reason == "stop"
        assert g.version == 5
        assert math.isclose(float(g.logprobs[0]), -math.log(vocab), abs_tol=1e-5)


def test_seeded_generation_is_deterministic(model_dir: Path, rollout: HFRolloutEngine) -> None:
    params = SamplingParams(max_new_tokens=16, n=2, seed=123, top_p=0.9)
    a = rollout.generate(PROMPTS, params)
    b = rollout.generate(PROMPTS, params)
    c = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=16, n=2, seed=124, top_p=0.9))
    assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, c, strict=True))
    # Unseeded calls advance the engine's generator: reproducible from the engine's seed.
    e1, e2 = (HFRolloutEngine(model_dir, device="cpu", seed=7) for _ in range(2))
    unseeded = SamplingParams(max_new_tokens=8)
    r1 = [e1.generate(PROMPTS, unseeded) for _ in range(2)]
    r2 = [e2.generate(PROMPTS, unseeded) for _ in range(2)]
    ids = [[g.response_ids.tolist() for g in call] for call in r1]
    assert ids == [[g.response_ids.tolist() for g in call] for call in r2]
    assert ids[0] != ids[1]


def test_prompt_seeds_sample_the_same_responses_in_any_batch(rollout: HFRolloutEngine) -> None:
    def ids(prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=12, n=3, top_p=0.95, prompt_seeds=tuple(seeds))
        return [g.response_ids.tolist() for g in rollout.generate(prompts, params)]

    p0, p1 = list(PROMPTS[0]), list(PROMPTS[1])
    alone = ids([p0], [11])
    together = ids([p1, p0, p1], [5, 11, 6])
    assert together[3:6] == alone  # p0's responses whatever shares the batch
    assert together[0:3] != together[6:9]  # same prompt, other seed: other responses
    assert len({tuple(r) for r in alone}) > 1  # a prompt's n responses are distinct streams
    assert ids([p0], [11]) == alone  # repeatable (the engine's generator is not used)
    with pytest.raises(ValueError, match="prompt_seeds"):
        ids([p0, p1], [1])


def test_seed_mixing_is_stable() -> None:
    # Pinned values: runs must sample the same streams across versions of flowrl.
    assert mix_seed(0, 0) == 5095610196844313600
    assert mix_seed(1, 2) == 9550467469912592448
    u = counter_uniforms(stream_keys_of([1, 2], 2, torch.device("cpu")), 0).squeeze(-1)
    assert u.dtype == torch.float64
    assert u.tolist() == pytest.approx([0.318563326, 0.984684380, 0.018541640, 0.319737937])


def test_top_k_one_and_tiny_top_p_are_greedy(rollout: HFRolloutEngine) -> None:
    greedy = rollout.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    for params in (
        SamplingParams(top_k=1, max_new_tokens=8, seed=3),
        SamplingParams(top_p=1e-6, max_new_tokens=8, seed=3),
    ):
        sampled = rollout.generate(PROMPTS, params)
        assert [g.response_ids.tolist() for g in sampled] == [
            g.response_ids.tolist() for g in greedy
        ]


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        (0, 1.0, [0.5, 0.3, 0.2]),
        (0, 0.7, [0.625, 0.375, 0.0]),  # nucleus {0, 1}, renormalised
        (2, 1.0, [0.625, 0.375, 0.0]),
        (2, 0.6, [1.0, 0.0, 0.0]),  # top-p on the top-k distribution (0.625 >= 0.6)
    ],
)
@pytest.mark.parametrize("uniforms", ["generator", "counter"])
def test_sampler_distribution(
    top_k: int, top_p: float, expected: list[float], uniforms: str
) -> None:
    rows = 40_000
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(rows, 3)
    if uniforms == "generator":
        u = torch.rand((rows, 1), generator=torch.Generator().manual_seed(0))
    else:  # one draw per row stream, as prompt_seeds sampling makes them
        u = counter_uniforms(stream_keys_of([7], rows, torch.device("cpu")), 3)
    tokens, lps = _sample(logits, SamplingParams(top_k=top_k, top_p=top_p), u)
    freq = torch.bincount(tokens, minlength=3).double() / rows
    for f, p in zip(freq.tolist(), expected, strict=True):
        assert abs(f - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / rows) + 1e-12
    # Reported logprobs are of the untruncated model distribution, whatever the filters.
    assert torch.allclose(lps, logits[0].log_softmax(-1)[tokens], atol=1e-6)


def test_sampler_wide_nucleus_falls_back_to_full_sort() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 300, generator=gen) * 0.1  # flat: the nucleus exceeds 64 tokens
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.9).sum()) + 1].tolist())
    assert len(nucleus) > 64
    u = torch.rand((20_000, 1), generator=gen)
    tokens, _ = _sample(logits.expand(20_000, 300), SamplingParams(top_p=0.9), u)
    seen = set(tokens.tolist())
    assert seen <= nucleus
    assert len(seen) > 0.9 * len(nucleus)


def test_sampling_params_validate() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1},
                {"max_new_tokens": 0}, {"n": 0}, {"stop": ("",)}):
        with pytest.raises(ValueError, match="must be"):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def test_prompt_too_long_for_the_model(rollout: HFRolloutEngine) -> None:
    with pytest.raises(ValueError, match="positions"):
        rollout.generate([[5] * 500], SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        rollout.generate([[]], SamplingParams())


# -- rollout vs trainer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        # Many stop ids: rows finish at different steps and leave the batch mid-decode.
        SamplingParams(max_new_tokens=24, n=2, seed=11, stop_token_ids=tuple(range(2, 60))),
        SamplingParams(max_new_tokens=24, n=2, seed=12, temperature=0.7, top_p=0.9),
    ],
)
def test_rollout_logprobs_match_trainer(
    rollout: HFRolloutEngine, trainer: TorchTrainerEngine, params: SamplingParams
) -> None:
    gens = rollout.generate(PROMPTS, params)
    lengths = {len(g.response_ids) for g in gens}
    assert len(lengths) > 1 or params.stop_token_ids == ()
    batch = batch_of(gens, PROMPTS)
    recomputed = batch.response_values(trainer.logprobs(batch, temperature=params.temperature))
    for g, lp in zip(gens, recomputed, strict=True):
        assert lp.shape == g.logprobs.shape
        assert float((lp - g.logprobs).abs().max()) < 1e-4
    full = trainer.logprobs(batch)
    assert bool((full[~batch.response_mask] == 0).all())


def test_trainer_logprobs_ignore_padding(trainer: TorchTrainerEngine) -> None:
    one = SequenceBatch.from_rows([PROMPTS[0]], [[7, 8, 9]], pad_token_id=PAD)
    padded = SequenceBatch.from_rows([PROMPTS[0], PROMPTS[1]], [[7, 8, 9], [1] * 12])
    a = one.response_values(trainer.logprobs(one))[0]
    b = padded.response_values(trainer.logprobs(padded))[0]
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="position 0"):
        trainer.logprobs(SequenceBatch(torch.tensor([[3, 4]]), torch.ones(1, 2),
                                       torch.tensor([[True, True]])))


# -- weights -----------------------------------------------------------------------------------


def test_weight_round_trip_is_exact(model_dir: Path, trainer: TorchTrainerEngine) -> None:
    engine = HFRolloutEngine(model_dir, device="cpu")
    batch = SequenceBatch.from_rows(PROMPTS, [[7, 8, 9, 10]] * len(PROMPTS), pad_token_id=PAD)
    trainer.train_micro_batch(batch, nll)
    trainer.optimizer_step()
    assert not params_equal(engine.model, trainer.model)
    weights = trainer.export_weights()
    # A tied weight travels once; everything is a contiguous CPU snapshot.
    assert "lm_head.weight" not in weights
    assert "model.embed_tokens.weight" in weights
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in weights.values())
    engine.load_weights(weights, version=1)
    assert engine.version == 1
    assert params_equal(engine.model, trainer.model)
    # The export does not move with later steps.
    snapshot = {k: v.clone() for k, v in weights.items()}
    trainer.train_micro_batch(batch, nll)
    trainer.optimizer_step()
    assert all(torch.equal(weights[k], snapshot[k]) for k in weights)
    # bfloat16 export, e.g. for a bf16 rollout engine.
    assert all(t.dtype == torch.bfloat16
               for t in trainer.export_weights(dtype=torch.bfloat16).values())


def test_shared_weights_are_served_in_place_and_never_written(
    model_dir: Path, trainer: TorchTrainerEngine
) -> None:
    engine = HFRolloutEngine(model_dir, device="cpu")
    copied = HFRolloutEngine(model_dir, device="cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    shared = trainer.export_weights()
    snapshot = {k: v.clone() for k, v in shared.items()}
    engine.load_weights(shared, version=1, shared=True)
    copied.load_weights(shared, version=1)
    params = engine.model.state_dict()
    # The model's tensors are the published ones (a tied head included): nothing was copied.
    assert all(params[k].data_ptr() == shared[k].data_ptr() for k in shared)
    assert engine.model.lm_head.weight.data_ptr() == shared["model.embed_tokens.weight"].data_ptr()
    assert [g.response_ids.tolist() for g in engine.generate(PROMPTS, greedy)] == \
        [g.response_ids.tolist() for g in copied.generate(PROMPTS, greedy)]
    # A later version given as a plain copy lands in tensors of the engine's own.
    other = {k: torch.randn_like(v) for k, v in shared.items()}
    engine.load_weights(other, version=2)
    assert all(torch.equal(shared[k], snapshot[k]) for k in shared)
    assert all(torch.equal(engine.model.state_dict()[k], other[k]) for k in other)
    assert all(engine.model.state_dict()[k].data_ptr() != other[k].data_ptr() for k in other)
    # A version of another dtype cannot be served in place: it is converted into own tensors.
    engine.load_weights({k: v.double() for k, v in shared.items()}, version=3, shared=True)
    assert all(torch.equal(engine.model.state_dict()[k], shared[k]) for k in shared)
    assert all(engine.model.state_dict()[k].dtype == torch.float32 for k in shared)


def test_bad_weights_are_rejected_atomically(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir, device="cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good: dict[str, Tensor] = {k: torch.zeros_like(v) for k, v in before.items()}
    cases: list[tuple[Mapping[str, Tensor], type[Exception]]] = [
        ({k: v for k, v in good.items() if k != "model.norm.weight"}, KeyError),
        ({**good, "model.extra.weight": torch.zeros(1)}, KeyError),
        ({**good, "model.norm.weight": torch.zeros(3)}, ValueError),
    ]
    for state, error in cases:
        with pytest.raises(error):
            engine.load_weights(state, version=9)
    assert engine.version == 0
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- training ----------------------------------------------------------------------------------


def sft_batch() -> SequenceBatch:
    return SequenceBatch.from_rows(
        PROMPTS, [[30, 18, 19, 0], [30, 20, 0], [12, 13, 14, 15, 0], [30, 21, 0]], pad_token_id=PAD
    )


def test_training_steps_lower_the_loss(trainer: TorchTrainerEngine) -> None:
    batch = sft_batch()
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    losses = []
    for _ in range(5):
        metrics = trainer.train_micro_batch(batch, nll)
        losses.append(metrics["loss"])
        step = trainer.optimizer_step()
        assert step["skipped"] == 0.0
        assert step["grad_norm"] > 0.0
    assert metrics["response_tokens"] == float(batch.num_response_tokens)
    assert trainer.step == 5
    assert losses[-1] < losses[0] - 0.5
    assert not all(torch.equal(start[k], v) for k, v in trainer.model.state_dict().items())


def test_accumulated_halves_equal_one_full_batch(model_dir: Path) -> None:
    batch = sft_batch()
    ids, attn, resp = batch.input_ids, batch.attention_mask, batch.response_mask
    halves = [SequenceBatch(ids[s], attn[s], resp[s]) for s in (slice(0, 2), slice(2, 4))]
    total = float(resp.sum())

    def summed(lps: Tensor, b: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        return -(lps * b.response_mask).sum() / total, {"rows": float(len(b.input_ids))}

    full = TorchTrainerEngine(model_dir, lr=1e-3, device="cpu")
    split = TorchTrainerEngine(model_dir, lr=1e-3, device="cpu")
    full.train_micro_batch(batch, summed)
    for half in halves:
        assert split.train_micro_batch(half, summed)["rows"] == 2.0
    # Compare gradients, not post-Adam weights: Adam's first step is sign-like and amplifies
    # rounding in near-zero gradient entries.
    grads = {n: p.grad for n, p in split.model.named_parameters()}
    for name, param in full.model.named_parameters():
        assert param.grad is not None
        assert torch.allclose(param.grad, grads[name], rtol=1e-4, atol=1e-7), name
    full_norm = full.optimizer_step()["grad_norm"]
    assert math.isclose(split.optimizer_step()["grad_norm"], full_norm, rel_tol=1e-5)


def test_warmup_schedule_and_misuse(model_dir: Path) -> None:
    engine = TorchTrainerEngine(model_dir, lr=1e-3, warmup_steps=4, device="cpu")
    assert [engine.lr_at(s) for s in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )
    with pytest.raises(RuntimeError, match="without any train_micro_batch"):
        engine.optimizer_step()
    engine.train_micro_batch(sft_batch(), nll)
    assert engine.optimizer_step()["lr"] == pytest.approx(2.5e-4)
    with pytest.raises(ValueError, match="scalar"):
        engine.train_micro_batch(sft_batch(), lambda lps, b: lps)
    empty = SequenceBatch.from_rows([[3, 4]], [[]])
    with pytest.raises(ValueError, match="no response tokens"):
        engine.train_micro_batch(empty, nll)


def test_cosine_schedule_after_warmup(model_dir: Path) -> None:
    engine = TorchTrainerEngine(model_dir, lr=1.0, warmup_steps=2, schedule="cosine",
                                min_lr_ratio=0.1, total_steps=10, device="cpu")
    # Warm-up 0.5, 1; then cosine over steps 2..9 from 1 down to 0.1; held there after.
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7))
    assert [engine.lr_at(s) for s in (0, 1, 2, 5, 9, 12)] == pytest.approx(
        [0.5, 1.0, 1.0, mid, 0.1, 0.1])
    assert all(engine.lr_at(s) > engine.lr_at(s + 1) for s in range(2, 9))
    with pytest.raises(ValueError, match="total_steps"):
        TorchTrainerEngine(model_dir, schedule="cosine", device="cpu")
    with pytest.raises(ValueError, match="schedule"):
        TorchTrainerEngine(model_dir, schedule="linear", device="cpu")


def test_the_recipe_schedule_reaches_the_trainer(model_dir: Path) -> None:
    r = Recipe(steps=5, model=ModelConfig(path=str(model_dir)),
               trainer=TrainerConfig(lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.5))
    role = make_hf_role("train", r.engine_config(), seed=0)
    assert isinstance(role, TrainerRole)
    assert [role.engine.lr_at(s) for s in (0, 4)] == pytest.approx([1e-3, 5e-4])


def test_non_finite_gradient_skips_the_step(trainer: TorchTrainerEngine) -> None:
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_micro_batch(sft_batch(), lambda lps, b: nll(lps, b) * float("nan"))
    metrics = trainer.optimizer_step()
    assert metrics["skipped"] == 1.0
    assert trainer.step == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    # The next good step goes through.
    trainer.train_micro_batch(sft_batch(), nll)
    assert trainer.optimizer_step()["skipped"] == 0.0


def test_checkpoint_resume_matches_uninterrupted_run(
    model_dir: Path, trainer: TorchTrainerEngine, tmp_path: Path
) -> None:
    batch = sft_batch()
    for _ in range(2):
        trainer.train_micro_batch(batch, nll)
        trainer.optimizer_step()
    ckpt = trainer.save_pretrained(tmp_path / "ckpt")
    trainer.state_dict().save(ckpt)
    resumed = TorchTrainerEngine(ckpt, lr=1e-3, device="cpu")
    resumed.load_state_dict(TrainerState.load(ckpt))
    assert resumed.step == 2
    for engine in (trainer, resumed):
        engine.train_micro_batch(batch, nll)
        engine.optimizer_step()
    assert params_equal(trainer.model, resumed.model)
    state = trainer.state_dict()
    state.meta["param_groups"][0]["params"][0] = "nope"
    with pytest.raises(ValueError, match="names"):
        resumed.load_state_dict(state)


def test_save_pretrained_loads_and_generates(
    model_dir: Path, trainer: TorchTrainerEngine, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer.train_micro_batch(sft_batch(), nll)
    trainer.optimizer_step()
    out = trainer.save_pretrained(tmp_path / "saved")
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    model: Any = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert params_equal(model, trainer.model)
    ids = tok("12+7=", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                   do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] > ids.shape[1]
    # And the rollout engine serves it directly.
    engine = HFRolloutEngine(out, device="cpu")
    assert params_equal(engine.model, trainer.model)
