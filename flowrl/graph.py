"""The stage graph: which stages exist, which fields each needs and produces.

A `StageGraph` is validated once, at construction, and is immutable afterwards. After a
successful construction it guarantees:

- stage names are unique;
- every field a stage needs is produced by exactly one stage or provided by the data source;
- no field is produced twice (by two stages, or by a stage and the data source);
- the field dependencies form no cycle, so `order` is a topological order of the stages.

The weight-sync edge (train → rollout, a new policy version) is not a field, so it is not an edge
of this graph and never forms a cycle. Every violation raises `GraphError` with a message that
names the stage and the field involved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DATA_SOURCE", "GraphError", "StageGraph", "StageSpec"]

DATA_SOURCE = "<data source>"
"""Producer name reported for fields that the data source provides."""


class GraphError(ValueError):
    """A stage graph that cannot run: a missing, doubly produced or cyclic field."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of the dataflow: a pool of workers turning needed fields into produced ones."""

    name: str
    needs: tuple[str, ...]
    produces: tuple[str, ...] = ()
    micro_batch: int = 1
    """Rows per task, or groups per task when `group_level`."""
    group_level: bool = False
    """The stage takes whole groups (e.g. group-normalised advantages), never part of one."""
    role: str = ""
    """Worker pool that serves the stage; empty means the stage's own name."""
    consumes_version_bound: bool = False
    """The stage only takes rows generated recently enough (the train stage, under staleness)."""

    def __post_init__(self) -> None:
        # Accept lists from recipe files but store tuples, so specs stay hashable and immutable.
        object.__setattr__(self, "needs", tuple(self.needs))
        object.__setattr__(self, "produces", tuple(self.produces))
        if not self.name:
            raise GraphError("a stage needs a non-empty name")
        if not self.role:
            object.__setattr__(self, "role", self.name)
        if self.micro_batch < 1:
            raise GraphError(f"stage {self.name!r} has micro_batch {self.micro_batch}; need >= 1")
        for what, names in (("needs", self.needs), ("produces", self.produces)):
            seen: set[str] = set()
            for f in names:
                if f in seen:
                    raise GraphError(f"stage {self.name!r} {what} field {f!r} twice")
                seen.add(f)
        for f in self.needs:
            if f in self.produces:
                raise GraphError(f"stage {self.name!r} both needs and produces field {f!r}")


class StageGraph:
    """A validated, immutable set of stages over a data source's fields."""

    __slots__ = ("_by_name", "_consumers", "_order", "_producer", "_source_fields", "_stages")

    def __init__(self, stages: Iterable[StageSpec], source_fields: Iterable[str]) -> None:
        self._stages: tuple[StageSpec, ...] = tuple(stages)
        self._source_fields: tuple[str, ...] = tuple(dict.fromkeys(source_fields))
        if not self._stages:
            raise GraphError("a stage graph needs at least one stage")

        self._by_name: dict[str, StageSpec] = {}
        for s in self._stages:
            if s.name in self._by_name:
                raise GraphError(f"stage {s.name!r} is declared twice")
            self._by_name[s.name] = s

        # producer[field] = stage name, or DATA_SOURCE.
        self._producer: dict[str, str] = dict.fromkeys(self._source_fields, DATA_SOURCE)
        for s in self._stages:
            for f in s.produces:
                other = self._producer.get(f)
                if other == DATA_SOURCE:
                    raise GraphError(
                        f"stage {s.name!r} produces field {f!r}, which the data source "
                        "already provides"
                    )
                if other is not None:
                    raise GraphError(
                        f"field {f!r} is produced by both stage {other!r} and stage {s.name!r}"
                    )
                self._producer[f] = s.name

        for s in self._stages:
            for f in s.needs:
                if f not in self._producer:
                    raise GraphError(
                        f"stage {s.name!r} needs field {f!r}, which no stage produces "
                        "and the data source does not provide"
                    )

        self._order = self._topological_order()
        consumers: dict[str, list[StageSpec]] = {f: [] for f in self._producer}
        for s in self._order:
            for f in s.needs:
                consumers[f].append(s)
        self._consumers = {f: tuple(c) for f, c in consumers.items()}

    def _topological_order(self) -> tuple[StageSpec, ...]:
        # Kahn's algorithm; ties broken by declaration order so the order is deterministic.
        upstream: dict[str, set[str]] = {s.name: set() for s in self._stages}
        for s in self._stages:
            for f in s.needs:
                p = self._producer[f]
                if p != DATA_SOURCE:
                    upstream[s.name].add(p)
        order: list[StageSpec] = []
        placed: set[str] = set()
        while len(order) < len(self._stages):
            progress = False
            for s in self._stages:
                if s.name not in placed and upstream[s.name] <= placed:
                    order.append(s)
                    placed.add(s.name)
                    progress = True
            if not progress:
                raise GraphError(self._describe_cycle(placed))
        return tuple(order)

    def _describe_cycle(self, placed: set[str]) -> str:
        # Walk upstream from an unplaced stage until a stage repeats: that walk is a cycle.
        start = next(s for s in self._stages if s.name not in placed)
        path: list[tuple[str, str]] = []  # (stage, field it needs from the next stage upstream)
        seen: dict[str, int] = {}
        cur = start
        while cur.name not in seen:
            seen[cur.name] = len(path)
            f = next(
                f
                for f in cur.needs
                if self._producer[f] != DATA_SOURCE and self._producer[f] not in placed
            )
            path.append((cur.name, f))
            cur = self._by_name[self._producer[f]]
        cycle = path[seen[cur.name] :]
        links = ", ".join(
            f"stage {stage!r} needs field {f!r} from stage {self._producer[f]!r}"
            for stage, f in cycle
        )
        return f"the stages form a cycle: {links}"

    # --- queries -------------------------------------------------------------------------------

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        """The stages in declaration order."""
        return self._stages

    @property
    def order(self) -> tuple[StageSpec, ...]:
        """The stages in a topological order: every stage after the producers of its needs."""
        return self._order

    def topological_order(self) -> tuple[StageSpec, ...]:
        """Same as `order`."""
        return self._order

    @property
    def source_fields(self) -> tuple[str, ...]:
        """Fields the data source provides when a group is admitted."""
        return self._source_fields

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field known to the graph: source fields first, then produced ones."""
        return tuple(self._producer)

    @property
    def stages_needing_row_retirement(self) -> tuple[StageSpec, ...]:
        """Stages that must consume a row before it retires: all of them, in `order`."""
        return self._order

    def stage(self, name: str) -> StageSpec:
        """The stage called `name`; `KeyError` naming it when there is none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no stage named {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def producer_of(self, field_name: str) -> str:
        """The name of the stage producing `field_name`, or `DATA_SOURCE`."""
        try:
            return self._producer[field_name]
        except KeyError:
            raise KeyError(f"no stage produces field {field_name!r}") from None

    def consumers_of(self, field_name: str) -> tuple[StageSpec, ...]:
        """The stages needing `field_name`, in `order`."""
        try:
            return self._consumers[field_name]
        except KeyError:
            raise KeyError(f"no stage produces field {field_name!r}") from None

    def upstream_of(self, name: str) -> tuple[str, ...]:
        """Names of the stages whose fields `name` needs directly."""
        s = self.stage(name)
        ups = (self._producer[f] for f in s.needs)
        return tuple(dict.fromkeys(p for p in ups if p != DATA_SOURCE))

    def __repr__(self) -> str:
        names: Sequence[str] = [s.name for s in self._order]
        return f"StageGraph({' → '.join(names)})"
