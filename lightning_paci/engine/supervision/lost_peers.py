"""Who is gone when a connection is lost: the failure watchdog's view of the processes beside it.

A process killed without a word (SIGKILL, the out-of-memory killer) leaves its neighbours with a lost connection:
gloo's "Connection closed by peer" in a receive, a data-parallel reduction or a collective. The neighbour's
exception is only the consequence; reported as it comes, the first neighbour to raise would be named as the failed
process (under torchrun, the dead rank's data-parallel peer, whose reduction breaks first). Two looks name the dead
one instead:

* every process publishes its machine (:func:`machine`) and pid at the start (``process/<id>``): a process of this
  machine that no longer runs and never said it ended (``done``, ``left``, ``heard``, ``unwinding``, ``ended``) was
  killed or exited abruptly; the watchdog's thread looks at every interval (one ``/proc`` read per process of the
  machine, the store read once per process and again only for one found gone), so a death on this machine is named
  within an interval, not after ``dead_after`` seconds of silence;
* a process whose exception is a lost connection (:func:`is_lost_connection`) waits, at most ``dead_after`` and a
  little more, for the cause before it reports itself: another process's report, one gone on this machine, or one
  of another machine silent for ``dead_after`` (the watchdog's thread judges that).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["OnceLost", "PeerProcesses", "is_lost_connection", "killed", "machine", "process_key", "running_here",
           "this_process", "where_it_runs"]

# what gloo, NCCL and the store say when the process at the other end is gone (lower case)
_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
         "communicator was aborted", "connection refused")
# the keys with which a process ends having said so ([Note: ending a run] in watchdog.py)
_SAID = ("done/", "left/", "heard/", "unwinding/", "ended/")


def is_lost_connection(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it was raised from or while handling) is a lost connection to another
    process: the consequence of another's failure, not a failure of this process's own."""
    seen: set[int] = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(marker in str(current).lower() for marker in _LOST):
            return True
        current = current.__cause__ or current.__context__
    return False


def machine() -> str:
    """Where this process's pids mean something: the host name, and, where procfs tells them, the boot and the pid
    namespace. Two containers of one machine may share its host name (host networking) but not their pids: a pid
    of the other's is never looked up here."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return "/".join(parts)


def process_key(process: int) -> str:
    """The store key under which process ``process`` (a watchdog id) publishes where it runs."""
    return f"process/{process}"


def this_process() -> str:
    """What a process publishes under its :func:`process_key`: its machine and its pid."""
    return f"{machine()}\n{os.getpid()}"


def where_it_runs(published: str) -> tuple[str, int | None]:
    """A :func:`this_process` value read back: the machine and the pid (None before the process published)."""
    host, _, pid = published.partition("\n")
    return host, int(pid) if pid else None


def running_here(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # ended, or no procfs here (where a zombie reads as running)
        if os.path.isdir("/proc/self"):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def killed(pid: int) -> str:
    """The reason given for a process of this machine that ended without a word."""
    return (f"its process (pid {pid}) ended without reporting an error: killed (SIGKILL, the out-of-memory killer) "
            f"or exited abruptly")


class PeerProcesses:
    """The watched processes of this machine, by the pid each published at its start.

    ``read(key)`` is the run's key in the store ("" where not set); ``num`` the watched processes, ``me`` this one;
    ``store_host`` the one whose process hosts the store (None: a launcher's agent does). A store host found gone is
    named without a look at its store: every call to a store whose host is gone prints a C++ backtrace.
    """

    def __init__(self, read: Callable[[str], str], num: int, me: int, store_host: int | None = None) -> None:
        self._read, self._num, self._me = read, num, me
        self._store_host = store_host
        self._host = machine()
        self._pids: dict[int, int | None] = {}  # id -> its pid where it runs here; None: elsewhere, or said it ended

    def _pid(self, other: int) -> int | None:
        if other not in self._pids:
            host, pid = where_it_runs(self._read(process_key(other)))
            if pid is None:
                return None  # not started yet: looked up again next time
            self._pids[other] = pid if host == self._host else None
        return self._pids[other]

    def learn(self) -> None:
        """Read every other process's published pid now (once all have published: the world is joined)."""
        for other in range(self._num):
            if other != self._me:
                self._pid(other)

    def ended_here(self, other: int) -> bool:
        """Whether ``other`` ran on this machine and runs no more (no store read)."""
        pid = self._pids.get(other)
        return pid is not None and not running_here(pid)

    def known_pid(self, other: int) -> int | None:
        """``other``'s pid on this machine as read before (no store read), or None."""
        return self._pids.get(other)

    def host_gone(self) -> tuple[int, str] | None:
        """The store's host, where it ran on this machine and runs no more (its pid read while the store was up;
        a store host ends normally only after every other process has left), and the reason; else None."""
        host = self._store_host
        if host is None or host == self._me:
            return None
        pid = self._pids.get(host)
        return (host, killed(pid)) if pid is not None and not running_here(pid) else None

    def gone(self) -> tuple[int, str] | None:
        """A process of this machine that ended without saying so, and the reason to report, or None."""
        if (host := self.host_gone()) is not None:
            return host
        for other in range(self._num):
            if other == self._me or (pid := self._pid(other)) is None or running_here(pid):
                continue
            if any(self._read(f"{key}{other}") for key in _SAID):
                self._pids[other] = None  # it ended having said so: never judged again
                continue
            return other, killed(pid)
        return None


class OnceLost:
    """A store that, once a call failed (its host is gone), fails at once: torch's client prints a C++ backtrace
    for every call to a store whose host is gone. ``host_ended`` (set where the host's pid is known on this
    machine) is asked before every call, so that the backtrace is printed only where the host dies during one."""

    def __init__(self, store: Any) -> None:
        self._store, self.lost = store, False
        self.host_ended: Callable[[], bool] | None = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            if not self.lost and self.host_ended is not None and self.host_ended():
                self.lost = True
            if self.lost:
                raise ConnectionError("the rendezvous store is unreachable")
            try:
                return method(*args)
            except Exception:
                self.lost = True
                raise

        return call
