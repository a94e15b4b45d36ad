"""``RuntimeState``: a stage runtime's counters, and the only ways to change them from outside the runtime.

A stage's runtime (runtime.py) runs actions; where it is in the run -- the index of its micro-batches across
streams, its optimizer version, the open accumulation window, the loss scale, the distance each forward's weights
are predicted ahead, its data-parallel replica -- is set by the stream driver, checkpoint resume, data parallelism and
the reference executor. They call the named methods below instead of writing fields, so that one file shows every
way these counters change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_paci.engine.runtime.norm_table import NormTable

__all__ = ["RuntimeState"]


def _no_crossings(microbatch: int) -> int:
    return 0


class RuntimeState:
    """The counters of one stage's runtime (read freely, changed through the methods)."""

    def __init__(self, loss_scale: float) -> None:
        self.loss_scale = loss_scale  # the last stage back-propagates ``loss * loss_scale`` (``1 / accumulation``)
        self.version = 0  # local optimizer steps so far
        self.microbatch_base = 0  # stream-local index -> run-global index (for records across drains)
        self.window_base = 0  # backwards before the current accumulation window's count began (see closing_actions)
        self.crossings: Callable[[int], int] = _no_crossings  # updates micro-batch ``mb``'s forward will cross
        self.window_backwards = 0  # backwards accumulated since the last update (the weight prediction's known share)
        self.replica, self.replica_tag = 0, ""  # data-parallel replica (own random streams), " (replica r)" in errors
        # data parallel: average over the stage's replicas (returns its `grad_buckets.ReplicaCheck`, or None)
        self.reduce_gradients: Callable[[], Any] | None = None
        # data parallel, overlapped ([Note: overlapped reduction]): called before the backward that closes a window
        self.arm_reduction: Callable[[int], None] | None = None
        # before every backward: whether it closes the update window (FSDP2's gradient reduction only then)
        self.gradient_sync: Callable[[bool], None] | None = None
        # [Note: deferred update]: the reduction whose update waits for the next backward (``start``/``finish``)
        self.deferred: Any = None
        self.window_size: int | None = None  # backwards per accumulation window of the current stream
        self.layered: Any = None  # schedule="layered": the layer-major backward (engine/blocks/layered.py)
        self.step_label = ""  # where the run is, for error messages ("Lightning batch 7 (global step 7)")
        # called with the new version right after every local update: the weights are then exactly that version
        # on this stage, with no other stage involved (e.g. to keep version-k weights without draining)
        self.update_hooks: list[Callable[[int], None]] = []
        self.norms: NormTable | None = None  # [Note: norm table]: carried on the messages when clipping by it

    def begin_stream(self, crossings: Callable[[int], int], window_backwards: int,
                     loss_scale: float | None = None, *, window_size: int | None = None) -> None:
        """A stream of actions starts: ``crossings(mb)`` is how many updates micro-batch ``mb``'s forward will cross
        (the weight prediction's distance), ``window_backwards`` the backwards already in the open accumulation window,
        ``loss_scale`` (when given) the new window's ``1 / accumulation``, ``window_size`` its backwards (an ``OPT``
        follows the backward that completes them)."""
        if loss_scale is not None:
            self.loss_scale = loss_scale
        self.window_size = window_size
        self.crossings = crossings
        self.window_backwards = window_backwards

    def end_stream(self, microbatches: int, *, window_closed: bool = False) -> None:
        """A stream of ``microbatches`` ended drained: later micro-batch indices continue after them; with
        ``window_closed`` the next accumulation window's count starts here."""
        self.microbatch_base += microbatches
        if window_closed:
            self.window_base = self.microbatch_base

    def restore(self, *, backwards: int, steps: int, window_start: int) -> None:
        """Resume a checkpoint's counters: backwards run, optimizer steps taken, where the open window began."""
        self.microbatch_base, self.version, self.window_base = backwards, steps, window_start

    def join_replicas(self, replica: int, reduce_gradients: Callable[[], Any] | None, *,
                      arm: Callable[[int], None] | None = None, deferred: Any = None) -> None:
        """Become data-parallel replica ``replica``: its own random streams, errors naming it, and
        ``reduce_gradients`` (an average over the stage's replicas) before every local step, if given; ``arm``
        before each backward that closes a window, with the accumulations each gradient has still to take (the
        reduction then starts during it); ``deferred`` (with
        ``start()`` and ``finish()``): the update waits for the next backward instead ([Note: deferred update])."""
        self.replica, self.replica_tag = replica, f" (replica {replica})"
        self.reduce_gradients, self.arm_reduction, self.deferred = reduce_gradients, arm, deferred

    def sync_gradients_with(self, hook: Callable[[bool], None]) -> None:
        """Call ``hook(closes)`` before every backward, ``closes`` whether it closes the update window: the
        module's own data parallelism (FSDP2) then reduces its gradients once per window, not per micro-batch
        ([Note: tensor parallelism in a stage])."""
        self.gradient_sync = hook

    def on_update(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(version)`` right after every local update (the weights are then exactly that version here)."""
        self.update_hooks.append(hook)

    def carry_norms(self, table: NormTable | None) -> None:
        """Keep ``table`` ([Note: norm table]) and carry it on every activation and gradient message; None: none."""
        self.norms = table

    def label(self, step_label: str) -> None:
        """Where the run is, for error messages (``"Lightning batch 7 (global step 7)"``)."""
        self.step_label = step_label

    def run_layer_major(self, backward: Any) -> None:
        """``schedule="layered"``: run each mini-batch's backwards through ``backward`` (``layered.LayeredBackward``,
        [Note: layered backward])."""
        self.layered = backward
