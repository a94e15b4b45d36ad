"""Where a preempted run stops: one Lightning batch, agreed by every process through the rendezvous store.

[Note: a preemption's stop]
A scheduler preempting a job (SLURM, a cloud's spot reclaim) sends SIGTERM to every process, a few at a time, and
kills what is left after a grace period (SLURM's KillWait, 30 s by default). Each process stopping at the next
batch it reaches would write its part of a checkpoint at another step -- the stages are a batch or two apart --
and the first to stop would leave the others waiting for its messages. So a SIGTERM only *asks* for a stop
(:meth:`StopAgreement.request`, from the signal handler: no store call there), and the processes agree on the first
Lightning batch none of them has started:

* each process's main thread records, before each batch ``k``, that it may start it (``next_batch = k + 1``), and
  is *pending* from the first batch after its own signal on;
* once the request is known to a process's watchdog thread -- its own signal, or another's ``preempt`` key in the
  store -- the thread marks the process *pending* and then publishes ``preempt/next/<id>`` = its ``next_batch``
  (in that order: whatever the main thread starts after it read *pending* as false is counted);
* the stop batch ``B`` is the largest published value, once every process published: no process has started
  ``B``, and a process blocked inside an earlier batch published more than it, so the others run on to ``B`` and
  its messages come;
* a pending process waits before each batch until ``B`` is known (an interval or two), runs the batches before
  ``B`` and stops before ``B``: every process stops at the same step, drains, and the checkpoint written then
  (``OnExceptionCheckpoint``) is one consistent step of the whole pipeline.

The store is read once per interval by the watchdog thread, never by the main thread: without a preemption a batch
costs two attribute accesses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["StopAgreement"]

_POLL = 0.02  # seconds between a waiting main thread's looks at the agreed batch


class StopAgreement:
    """One process's part of [Note: a preemption's stop]. ``read(key)`` / ``write(key, value)`` are the run's keys
    in the store ("" where not set); ``num`` the watched processes, ``me`` this one's id."""

    def __init__(self, read: Callable[[str], str], write: Callable[[str, str], None], num: int, me: int) -> None:
        self._read, self._write, self._num, self._me = read, write, num, me
        self.next_batch = 0  # the first Lightning batch the main thread has not allowed itself to start
        self.stop_batch: int | None = None  # the agreed batch, once every process published
        self._requested = False  # this process got the signal
        self._pending = False  # a stop was asked for, here or elsewhere: the main thread waits for its batch
        self._published = False  # this process said its next batch

    @property
    def pending(self) -> bool:
        """Whether a stop was asked for and this process takes part (its main thread waits for the batch)."""
        return self._pending

    def request(self) -> None:
        """This process got the signal (called in the handler: a flag, no store call)."""
        self._requested = True

    def poll(self) -> None:
        """The watchdog thread, every interval: join a stop asked for anywhere, then read the agreed batch."""
        if self.stop_batch is not None:
            return
        if not self._published:
            if not (self._requested or self._pending or self._read("preempt")):
                return
            self._pending = True  # first: the main thread now waits before every batch it has not allowed
            if self._requested:
                self._write("preempt", str(self._me))
            self._write(f"preempt/next/{self._me}", str(self.next_batch))
            self._published = True
        published = [self._read(f"preempt/next/{other}") for other in range(self._num)]
        if all(published):
            self.stop_batch = max(int(value) for value in published)

    def before_batch(self, batch: int, *, timeout: float) -> bool:
        """The main thread, before Lightning batch ``batch`` (counted over the run): whether to stop before it.
        While a stop is pending and its batch unknown, waits for it (at most ``timeout`` seconds: a process that
        never publishes is a failure the watchdog names)."""
        self.next_batch = batch + 1
        if self._requested:  # its own signal: wait from here on (the thread says the batch within an interval)
            self._pending = True
        if not self._pending:
            return False
        deadline = time.monotonic() + timeout
        while self.stop_batch is None and time.monotonic() < deadline:
            time.sleep(_POLL)
        if self.stop_batch is None:
            raise RuntimeError(f"lightning_paci: a preemption was asked for, and after {timeout:.0f} s not every "
                               f"stage has said which batch it reached: stopping here")
        return batch >= self.stop_batch
