"""What a trainer does on the stability guard's orders (`flowrl.control.stability`), which
reach it as train task params from the step they apply to:

- ``lr_scale``: the learning rate of this step's optimizer step is the schedule's times it;
- ``keep_from``: at the start of the first step at or after it, keep a copy of the weights and
  optimizer state in memory (once per value): the good weights a rollback returns to (of a
  policy trained with adapters, the adapters alone: the rest never changes);
- ``rollback`` (``{"id", "version"}``): at the start of a step, restore that copy, once per
  id. The schedule keeps its place (a rollback lowers the rate rather than rewinding it).

Every data-parallel rank meets an order at the same step and keeps or restores its own part
(its shard, when sharded), so the ranks stay identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from torch import Tensor

from workers.engines.protocols import TrainerEngine, TrainerState

log = structlog.get_logger("flowrl.trainer")


@dataclass(frozen=True)
class _Copy:
    version: int
    weights: dict[str, Tensor]
    state: TrainerState


def trainable_weights(engine: TrainerEngine) -> dict[str, Tensor]:
    """What ``engine`` trains, copied: its ``export_trainable()`` when it has one (adapters
    only), else its whole `export_weights`."""
    method = getattr(engine, "export_trainable", None)
    if callable(method):
        out: dict[str, Tensor] = method()
        return out
    return engine.export_weights()


class GuardOrders:
    """One trainer's record of the orders it applied and the copy it keeps."""

    def __init__(self) -> None:
        self._copy: _Copy | None = None
        self._kept_from: int | None = None
        self._rolled_back = 0
        self.lr_scale = 1.0

    @property
    def kept_version(self) -> int | None:
        """The version of the weights kept (None: none yet)."""
        return None if self._copy is None else self._copy.version

    def at_step_start(self, engine: TrainerEngine, params: Mapping[str, Any], *,
                      version: int, load: Any) -> None:
        """Apply the orders that act at the start of a step; ``version``: the weights held now;
        ``load(engine, weights)``: copies weights into the engine's model."""
        rollback = params.get("rollback")
        if isinstance(rollback, Mapping) and int(rollback.get("id", 0)) > self._rolled_back:
            self._rolled_back = int(rollback["id"])
            wanted = rollback.get("version")
            if self._copy is None or self._copy.version != wanted:
                log.warning("rollback ordered but those weights are not kept here; continuing "
                            "from the current ones", wanted=wanted, kept=self.kept_version)
            else:
                step = engine.step
                load(engine, self._copy.weights)
                state = self._copy.state  # cloned: the optimizer may adopt what it is given
                engine.load_state_dict(TrainerState({k: v.clone() for k, v in
                                                     state.tensors.items()}, dict(state.meta)))
                engine.join_at(step)
                log.warning("rolled back to kept weights", version=self._copy.version,
                            at_version=version)
        keep = params.get("keep_from")
        step_no = params.get("step")
        if (isinstance(keep, int) and keep != self._kept_from and isinstance(step_no, int)
                and step_no >= keep):
            self._kept_from = keep
            self._copy = _Copy(version, trainable_weights(engine), engine.state_dict())
        self.lr_scale = float(params.get("lr_scale", 1.0))
