"""No stage waits forever for a dead one: heartbeats and failure reports through the process group's store.

A pipeline stage blocked in a receive from a neighbour that died (killed, out of memory) or raised would wait until
the process-group timeout (30 minutes by default). Every stage therefore runs a small watchdog thread that talks to
the rendezvous store (its own TCP connection, never the training communicators):

* it bumps ``paci/<run>/heartbeat/<stage>`` every ``interval`` seconds; a stage whose counter has not moved for
  ``dead_after`` seconds is declared dead ("stopped responding: killed or hung");
* it publishes what the process's main thread is doing (``paci/<run>/activity/<stage>``, [Note: judging progress]):
  a phase of setup, a collective, a gather, a pipeline action, with whom it waits for and for how long. A process
  that has worked inside one phase past its limit while another waits for it, or that waits for a process which
  waits for it in something else, is declared hung. A heartbeat comes from this thread, which goes on beating
  while the main thread is stuck in a kernel, a collective, a group's creation or a host read that never returns
  (an NCCL hang): judging the progress catches that. A process outside any phase (Lightning's loop, the
  dataloader) is never judged so;
* a stage whose code raises (the user's step, a non-finite loss, a lost neighbour) writes ``paci/<run>/failed`` with
  its stage index and exception before Lightning unwinds it;
* on either, every other stage prints one line naming the failed stage and its reason and exits the process with
  status 1 -- it may be blocked inside a receive that no exception can interrupt. A stage that reported its own
  exception goes on beating while it unwinds, and the others exit only once its heartbeat stops (or after
  ``dead_after``): its process ends first, so a launcher that joins its children (fork, spawn) raises the failed
  stage's own exception, not "process N exited with code 1" of a stage that stopped because of it. A stage whose
  own exception came after another stage's reported failure (a neighbour's lost connection) reports it in one line
  too, not as a traceback: the failed stage's traceback stays the last one on the screen, the cause last.

The watchdog starts before the world's process group exists (:func:`rendezvous_store` makes the store first), so a
rank held anywhere in setup is named too; a rank that has not beaten yet (still starting, importing) is given
``PATIENCE * dead_after`` to join.

[Note: judging progress]
Each process publishes its innermost phase: a label, what it waits for (nothing while it works; a set of watched
processes, or all of them, while it waits in a receive or a collective), the seconds since it began, and whether
it is patient. Another process is declared hung when

* it has *worked* inside one phase for ``dead_after`` seconds (``10 * dead_after`` for patient work: setup's
  building and loading, and every action before a stage's first update, where compilation and autotuning run)
  while a process has waited for it at least ``dead_after`` seconds; or
* it has *waited* ``dead_after`` seconds in a phase that needs a process which waits for it, as long, in a
  phase with another label (two ranks in different collectives, a receive and a collective): neither can go on.

Labels of one collective are the same text on every rank (the group creations are numbered), so ranks waiting
together in one collective never name each other.

A watchdog that finds a failure publishes it too before it stops its process, so every other stage stops at once.
Keys are per run (``run``: the how-many-th fit of these processes, counted alike on every rank), so a later fit
in the same processes (a resume after torchrun's first fit) never reads an earlier one's records.

Stages that finished cleanly set ``paci/<run>/done/<stage>`` and stop their watchdog before the final gather, so a
normal shutdown is never mistaken for a failure. Heartbeats are counters, not timestamps: no clock agreement is
needed across machines.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_paci.engine.activity import Doing, decode_doing, encode_doing
from lightning_paci.errors import StageFailure

__all__ = ["StageWatchdog", "connect_store", "mark_setup_error", "print_setup_errors_once", "rendezvous_store"]

_ENDED_AFTER_BEATS = 3  # a reporting stage whose heartbeat has not moved for this many intervals has ended
PATIENCE = 10  # patient work is judged after PATIENCE * dead_after ([Note: judging progress])




def rendezvous_store(environment: Any, rank: int, world: int, timeout: timedelta) -> Any:
    """The world's TCP store, made before the process group so the watchdog can run from the start of setup.
    Global rank 0 hosts it (a launcher's agent store when torchelastic provides one) and waits for no one: a rank
    that never arrives is named by the others' watchdogs, not by a store timeout. Sets MASTER_ADDR/MASTER_PORT as
    Lightning's own process-group start does."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return dist.TCPStore(environment.main_address, int(environment.main_port), world, is_master=hosts,
                         timeout=timeout, wait_for_workers=False, multi_tenant=True)


