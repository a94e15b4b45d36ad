"""Receives posted ahead of the actions that take them: which receive each link posts next, and, under NCCL, who
waits for a posted header so that the host only reads a flag.

``ReceivesAhead`` ([Note: receives posted ahead] in point_to_point.py) posts each link's next activation or gradient
receive while a stage runs one call's actions, and after every other action advances the posted ones ([Note:
payloads received early] in point_to_point.py). ``HeaderWaiter`` is the thread that waits for a link's posted
header receives, for the transport whose headers travel apart from their payloads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_paci.schedules.actions import RECV_B, RECV_F, Action

if TYPE_CHECKING:
    from lightning_paci.engine.transport.point_to_point import Comm

__all__ = ["Arrival", "HeaderWaiter", "ReceivesAhead"]


class ReceivesAhead:
    """The receives a stage posts ahead while it runs one call's ``actions`` ([Note: receives posted ahead]): the
    first activation and gradient receive at once, each next one of a link when the previous was taken, none past
    the call's last receive of that link."""

    def __init__(self, comm: Comm, stage: int, actions: Sequence[Action]) -> None:
        self._comm = comm
        self._advances = bool(getattr(comm, "advances", False))  # [Note: payloads received early]
        self._sources = {RECV_F: stage - 1, RECV_B: stage + 1}
        self._left = {RECV_F: 0, RECV_B: 0}  # receives of each link still to come in this call
        for action in actions:
            if action.kind in self._left:
                self._left[action.kind] += 1
        for kind, count in self._left.items():
            if count:
                comm.post(self._sources[kind])

    def taken(self, action: Action) -> None:
        """Call after each action: a receive that completed posts the next of its link, if the call has one; any
        other action advances the links' posted receives ([Note: payloads received early])."""
        left = self._left.get(action.kind)
        if left is not None:
            self._left[action.kind] = left - 1
            if left > 1:
                self._comm.post(self._sources[action.kind])
            return
        if self._advances:
            for kind, count in self._left.items():
                if count:
                    self._comm.post(self._sources[kind])


class Arrival:
    """A posted header receive as the host sees it: ``is_completed`` without waiting, ``wait`` until it is in (its
    error raised there)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class HeaderWaiter:
    """One daemon thread per link that waits for its posted header receives in turn ([Note: payloads received
    early]): gloo's receive work reports completion only from ``wait()`` (``is_completed()`` stays False until
    then, measured with torch 2.13), and a second ``wait()`` would wait for a second message, so only this thread
    waits on the work and the host reads the :class:`Arrival` it sets. Per link, not per transport: one thread
    waiting for a header of one link could not flag the other link's, which may have to arrive first."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Arrival]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def watch(self, work: Any) -> Arrival:
        arrival = Arrival()
        self._queue.put((work, arrival))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning_paci headers", daemon=True)
            self._thread.start()
        return arrival

    def _run(self) -> None:
        while True:
            work, arrival = self._queue.get()
            try:
                work.wait()
            except BaseException as err:  # a dead peer, a timeout: raised by the receive that takes it
                arrival.error = err
            arrival.done.set()
