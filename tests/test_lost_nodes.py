"""`LostNodes` over a real index: a group with data on a lost node's store is dropped once no
task holds it, a held one is trained as usual or dropped after its task fails, and only groups
with data there are touched."""

from __future__ import annotations

from flowrl.control.lost_nodes import LostNodes
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index
from transport.handles import Handle, handle_node, handle_nodes, handle_to_wire


def graph() -> StageGraph:
    return StageGraph(
        [StageSpec("rollout", ("prompt",), ("response",), micro_batch=2),
         StageSpec("reward", ("response",), ("reward",), micro_batch=2),
         StageSpec("train", ("response", "reward"), micro_batch=1, group_level=True)],
        source_fields=("prompt",),
    )


def on(node: str, offset: int) -> object:
    return handle_to_wire(Handle(node, "seg", offset, "int64", (4,)))


def generated(ix: Index, node: str) -> int:
    """A group of two rows whose responses are on ``node``'s store; rewards are inline."""
    gid = ix.add_group(2, {"prompt": [0, 1]})
    t = ix.request("rollout")
    assert t is not None
    ix.complete(t.id, {"response": [on(node, 0), on(node, 64)]}, version=0)
    return gid


def test_handle_node_reads_a_handles_node_and_nothing_else() -> None:
    assert handle_node(on("a", 0)) == "a"
    assert handle_node(0.5) is None  # an inline value (a reward)
    assert handle_node([1, 2]) is None


def test_handle_nodes_reads_each_node_whatever_the_form() -> None:
    bad = handle_to_wire(Handle("c", "seg", 0, "int64", (4,)))._replace(data=b"\xc1")
    assert handle_nodes([on("a", 0), on("b", 32)]) == ["a", "b"]  # decoded in one call
    assert handle_nodes([on("a", 0), bad, on("b", 32)]) == ["a", None, "b"]
    assert handle_nodes([["a", "seg", 0, "int64", [4]], on("b", 32), 0.5, [1]]) == [
        "a", "b", None, None]
    assert handle_nodes([]) == []
    # read from a handle's leading bytes: a long name (not a fixstr) is decoded instead, and
    # bytes that are no name give None
    long = "node-" + "x" * 40
    not_utf8 = on("ab", 0)._replace(data=on("ab", 0).data.replace(b"ab", b"\xff\xfe", 1))
    assert handle_nodes([on(long, 0), on("a", 0), not_utf8, on("a", 64), on(long, 8)]) == [
        long, "a", None, "a", long]


def test_groups_with_data_on_the_lost_node_are_dropped_once_no_task_holds_them() -> None:
    ix = Index(graph())
    dropped: list[int] = []

    def drop(gid: int) -> None:
        dropped.append(gid)
        ix.drop_group(gid)

    lost = LostNodes(ix, drop)
    waiting = generated(ix, "a")  # waits for its reward: no task holds it
    held = generated(ix, "a")
    elsewhere = generated(ix, "b")
    reward = ix.request("reward")  # the first group's rows, FIFO
    assert reward is not None
    assert ix.row_group(reward.rows[0]) == waiting
    ix.fail(reward.id)
    reward = ix.request("reward")
    assert reward is not None
    ix.complete(reward.id, {"reward": [0.1, 0.2]})
    reward = ix.request("reward")
    assert reward is not None
    assert {ix.row_group(r) for r in reward.rows} == {held}
    # `waiting` is queued, `held` in flight at reward, `elsewhere` untouched.
    assert lost.lost("a") == 2
    assert lost.lost("a") == 0  # once
    assert dropped == [waiting]
    assert lost.waiting == 1
    assert lost.groups_dropped == 1
    assert ix.has_group(held)
    assert ix.has_group(elsewhere)
    lost.sweep()
    assert dropped == [waiting]  # still held
    ix.fail(reward.id)  # it could not read the lost rows: they come back, and are dropped
    lost.sweep()
    assert dropped == [waiting, held]
    assert lost.waiting == 0
    assert lost.nodes == ["a"]
    assert ix.has_group(elsewhere)
    assert not ix.groups_holding(lambda h: handle_node(h) == "a")


def test_a_held_group_that_trains_is_not_dropped() -> None:
    ix = Index(graph())
    lost = LostNodes(ix, lambda gid: ix.drop_group(gid))
    gid = generated(ix, "a")
    reward = ix.request("reward")
    assert reward is not None
    ix.complete(reward.id, {"reward": [0.1, 0.2]})
    train = ix.request("train")
    assert train is not None  # the trainer has read it
    assert lost.lost("a") == 1
    assert lost.waiting == 1
    freed = ix.complete(train.id)  # its step commits: retired as usual
    assert sorted(handle_node(h) or "" for h in freed) == ["", "", "", "", "a", "a"]
    lost.sweep()
    assert lost.waiting == 0
    assert lost.groups_dropped == 0
    assert not ix.has_group(gid)
