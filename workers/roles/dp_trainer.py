"""The train role of one rank of a data-parallel group (``trainer.ranks > 1``).

Each rank is a `TrainerRole` that accumulates its share of the step's micro-batches exactly as
one trainer would (loss *sums*, see `workers.roles.trainer`). At the step's end the ranks
all-reduce their gradient sums and every count the step's normalisation and metrics use
(`workers.distributed.all_reduce_step`), so every rank holds ``Σ_ranks Σ_k ∇S_k`` and the whole
step's divisor ``D``; the base class then scales by ``1/D``, clips and steps. The step is thus
the one a single trainer takes on the concatenated batch (``tests/test_dp_trainer.py`` checks
1e-6), and all ranks hold the same parameters after it: the same kernels run on the same
values. The step's metrics cover the whole global batch on every rank.

Only rank 0 exports the new weights (one export per step) and writes checkpoints. Every rank
reports ``param_checksum`` (`workers.distributed.parameter_checksum`) and ``rank_tokens`` (its
own share), which the controller compares and summarises (`flowrl.dp.merge_step_ends`).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from workers.distributed import (
    DataParallel,
    all_reduce_step,
    broadcast_parameters,
    parameter_checksum,
)
from workers.engines.protocols import TrainerEngine
from workers.roles.trainer import TrainerRole, TrainSettings, _Step
from workers.runtime import RoleOutput

__all__ = ["DataParallelTrainerRole"]

#: the `_Step` sums the ranks add up (``step`` is the step number, the same on every rank).
_SUMS = tuple(f.name for f in fields(_Step) if f.name != "step")


class DataParallelTrainerRole(TrainerRole):
    """`TrainerRole` on one rank of a joined group (`DataParallel.join`).

    The engine must expose its torch ``model``; its parameters are set to rank 0's here, so
    the ranks start identical whatever their seeds.
    """

    def __init__(
        self, engine: TrainerEngine, settings: TrainSettings, *, pad_token_id: int,
        group: DataParallel, version: int = 0,
    ) -> None:
        super().__init__(engine, settings, pad_token_id=pad_token_id, version=version)
        model = getattr(engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(engine).__name__} has no torch model to all-reduce")
        self.group = group
        #: the base class's switch: one export per step, from rank 0.
        self.exports_weights = group.rank == 0
        self._params = [p for p in model.parameters() if p.requires_grad]
        broadcast_parameters(self._params)

    def finish_step(self) -> RoleOutput:
        """All-reduce the step's gradient sums and counts, then step as one trainer would."""
        st = self._step
        own_tokens = st.tokens
        local = [float(getattr(st, name)) for name in _SUMS]
        for name, value in zip(_SUMS, all_reduce_step(self._params, local), strict=True):
            # The integer counts are exact in float64 (below 2**53).
            setattr(st, name, round(value) if isinstance(getattr(st, name), int) else value)
        out = super().finish_step()
        if not self.exports_weights:
            out.weights = None
        out.metrics["param_checksum"] = parameter_checksum(self._params)
        out.metrics["rank_tokens"] = float(own_tokens)
        return out

    def _checkpoint_due(self) -> bool:
        # Every rank holds the same state; rank 0 writes it, once.
        return self.group.rank == 0 and super()._checkpoint_due()
