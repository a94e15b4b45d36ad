"""No stage waits forever for a dead one, and none outlives a failed run: heartbeats, failure reports and the end
of every run through the rendezvous store.

A stage blocked in a receive from a neighbour that died or raised would wait for the process-group timeout (30
minutes by default). Every process therefore runs a watchdog thread that talks to the rendezvous store (its own
connection), from the start of setup (the store is made first) to the end of the run, teardown hooks included:

* it bumps ``paci/<run>/heartbeat/<id>`` every ``interval`` seconds; a process silent for ``dead_after`` seconds
  is declared dead, one that has not beaten yet (starting, importing) after ``PATIENCE * dead_after``;
* it publishes what the process's main thread is doing (``paci/<run>/activity/<id>``, [Note: judging progress]):
  the heartbeat comes from this thread, which goes on beating while the main thread is stuck in a kernel, a
  collective or a host read that never returns (an NCCL hang): judging the progress catches that;
* a process whose code raises (the user's step, a non-finite loss, the last drain's data check, a teardown hook)
  writes ``paci/<run>/failed`` with its id and exception before Lightning unwinds it ([Note: ending a run]).
* a process of this machine that ended without a word (killed) is named within an interval, and an exception
  that is a lost connection waits for the failure it follows from before reporting itself (lost_peers.py).

Keys are per run (counted alike on every rank); heartbeats are counters, not timestamps (no clock agreement).

[Note: judging progress]
Each process publishes its innermost phase: a label, what it waits for (nothing while it works; a set of watched
processes, or all of them, while it waits in a receive or a collective), the seconds since it began, and whether
it is patient. Another process is declared hung when

* it has *worked* inside one phase for ``dead_after`` seconds (``PATIENCE * dead_after`` for patient work: setup,
  every action before a stage's first update, where compilation and autotuning run, and teardown) while a process
  has waited for it at least ``dead_after`` seconds; or
* it has *waited* ``dead_after`` seconds in a phase that needs a process which waits for it, as long, in a
  phase with another label (two ranks in different collectives, a receive and a collective): neither can go on.

Labels of one collective are the same text on every rank (the group creations are numbered), so ranks waiting
together in one collective never name each other. A process outside any phase (Lightning's loop, the dataloader)
is never judged so, nor one done with its run, and one done waits for the others' work only.

[Note: ending a run]
On a failure every other process prints one line, ``lightning_paci: <failed> failed: <reason> -- stopping
<itself>``, at once, says in the store that it heard it, and exits with status 1 -- it may be blocked in a receive
or a gather that no exception can interrupt. A process that raised waits (at most ``dead_after``) until every other
has heard it before it unwinds, so every line is said while the store it may host runs; the others exit once its
process has ended (its pid on the same machine, else its ``ended`` key or heartbeat), so a launcher that joins its
children (fork, spawn) raises its exception, the only traceback; there they exit with status 0, as torch's join
raises the first failed worker's error in rank order when several ended before it looked. An exception that follows
another process's failure (a neighbour's connection closed) is its consequence: one line too. A process found hung
or dead is named the same way, and stops itself. A launcher waits for the processes it started before it exits, and
a launched process whose launcher is gone stops: no process outlives its launcher.

Without a failure each process sets ``done/<id>`` when its run returned and stays, watched and watching, until
every process is done; the store's host (global rank 0) then waits until the others read it for the last time
(``left/<id>``). So a failure in the last drain or a teardown hook reaches every process.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_paci.engine.supervision.activity import Doing, activity, decode_doing, encode_doing
from lightning_paci.engine.supervision.lost_peers import (
    OnceLost,
    PeerProcesses,
    killed,
    machine,
    process_key,
    running_here,
    this_process,
    where_it_runs,
)
from lightning_paci.engine.supervision.preemption import StopAgreement
from lightning_paci.errors import is_setup_error, mark_setup_error

__all__ = ["LAUNCHED", "PATIENCE", "StageWatchdog", "is_setup_error", "judge_progress", "mark_setup_error", "say"]

_ENDED_AFTER_BEATS = 3  # a process whose heartbeat has not moved for this many intervals has ended
_POLL = 0.02  # seconds between a waiting end's looks at the store (a run's end waits for the slowest rank only)
PATIENCE = 10  # patient work is judged after PATIENCE * dead_after ([Note: judging progress])


def say(line: str) -> None:
    """``line`` to standard error in one write, flushed: the processes of a machine share the stream, and
    ``print``'s two writes (the text, then the newline) interleave with theirs."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class StageWatchdog:
    """Heartbeat and failure watcher of one process (see the module docstring)."""

    def __init__(self, stage: int, num_stages: int, store: Any, *, interval: float = 1.0, dead_after: float = 20.0,
                 exit_fn: Callable[[int], None] = os._exit, name: Callable[[int], str] = "stage {}".format,
                 store_host: int | None = 0, launcher: int | None = None, run: int = 0, restart: int = 0) -> None:
        # ``stage``/``num_stages``: this process's index among the watched ones and their count -- the stage index
        # of a pure pipeline, the global rank under data parallelism (``name`` then says "stage s (replica r)")
        self.stage = stage
        self.num_stages = num_stages
        self.name = name
        self.store_host = store_host  # the process hosting the store (global rank 0's); None: a launcher's agent
        self.launcher = launcher  # the pid of the launcher that started this process, if one did
        self.store = OnceLost(store)
        # the run's own keys (see the module docstring); torchrun's restarts keep its agent's store: their own
        self.prefix = f"paci/{run}/" if restart == 0 else f"paci/restart{restart}/{run}/"
        self.interval = interval
        self.dead_after = dead_after
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"paci-watchdog-{stage}", daemon=True)
        self._lock = threading.Lock()
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # stage -> (last counter, local time it last moved)
        self.activity: Callable[[], Doing | None] | None = None
        self._unwinding = False  # this process reported its own failure: beat until it ends, judge no one
        self._heard: tuple[int, str] | None = None  # the failure this process stops for ([Note: ending a run])
        self._heard_at, self._ending, self._exited = 0.0, False, threading.Event()
        self._await_end = False  # whether the failed process raised itself (its end is waited for) or was judged
        self._where: tuple[str, int] = ("", 0)  # the failed process's host and pid
        self._peers = PeerProcesses(self._text, num_stages, stage, store_host)  # those of this machine (lost_peers.py)
        self.preemption = StopAgreement(self._text, lambda key, value: self.store.set(self.prefix + key, value),
                                        num_stages, stage)  # a SIGTERM's stop, one batch for all (preemption.py)

    def start(self) -> None:
        self.store.set(f"{self.prefix}{process_key(self.stage)}", this_process())
        self._beat()
        self._thread.start()

    def joined(self) -> None:
        """The world's process group is joined: every process published its pid before joining; read them now,
        so that one killed from here on is named by its pid (the store's host too, without a store call)."""
        with contextlib.suppress(Exception):
            self._peers.learn()
        if self.store_host is not None and self.store_host != self.stage:
            self.store.host_ended = lambda: self._peers.ended_here(self.store_host)

    @property
    def watching(self) -> bool:
        """Whether its thread runs (from ``start`` until the run ended or this process is ending)."""
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def said(self) -> bool:
        """Whether this process printed its line about another's failure ([Note: ending a run])."""
        return self._heard is not None

    def _text(self, key: str) -> str:  # the run's ``key`` in the store, "" where not set
        key = self.prefix + key
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def _reported(self) -> tuple[int, str] | None:
        """The first failure any stage published (this one's included), or None."""
        stage, _, reason = self._text("failed").partition("\n")
        return (int(stage), reason) if stage else None

    def stop(self, *, done: bool = True) -> None:
        self._stop.set()  # first: the thread never reads a store that ends after this
        if done:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}done/{self.stage}", "1")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5 * self.interval)

    def report(self, stage: int, reason: str) -> None:
        """Publish the first failure (later reports, e.g. neighbours that lost it, keep the original)."""
        with contextlib.suppress(Exception):
            if not self.store.check([self.prefix + "failed"]):
                self.store.set(self.prefix + "failed", f"{stage}\n{reason}")

    def fail(self, reason: str, *, may_follow: bool = True, lost: bool = False) -> None:
        """This process raised. Where another stage failed first (``may_follow``: not the same setup error on
        every rank), this exception is its consequence: say the one line and end the process; a ``lost``
        connection waits for its cause first (lost_peers.py). Otherwise publish it, keep beating while it
        unwinds, and return once every other process has heard it ([Note: ending a run]): the others end after
        this one, each with its line said."""
        first, raised = self._orphaned(), False  # after its launcher died (torch's SIGINT to a fork's ranks)
        if first is None and lost:  # its connection may close before the process that closed it is seen gone
            first = self._settled_host()
        if first is None:
            first = self._host_gone()
        if first is None:
            first, raised = (self._heard, self._await_end) if self._heard is not None else self.failed_elsewhere()
        if first is None and lost and may_follow:  # waiting for no one: neither judged hung nor judging others
            with activity.aside("waiting for the failure its lost connection follows from"):
                first, raised = self._cause_of_lost_connection()
        if first is not None and (may_follow or first[0] == _NO_ONE):
            self._follow(first, await_end=raised)
            return
        self._unwinding = True  # before the report: the thread must not read it as a judgement of this process
        self.report(self.stage, reason)
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}unwinding/{self.stage}", "1")
        self._await_others("heard/", "unwinding/", "left/", silent_ended=True)  # who raised too hears no one
        atexit.register(self._at_exit)

    def failed_elsewhere(self) -> tuple[tuple[int, str] | None, bool]:
        """Another stage's published failure, and whether it raised it itself (None where the store is lost)."""
        with contextlib.suppress(Exception):
            if (reported := self._reported()) is not None and reported[0] != self.stage:
                return reported, self.store.check([f"{self.prefix}unwinding/{reported[0]}"])
        return None, False

    def _orphaned(self) -> tuple[int, str] | None:
        """The launcher gone: named as the stage it ran where it was one (global rank 0 under Lightning's script
        launcher, which hosts the store too), else as the launcher."""
        if self.launcher is None or os.getppid() == self.launcher:
            return None
        if self.store_host is not None and self._peers.known_pid(self.store_host) == self.launcher:
            self.store.lost = True  # its store went with it: never called again (a C++ backtrace per call)
            return self.store_host, killed(self.launcher)
        return _NO_ONE, f"the launcher that started this process (pid {self.launcher}) is gone"

    def _host_gone(self) -> tuple[int, str] | None:
        """The store's host, killed on this machine (lost_peers.py); the store is then never called again."""
        if (gone := self._peers.host_gone()) is not None:
            self.store.lost = True
        return gone

    def _store_lost(self) -> tuple[int, str]:  # its host named as killed where it is seen gone here
        if self.store_host is None:
            return _NO_ONE, _AGENT_LOST
        self.store.lost = True
        return self._settled_host() or (self.store_host, _HOST_LOST)

    def _follow(self, failure: tuple[int, str], *, await_end: bool) -> None:
        """(The main thread) end this process for ``failure``, after the failed process where it raised itself."""
        self._hear(failure, await_end=await_end)
        while self._await_end and not self._has_ended() and time.monotonic() - self._heard_at < self.dead_after:
            time.sleep(self.interval / 2)
        self._end_process()

    def _hear(self, failure: tuple[int, str], *, await_end: bool) -> None:
        """Say the one line at once and tell the failed process this one heard it (it waits for that)."""
        with self._lock:
            if self._heard is not None:
                return
            stage, reason = failure
            failed = f"{self.name(stage)} failed: " if stage != _NO_ONE else ""
            cause = reason.partition("\n")[0]  # one line: a schedule's grid, a long message's rest, stay out
            say(f"lightning_paci: {failed}{cause} -- stopping {self.name(self.stage)}")
            self._heard, self._heard_at, self._await_end = failure, time.monotonic(), await_end
            if self.store.lost:  # no one to tell
                return
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}heard/{self.stage}", "1")  # an orphan's too: it ends having said so
                host, pid = where_it_runs(self._text(process_key(stage)))
                if pid is not None:
                    self._where = (host, pid)

    def _end_process(self) -> None:
        with self._lock:
            second, self._ending = self._ending, True
        if second:  # the other thread ends it: wait for that, as an exit from here would
            self._exited.wait(timeout=4 * self.dead_after)
            return
        if self.stage == self.store_host and not self.store.lost:  # the others read the store until they heard
            self._await_others("heard/", "unwinding/", "left/", "ended/", silent_ended=True)
        _wait_for(LAUNCHED, 2 * self.dead_after)  # each ends by itself within that
        # a forked or spawned worker stopped by another's raised exception ends with status 0: its launcher joins
        # the workers in rank order and raises the first failure it sees -- that exception, whichever ends first
        self._exit(0 if self._await_end and multiprocessing.parent_process() is not None else 1)
        self._exited.set()  # (an ``exit_fn`` that returns: a test's)

    def _at_exit(self) -> None:
        """A failed process's last act: say it ended, then wait for the processes it launched."""
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}ended/{self.stage}", "1")
        _wait_for(LAUNCHED, 2 * self.dead_after)

    def _await_others(self, *keys: str, silent_ended: bool) -> None:
        """Until every other process has set one of ``keys`` (the run's, each ending with the id) or left the run
        (or, with ``silent_ended``, stopped beating or ended on this machine), for at most ``dead_after``."""
        waiting, deadline = set(range(self.num_stages)) - {self.stage}, time.monotonic() + self.dead_after
        while waiting and time.monotonic() < deadline:
            try:
                waiting = {other for other in waiting if not any(self._text(f"{key}{other}") for key in keys)
                           and not (silent_ended and (self._peers.ended_here(other) or
                           self._silence(other, time.monotonic())[1] >= _ENDED_AFTER_BEATS * self.interval))}
            except Exception:
                return
            time.sleep(_POLL)

    def leave(self) -> None:
        """The end of a run without error ([Note: ending a run]); a failure reported meanwhile ends this process
        with its line, as during training."""
        if self._unwinding:
            return
        everyone = [f"{self.prefix}done/{other}" for other in range(self.num_stages)]
        try:
            self.store.set(everyone[self.stage], "1")
            while self._heard is None and not self.store.check(everyone):
                time.sleep(_POLL)
        except Exception:
            self._follow(self._store_lost(), await_end=False)
            return
        if self._heard is not None:
            self._follow(self._heard, await_end=self._await_end)
            return
        self.stop(done=False)
        if self.stage == self.store_host:
            self._await_others("left/", silent_ended=False)
        else:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}left/{self.stage}", "1")

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
            if self._heard is not None:  # the main thread follows it, or this thread does
                if not self._await_end or self._has_ended() or time.monotonic() - self._heard_at > self.dead_after:
                    self._end_process()
                    return
                continue
            raised, failure = False, self._orphaned() or self._host_gone()
            lost = failure is not None
            if not lost:  # first: the store may have gone with the launcher or its host
                try:
                    self._beat()
                    failure, raised = self._failure()
                    if failure is None:
                        self.preemption.poll()
                except Exception:  # the store lives in rank 0's process: unreachable means rank 0 is gone
                    failure, lost = (None if self._stop.is_set() else self._store_lost()), True
            if failure is None or self._stop.is_set() or self._unwinding:  # unwinding: maybe its own report read
                continue
            if not lost and failure[0] != _NO_ONE:
                self.report(*failure)  # the others stop on it at once (a no-op if one was reported first)
            self._hear(failure, await_end=raised)
            if raised:  # its process ends by itself, after this one heard it: wait for that (above)
                continue
            if failure[0] == self.stage and not lost:  # judged by the others: they read the store until they heard
                self._await_others("heard/", "unwinding/", "left/", silent_ended=True)
            self._end_process()
            return

    def _silence(self, stage: int, now: float) -> tuple[int, float]:
        """``stage``'s heartbeat counter and the seconds since it last moved (0 when it moved since the last look)."""
        count = int(self._text(f"heartbeat/{stage}") or 0)
        last, since = self._seen.get(stage, (-1, now))
        if count != last:
            self._seen[stage] = (count, now)
            return count, 0.0
        return count, now - since

    def _failure(self) -> tuple[tuple[int, str] | None, bool]:
        """A failure to stop for, and whether the failed process raised it itself (and so ends by itself)."""
        if (reported := self._reported()) is not None:
            return reported, self.store.check([f"{self.prefix}unwinding/{reported[0]}"])
        if (gone := self._peers.gone()) is not None:  # a death on this machine, at once (lost_peers.py)
            return gone, False
        done = {other for other in range(self.num_stages) if self.store.check([f"{self.prefix}done/{other}"])}
        doing = {other: decode_doing(text) for other in range(self.num_stages)
                 if (text := self._text(f"activity/{other}"))}
        if (hung := judge_progress(doing, done, self.num_stages, self.dead_after, self.name)) is not None:
            return hung, False
        now = time.monotonic()
        for other in range(self.num_stages):
            if other == self.stage or other in done:
                continue
            count, silent = self._silence(other, now)
            if count == 0 and silent > self.dead_after * PATIENCE:  # started, imports, joins: patient
                return (other, f"never joined: no heartbeat in {silent:.0f} s since this process started "
                               f"watching (it did not start, or failed before setup)"), False
            if count > 0 and silent > self.dead_after:
                return (other, f"stopped responding (no heartbeat for {silent:.0f} s: "
                               f"killed, out of memory or hung)"), False
        return None, False

    def _settled_host(self) -> tuple[int, str] | None:
        """The store's host or the launcher found gone within one interval (the kernel closes a dying process's
        connections before it reports it ended), or None: no store call before that, one would print a C++ stack."""
        if self.store_host is None or self._peers.known_pid(self.store_host) is None:
            return self._orphaned()  # the host runs elsewhere (or is this process): nothing to wait for
        deadline = time.monotonic() + self.interval
        while (gone := self._orphaned() or self._host_gone()) is None and time.monotonic() < deadline:
            time.sleep(_POLL)
        return gone

    def _cause_of_lost_connection(self) -> tuple[tuple[int, str] | None, bool]:
        """Another process's failure that this process's lost connection follows from, found within ``dead_after``
        (and two beats, for the thread's judgement of a silent one), or None (lost_peers.py)."""
        deadline = time.monotonic() + self.dead_after + 2 * self.interval
        while time.monotonic() < deadline:
            if self._heard is not None:  # the thread found it
                return self._heard, self._await_end
            if (gone := self._host_gone()) is not None:
                return gone, False
            if self.store.lost:  # its host gone elsewhere, or the launcher's agent
                return self._store_lost(), False
            if (found := self.failed_elsewhere())[0] is not None:
                return found
            with contextlib.suppress(Exception):
                if (gone := self._peers.gone()) is not None:
                    self.report(*gone)
                    return gone, False
            time.sleep(5 * _POLL)
        if self._heard is not None:  # judged by the thread as the wait ended
            return self._heard, self._await_end
        return self.failed_elsewhere()

    def _has_ended(self) -> bool:
        """Whether the failed process has ended; its own pid where it runs on this machine, so that a store it
        hosts is not read after it ended (unless it is this process's launcher, which waits for it)."""
        stage = self._heard[0] if self._heard is not None else self.stage
        host, pid = self._where
        if host == machine():
            if not running_here(pid):
                return True
            if stage == self.store_host and pid != os.getppid():
                return False
        try:
            return self.store.check([f"{self.prefix}ended/{stage}"]) or \
                self._silence(stage, time.monotonic())[1] >= _ENDED_AFTER_BEATS * self.interval
        except Exception:
            return True


