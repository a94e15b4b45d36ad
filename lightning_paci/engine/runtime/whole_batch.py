"""A loss computed once over the whole batch on the last stage, its gradient sent back per micro-batch.

[Note: the whole-batch loss]
A loss that couples a batch's samples (in-batch negatives, [Note: a loss that couples a batch's samples] in
integration/setup/batch_coupling.py) is one device's only when it sees the whole batch. Where the user's step
computes it by calling one method of the module on per-sample tensors (``self.contrastive_loss(text, image)``;
``PACIStrategy(whole_batch_loss="contrastive_loss")``), the last stage runs each micro-batch's step up to that call
and keeps the call's arguments (:class:`LossCall`, graph attached) instead of a loss. At the mini-batch's first
backward, every micro-batch's forward is done ([Note: whole-batch order] in schedules/build.py): ``joined`` makes
each tensor argument a leaf per micro-batch, concatenates them along dim 0 in micro-batch order -- the whole batch
as one device holds it -- and the method runs once on them. Its loss, scaled as the micro-batches' losses would be
(``loss * m * loss_scale``: the mean over the window's batches), is back-propagated to those leaves only; their
gradients become each micro-batch's received gradient, and each micro-batch's ``B`` back-propagates its own part
as a stage before the last does, in the list's order. A tensor that is the same object in every call (a
parameter passed as an argument) is passed once and receives its gradient from that one backward.

What it costs: the list's warm-up grows by ``m - 1`` on every stage (the whole-batch order), the loss's arguments
of a whole batch are held on the last stage until its first backward (their size: the embeddings, not the
activations), and one extra autograd call per mini-batch. What the step does after the call does not run on the
last stage (its value would be a micro-batch's): the step must return the method's result, which the setup checks
on the first batch; what the method itself logs is logged once per batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lightning_paci.engine.runtime.program import LOSS_KEY, LogRecord, loss_value
from lightning_paci.engine.transport.messages import TensorMeta, flatten, map_leaves, unflatten
from lightning_paci.schedules import RECV_B

if TYPE_CHECKING:
    from lightning_paci.engine.runtime.runtime import StageRuntime

__all__ = ["LossCall", "WholeBatch", "joined"]


class LossCall(NamedTuple):
    """The arguments one micro-batch's step passed to the whole-batch loss method (tensors with their graph)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    samples: int  # the micro-batch's samples: its share of the loss's log record


