"""StageGraph validation: every error names the stage and the field; queries on a valid graph."""

from __future__ import annotations

import pytest

from flowrl.graph import DATA_SOURCE, GraphError, StageGraph, StageSpec


def grpo() -> StageGraph:
    return StageGraph(
        [
            # Declared out of order on purpose: `order` must sort them.
            StageSpec("train", ("response", "advantages"), micro_batch=4,
                      consumes_version_bound=True),
            StageSpec("advantage", ("reward",), ("advantages",), group_level=True),
            StageSpec("reward", ("prompt", "response"), ("reward",), role="scorer"),
            StageSpec("rollout", ("prompt",), ("response", "logprobs")),
        ],
        source_fields=("prompt",),
    )


def test_topological_order_and_queries() -> None:
    g = grpo()
    assert [s.name for s in g.order] == ["rollout", "reward", "advantage", "train"]
    assert g.topological_order() == g.order
    assert [s.name for s in g.stages] == ["train", "advantage", "reward", "rollout"]
    assert [s.name for s in g.consumers_of("prompt")] == ["rollout", "reward"]
    assert [s.name for s in g.consumers_of("response")] == ["reward", "train"]
    assert g.consumers_of("logprobs") == ()
    assert g.producer_of("prompt") == DATA_SOURCE
    assert g.producer_of("advantages") == "advantage"
    assert g.upstream_of("train") == ("rollout", "advantage")
    assert g.upstream_of("rollout") == ()
    assert g.stages_needing_row_retirement == g.order
    assert set(g.fields) == {"prompt", "response", "logprobs", "reward", "advantages"}
    assert g.fields[0] == "prompt"
    assert "train" in g
    assert "critic" not in g
    assert g.stage("reward").role == "scorer"
    assert g.stage("rollout").role == "rollout"  # role defaults to the stage name
    assert g.stage("train").consumes_version_bound
    with pytest.raises(KeyError, match="critic"):
        g.stage("critic")
    with pytest.raises(KeyError, match="values"):
        g.consumers_of("values")


def test_missing_field_names_stage_and_field() -> None:
    with pytest.raises(GraphError) as e:
        StageGraph(
            [StageSpec("rollout", ("prompt",), ("response",)),
             StageSpec("train", ("response", "advantages"))],
            source_fields=("prompt",),
        )
    assert str(e.value) == (
        "stage 'train' needs field 'advantages', which no stage produces "
        "and the data source does not provide"
    )


def test_field_produced_twice() -> None:
    with pytest.raises(GraphError, match="field 'reward' is produced by both stage 'rm' and "
                                         "stage 'judge'"):
        StageGraph(
            [StageSpec("rm", ("prompt",), ("reward",)),
             StageSpec("judge", ("prompt",), ("reward",))],
            source_fields=("prompt",),
        )


def test_field_produced_by_stage_and_source() -> None:
    with pytest.raises(GraphError, match="stage 'rollout' produces field 'prompt', which the "
                                         "data source already provides"):
        StageGraph([StageSpec("rollout", ("seed",), ("prompt", "response"))],
                   source_fields=("prompt", "seed"))


def test_duplicate_stage() -> None:
    with pytest.raises(GraphError, match="stage 'reward' is declared twice"):
        StageGraph(
            [StageSpec("reward", ("prompt",), ("a",)), StageSpec("reward", ("prompt",), ("b",))],
            source_fields=("prompt",),
        )


def test_cycle_names_every_stage_and_field() -> None:
    with pytest.raises(GraphError) as e:
        StageGraph(
            [
                StageSpec("rollout", ("prompt",), ("response",)),
                StageSpec("a", ("response", "y"), ("x",)),
                StageSpec("b", ("x",), ("y",)),
            ],
            source_fields=("prompt",),
        )
    msg = str(e.value)
    assert msg.startswith("the stages form a cycle")
    assert "stage 'a' needs field 'y' from stage 'b'" in msg
    assert "stage 'b' needs field 'x' from stage 'a'" in msg
    assert "rollout" not in msg  # not part of the cycle


def test_self_loop_and_spec_errors() -> None:
    with pytest.raises(GraphError, match="stage 'a' both needs and produces field 'x'"):
        StageSpec("a", ("x",), ("x",))
    with pytest.raises(GraphError, match="stage 'a' needs field 'x' twice"):
        StageSpec("a", ("x", "x"))
    with pytest.raises(GraphError, match="stage 'a' has micro_batch 0"):
        StageSpec("a", ("x",), micro_batch=0)
    with pytest.raises(GraphError, match="non-empty name"):
        StageSpec("", ("x",))
    with pytest.raises(GraphError, match="at least one stage"):
        StageGraph([], source_fields=("x",))


def test_weight_sync_is_not_a_cycle() -> None:
    # train feeds rollout only through a new policy version, which is not a field: a valid graph.
    g = StageGraph(
        [StageSpec("rollout", ("prompt",), ("response",)), StageSpec("train", ("response",))],
        source_fields=("prompt",),
    )
    assert [s.name for s in g.order] == ["rollout", "train"]


def test_spec_accepts_lists_and_is_hashable() -> None:
    s = StageSpec("a", ["x"], ["y"])  # type: ignore[arg-type]
    assert s.needs == ("x",)
    assert s.produces == ("y",)
    assert hash(s) == hash(StageSpec("a", ("x",), ("y",)))
