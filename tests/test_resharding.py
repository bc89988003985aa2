"""Bucketed weight export (`workers.resharding`): the buckets' plan, the export from FSDP2
shards on two gloo ranks (equal to a whole gather bit for bit, one bucket of memory), their
publication into a real store as one version (`workers.runtime.WeightPublisher`), and the
tensor-parallel split for an engine (slices that rebuild the whole tensor, a TP=2 layer equal
to the whole one, a bucketed export from FSDP2 shards into TP=2 targets)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import importlib
import json
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from transport.endpoints import ipc_endpoint
from transport.handles import Handle
from transport.store import SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer
from workers.resharding import (
    copy_into,
    export_bucketed,
    plan_buckets,
    tp_copy_into,
    tp_slice,
    tp_split_dim,
)
from workers.runtime import WeightPublisher, fetch_weights, publish_weights

pytestmark = pytest.mark.timeout(60)

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # bench/ is not a package the tests' path holds
    sys.path.insert(0, str(_ROOT))
reshard = importlib.import_module("bench.reshard")


def test_buckets_keep_the_order_and_hold_at_most_their_size() -> None:
    sizes = [("a", 40), ("b", 40), ("c", 30), ("big", 500), ("d", 10), ("e", 100)]
    assert plan_buckets(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"], ["e"]]
    assert plan_buckets(sizes, 1 << 30) == [[n for n, _ in sizes]]
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        plan_buckets(sizes, 0)


def test_a_bucket_is_dropped_before_the_next_is_gathered() -> None:
    named = [(f"w{i}", torch.full((256,), float(i))) for i in range(6)]
    handed: list[weakref.ref[torch.Tensor]] = []
    seen: dict[str, torch.Tensor] = {}

    def sink(bucket: dict[str, torch.Tensor]) -> None:
        # Nothing keeps the buckets handed over before this one (no second bucket alive).
        gc.collect()
        assert all(ref() is None for ref in handed)
        handed.extend(weakref.ref(t) for t in bucket.values())
        seen.update({n: t.clone() for n, t in bucket.items()})
        for t in bucket.values():  # the bucket is a copy: writing it changes no source
            t.fill_(-1.0)

    assert export_bucketed(named, 2 * 256 * 4, sink) == 3
    assert list(seen) == [n for n, _ in named]
    assert all(torch.equal(seen[n], t) for n, t in named)
    assert all(torch.equal(t, torch.full((256,), float(i))) for i, (_, t) in enumerate(named))


def test_buckets_copied_into_place_fill_the_targets_and_check_their_shapes() -> None:
    named = [(f"w{i}", torch.randn(8, 4)) for i in range(5)]
    targets = {n: torch.zeros(8, 4) for n, _ in named}
    pointers = {n: t.data_ptr() for n, t in targets.items()}
    assert export_bucketed(named, 2 * 8 * 4 * 4, copy_into(targets)) == 3
    assert all(torch.equal(targets[n], t) for n, t in named)
    assert {n: t.data_ptr() for n, t in targets.items()} == pointers  # in place
    with pytest.raises(ValueError, match=r"w0: shape \(8, 4\) into \(4, 8\)"):
        export_bucketed(named, 1 << 20, copy_into({n: torch.zeros(4, 8) for n, _ in named}))
    with pytest.raises(KeyError, match="w4"):
        export_bucketed(named, 1 << 20, copy_into({n: t for n, t in targets.items()
                                                   if n != "w4"}))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bucketed_export_equals_a_whole_gather_bit_for_bit_in_one_bucket_of_memory(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    reshard.build(model, hidden=128, layers=4)
    # As bench/colocated.py runs it: the ranks start, say they are ready, and measure on `go`.
    go, ready = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(reshard.measure_reshard, model, buckets=(4,), repeats=1,
                             tmp=tmp_path, timeout_s=120, go=go, ready=ready)
        try:
            assert ready.wait(120)
            assert not future.done()  # waiting for the signal, not measuring
        finally:
            go.set()
        figures = future.result(timeout=150)
    assert figures["reshard_bit_equal"] is True
    # A whole gather holds a second model; four buckets about a quarter (plus one tensor's
    # gather, the largest being a few percent of this model).
    assert figures["reshard_peak_extra_share_whole"] > 0.8
    assert figures["reshard_peak_extra_share_4"] < 0.5


async def test_buckets_published_from_a_thread_are_one_version(run_id: str) -> None:
    endpoint = ipc_endpoint(run_id, "store")
    store = SampleStore(run_id, "node0", capacity_bytes=64 << 20)
    weights = {f"layer{i}.weight": torch.randn(64, 32) for i in range(5)}
    weights["norm"] = torch.randn(32, dtype=torch.float64)  # a second dtype
    try:
        async with StoreServer(store, endpoint), StoreClient(run_id, "node0", endpoint) as client:
            publish = WeightPublisher(client, asyncio.get_running_loop())
            published: dict[str, list[object]] = {}

            def export() -> int:  # in a compute thread, as a trainer's step end runs
                return export_bucketed(list(weights.items()), 64 * 32 * 4 * 2,
                                       lambda bucket: published.update(publish(bucket)))

            assert await asyncio.to_thread(export) == 3  # 2 + 2 + (1 and the norm)
            # The buckets' handles, merged, are one version as one put would give it.
            whole = await publish_weights(client, weights)
            assert list(published) == list(whole)
            assert [v[1] for v in published.values()] == [v[1] for v in whole.values()]
            segments = {Handle.from_wire(v[0]).segment for v in published.values()}
            assert len(segments) == 3
            loaded = await fetch_weights(client, published)
            assert all(torch.equal(loaded[n], w) for n, w in weights.items())
            del loaded
            # Called on its own loop it would wait for itself: refused.
            with pytest.raises(RuntimeError, match="its own event loop"):
                publish(weights)
            # A failed export frees what it had published.
            assert store.statistics().segments == 3 + 1
            await asyncio.to_thread(publish.discard, published)
            assert store.statistics().segments == 1
            await client.free([Handle.from_wire(v[0]) for v in whole.values()])
    finally:
        store.close()


async def test_a_data_parallel_rank_publishes_in_buckets_and_frees_them_if_its_step_fails(
    tmp_path: Path, run_id: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from test_dp_trainer import PAD, SETTINGS, micro_batches, train_task

    import workers.roles.dp_trainer as dp_trainer
    from flowrl.tiny_model import build_tiny_model
    from workers.distributed import DataParallel
    from workers.engines import TorchTrainerEngine

    model = build_tiny_model(tmp_path / "tiny", vocab_size=300, hidden=32, layers=2, heads=2,
                             kv_heads=1, max_positions=64)
    # Rank 0 of a replicated group whose collectives run in a group of this one process: the
    # role's export and publication are the real ones, without a second process.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    endpoint = ipc_endpoint(run_id, "store")
    store = SampleStore(run_id, "node0", capacity_bytes=64 << 20)
    try:
        group = DataParallel(rank=0, world=2, init_method="file:///unused",
                             export_bucket_bytes=16 << 10)
        engine = TorchTrainerEngine(model, lr=1e-3, device="cpu")
        role = dp_trainer.DataParallelTrainerRole(engine, SETTINGS, pad_token_id=PAD,
                                                  group=group)
        async with StoreServer(store, endpoint), StoreClient(run_id, "node0", endpoint) as client:
            role.bind_weight_publisher(WeightPublisher(client, asyncio.get_running_loop()))
            inputs, groups = micro_batches(1)[0]
            out = await role.run(train_task(len(groups), groups, end=True), inputs)
            assert out.weights is None
            assert out.published is not None
            segments = {Handle.from_wire(v[0]).segment for v in out.published.values()}
            assert len(segments) > 3  # bucket by bucket ...
            loaded = await fetch_weights(client, out.published)
            want = engine.export_weights()
            assert list(loaded) == list(want)  # ... one version: what one export holds
            assert all(torch.equal(loaded[n], w) for n, w in want.items())
            del loaded
            await client.free([Handle.from_wire(v[0]) for v in out.published.values()])
            assert store.statistics().segments == 0

            def peer_gone(params: object) -> float:
                raise RuntimeError("a peer rank is gone")

            # A step end that fails after its export (a collective whose peer died) reports
            # nothing: the buckets it wrote are freed, not left taken until the run ends.
            monkeypatch.setattr(dp_trainer, "parameter_checksum", peer_gone)
            with pytest.raises(RuntimeError, match="a peer rank is gone"):
                await role.run(train_task(len(groups), groups, end=True), inputs)
            assert store.statistics().segments == 0
    finally:
        store.close()
        dist.destroy_process_group()


# ---- tensor-parallel split -----------------------------------------------------------------


def _tiny(path: Path) -> Path:
    from flowrl.tiny_model import build_tiny_model

    # 4 heads of 8, 2 key/value heads: both divide by a TP size of 2.
    return build_tiny_model(path, vocab_size=300, hidden=32, layers=2, heads=4, kv_heads=2,
                            intermediate=48, max_positions=64)


def _qwen2(**extra: object) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at zero: random ones so that their split is seen
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return model


def test_the_tp_slices_of_all_ranks_rebuild_each_whole_tensor_bit_for_bit() -> None:
    model = _qwen2()
    state = model.state_dict()
    splits = {tp_split_dim(n) for n in state}
    assert splits == {0, 1, None}
    assert tp_split_dim("model.layers.0.self_attn.q_proj.bias") == 0
    assert tp_split_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert tp_split_dim("model.layers.0.self_attn.o_proj.bias") is None  # added once, whole
    assert tp_split_dim("model.embed_tokens.weight") == 0
    assert tp_split_dim("lm_head.weight") == 0
    assert tp_split_dim("model.layers.0.input_layernorm.weight") is None
    for size in (1, 2):
        for name, whole in state.items():
            parts = [tp_slice(name, whole, r, size, head_dim=8) for r in range(size)]
            dim = tp_split_dim(name)
            if dim is None:
                assert all(p is whole for p in parts)
                continue
            storage = whole.untyped_storage().data_ptr()  # views, no copies:
            assert all(p.untyped_storage().data_ptr() == storage for p in parts)
            rebuilt = torch.cat(parts, dim)
            assert rebuilt.dtype == whole.dtype
            assert torch.equal(rebuilt, whole), name


def test_a_tp_split_that_does_not_divide_is_refused_with_its_reason() -> None:
    w = torch.zeros(6, 4)
    with pytest.raises(ValueError, match=r"q_proj.weight: dim 0 of \(6, 4\) \(6\) does not "
                                         r"divide by the tensor-parallel size 4"):
        tp_slice("model.layers.0.self_attn.q_proj.weight", w, 0, 4)
    with pytest.raises(ValueError, match=r"down_proj.weight: dim 1 of \(6, 4\) \(4\)"):
        tp_slice("model.layers.0.mlp.down_proj.weight", w, 0, 3)
    # 6 rows are 3 heads of 2: two ranks would each hold a head and a half.
    with pytest.raises(ValueError, match="3 heads of 2 do not divide by the tensor-parallel "
                                         "size 2"):
        tp_slice("model.layers.0.self_attn.k_proj.weight", w, 1, 2, head_dim=2)
    assert tp_slice("model.layers.0.self_attn.k_proj.weight", w, 1, 2, head_dim=3).shape == (3, 4)
    with pytest.raises(ValueError, match=r"rotary\.inv_freq: no tensor-parallel layout"):
        tp_split_dim("model.rotary.inv_freq")
    with pytest.raises(ValueError, match="need 0 <= rank < size"):
        tp_slice("model.norm.weight", w, 2, 2)


def _parts(layer: torch.nn.Module, prefix: str, rank: int) -> dict[str, torch.Tensor]:
    return {n: tp_slice(f"{prefix}.{n}", t, rank, 2, head_dim=8)
            for n, t in layer.state_dict().items()}


def test_a_tp2_mlp_and_attention_from_the_slices_equal_the_whole_layers() -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv

    model = _qwen2()
    layer = model.model.layers[0]
    torch.manual_seed(1)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        # MLP: gate and up column-parallel, down row-parallel; the partial sums added.
        mlp = layer.mlp
        partial = []
        for rank in range(2):
            p = _parts(mlp, "model.layers.0.mlp", rank)
            h = torch.nn.functional.silu(x @ p["gate_proj.weight"].T) * (x @ p["up_proj.weight"].T)
            partial.append(h @ p["down_proj.weight"].T)
        assert partial[0].shape == (2, 5, 32)
        torch.testing.assert_close(partial[0] + partial[1], mlp(x), atol=1e-6, rtol=0)

        # Attention: each rank its heads (2 of 4) and key/value heads (1 of 2), o_proj's
        # partial sums added, its bias (if any) once.
        attn = layer.self_attn
        positions = torch.arange(5).expand(2, 5)
        cos, sin = model.model.rotary_emb(x, positions)
        mask = torch.full((5, 5), torch.finfo(x.dtype).min).triu(1)[None, None]
        whole, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
        out = torch.zeros(2, 5, 32)
        for rank in range(2):
            p = _parts(attn, "model.layers.0.self_attn", rank)

            def heads(name: str, p: dict[str, torch.Tensor] = p) -> torch.Tensor:
                y = x @ p[f"{name}.weight"].T + p[f"{name}.bias"]
                return y.view(2, 5, -1, 8).transpose(1, 2)

            q, k = apply_rotary_pos_emb(heads("q_proj"), heads("k_proj"), cos, sin)
            assert (q.shape[1], k.shape[1]) == (2, 1)
            k, v = repeat_kv(k, 2), repeat_kv(heads("v_proj"), 2)
            scores = (q @ k.transpose(2, 3)) * 8 ** -0.5 + mask
            y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 16)
            out += y @ p["o_proj.weight"].T
        torch.testing.assert_close(out, whole, atol=1e-6, rtol=0)


def test_tp_targets_are_filled_in_place_one_bucket_at_a_time() -> None:
    model = _qwen2()
    named = list(model.state_dict().items())
    targets = [{n: torch.full_like(tp_slice(n, t, r, 2), float("nan")) for n, t in named}
               for r in range(2)]
    pointers = [{n: t.data_ptr() for n, t in ts.items()} for ts in targets]
    assert export_bucketed(named, 4096, tp_copy_into(targets, head_dim=8)) > 3
    for r in range(2):
        assert {n: t.data_ptr() for n, t in targets[r].items()} == pointers[r]
        assert all(torch.equal(targets[r][n], tp_slice(n, t, r, 2)) for n, t in named)
    wrong = [{n: torch.zeros(1) for n, _ in named}] * 2
    with pytest.raises(ValueError, match="TP rank 0's part"):
        export_bucketed(named, 4096, tp_copy_into(wrong))
    with pytest.raises(ValueError, match="at least one TP rank"):
        tp_copy_into([])


def _fsdp_into_tp_rank(rank: int, store: str, model: str, out: str) -> None:
    """One of two gloo ranks: the FSDP2-sharded model exported in buckets into TP=2 targets,
    against slices of a whole gather."""
    import torch.distributed as dist

    from workers.engines import TorchTrainerEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        engine = TorchTrainerEngine(model, device="cpu")
        engine.shard()
        whole = engine.export_weights()  # a collective: one whole gather
        targets = [{n: torch.full_like(tp_slice(n, t, r, 2, head_dim=8), float("nan"))
                    for n, t in whole.items()} for r in range(2)]
        pointers = [{n: t.data_ptr() for n, t in ts.items()} for ts in targets]
        made = engine.export_bucketed(16 << 10, tp_copy_into(targets, head_dim=8))
        equal = all(torch.equal(targets[r][n], tp_slice(n, t, r, 2))
                    and targets[r][n].data_ptr() == pointers[r][n]
                    for r in range(2) for n, t in whole.items())
        Path(f"{out}.{rank}").write_text(json.dumps({"equal": equal, "buckets": made,
                                                     "names": len(whole)}))
        # Both ranks done with every collective before either tears gloo down (as in
        # `bench/reshard.py`): without it a rank aborted at exit, exit -6, under load.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_bucketed_export_from_fsdp2_shards_into_tp2_targets_equals_slicing_a_whole_gather(
    tmp_path: Path,
) -> None:
    model = _tiny(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": str(_ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, __file__, "tp-rank", str(r),
                               str(tmp_path / "pg"), str(model), str(tmp_path / "out")],
                              env=env) for r in range(2)]
    try:
        assert [p.wait(timeout=150) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert all(r["equal"] for r in results)
    assert results[0]["buckets"] > 1
    assert results[0]["names"] > 10


if __name__ == "__main__" and sys.argv[1:2] == ["tp-rank"]:
    _fsdp_into_tp_rank(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
