"""Interruptible (partial) rollout: new weights are loaded between decode steps while sequences
run, and each sequence continues under them with every token kept and tagged with the version
that produced it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from flowrl.data import Example, arithmetic
from flowrl.episode import Policy
from flowrl.recipe import ModelConfig, Recipe, RolloutConfig
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines import HFRolloutEngine, SamplingParams
from workers.engines.hf_continuous import ContinuousBatcher, RunningBatch, _Seq
from workers.engines.hf_rollout import new_cache
from workers.roles.episode_rollout import EpisodeRolloutRole
from workers.roles.factory import load_tokenizer, make_hf_role

set_threads(1)

OLD, NEW = 3, 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
CONTEXTS = ([11, 42, 7, 99, 23], [5, 61, 200, 17, 3, 88, 140, 9, 31])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("partial") / "tiny", hidden=32, layers=2,
                            heads=2, kv_heads=1, vocab_size=300, max_positions=256)


@pytest.fixture(scope="module")
def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The next version's weights: the model's, moved as a training step might."""
    g = torch.Generator().manual_seed(1)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
            for n, p in _engine(model_dir).model.named_parameters()}


def _engine(path: Path, weights: dict[str, torch.Tensor] | None = None) -> HFRolloutEngine:
    engine = HFRolloutEngine(path, device="cpu", seed=0, version=OLD)
    if weights is not None:
        engine.load_weights(weights, NEW)
    return engine


def _next(engine: HFRolloutEngine, ids: list[int], cache: Any, start: int
          ) -> tuple[int, float, Any]:
    """Greedy next token after ``ids`` (at positions from ``start``) over ``cache`` (which
    the forward extends)."""
    out = engine.model(input_ids=torch.tensor([ids]), use_cache=True,
                       position_ids=torch.arange(start, start + len(ids)).unsqueeze(0),
                       **{engine.forward_names.cache: cache})
    logp = out.logits[0, -1].float().log_softmax(-1)
    tok = int(logp.argmax())
    return tok, float(logp[tok]), cache


@torch.no_grad()
def _by_hand(old: HFRolloutEngine, new: HFRolloutEngine, context: list[int], k: int, n: int,
             *, rebuild: bool) -> tuple[list[int], list[float]]:
    """One sequence alone: ``k`` greedy tokens from ``old``, then ``new`` continues to ``n``
    tokens, over the old weights' KV cache of the kept prefix (its last token recomputed by
    ``new``) or, with ``rebuild``, over a prefill of the whole prefix by ``new``."""
    tokens: list[int] = []
    lps: list[float] = []
    tok, lp, cache = _next(old, context, new_cache(old.model), 0)
    while True:
        tokens.append(tok)
        lps.append(lp)
        if len(tokens) == k:
            break
        tok, lp, cache = _next(old, [tok], cache, len(context) + len(tokens) - 1)
    prefix = context + tokens
    if rebuild:
        tok, lp, cache = _next(new, prefix, new_cache(new.model), 0)
    else:
        # Drop the KV of the last kept token; the new weights compute it again.
        _, _, cache = _next(old, prefix[:-1], new_cache(old.model), 0)
        tok, lp, cache = _next(new, prefix[-1:], cache, len(prefix) - 1)
    while True:
        tokens.append(tok)
        lps.append(lp)
        if len(tokens) == n:
            return tokens, lps
        tok, lp, cache = _next(new, [tok], cache, len(context) + len(tokens) - 1)


def _seqs(contexts: Sequence[list[int]]) -> list[_Seq]:
    loop = asyncio.get_running_loop()
    return [_Seq(list(c), GREEDY, i, loop.create_future()) for i, c in enumerate(contexts)]


