"""No stage waits forever for a dead one: heartbeats and failure reports through the process group's store.

A pipeline stage blocked in a receive from a neighbour that died (killed, out of memory) or raised would wait until
the process-group timeout (30 minutes by default). Every stage therefore runs a small watchdog thread that talks to
the rendezvous store (its own TCP connection, never the training communicators):

* it bumps ``paci/heartbeat/<stage>`` every ``interval`` seconds; a stage whose counter has not moved for
  ``dead_after`` seconds is declared dead ("stopped responding: killed or hung");
* it publishes what the stage's runtime is doing (``paci/activity/<stage>``: the action, the stage it waits for
  when the action is a receive, for how long): a stage inside one action other than a receive for ``dead_after``
  seconds while a neighbour's receive has waited for it as long is declared hung ("completed no action ...").
  A heartbeat comes from this thread, which goes on beating while the main thread is stuck in a kernel, a
  collective or a host read that never returns (an NCCL hang): judging the progress of the actions catches that.
  A stage outside any action (Lightning's loop, the dataloader) is never judged so;
* a stage whose code raises (the user's step, a non-finite loss, a lost neighbour) writes ``paci/failed`` with
  its stage index and exception before Lightning unwinds it;
* on either, every other stage prints one line naming the failed stage and its reason and exits the process with
  status 1 -- it may be blocked inside a receive that no exception can interrupt. A stage whose own exception
  came after another stage's reported failure (a neighbour's lost connection) reports it in one line too, not as
  a traceback: the failed stage's traceback stays the last one on the screen, the cause last.

Stages that finished cleanly set ``paci/done/<stage>`` and stop their watchdog before the final gather, so a normal
shutdown is never mistaken for a failure. Heartbeats are counters, not timestamps: no clock agreement is needed
across machines.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["StageFailure", "StageWatchdog", "connect_store", "mark_setup_error", "print_setup_errors_once",
           "runtime_activity"]

FAILED_KEY = "paci/failed"


class StageFailure(RuntimeError):
    """A pipeline stage cannot go on; the message names the stage and the reason."""


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
                 store_host: int = 0) -> None:
        # ``stage``/``num_stages``: this process's index among the watched ones and their count -- the stage index
        # of a pure pipeline, the global rank under data parallelism (``name`` then says "stage s (replica r)")
        self.stage = stage
        self.num_stages = num_stages
        self.name = name
        self.store_host = store_host  # the index of global rank 0, whose process hosts the store
        self.store = store
        self.interval = interval
        self.dead_after = dead_after
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"paci-watchdog-{stage}", daemon=True)
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # stage -> (last counter, local time it last moved)
        # what this stage's runtime is doing: (action, the watched index it waits for or None, seconds in it);
        # set once the runtime exists (``runtime_activity``)
        self.activity: Callable[[], tuple[str, int | None, float] | None] | None = None

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
        if not self.store.check([FAILED_KEY]):
            return None
        stage, _, reason = self.store.get(FAILED_KEY).decode().partition("\n")
        return int(stage), reason

    def stop(self, *, done: bool = True) -> None:
        if done:
            try:
                self.store.set(f"paci/done/{self.stage}", "1")
            except Exception:
                pass
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5 * self.interval)

    def report(self, stage: int, reason: str) -> None:
        """Publish the first failure (later reports, e.g. neighbours that lost it, keep the original)."""
        try:
            if not self.store.check([FAILED_KEY]):
                self.store.set(FAILED_KEY, f"{stage}\n{reason}")
        except Exception:
            pass

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"paci/heartbeat/{self.stage}", str(self._beats))
        now = self.activity() if self.activity is not None else None
        self.store.set(f"paci/activity/{self.stage}",
                       "" if now is None else f"{now[0]}\n{'' if now[1] is None else now[1]}\n{now[2]:.1f}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                failure = self._failure()
            except Exception as err:  # the store lives in rank 0's process: unreachable means rank 0 is gone
                failure = (self.store_host, f"exited or died: the rendezvous store it hosts is unreachable ({err}); "
                                            f"if another stage failed first, its message is above")
            if failure is not None and not self._stop.is_set():
                stage, reason = failure
                print(f"lightning_paci: {self.name(stage)} failed: {reason} -- stopping {self.name(self.stage)}",
                      file=sys.stderr, flush=True)
                self._exit(1)
                return

    def _failure(self) -> tuple[int, str] | None:
        if (reported := self._reported()) is not None:
            return reported if reported[0] != self.stage else None
        if (hung := self._hung()) is not None:
            return hung
        now = time.monotonic()
        for other in range(self.num_stages):
            if other == self.stage or self.store.check([f"paci/done/{other}"]):
                continue
            key = f"paci/heartbeat/{other}"
            count = int(self.store.get(key)) if self.store.check([key]) else 0
            last, since = self._seen.get(other, (-1, now))
            if count != last:
                self._seen[other] = (count, now)
            elif now - since > self.dead_after:
                return other, (f"stopped responding (no heartbeat for {now - since:.0f} s: "
                               f"killed, out of memory or hung)")
        return None


    def _hung(self) -> tuple[int, str] | None:
        """A stage inside one non-receive action for ``dead_after`` s while a receive has waited for it as long."""
        doing: dict[int, tuple[str, int | None, float]] = {}
        for other in range(self.num_stages):
            key = f"paci/activity/{other}"
            text = self.store.get(key).decode() if self.store.check([key]) else ""
            if text:
                action, peer, seconds = text.split("\n")
                doing[other] = (action, int(peer) if peer else None, float(seconds))
        for waiter, (waits_at, peer, waited) in doing.items():
            if peer is None or waited < self.dead_after or peer not in doing:
                continue
            action, its_peer, inside = doing[peer]
            if its_peer is None and inside >= self.dead_after:
                return peer, (f"completed no action for {inside:.0f} s: inside {action} while {self.name(waiter)} "
                              f"waits for it at {waits_at} (hung in a kernel, a collective or a host read)")
        return None


def runtime_activity(runtime: Any, watched: Callable[[int], int]) -> Callable[[], tuple[str, int | None, float] | None]:
    """What ``runtime`` (a StageRuntime) is doing, for :attr:`StageWatchdog.activity`: its current action, the
    watched index (``watched(stage)``) of the stage a receive waits for, and the seconds since it began."""
    from lightning_paci.schedules import RECV_KINDS, message_key  # light, and no cycle: schedules import nothing here

    def activity() -> tuple[str, int | None, float] | None:
        current = runtime.current
        if current is None:
            return None
        action, start = current
        key = message_key(action, runtime.num_stages) if action.kind in RECV_KINDS else None
        return str(action), None if key is None else watched(key[1]), runtime.clock() - start

    return activity


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

