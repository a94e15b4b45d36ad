"""What this process's main thread is doing, published by the failure watchdog ([Note: judging progress] in
watchdog.py): a phase of setup, a collective, a gather, a pipeline action, with whom it waits for and since when.

The main thread marks its phases here (``activity.phase``, ``activity.collective``, ``activity.begin``); a stage's
runtime is consulted first (``runtime_activity``: its current action). The watchdog's thread reads ``activity.now()``
and writes it to the store as text (``encode_doing``); the others decode it and judge it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ALL", "Doing", "ProcessActivity", "Waits", "activity", "decode_doing", "encode_doing",
           "runtime_activity"]


class _Everyone:
    """What a collective of every watched process waits for."""

    def __repr__(self) -> str:
        return "ALL"


ALL = _Everyone()
Waits = _Everyone | frozenset[int] | None
# (label, what it waits for, seconds in it, patient)
Doing = tuple[str, Waits, float, bool]


class ProcessActivity:
    """What this process's main thread is doing, for the watchdog's thread ([Note: judging progress]): a stack of
    phases (the innermost counts) under an optional base phase (setup), and a source consulted first (a runtime's
    current action)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._stack: list[tuple[str, Waits, float, bool]] = []
        self._base: tuple[str, Waits, float, bool] | None = None
        self.source: Callable[[], Doing | None] | None = None
        self._numbers: dict[str, int] = {}
        self._aside: tuple[str, Waits, float, bool] | None = None

    def begin(self, label: str, *, patient: bool = False) -> None:
        """The base phase, under the stack's: ``label`` (work) until :meth:`end`."""
        self._base = (label, None, self.clock(), patient)

    def end(self) -> None:
        self._base = None

    @contextlib.contextmanager
    def phase(self, label: str, *, waits: Waits = None) -> Iterator[None]:
        """``label`` while the block runs: work (``waits=None``) or a wait for ``waits`` (watched ids, or ALL);
        only the base phase (:meth:`begin`) is patient."""
        entry = (label, waits, self.clock(), False)
        self._stack.append(entry)
        try:
            yield
        finally:
            if self._stack and self._stack[-1] is entry:
                self._stack.pop()

    @contextlib.contextmanager
    def aside(self, label: str) -> Iterator[None]:
        """``label``, a wait for no watched process, over whatever the source says while the block runs: it
        neither keeps anyone waiting nor is kept waiting (a rank that raised, waiting for the failure its lost
        connection follows from, inside the action that raised)."""
        previous, self._aside = self._aside, (label, frozenset(), self.clock(), False)
        try:
            yield
        finally:
            self._aside = previous

    def collective(self, label: str, waits: Waits = ALL) -> contextlib.AbstractContextManager[None]:
        """A wait in a collective, numbered per label: the n-th one reads the same on every member, and members
        in different ones read differently ([Note: judging progress])."""
        self._numbers[label] = number = self._numbers.get(label, 0) + 1
        return self.phase(f"{label} #{number}", waits=waits)

    def now(self) -> Doing | None:
        if self._aside is not None:
            label, waits, start, patient = self._aside
            return label, waits, self.clock() - start, patient
        if self.source is not None and (current := self.source()) is not None:
            return current
        top = self._stack[-1] if self._stack else self._base
        if top is None:
            return None
        label, waits, start, patient = top
        return label, waits, self.clock() - start, patient


activity = ProcessActivity()  # this process's (the watchdog of a stage process reads it)


def encode_doing(now: Doing) -> str:
    label, waits, seconds, patient = now
    text = "" if waits is None else "*" if isinstance(waits, _Everyone) else ",".join(map(str, sorted(waits))) or "-"
    return f"{label}\n{text}\n{seconds:.1f}\n{int(patient)}"


def decode_doing(text: str) -> Doing:
    label, waits, seconds, patient = text.split("\n")
    parsed: Waits = None if not waits else ALL if waits == "*" else frozenset() if waits == "-" else frozenset(
        int(w) for w in waits.split(","))
    return label, parsed, float(seconds), patient == "1"


def runtime_activity(runtime: Any, watched: Callable[[int], int]) -> Callable[[], Doing | None]:
    """What ``runtime`` (a StageRuntime) is doing, for :attr:`ProcessActivity.source`: its current action, the
    watched index (``watched(stage)``) of the stage a receive waits for, the seconds since it began, and whether it
    is patient (every action before the stage's first update: compilation, autotuning)."""
    from lightning_paci.schedules import RECV_KINDS, message_key  # light, and no cycle: schedules import nothing here

    def now() -> Doing | None:
        current = runtime.current
        if current is None:
            return None
        action, start = current
        key = message_key(action, runtime.num_stages) if action.kind in RECV_KINDS else None
        waits = None if key is None else frozenset([watched(key[1])])
        return str(action), waits, runtime.clock() - start, runtime.version == 0

    return now