def joined(calls: list[LossCall], method: str) -> tuple[LossCall, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """The whole batch's call from the micro-batches' ``calls``; per call, its tensors that need a gradient and the
    leaves standing for them in the whole call (same order).

    Each tensor argument is detached per micro-batch and the parts are concatenated along dim 0 (a (b_j, ...)
    tensor per micro-batch, (sum b_j, ...) whole); a tensor that is the same object in every call is passed once.
    Non-tensor arguments must be equal in every call."""
    skeletons, tensors = zip(*(flatten((c.args, c.kwargs)) for c in calls), strict=True)
    shapes = [map_leaves(skeleton, TensorMeta, lambda _: None) for skeleton in skeletons]  # the rest, tensors out
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError(f"`{method}` was called with other arguments by different micro-batches of one batch: the "
                         f"whole-batch loss joins the tensors position by position and needs every other argument "
                         f"equal in every call (got {shapes[0]!r} and {next(x for x in shapes if x != shapes[0])!r}).")
    whole: list[torch.Tensor] = []
    outgoing: list[list[torch.Tensor]] = [[] for _ in calls]
    leaves: list[list[torch.Tensor]] = [[] for _ in calls]
    for position, parts in enumerate(zip(*tensors, strict=True)):
        if all(p is parts[0] for p in parts):  # a parameter or constant: not per sample
            whole.append(parts[0])
            continue
        if any(p.dim() == 0 for p in parts):
            raise ValueError(f"tensor argument {position} of `{method}` is 0-dimensional and differs between "
                             f"micro-batches: the whole-batch loss concatenates per-sample tensors along dim 0. Pass "
                             f"per-sample values (batch first), or compute the scalar inside `{method}`.")
        detached = [p.detach().requires_grad_(p.requires_grad) for p in parts]
        for j, (p, leaf) in enumerate(zip(parts, detached, strict=True)):
            if p.requires_grad:
                outgoing[j].append(p)
                leaves[j].append(leaf)
        whole.append(torch.cat(detached, dim=0))  # (sum b_j, ...)
    args, kwargs = unflatten(skeletons[0], whole)
    return LossCall(tuple(args), dict(kwargs), sum(c.samples for c in calls)), outgoing, leaves


class WholeBatch:
    """The last stage's whole-batch loss: ``loss(call)`` runs the user's method on the joined call and returns the
    loss and what it logged; ``num_microbatches`` is ``m`` (micro-batch ``mb`` belongs to mini-batch ``mb // m``)."""

    def __init__(self, loss: Callable[[LossCall], tuple[torch.Tensor, list[LogRecord]]], num_microbatches: int,
                 method: str) -> None:
        self.loss, self.num_microbatches, self.method = loss, num_microbatches, method

    def backward(self, runtime: StageRuntime, mb: int, refuse: Callable[[int, float], None]) -> None:
        """At the first ``B`` of ``mb``'s mini-batch: the loss over the mini-batch, back-propagated to its
        micro-batches' loss arguments, each one's gradient put where a received gradient goes (``runtime.inbox``).
        Padding micro-batches (weight 0) take no part. A non-finite loss read on the host goes to ``refuse``
        (raises unless ``nonfinite="skip"``); skipped, it drops every micro-batch of the mini-batch."""
        m = self.num_microbatches
        members = range(mb // m * m, mb // m * m + m)
        missing = [k for k in members if k not in runtime.held]
        if missing:
            raise AssertionError(f"stage {runtime.stage}: the whole-batch loss of micro-batch {mb} needs micro-batches "
                                 f"{missing} forwarded first: the list is not in the whole-batch order")
        live = [k for k in members if not runtime.held[k].output.skipped]
        calls = [runtime.held[k].output.outgoing for k in live]
        whole, outgoing, leaves = joined(calls, self.method)
        loss, records = self.loss(whole)
        key = runtime.microbatch_base + live[0]
        value = loss_value(loss.detach(), key, runtime.unchecked_losses, keep=runtime.device_losses,
                           skip=runtime.skip_nonfinite)
        if isinstance(value, float) and not math.isfinite(value):
            refuse(key, value)
            for k in live:
                self._record(runtime, k, [], {"grads": [], "skip": True})
            return
        scaled = loss * (m * runtime.loss_scale)  # the mean over the window's batches, as m micro-batch losses give
        if runtime.hooks is not None:
            runtime.hooks.before_backward(scaled)
        # into the leaves (the micro-batches' graphs stay for their own B) and the parameters the method uses
        scaled.backward()
        for j, k in enumerate(live):
            held = runtime.held[k].output
            held.outgoing = outgoing[j]
            logs = [*held.logs, *(records if j == 0 else ()), LogRecord(LOSS_KEY, value, calls[j].samples, ())]
            runtime.records.losses[runtime.microbatch_base + k] = value
            grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves[j]]
            self._record(runtime, k, logs, {"grads": grads, "skip": False})

    @staticmethod
    def _record(runtime: StageRuntime, mb: int, logs: list[LogRecord], payload: dict[str, Any]) -> None:
        """Micro-batch ``mb``'s gradient where a received one goes, and its log records at once: the mini-batch's
        records are complete in the call that computed its loss, so the logging rank logs batch ``k`` at step ``k``
        under ``"paci"`` too, where the batch's last backwards run in the next call."""
        key = runtime.microbatch_base + mb
        runtime.logs[key] = logs
        if runtime.stage > 0:
            runtime.upstream_logs[key] = logs  # sent with the gradient (SEND_B), whether or not replayed by then
        runtime.inbox[(RECV_B, mb)] = payload