def connect_store(timeout: float = 10.0) -> Any | None:
    """A new client connection to the rendezvous TCP store (MASTER_ADDR / MASTER_PORT), or ``None``."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except Exception:
        return None


class StageWatchdog:
    """Heartbeat and failure watcher of one stage (see the module docstring)."""

    def __init__(self, stage: int, num_stages: int, store: Any, *, interval: float = 1.0, dead_after: float = 20.0,
                 exit_fn: Callable[[int], None] = os._exit, name: Callable[[int], str] = "stage {}".format,
                 store_host: int = 0, run: int = 0) -> None:
        # ``stage``/``num_stages``: this process's index among the watched ones and their count -- the stage index
        # of a pure pipeline, the global rank under data parallelism (``name`` then says "stage s (replica r)")
        self.stage = stage
        self.num_stages = num_stages
        self.name = name
        self.store_host = store_host  # the index of global rank 0, whose process hosts the store
        self.store = store
        self.prefix = f"paci/{run}/"  # the run's own keys (see the module docstring)
        self.interval = interval
        self.dead_after = dead_after
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"paci-watchdog-{stage}", daemon=True)
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # stage -> (last counter, local time it last moved)
        # what this process is doing ([Note: judging progress]); ``activity.now`` for a stage process
        self.activity: Callable[[], Doing | None] | None = None
        self._unwinding = False  # this process reported its own failure: beat until it ends, judge no one
        self._heard: tuple[int, str] | None = None  # another stage's reported failure, waiting for it to end
        self._heard_at = 0.0

    def start(self) -> None:
        self._beat()
        self._thread.start()
        self._report_secondary_failures_in_one_line()

    def _report_secondary_failures_in_one_line(self) -> None:
        """An uncaught exception in this process after another stage reported its failure is a consequence of
        that failure (the neighbour's connection closed): one line naming the cause instead of a traceback."""
        previous = sys.excepthook

        def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
            try:
                reported = self._reported()
                failure = reported if reported is not None and reported[0] != self.stage else None
            except Exception:  # the store is gone with rank 0's process: a lost message is its consequence
                failure = (self.store_host, "exited (its message is above)") \
                    if isinstance(value, (StageFailure, ConnectionError)) else None
            if failure is None:
                previous(kind, value, traceback)
                return
            stage, reason = failure
            first_line = str(value).splitlines()[0] if str(value) else ""
            print(f"lightning_paci: {self.name(self.stage)} stopped ({kind.__name__}: {first_line[:200]}) because "
                  f"{self.name(stage)} failed first: {reason.splitlines()[0][:300] if reason else ''}",
                  file=sys.stderr, flush=True)

        sys.excepthook = hook

    def _reported(self) -> tuple[int, str] | None:
        """The first failure any stage published (this one's included), or None."""
        if not self.store.check([self.prefix + "failed"]):
            return None
        stage, _, reason = self.store.get(self.prefix + "failed").decode().partition("\n")
        return int(stage), reason

    def stop(self, *, done: bool = True) -> None:
        if done:
            try:
                self.store.set(f"{self.prefix}done/{self.stage}", "1")
            except Exception:
                pass
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5 * self.interval)

    def report(self, stage: int, reason: str) -> None:
        """Publish the first failure (later reports, e.g. neighbours that lost it, keep the original)."""
        try:
            if not self.store.check([self.prefix + "failed"]):
                self.store.set(self.prefix + "failed", f"{stage}\n{reason}")
        except Exception:
            pass

    def fail(self, reason: str) -> None:
        """This process raised: publish it (unless another stage failed first) and keep beating while it unwinds,
        so the others exit after it (see the module docstring)."""
        self.report(self.stage, reason)
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}unwinding/{self.stage}", "1")
        self._unwinding = True

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{self.prefix}heartbeat/{self.stage}", str(self._beats))
        now = self.activity() if self.activity is not None else None
        self.store.set(f"{self.prefix}activity/{self.stage}", "" if now is None else encode_doing(now))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._unwinding:
                with contextlib.suppress(Exception):
                    self._beat()
                continue
            try:
                self._beat()
                failure = self._failure()
                if failure is not None and self._heard == failure and self._still_unwinding(failure[0]):
                    continue
            except Exception as err:  # the store lives in rank 0's process: unreachable means rank 0 is gone
                failure = self._heard or (
                    self.store_host, f"exited or died: the rendezvous store it hosts is unreachable ({err}); "
                                     f"if another stage failed first, its message is above")
            if failure is not None and not self._stop.is_set():
                stage, reason = failure
                self.report(stage, reason)  # the others stop on it at once (a no-op if one was reported first)
                print(f"lightning_paci: {self.name(stage)} failed: {reason} -- stopping {self.name(self.stage)}",
                      file=sys.stderr, flush=True)
                self._exit(1)
                return

    def _still_unwinding(self, stage: int) -> bool:
        """Whether ``stage``, which reported its own failure, still beats (its process has not ended), for at most
        ``dead_after`` after the report was first seen. A stage named by another's report (hung, dead) is not
        waited for."""
        if not self.store.check([f"{self.prefix}unwinding/{stage}"]):
            return False
        now = time.monotonic()
        _, silent = self._silence(stage, now)
        return silent < _ENDED_AFTER_BEATS * self.interval and now - self._heard_at < self.dead_after

    def _silence(self, stage: int, now: float) -> tuple[int, float]:
        """``stage``'s heartbeat counter and the seconds since it last moved (0 when it moved since the last look)."""
        key = f"{self.prefix}heartbeat/{stage}"
        count = int(self.store.get(key)) if self.store.check([key]) else 0
        last, since = self._seen.get(stage, (-1, now))
        if count != last:
            self._seen[stage] = (count, now)
            return count, 0.0
        return count, now - since

    def _failure(self) -> tuple[int, str] | None:
        if (reported := self._reported()) is not None:
            if reported[0] == self.stage:
                return None
            if self._heard is None:
                self._heard, self._heard_at = reported, time.monotonic()
            return reported
        if (hung := self._hung()) is not None:
            return hung
        now = time.monotonic()
        for other in range(self.num_stages):
            if other == self.stage or self.store.check([f"{self.prefix}done/{other}"]):
                continue
            count, silent = self._silence(other, now)
            if count == 0 and silent > self.dead_after * PATIENCE:  # started, imports, joins: patient
                return other, (f"never joined: no heartbeat in {silent:.0f} s since this process started "
                               f"watching (it did not start, or failed before setup)")
            if count > 0 and silent > self.dead_after:
                return other, (f"stopped responding (no heartbeat for {silent:.0f} s: "
                               f"killed, out of memory or hung)")
        return None


    def _hung(self) -> tuple[int, str] | None:
        """A process that keeps another waiting ([Note: judging progress]), with the reason, or None."""
        doing: dict[int, Doing] = {}
        for other in range(self.num_stages):
            key = f"{self.prefix}activity/{other}"
            text = self.store.get(key).decode() if self.store.check([key]) else ""
            if text:
                doing[other] = decode_doing(text)
        for waiter, (waits_at, waits, waited, _) in doing.items():
            if waits is None or waited < self.dead_after:
                continue
            for held in (waits if isinstance(waits, frozenset) else range(self.num_stages)):  # a set, or ALL
                if held == waiter or held not in doing:
                    continue
                label, its_waits, inside, patient = doing[held]
                if its_waits is None and inside >= self.dead_after * (PATIENCE if patient else 1):
                    grace = ", past the patience given to setup and first steps" if patient else ""
                    return held, (f"made no progress for {inside:.0f} s: inside {label} while "
                                  f"{self.name(waiter)} waits for it at {waits_at} (hung in a kernel, a collective "
                                  f"or a host read{grace})")
                if its_waits is not None and label != waits_at and inside >= self.dead_after and \
                        (not isinstance(its_waits, frozenset) or waiter in its_waits):
                    return held, (f"waits at {label} for {inside:.0f} s while {self.name(waiter)} waits for it at "
                                  f"{waits_at}: each waits for the other")
        return None


_SETUP_MARK = "_lightning_paci_setup_error"


def mark_setup_error(error: BaseException) -> BaseException:
    """Mark an error raised by the checks at setup: every rank runs the same checks and raises the same error."""
    setattr(error, _SETUP_MARK, True)
    return error


def print_setup_errors_once(rank: int) -> None:
    """On ranks other than 0, report a marked setup error in one line instead of a full traceback.

    A setup error is the same on every rank; with the default launcher each rank is its own Python process, and
    8 stages printed 8 identical tracebacks (186 lines) for one bad option. Rank 0 prints the traceback; the others
    print one line that names their rank and points at it. Any other uncaught exception is reported as before.
    """
    if rank == 0:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if getattr(value, _SETUP_MARK, False):
            first_line = str(value).splitlines()[0] if str(value) else ""
            print(f"lightning_paci: rank {rank} stopped at setup with the error rank 0 reports in full: "
                  f"{kind.__name__}: {first_line}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook

