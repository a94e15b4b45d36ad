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

[Note: one host read per update]
On an accelerator a host read waits for the device, so the host cannot queue the next forward while it waits. A
stage reads the device once per update, in ``StageOptimizer.step``: one stack of 0-dim flags -- the losses kept on
the device are finite, every gradient is finite (one multi-tensor max-norm over the gradients), and with replicas
the reduction's presence flags agree (``grad_buckets.ReplicaCheck``: a gradient on all replicas or on none). The
gradients' reduction itself reads nothing; the weight prediction keeps Adam's step counts on the host, and under
``compensation="auto"`` the measurement of its quality reads its two sums in this same read, once, at the update that
decides ([Note: the prediction's quality]). Only a failed check reads more, to name what failed
(tests/test_host_reads.py counts them).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_paci.engine.replicas.grad_buckets import ReplicaCheck
from lightning_paci.engine.runtime.program import check_losses
from lightning_paci.errors import StageFailure
from lightning_paci.optim.stage_optimizer import StageOptimizer, Step

__all__ = ["checked_update"]


def checked_update(runtime: Any, optimizer: StageOptimizer, replicas: ReplicaCheck | None = None) -> Step:
    """One optimizer call that checks everything that must hold before an update, in one host read ([Note: one
    host read per update]): the losses kept on the device are finite ([Note: no host sync per micro-batch]), the
    replicas' reduction found every gradient on all replicas or on none (``replicas``), every gradient is
    finite; the weight prediction's quality is measured around it. Only a failure reads more, to name what failed."""
    losses, runtime.unchecked_losses[:] = list(runtime.unchecked_losses), []
    flags = [torch.isfinite(torch.stack([loss for _, loss in losses])).all()] if losses else []
    if replicas is not None:
        flags.append(replicas.agree)
    tied = [p.grad for p in runtime.tied if p.grad is not None]
    quality = runtime.prediction.quality if runtime.prediction is not None else None
    due = quality.before_update() if quality is not None else []  # [Note: the prediction's quality]
    if (step := optimizer.step(measure=runtime.records.weight_drift, extra=tied, flags=flags, values=due)).done:
        if quality is not None:
            quality.after_update(step.values)
        return step
    if replicas is not None:
        replicas.verify()
    check_losses(losses, runtime.stage, runtime.step_label)
    bad = optimizer.nonfinite_parameters()
    names = [n for n, p in runtime.program.module.named_parameters() if any(p is q for q in bad)]
    raise StageFailure(f"stage {runtime.stage}: non-finite gradient in {names[:3]} before optimizer step "
                       f"{runtime.version + 1} at {runtime.step_label}.")
