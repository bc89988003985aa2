"""The ``tracking`` field: which experiment trackers a run logs to (`flowrl.tracking`)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BeforeValidator

TrackerName = Literal["tensorboard", "wandb", "mlflow"]
TRACKERS: tuple[TrackerName, ...] = get_args(TrackerName)


def _one_or_many(v: object) -> object:
    return (v,) if isinstance(v, str) else v  # --set tracking=tensorboard


def _once_each(v: tuple[TrackerName, ...]) -> tuple[TrackerName, ...]:
    twice = sorted({name for name in v if v.count(name) > 1})
    if twice:
        raise ValueError(f"{', '.join(repr(n) for n in twice)} listed more than once")
    return v


Trackers = Annotated[tuple[TrackerName, ...], BeforeValidator(_one_or_many),
                     AfterValidator(_once_each)]
"""Tracker names, each at most once (one name alone is a list of one)."""
