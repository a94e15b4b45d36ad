"""A stage's update besides the optimizer's own step: the checks made in the same host read (``checked_update``;
``runtime`` is the stage's ``runtime.StageRuntime``), and when the update is made.

[Note: deferred update]
With ``PACIStrategy(deferred_update=True)`` (``"paci"`` with data-parallel replicas) an ``OPT`` only starts what is
left of its window's reduction over the replicas; the update itself -- the wait for the reduction, the step, the
version -- is made right before the stage's next ``B``, ``OPT`` or tied-weight message, or at the end of a drain.
The forwards in between (in PACI's steady state, the one that follows the ``OPT``) run with the weights before it,
so the reduction has that forward and its messages to complete in, and those micro-batches cross one more update:
the drift bound read off the list with the update at that point (``schedules.static_drift(deferred=True)``) is at
most one more than PACI's. Where the update is made is fixed by the list, never by timing.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_paci.engine.program import check_losses
from lightning_paci.errors import StageFailure
from lightning_paci.optim.stage_optimizer import StageOptimizer, Step

__all__ = ["checked_update"]


def checked_update(runtime: Any, optimizer: StageOptimizer) -> Step:
    """One optimizer call that checks everything that must hold before an update, in one host read: the losses
    kept on the device are finite ([Note: no host sync per micro-batch]), the weight prediction kept every element
    it moved ([Note: weight prediction without host reads]), every gradient is finite. Only a failure reads more,
    to name what failed; an inexact prediction is reported and the update made without it."""
    losses, runtime.unchecked_losses[:] = list(runtime.unchecked_losses), []
    overflow = runtime.prediction.take_overflow() if runtime.prediction is not None else None
    flags = [] if overflow is None else [~overflow]
    if losses:
        flags.append(torch.isfinite(torch.stack([loss for _, loss in losses])).all())
    tied = [p.grad for p in runtime.tied if p.grad is not None]
    measure = runtime.records.weight_drift
    if (step := optimizer.step(measure=measure, extra=tied, flags=flags)).done:
        return step
    check_losses(losses, runtime.stage, runtime.step_label)
    if overflow is not None and bool(overflow):
        if runtime.prediction is None:
            raise AssertionError("an overflow flag without a weight prediction")
        runtime.prediction.inexact(f"stage {runtime.stage}", f"optimizer step {runtime.version + 1} at "
                                                             f"{runtime.step_label}")
        if (step := optimizer.step(measure=measure, extra=tied)).done:
            return step
    bad = optimizer.nonfinite_parameters()
    names = [n for n, p in runtime.program.module.named_parameters() if any(p is q for q in bad)]
    raise StageFailure(f"stage {runtime.stage}: non-finite gradient in {names[:3]} before optimizer step "
                       f"{runtime.version + 1} at {runtime.step_label}.")