@pytest.mark.parametrize("rebuild", [False, True], ids=["keep_kv", "rebuild_kv"])
async def test_a_swap_between_decode_steps_continues_every_sequence_under_the_new_weights(
    model_dir: Path, weights: dict[str, torch.Tensor], rebuild: bool
) -> None:
    engine = _engine(model_dir)
    batch = RunningBatch(engine)
    seqs = _seqs(CONTEXTS)
    batch.admit(seqs)
    k = 5
    for _ in range(k):
        assert batch.step() == []
    engine.load_weights(weights, NEW)
    batch.refresh(rebuild_kv=rebuild)
    ended: list[Any] = []
    while batch.rows:
        ended += batch.step()
    assert len(ended) == 2
    assert all(reason == "length" for _, reason in ended)
    old_model, new_model = _engine(model_dir), _engine(model_dir, weights)
    for s, context in zip(seqs, CONTEXTS, strict=True):
        tokens, lps = _by_hand(old_model, new_model, context, k, GREEDY.max_new_tokens,
                               rebuild=rebuild)
        assert s.tokens == tokens  # never restarted: the first k tokens are the old policy's
        assert s.logprobs == pytest.approx(lps, abs=1e-4)
        assert s.versions == [OLD] * k + [NEW] * (GREEDY.max_new_tokens - k)
        g = s.result("length")
        assert g.token_versions is not None
        assert g.token_versions.tolist() == s.versions
    # The new weights change what follows: the swap is not a no-op.
    alone, _ = _by_hand(old_model, old_model, CONTEXTS[0], k, GREEDY.max_new_tokens,
                        rebuild=True)
    assert alone != seqs[0].tokens


async def test_a_token_records_the_version_that_computed_its_logits(
    model_dir: Path, weights: dict[str, torch.Tensor]
) -> None:
    # Weights loaded under running rows without `refresh`: the next token is still sampled
    # from logits the old weights computed, and says so.
    engine = _engine(model_dir)
    batch = RunningBatch(engine)
    (seq,) = _seqs(CONTEXTS[:1])
    batch.admit([seq])
    batch.step()
    engine.load_weights(weights, NEW)
    batch.step()
    batch.step()
    assert seq.versions == [OLD, OLD, NEW]


async def test_the_batcher_swaps_at_the_next_step_while_a_request_runs(
    model_dir: Path, weights: dict[str, torch.Tensor]
) -> None:
    engine = _engine(model_dir)
    batcher = ContinuousBatcher(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=200)
    running = asyncio.create_task(batcher.generate(CONTEXTS[1], params, stream_key=1))
    # A short request joins the batch with it: once that one has ended, the long one runs.
    await batcher.generate(CONTEXTS[0], replace(GREEDY, max_new_tokens=2), stream_key=0)
    assert batcher.running == 1
    # The swap waits for the next decode-step boundary (the driver gives way after a step).
    continued = await batcher.swap(lambda: engine.load_weights(weights, NEW))
    g = await running
    assert continued == 1
    assert batcher.stats.interruptions == 1
    assert batcher.stats.interrupted_rows == 1
    assert g.token_versions is not None
    versions = g.token_versions.tolist()
    k = versions.count(OLD)
    assert 2 <= k < params.max_new_tokens
    assert versions == [OLD] * k + [NEW] * (params.max_new_tokens - k)
    tokens, lps = _by_hand(_engine(model_dir), _engine(model_dir, weights), CONTEXTS[1], k,
                           params.max_new_tokens, rebuild=False)
    assert g.response_ids.tolist() == tokens
    assert g.logprobs.tolist() == pytest.approx(lps, abs=1e-4)
    # With nothing running, a swap only loads.
    assert await batcher.swap(lambda: engine.load_weights(weights, NEW + 1)) == 0
    assert batcher.stats.interruptions == 1
    assert engine.version == NEW + 1


class LongOrShort:
    """An episode: the first of a task's rows generates long, the others two tokens; once a
    short one has ended, the long one is running."""

    def __init__(self) -> None:
        self.started = 0
        self.short_done = asyncio.Event()

    async def __call__(self, policy: Policy, example: Example) -> None:
        policy.add(example.prompt)
        long = self.started == 0
        self.started += 1
        await policy.generate(max_new_tokens=LONG if long else 2)
        if not long:
            self.short_done.set()
        policy.finish(1.0)


LONG = 200


