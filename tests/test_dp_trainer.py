"""Data-parallel trainer ranks: exactness against one process, the controller's sharing of a
step among the ranks, a real two-rank run, a lost rank, and the recipe's rules.

The rank processes are real (``python tests/test_dp_trainer.py rank ...`` joins a gloo group
through a file store) and exchange results through safetensors and JSON files, not pickle.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from test_roles import synthetic_groups
from torch import Tensor

from flowrl.controller import Controller, RunError
from flowrl.dp import RankShares, StepDivergence, merge_step_ends, pair_closing
from flowrl.recipe import (
    AlgorithmConfig,
    ClusterSettings,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_spec import DataParallelSpec
from transport.handles import Handle
from workers.distributed import DataParallel, full_tensor, local_part
from workers.engines import TorchTrainerEngine
from workers.engines.protocols import TrainerState
from workers.roles.trainer import TrainerRole, TrainSettings

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PAD = 1
MAX_NEW = 8
LR = 1e-3
SETTINGS = TrainSettings(algorithm="grpo", loss_agg="token-mean", kl_coef=0.05, tis_cap=1.5,
                         max_new_tokens=MAX_NEW * 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dp") / "tiny", vocab_size=300)


# ---- the exact step: two gloo ranks against one process ------------------------------------------


#: each rank's micro-batches: (group sizes, data seed); the shares differ in rows and tokens,
#: so a rank normalising by its own count (or averaging the ranks) is measurably wrong.
SHARES: dict[int, list[tuple[list[int], int]]] = {0: [([3, 3], 1), ([3], 2)], 1: [([4], 3)]}


def micro_batches(rank: int) -> list[tuple[dict[str, list[Any]], list[int]]]:
    out = []
    for sizes, seed in SHARES[rank]:
        row_groups = [g for g, n in enumerate(sizes) for _ in range(n)]
        # -ln 300: the dp model's vocabulary is smaller than test_roles'.
        out.append((synthetic_groups(sizes, seed, logprob_mean=-5.7), row_groups))
    return out


#: the step's most micro-batches on one rank (a sharded rank with fewer runs empty passes).
PASSES = max(len(share) for share in SHARES.values())


def train_task(rows: int, row_groups: Sequence[int], *, end: bool) -> Any:
    return {"task_id": 1, "stage": "train", "rows": list(range(rows)),
            "groups": sorted(set(row_groups)), "row_groups": list(row_groups), "inputs": {},
            "params": {"step": 0, "step_end": end, "passes": PASSES}}


class SpyEngine(TorchTrainerEngine):
    """Keeps the gradients the optimizer step sees (normalised, before clipping)."""

    grads: dict[str, Tensor]

    def optimizer_step(self) -> dict[str, float]:
        self.grads = {n: full_tensor(p.grad).clone() for n, p in self.model.named_parameters()
                      if p.grad is not None}
        return super().optimizer_step()


async def one_step(role: TrainerRole,
                   batches: Sequence[tuple[dict[str, list[Any]], list[int]]]) -> dict[str, float]:
    for i, (inputs, groups) in enumerate(batches):
        out = await role.run(train_task(len(groups), groups, end=i == len(batches) - 1), inputs)
    assert out.version == 1
    return out.metrics


def rank_main(rank: int, store: str, model: str, out_dir: str, sharding: str) -> None:
    """One rank of the exactness test, in its own process."""
    from workers.roles.dp_trainer import DataParallelTrainerRole

    torch.set_num_threads(1)
    # "fsdp2-bfloat16": sharded, passes in bfloat16 (FSDP2 mixed precision).
    sharding, _, compute = sharding.partition("-")
    group = DataParallel(rank=rank, world=2, init_method=f"file://{store}", timeout_s=200,
                         sharding=sharding, compute_dtype=compute or "float32")
    # Another seed on each rank: the role must give every rank rank 0's parameters.
    engine = SpyEngine(model, lr=LR, device="cpu", dtype=torch.float64, seed=rank)
    group.join(engine.device)
    role = DataParallelTrainerRole(engine, SETTINGS, pad_token_id=PAD, group=group)
    generator = None
    if group.sharded:  # as colocated placement does: the step end also loads an engine
        from workers.engines.hf_rollout import HFRolloutEngine
        from workers.resharding import copy_into

        generator = HFRolloutEngine(model, device="cpu", dtype=torch.float64)
        role.load_engine_with(copy_into(generator.weight_targets))
    metrics = asyncio.run(one_step(role, micro_batches(rank)))
    # The optimizer state gathers whole and loads back into this rank's shards (as a resumed
    # rank loads its checkpoint's).
    state = engine.state_dict()
    again = TorchTrainerEngine(model, lr=LR, device="cpu", dtype=torch.float64)
    if group.sharded:
        again.shard()
    again.load_state_dict(state)
    back = again.state_dict()
    metrics["state_round_trip"] = float(all(torch.equal(back.tensors[k], v)
                                            for k, v in state.tensors.items()))
    # What this rank holds of the parameters: everything, or its shard.
    metrics["held"] = sum(local_part(p).numel() for p in engine.model.parameters())
    params = {n: full_tensor(p.detach()).clone() for n, p in engine.model.named_parameters()}
    if generator is not None:  # the engine's load equals a whole gather, bit for bit
        metrics["engine_exact"] = float(all(torch.equal(generator.weight_targets[n], p)
                                            for n, p in params.items()))
    out = Path(out_dir)
    save_file(params, str(out / f"params{rank}.safetensors"))
    save_file(engine.grads, str(out / f"grads{rank}.safetensors"))
    (out / f"metrics{rank}.json").write_text(json.dumps(metrics))
    DataParallel.leave()


def concat(*parts: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}


async def single_process_step(
    model_dir: Path, batches: Sequence[tuple[dict[str, list[Any]], list[int]]],
) -> tuple[SpyEngine, dict[str, float]]:
    """One trainer stepping on ``batches`` concatenated into one micro-batch."""
    groups: list[int] = []
    for _, gids in batches:
        groups += [max(groups, default=-1) + 1 + g for g in gids]
    engine = SpyEngine(model_dir, lr=LR, device="cpu", dtype=torch.float64)
    role = TrainerRole(engine, SETTINGS, pad_token_id=PAD)
    metrics = await one_step(role, [(concat(*(b for b, _ in batches)), groups)])
    return engine, metrics


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["replicate", "fsdp2", "fsdp2-bfloat16"])
async def test_two_gloo_ranks_take_exactly_the_single_process_step(
    model_dir: Path, tmp_path: Path, sharding: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [await asyncio.create_subprocess_exec(
        sys.executable, __file__, "rank", str(r), str(tmp_path / "store"), str(model_dir),
        str(tmp_path), sharding, cwd=ROOT, env=env, stderr=asyncio.subprocess.PIPE)
        for r in (0, 1)]
    try:
        # The reference steps meanwhile: the same rows, one process, one micro-batch; and
        # each rank's share alone (for the check below that the test can fail).
        whole, want = await single_process_step(model_dir, micro_batches(0) + micro_batches(1))
        own = [await single_process_step(model_dir, micro_batches(r)) for r in (0, 1)]
        for r in ranks:
            async with asyncio.timeout(240):
                _, err = await r.communicate()
            assert r.returncode == 0, err.decode()[-3000:]
    finally:
        for r in ranks:
            if r.returncode is None:
                r.kill()
                await r.wait()
    params = [load_file(str(tmp_path / f"params{r}.safetensors")) for r in (0, 1)]
    grads = [load_file(str(tmp_path / f"grads{r}.safetensors")) for r in (0, 1)]
    metrics = [json.loads((tmp_path / f"metrics{r}.json").read_text()) for r in (0, 1)]
    total = sum(p.numel() for p in whole.model.parameters())
    if sharding.startswith("fsdp2"):  # each rank holds about half (FSDP2 pads uneven shards)
        assert metrics[0]["held"] + metrics[1]["held"] == pytest.approx(total, rel=0.01)
        assert max(metrics[0]["held"], metrics[1]["held"]) < 0.6 * total
        # Every rank loaded its rollout engine with the new weights, whole and exact.
        for r in (0, 1):
            assert metrics[r]["engine_exact"] == 1.0
            assert metrics[r]["engine_sync_s"] > 0
            assert metrics[r]["engine_sync_buckets"] >= 1
    else:
        assert metrics[0]["held"] == metrics[1]["held"] == total
    # The ranks hold bit-identical parameters after the step, and say so.
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])
    assert metrics[0]["param_checksum"] == metrics[1]["param_checksum"]
    assert metrics[0]["state_round_trip"] == metrics[1]["state_round_trip"] == 1.0
    assert (metrics[0]["rank_tokens"] + metrics[1]["rank_tokens"]) == want["tokens"]
    # ... and they equal one process's step on the whole batch.
    reference = dict(whole.model.named_parameters())
    assert grads[0].keys() == whole.grads.keys()
    if sharding == "fsdp2-bfloat16":
        # Passes in bfloat16 (8 bits of mantissa): the step is the same one, to bfloat16's
        # precision, and measurably not the float64 one (so the passes did run in bfloat16).
        diff = torch.cat([(grads[0][n] - g).flatten() for n, g in whole.grads.items()])
        norm = torch.cat([g.flatten() for g in whole.grads.values()]).norm()
        assert 1e-5 < float(diff.norm() / norm) < 2e-2
        for name in whole.grads:  # an Adam step of lr 1e-3 moves each by about 1e-3
            torch.testing.assert_close(params[0][name], reference[name].detach(), atol=2.5e-3,
                                       rtol=0, msg=name)
        for key in ("loss", "grad_norm", "tokens", "seqs", "reward_mean"):
            assert metrics[0][key] == pytest.approx(want[key], abs=1e-3, rel=2e-2), key
        return
    for name, g in whole.grads.items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-6, msg=name)
        torch.testing.assert_close(params[0][name], reference[name].detach(), atol=1e-6,
                                   rtol=1e-6, msg=name)
    for key in ("loss", "kl", "tis_mean", "grad_norm", "tokens", "seqs", "reward_mean"):
        assert metrics[0][key] == pytest.approx(want[key], abs=1e-6, rel=1e-6), key

    # The check can fail: averaging the ranks' own normalised gradients (DDP's mean over
    # per-rank mean losses) is not the step's gradient when the ranks' token counts differ.
    name = next(iter(whole.grads))
    naive = (own[0][0].grads[name] + own[1][0].grads[name]) / 2
    assert float((naive - whole.grads[name]).abs().max()) > 1e-4


# ---- the controller's share of a step (pure) ---------------------------------------------------


def test_closing_pairs_minimise_the_largest_rank_load() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 5)
        loads = {f"r{i}": rng.randint(0, 50) for i in range(n)}
        items = [(i, rng.randint(1, 40)) for i in range(n)]
        placed = dict(pair_closing(loads, items))
        assert sorted(placed.values()) == list(range(n))  # one item per rank
        tokens = dict(items)
        got = max(loads[r] + tokens[i] for r, i in placed.items())
        best = min(max(loads[r] + tokens[i] for r, i in zip(loads, perm, strict=True))
                   for perm in itertools.permutations(range(n)))
        assert got == best
    with pytest.raises(ValueError, match="one each"):
        pair_closing({"a": 0, "b": 0}, [(0, 1)])


@pytest.mark.parametrize(("ranks", "groups", "micro"), [(2, 4, 2), (2, 8, 3), (3, 9, 1),
                                                         (4, 4, 1), (2, 16, 8)])
def test_every_rank_gets_a_share_and_one_step_end(ranks: int, groups: int, micro: int) -> None:
    rng = random.Random(ranks * 100 + groups)
    shares: RankShares[int] = RankShares(ranks, groups, micro)
    names = [f"train-{r}" for r in range(ranks)]
    for _step in range(5):
        given: dict[str, list[int]] = {r: [] for r in names}
        ends: dict[str, int] = dict.fromkeys(names, 0)
        tokens: dict[str, int] = dict.fromkeys(names, 0)
        in_step = 0
        while in_step < groups:
            k = shares.want(in_step)
            assert 1 <= k <= micro
            task_tokens = sum(rng.randint(1, 50) for _ in range(k))
            if not shares.closing(in_step):
                rank = shares.choose(names)
                assert rank is not None
                assert tokens[rank] == min(tokens.values())  # the least loaded rank
                shares.add(rank, task_tokens)
                given[rank].append(k)
                tokens[rank] += task_tokens
                in_step += k
                continue
            assert k == 1
            in_step += 1
            passes = shares.passes()
            placed = shares.hold(len(shares.held), task_tokens, names)
            if placed is None:
                continue
            assert in_step == groups
            assert sorted(r for r, _ in placed) == sorted(names)
            for rank, _item in placed:
                given[rank].append(1)
                ends[rank] += 1
            # The step's end tells every rank the busiest rank's micro-batches.
            assert passes == max(len(g) for g in given.values())
        assert sum(map(sum, given.values())) == groups
        assert all(given[r] for r in names)
        assert set(ends.values()) == {1}
        assert shares.tokens == {}  # the next step starts afresh


def test_step_ends_merge_only_when_the_ranks_agree() -> None:
    def report(version: int, checksum: float, weights: bool, tokens: float) -> dict[str, Any]:
        return {"version": version, "weights": {"w": [1]} if weights else None,
                "metrics": {"loss": 0.5, "param_checksum": checksum, "rank_tokens": tokens}}

    merged = merge_step_ends([report(1, 2.5, False, 30.0), report(1, 2.5, True, 10.0)])
    assert merged["weights"] == {"w": [1]}
    assert merged["metrics"]["ranks"] == 2.0
    assert merged["metrics"]["rank_imbalance"] == pytest.approx(1.5)
    assert "rank_tokens" not in merged["metrics"]
    with pytest.raises(StepDivergence, match="diverged"):
        merge_step_ends([report(1, 2.5, True, 1.0), report(1, 2.6, False, 1.0)])
    with pytest.raises(StepDivergence, match="exactly one"):
        merge_step_ends([report(1, 2.5, True, 1.0), report(1, 2.5, True, 1.0)])
    with pytest.raises(StepDivergence, match="versions"):
        merge_step_ends([report(1, 2.5, True, 1.0), report(2, 2.5, False, 1.0)])


def test_a_rank_is_its_process_index() -> None:
    section = DataParallelSpec(world=2, sharding="replicate", compute_dtype="float32")
    group = DataParallel.of_process(section, process="train.1", run_dir=Path("/tmp/flowrl-x"))
    assert (group.rank, group.world) == (1, 2)
    assert group.init_method == "file:///tmp/flowrl-x/train-ranks.store"
    again = section.model_copy(update={"generation": 2})
    assert DataParallel.of_process(again, process="train.0", run_dir=Path("/x")).init_method == (
        "file:///x/train-ranks.store.2")  # a restarted group meets in a fresh store
    with pytest.raises(ValueError, match=r"train\.<rank>"):
        DataParallel.of_process(section, process="trainer", run_dir=Path("/x"))
    with pytest.raises(ValueError, match="loopback"):
        DataParallel(rank=0, world=2, init_method="tcp://10.0.0.1:29500")


# ---- the recipe --------------------------------------------------------------------------------


def test_a_split_that_leaves_a_rank_idle_names_the_field() -> None:
    with pytest.raises(ValidationError, match=r"micro_batch_groups") as excinfo:
        TrainerConfig(ranks=4, groups_per_step=8, micro_batch_groups=4)
    assert "ranks=4" in str(excinfo.value)
    with pytest.raises(ValidationError, match=r"micro_batch_groups"):
        TrainerConfig(ranks=3, groups_per_step=2)
    with pytest.raises(ValidationError, match=r"sharding: 'fsdp2' shards the model"):
        TrainerConfig(sharding="fsdp2")
    with pytest.raises(ValidationError, match=r"compute_dtype: 'bfloat16' is FSDP2 mixed"):
        TrainerConfig(ranks=2, compute_dtype="bfloat16")
    dp = Recipe(steps=1, trainer=TrainerConfig(
        ranks=2, groups_per_step=4, sharding="fsdp2", compute_dtype="bfloat16"),
    ).engine_config()["data_parallel"]
    assert dp == {"world": 2, "sharding": "fsdp2", "compute_dtype": "bfloat16",
                  "export_bucket_bytes": 256 << 20, "timeout_s": 600.0, "store": "",
                  "generation": 0}
    with pytest.raises(ValidationError, match=r"export_bucket_mb"):
        TrainerConfig(ranks=2, groups_per_step=4, export_bucket_mb=0)
    with pytest.raises(ValidationError, match=r"trainer\.ranks"):
        Recipe(steps=1, rollout=RolloutConfig(engine="sim"), trainer=TrainerConfig(ranks=2))
    with pytest.raises(ValidationError, match=r"placement\.roles\.train"):
        Recipe(steps=1, trainer=TrainerConfig(ranks=2, groups_per_step=4),
               placement=PlacementConfig(roles={"train": ("a", "b")},
                                         cluster=ClusterSettings(keys_file="/tmp/keys.json")))
    spec = Recipe(steps=1, trainer=TrainerConfig(ranks=2, groups_per_step=4,
                                                 micro_batch_groups=2)).to_pipeline()
    assert spec.engine_config["data_parallel"]["world"] == 2
    assert Recipe(steps=1).to_pipeline().engine_config["data_parallel"] is None


# ---- a real run with two ranks ------------------------------------------------------------------


REWARD = """
def response_length(prompt, response, *, answer, **_):
    # Responses of one group earn different rewards, so the advantages are not all zero.
    return float(len(response))
"""


# Three runs (60 + 90 + 60 s at most): on two busy cores they took 45-65 s, and once 120;
# 102 s beside a `make demo` on a host three times slower at plain Python.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["replicate", "fsdp2"])
async def test_a_two_rank_run_stays_in_sync_and_a_lost_rank_restarts_the_group(
    model_dir: Path, tmp_path: Path, sharding: Literal["replicate", "fsdp2"]
) -> None:
    (tmp_path / "reward.py").write_text(REWARD)
    recipe = Recipe(
        steps=3, model=ModelConfig(path=str(model_dir)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=2),
        reward=RewardConfig(fn=f"{tmp_path / 'reward.py'}:response_length"),
        rollout=RolloutConfig(max_new_tokens=4, groups_per_task=2),
        # Buckets of 64 KiB: rank 0 publishes each version in many (the model is ~1 MB).
        trainer=TrainerConfig(lr=1e-3, groups_per_step=4, micro_batch_groups=1, ranks=2,
                              sharding=sharding, export_bucket_mb=1 / 16),
        output=str(tmp_path / "out"), checkpoint_every=3,
        placement=PlacementConfig(max_restarts=1),
    )
    async with Controller(recipe.to_pipeline()) as ctl:
        out = await ctl.run(steps=recipe.steps, timeout_s=60)
        assert out["version"] == 3
        assert out["rows_trained_twice"] == 0
        assert ctl.status()["errors"] == []
        log = ctl.step_log
        # Each step was committed from both ranks' ends, which agreed on their parameters
        # (the controller stops the run when they do not), and the parameters moved.
        assert [s["train_ranks"] for s in log] == [2.0] * 3
        checksums = [s["train_param_checksum"] for s in log]
        assert len(set(checksums)) == 3
        assert all(s["train_rank_imbalance"] >= 1.0 for s in log)
        assert all(s["train_tokens"] > 0 for s in log)
        # One weight export per step (the controller refuses a step exported twice).
        published = [e["version"] for e in ctl.events.recent if e["kind"] == "version"]
        assert published == [1, 2, 3]
        # Rank 0 wrote the checkpoint: whole weights and optimizer state (gathered when
        # sharded), loadable as one model.
        saved = TrainerState.load(tmp_path / "out" / "step_3")
        moments = {k: v for k, v in saved.tensors.items() if k.endswith("/exp_avg")}
        reloaded = TorchTrainerEngine(tmp_path / "out" / "step_3", device="cpu")
        shapes = {n: p.shape for n, p in reloaded.model.named_parameters()}
        assert {k.rpartition("/")[0]: v.shape for k, v in moments.items()} == shapes
        # Rank 0 wrote the final model too, once: the same whole weights.
        assert log[-1]["train_final_saved"] == 1.0
        final = TorchTrainerEngine(tmp_path / "out" / "final", device="cpu")
        assert all(torch.equal(p, dict(reloaded.model.named_parameters())[n])
                   for n, p in final.model.named_parameters())
        # The version was published bucket by bucket (several segments), whole: every weight
        # once, at its shape, which the rollout workers loaded to serve it.
        wire = ctl.weights.get(3)
        assert wire is not None
        assert len({Handle.from_wire(h).segment for h, _ in wire.values()}) > 4
        assert {n: tuple(shape) for n, (_, shape) in wire.items()} == {
            n: tuple(p.shape) for n, p in final.model.named_parameters()}

        # A rank that dies mid-run takes the group down: every rank is started again (in a
        # fresh rendezvous), loads the current version, and the step is redone; nothing is
        # trained twice and the ranks agree again.
        def rank(n: int) -> int:
            return next(w.pid for w in ctl.registry.of_role("train")
                        if w.name.startswith(f"train.{n}"))

        old = ctl.worker_pids("train")
        run = asyncio.ensure_future(ctl.run(steps=2, timeout_s=90))
        ctl.kill_worker_process(rank(1))
        out = await run
        assert out["version"] == 5
        assert out["rows_trained_twice"] == 0
        assert ctl.restarts == 1
        assert not set(old) & set(ctl.worker_pids("train"))  # rank 0 was restarted too
        assert [s["train_ranks"] for s in ctl.step_log[3:]] == [2.0] * 2

        # One more death than max_restarts stops the run with an error naming the rank.
        run = asyncio.ensure_future(ctl.run(steps=2, timeout_s=60))
        ctl.kill_worker_process(rank(0))
        with pytest.raises(RunError, match=r"rank train\.0.*max_restarts is 1"):
            await run


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
