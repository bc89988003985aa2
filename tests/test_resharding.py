"""Bucketed weight export (`workers.resharding`): the buckets' plan, the export from FSDP2
shards on two gloo ranks (equal to a whole gather bit for bit, one bucket of memory), and
their publication into a real store as one version (`workers.runtime.WeightPublisher`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import importlib
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
from workers.resharding import copy_into, export_bucketed, plan_buckets
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