async def test_an_interruptible_rollout_reports_its_oldest_tokens_version(
    model_dir: Path, weights: dict[str, torch.Tensor]
) -> None:
    episode = LongOrShort()
    role = EpisodeRolloutRole(
        ContinuousBatcher(_engine(model_dir)), load_tokenizer(model_dir), arithmetic(16),
        SamplingParams(temperature=0.0, max_new_tokens=LONG), episode, interruptible=True)
    assert role.interruptible
    task = {"task_id": 1, "row_groups": [0, 0, 0], "params": {}}
    running = asyncio.create_task(role.run(task, {"prompt": [3, 3, 3]}))  # type: ignore[arg-type]
    await episode.short_done.wait()
    assert await role.load_version(NEW, weights) == 1  # the long row continues under it
    out = await running
    versions = [v.tolist() for v in out.fields["token_versions"]]
    k = versions[0].count(OLD)
    assert 2 <= k < LONG
    assert versions[0] == [OLD] * k + [NEW] * (LONG - k)
    assert versions[1:] == [[OLD, OLD], [OLD, OLD]]
    # The staleness bound holds for every token: the task's version is its oldest token's.
    assert out.version == OLD
    assert out.metrics["interrupted_episodes"] == 1.0
    assert role.batcher.engine.version == NEW


def test_partial_rollout_needs_episodes(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "episodes.py"
    path.write_text("async def one(policy, example):\n    return 1.0\n")
    r = Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:one", partial=True))
    assert r.engine_spec().rollout.partial
    assert not Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:one")
                      ).engine_spec().rollout.partial
    with pytest.raises(ValidationError, match=r"rollout\.partial: .* needs rollout\.episode"):
        Recipe(steps=1, rollout=RolloutConfig(partial=True))
    with pytest.raises(ValidationError, match=r"rollout\.partial: .* needs rollout\.episode"):
        Recipe(steps=1, rollout=RolloutConfig(partial=True, engine="vllm"))
    # A worker given such a spec by hand refuses it before loading anything.
    spec = Recipe(steps=1, model=ModelConfig(path=str(model_dir))).engine_spec()
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"partial": True})})
    with pytest.raises(ValueError, match=r"rollout\.partial: .* needs rollout\.episode"):
        make_hf_role("rollout", spec, 0)


UNTIL_NEW_VERSION = '''
import asyncio

FIRST_STEP = 8  # the first train step's episodes: groups_per_step x group_size
started = 0


async def until_new_version(policy, example):
    """The first step's episodes take one turn. Later ones take turns, pausing between them
    (as an agent waits on a tool), until the policy that generates them has moved on."""
    global started
    started += 1
    policy.add(example.prompt)
    turn = await policy.generate(max_new_tokens=4)
    t = policy.trajectory
    while started > FIRST_STEP and turn.version < 1 and len(t.context) < 250:
        await asyncio.sleep(0.1)
        turn = await policy.generate(max_new_tokens=1)
    return float(turn.token_ids[-1] % 2)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_run_loads_a_new_version_while_episodes_run(tmp_path: Path) -> None:
    from flowrl.controller import Controller
    from flowrl.recipe import AlgorithmConfig, DataConfig, TrainerConfig

    (tmp_path / "episodes.py").write_text(UNTIL_NEW_VERSION)
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=256)
    steps = 2
    r = Recipe(
        steps=steps, max_staleness=1, model=ModelConfig(path=str(model)),
        data=DataConfig(max_prompt_tokens=16), algorithm=AlgorithmConfig(group_size=4),
        rollout=RolloutConfig(episode=f"{tmp_path / 'episodes.py'}:until_new_version",
                              partial=True, groups_per_task=2, max_new_tokens=8),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=2),
    )
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=100)
    assert out["version"] == steps
    assert out["rows_trained_twice"] == 0
    # Step 1's episodes were running when version 1 came: the worker loaded it without
    # waiting for them, and they continued under it.
    interrupted = [e for e in ctl.events.recent if e["kind"] == "interrupted"]
    assert [(e["version"], e["tasks"]) for e in interrupted][:1] == [(1, 1)]
    marks = [(mk.worker, mk.name, mk.args["version"]) for mk in ctl.events.marks]
    assert marks[:1] == [(interrupted[0]["worker"], "interrupted", 1)]  # on its timeline
    first, second = ctl.step_log
    assert first["train_token_staleness"] == 0.0
    assert second["rollout_interrupted_episodes"] == 8.0
    # Their rows are as old as their oldest token, within the bound; newer tokens are fresher.
    assert second["staleness_max"] == 1
    assert 0.0 < second["train_token_staleness"] < 1.0