def judge_progress(doing: dict[int, Doing], done: set[int], num: int, dead_after: float,
                   name: Callable[[int], str]) -> tuple[int, str] | None:
    """Of ``num`` processes doing ``doing``, one that keeps another waiting ([Note: judging progress]), with the
    reason, or None. A process ``done`` with its run is never held; waiting at its end, it judges only work."""
    for waiter, (waits_at, waits, waited, _) in doing.items():
        if waits is None or waited < dead_after:
            continue
        for held in (waits if isinstance(waits, frozenset) else range(num)):  # a set, or ALL
            if held == waiter or held not in doing or held in done:
                continue
            label, its_waits, inside, patient = doing[held]
            if its_waits is None and inside >= dead_after * (PATIENCE if patient else 1):
                grace = ", past the patience given to setup and first steps" if patient else ""
                return held, (f"made no progress for {inside:.0f} s: inside {label} while {name(waiter)} waits "
                              f"for it at {waits_at} (hung in a kernel, a collective or a host read{grace})")
            if its_waits is not None and label != waits_at and inside >= dead_after and waiter not in done and \
                    (not isinstance(its_waits, frozenset) or waiter in its_waits):
                return held, (f"waits at {label} for {inside:.0f} s while {name(waiter)} waits for it at "
                              f"{waits_at}: each waits for the other")
    return None


_HOST_LOST = ("exited or died: the rendezvous store it hosts is unreachable; if another stage failed first, its "
              "message is above")
_AGENT_LOST = "the rendezvous store of the launcher's agent (torchrun) is unreachable: the launcher exited or died"
_NO_ONE = -1  # a failure of no watched process (the launcher's)
LAUNCHED: list[Any] = []  # the processes this one started (Lightning's script launcher's): it ends after them


def _wait_for(processes: list[Any], seconds: float) -> None:
    """Wait (at most ``seconds`` in all) for ``processes`` (``subprocess.Popen``) to end."""
    deadline = time.monotonic() + seconds
    for process in processes:
        with contextlib.suppress(Exception):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
