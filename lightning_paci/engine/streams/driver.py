"""Feeding Lightning batches into a stage's runtime as *streams*: the runs between two drains.

[Note: no flush per Lightning batch]
Lightning calls ``training_step`` once per batch. Each stage runs, in call ``k`` of a stream, its actions of round
``k`` (see ``schedules.assign_rounds``): everything it can do before it needs mini-batch ``k + 1``. Stages then
return to Lightning at different moments and never wait for each other except for real data dependencies, so the
pipeline stays full across batches. The pipeline drains (runs the cool-down of the current stream) only when the
caller says so -- inside the last call before validation, at the end of an epoch, at ``max_steps``, before a
checkpoint or teardown -- and after ``max_stream_batches`` batches without another drain.

This module knows nothing about Lightning: the strategy decides *when* to drain, the driver knows *how*.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_paci.engine.runtime.microbatch import loss_scale_for, split_weighted
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.runtime.virtual_stages import DeviceRuntime
from lightning_paci.engine.streams.cursor import StreamCursor
from lightning_paci.schedules import OPT, RECV_T, SEND_T, Action

__all__ = ["StreamDriver", "closing_actions"]


class StreamDriver:
    """One stage's stream state: the cursor into its action list and the number of batches fed.

    Args:
        runtime: the stage's runtime (its ``microbatch_base`` counts the micro-batches of all finished streams).
        schedule, num_microbatches, accumulation: what each stream's lists are built with (``accumulation`` may be
            changed between streams).
        tied: the first and last stage share tied weights.
        max_stream_batches: drain at least this often (bounds a stream's lists and the time between drains).
        on_drain: called after every drain (the stages' data check, fingerprint.py).
        whole_batch: the lists of a whole-batch loss ([Note: whole-batch order] in schedules/build.py).
    """

    def __init__(self, runtime: StageRuntime, *, schedule: str, num_microbatches: int, accumulation: int,
                 tied: bool, max_stream_batches: int, on_drain: Callable[[], None] | None = None,
                 device: DeviceRuntime | None = None, whole_batch: bool = False) -> None:
        self.runtime = runtime
        self.whole_batch = whole_batch
        # with virtual stages, ``device`` runs this process's chunks (``runtime`` is one of them): every chunk
        # begins, takes the micro-batches and ends each stream; the device's list interleaves their actions
        self.device = device
        self.chunks = list(device.runtimes.values()) if device is not None else [runtime]
        self._runner: StageRuntime | DeviceRuntime = device if device is not None else runtime
        self.on_drain = on_drain
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.accumulation = accumulation
        self.tied = tied
        self.max_stream_batches = max_stream_batches
        self._cursor: StreamCursor | None = None
        self.calls = 0  # batches fed into the current stream

    def feed(self, batch: Any, batch_idx: int, *, drain: bool, accumulation: int | None = None,
             close_window: bool = False) -> None:
        """Split ``batch`` into micro-batches, run this stage's actions of the current round, and drain when
        ``drain`` (or when the stream reached ``max_stream_batches``). ``accumulation``, when given, is the window
        of the stream this batch opens (Lightning's ``accumulate_grad_batches`` may change between epochs, and
        streams end at epochs); the loss scale follows it. ``close_window`` (with ``drain``: an epoch's last batch)
        steps a window the drain leaves open, as Lightning does at the end of an epoch."""
        runtime, m = self.runtime, self.num_microbatches
        if self._cursor is None:
            if accumulation is not None:
                self.accumulation = accumulation
            done = runtime.microbatch_base  # backwards run so far on every stage (streams end drained)
            offset = (done - runtime.window_base) % self.accumulation
            self._cursor = self._new_cursor(offset)
            for chunk in self.chunks:
                chunk.begin_stream(_crossings(chunk, offset, self.accumulation), offset,
                                   loss_scale_for(accumulation) if accumulation is not None else None,
                                   window_size=self.accumulation)
                chunk.records.set_phase("startup")  # the new stream fills the pipeline
            self.calls = 0
        for i, (part, weight) in enumerate(split_weighted(batch, m)):
            for chunk in self.chunks:
                chunk.add_microbatch(self.calls * m + i, part, batch_idx, weight=weight)
        self.calls += 1
        if drain or self.calls >= self.max_stream_batches:
            self.drain(close_window=close_window and drain)
        else:
            self._runner.run(self._cursor.segment(self.calls - 1))

    def _new_cursor(self, offset: int) -> StreamCursor:
        device, runtime, m = self.device, self.runtime, self.num_microbatches
        if device is None:
            return StreamCursor(self.schedule, runtime.num_stages, m, self.accumulation, runtime.stage,
                                backward_offset=offset, tied=self.tied, whole_batch=self.whole_batch)
        return StreamCursor(self.schedule, device.num_devices, m, self.accumulation, device.index,
                            backward_offset=offset, tied=self.tied, virtual_stages=device.virtual_stages,
                            placement=device.placement)

    def drain(self, *, close_window: bool = False) -> None:
        """Run the cool-down of the current stream on this stage and wait for its sends (no-op outside a stream);
        ``close_window``: then step the accumulation window if it is still open (``closing_actions``), and start
        the next window's count here."""
        runtime, cursor, chunks = self.runtime, self._cursor, self.chunks
        if cursor is None:
            return
        for chunk in chunks:
            chunk.records.set_phase("drain")
        self._runner.run(cursor.drain(self.calls))
        for chunk in chunks:
            chunk.apply_pending_update()  # [Note: deferred update]: nothing stays pending past a drain
            chunk.comm.flush()
            if chunk.held or chunk.data:
                raise AssertionError(f"stage {chunk.stage}: drain left {len(chunk.held)} micro-batches in flight")
            chunk.end_stream(self.calls * self.num_microbatches)
        self._cursor = None
        if close_window:
            if (runtime.microbatch_base - runtime.window_base) % self.accumulation:
                tied = self.tied and len(chunks) == 1  # a device holding both tied stages exchanges nothing
                self._runner.run([action for chunk in chunks
                                  for action in closing_actions(chunk.stage, chunk.num_stages, tied=tied)])
                for chunk in chunks:
                    chunk.apply_pending_update()
                    chunk.comm.flush()
            for chunk in chunks:
                chunk.end_stream(0, window_closed=True)
        for chunk in chunks:
            chunk.records.set_phase("outside")  # validation, checkpoints, epoch ends: not pipeline time
        if self.on_drain is not None:
            self.on_drain()


def _crossings(runtime: StageRuntime, offset: int, accumulation: int) -> Callable[[int], int]:
    """How many local updates micro-batch ``mb`` of the stream starting now crosses between its forward (now) and
    its backward: every list steps right after each ``accumulation``-th backward and backwards run in micro-batch
    order, so ``(offset + mb) // accumulation`` updates of the stream precede its backward. Equal to
    ``schedules.static_drift`` of the stream's list (tests/test_compensation.py checks the grid)."""
    start = runtime.version

    def crossings(mb: int) -> int:
        return start + (offset + mb) // accumulation - runtime.version

    return crossings


def closing_actions(stage: int, num_stages: int, *, tied: bool) -> list[Action]:
    """The optimizer step that closes an accumulation window left open at a drain, as Lightning steps at an epoch's
    last batch whatever ``accumulate_grad_batches`` says. With tied weights it carries the same exchange as any
    other update: the last stage sends its replica's gradient after its own step and installs stage 0's new
    weights; stage 0 adds that gradient before its step and sends the weights after it."""
    last = num_stages - 1
    if tied and stage == 0:
        return [Action(stage, RECV_T, 0), Action(stage, OPT, None), Action(stage, SEND_T, 0)]
    if tied and stage == last:
        return [Action(stage, OPT, None), Action(stage, SEND_T, 0), Action(stage, RECV_T, 0)]
    return [Action(stage, OPT, None)]
