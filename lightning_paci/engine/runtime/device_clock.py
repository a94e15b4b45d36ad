"""Device time for the monitors: CUDA events around a stage's compute, read at the logging interval.

[Note: device clocks]
On a GPU the host only queues kernels: a forward costs the host the microseconds it takes to enqueue its kernels
while the device works for milliseconds, and under NCCL a receive blocks the host only for its header, which leaves
when the sending stage's *host* reaches its send. Host clocks around F and B therefore measure the host, and a
bubble read from the host's receive waits is ~0 whatever the device does. On CUDA the runtime records a pair of
CUDA events on the current stream around every F, B and OPT and keeps them pending: nothing waits. When the time
accounts are read (``StageRecords.time_snapshot``, the monitors at their logging interval) the newest pending event
is waited for once, and every pending pair becomes a device duration, placed on the host's time axis from an anchor
event recorded with the host clock (its position on the device's axis is then exact up to the anchor's queueing
delay, which shifts every interval alike). The stage's compute and optimizer seconds are then the device's, and
its idle seconds are what the device did not spend on them: the wall clock less F, B, OPT and the host's message
posting (``BubbleMonitor``'s ``bubble_fraction`` on CUDA). On the CPU the host clock is the device's clock and
nothing changes. At most ``bound`` pairs wait: past that they are read at once (one host wait per ``bound``
actions), so a run without monitors holds a bounded number of events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["DeviceClock", "DeviceSpan"]

Resolved = tuple[str, str, tuple[int, str, int | None], float, float]  # (category, phase, interval fields, start, end)


class DeviceSpan(NamedTuple):
    """One action timed on the device: the account it adds to (``category``, in ``phase``), what its interval
    names, and its events."""

    category: str
    phase: str
    fields: tuple[int, str, int | None]  # Interval's (stage, kind, microbatch)
    start: Any  # torch.cuda.Event
    end: Any


class DeviceClock:
    """CUDA events around a stage's compute actions, resolved in batches ([Note: device clocks]).

    Args:
        host_clock: the records' clock (seconds); the anchor's host time is read from it.
        bound: pending pairs at most before they are read at once.
        event: the event factory (``torch.cuda.Event`` with timing on).
    """

    def __init__(self, host_clock: Callable[[], float], *, bound: int = 4096,
                 event: Callable[[], Any] | None = None) -> None:
        self.host_clock = host_clock
        self.bound = bound
        self._event = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))
        self.pending: deque[DeviceSpan] = deque()
        self._anchor: tuple[Any, float] | None = None  # (event, host seconds when it was recorded)
        self.reads = 0  # host waits for the device, one per resolution

    def begin(self) -> Any:
        """Record an action's start on the current stream (the first one anchors the axis)."""
        start = self._event()
        start.record()
        if self._anchor is None:
            self._anchor = (start, self.host_clock())
        return start

    def end(self, start: Any, category: str, phase: str, fields: tuple[int, str, int | None]) -> list[Resolved]:
        """Record the action's end; returns what :meth:`resolve` returns when the bound was reached, else []."""
        end = self._event()
        end.record()
        self.pending.append(DeviceSpan(category, phase, fields, start, end))
        return self.resolve() if len(self.pending) >= self.bound else []

    def resolve(self) -> list[Resolved]:
        """Wait for the newest pending event, then every pending span as ``(category, phase, fields, start, end)``
        in host seconds; the newest end anchors the next ones (elapsed times stay short)."""
        if not self.pending or self._anchor is None:
            return []
        spans, self.pending = self.pending, deque()
        spans[-1].end.synchronize()
        self.reads += 1
        anchor, at = self._anchor
        out = [(s.category, s.phase, s.fields, at + anchor.elapsed_time(s.start) / 1e3,
                at + anchor.elapsed_time(s.end) / 1e3) for s in spans]
        self._anchor = (spans[-1].end, out[-1][4])
        return out
