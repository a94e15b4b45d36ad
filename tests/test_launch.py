"""The default launcher: `strategy="paci"` re-executes the user's script per rank (as `ddp` does)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_paci.engine.supervision.lost_peers import running_here

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]


LAUNCHING = Path(__file__).parents[1] / "docs" / "launching.md"


def _docs_torchrun_nodes() -> list[str]:
    """The torchrun command lines of docs/launching.md, one per "node" (``# node 1``, ``# node 2``), as written."""
    found = re.findall(r"^\s*(torchrun .+?)\s+# node (\d)\s*$", LAUNCHING.read_text(), flags=re.MULTILINE)
    assert [node for _, node in found] == ["1", "2"], found
    return [command for command, _ in found]


def _two_torchrun_nodes(workdir: Path, *args: str) -> tuple[list[subprocess.CompletedProcess], float]:
    """docs/launching.md's two torchrun commands verbatim (``args`` appended), one per "node" at once, run by bash
    in ``workdir``: a fresh directory where ``tests`` is the only entry (a link to this directory), ``PORT`` a free
    port and ``torchrun`` the one of this interpreter. Their ``OUT`` is ``workdir/OUT``."""
    workdir.joinpath("tests").symlink_to(Path(__file__).parent, target_is_directory=True)
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PORT=str(port),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    start = time.monotonic()
    commands = [" ".join([command, *args]) for command in _docs_torchrun_nodes()]
    nodes = [subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=workdir) for command in commands]
    done = []
    for command, node in zip(commands, nodes):
        try:
            stdout, stderr = node.communicate(timeout=150)
        except subprocess.TimeoutExpired:  # what every node said so far, for the failure's message
            for other in nodes:
                other.kill()
            said = "\n---\n".join(other.communicate()[1][-6000:] for other in nodes)
            raise AssertionError(f"the torchrun nodes did not end in 150 s: {said}") from None
        done.append(subprocess.CompletedProcess(command, node.returncode, stdout, stderr))
    return done, time.monotonic() - start


def test_two_torchrun_nodes_train_checkpoint_and_resume_as_pp2_dp2_and_pp4_dp1(tmp_path):
    # the docs' commands as a user pastes them, from a fresh directory
    nodes, _ = _two_torchrun_nodes(tmp_path)
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    said = "".join(node.stdout for node in nodes)
    for rank in range(4):
        assert f"OK rank {rank}: pipeline 2 x data 2 and pipeline 4 x data 1 trained, saved, resumed" in said
    suggestions = {float(tmp_path.joinpath("OUT", f"lr{rank}").read_text()) for rank in range(4)}
    assert len(suggestions) == 1 and 1e-3 < suggestions.pop() < 1.0  # lr_find: one learning rate on every rank


_KILLED = re.compile(r"^lightning_paci: (stage \d+(?: \(replica \d\))?) failed: its process \(pid \d+\) ended without "
                     r"reporting an error: killed \(SIGKILL, the out-of-memory killer\) or exited abruptly -- stopping "
                     r"(stage \d+(?: \(replica \d\))?)$")


def _one_line_per_survivor(said: str, killed: str, survivors: list[str], traceback: str = "Traceback",
                           call_in_flight: bool = False) -> None:
    """Each surviving rank's one line naming the killed rank; no other line of ours, no traceback of a rank
    (``traceback``: how one starts), no C++ stack -- but, with ``call_in_flight`` (the store's host killed), the
    one warning torch's store client prints, with its C++ stack, for a call under way at the instant its host
    died: a rank calls the store no more once the host is seen gone, but cannot recall a call already sent (seen
    under two busy loops beside the suite's workers, never idle)."""
    lines = [line for line in said.splitlines() if " -- stopping " in line or "Forcefully terminating" in line
             or line.startswith("lightning_paci: the launcher")]
    found = [_KILLED.match(line) for line in lines]
    assert all(found) and {m.group(1) for m in found if m} == {killed}, said[-4000:]
    assert sorted(m.group(2) for m in found if m) == sorted(survivors), said[-4000:]
    if call_in_flight:
        warnings = re.findall(r"^\[rank\d\]:\[W\S+ \S+ TCPStore\.cpp:\d+\] \[c10d\] (?:sendBytes|recvValue) failed",
                              said, flags=re.MULTILINE)
        assert len(warnings) <= 1, said[-4000:]
        if warnings:  # its stack ends where the next line of ours or of Lightning's begins
            stack = r"^\[rank\d\]:\[W[^\n]*TCPStore\.cpp[^\n]*\n(?:(?:Exception raised|frame #|<omitting)[^\n]*\n)*"
            said = re.sub(stack, "", said, flags=re.MULTILINE)
    first = min((i for i in (said.find(traceback), said.find("frame #")) if i >= 0), default=-1)
    assert first < 0, said[max(0, first - 2500):first + 1500]  # what printed the stack, and the stack


def _none_left(pids: list[int], seconds: float = 10.0) -> list[int]:
    """The processes of ``pids`` still running after at most ``seconds`` (the last closes its pipes as it ends)."""
    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if running_here(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# global rank -> the stage it runs (2 stages x 2 replicas: the last stage on ranks 0 and 1)
_TORCHRUN_STAGES = {0: "stage 1 (replica 0)", 1: "stage 1 (replica 1)", 2: "stage 0 (replica 0)",
                    3: "stage 0 (replica 1)"}


@pytest.mark.parametrize("rank", [1])
def test_sigkill_of_one_rank_under_torchrun_brings_every_rank_down_naming_it(tmp_path, rank):
    # the killed rank is named by each other rank in one line: its data-parallel peer (whose reduction broke first)
    # and its neighbours (whose receives did) included; no rank prints a traceback or a C++ stack, none is left.
    # Under torchrun the store lives in the agent, not in a rank: rank 1, with a data-parallel peer and two
    # neighbours, stands for every rank (the default launcher's test kills rank 0, the store's host, too)
    nodes, _ = _two_torchrun_nodes(tmp_path, "kill", str(rank))
    assert all(node.returncode != 0 for node in nodes)
    # (torchrun's agent prints its own summary, ChildFailedError, with a traceback of the agent: not a rank's)
    _one_line_per_survivor("".join(node.stderr for node in nodes), _TORCHRUN_STAGES[rank],
                           [name for other, name in _TORCHRUN_STAGES.items() if other != rank], "]: Traceback")
    pids = [int(p.read_text()) for p in tmp_path.glob("OUT/pid*")]
    assert len(pids) == 4 and not _none_left(pids)


# global rank -> its stage (4 stages, one process each: the last stage on global rank 0, the launcher)
_SCRIPT_STAGES = {0: "stage 3", 1: "stage 2", 2: "stage 1", 3: "stage 0"}


@pytest.mark.parametrize("rank", [0, 3])
def test_sigkill_of_one_rank_under_the_default_launcher_brings_every_rank_down_naming_it(tmp_path, rank):
    # global rank 0 is the launcher and hosts the store: killed, it is named as the stage it ran (not as "the
    # launcher"), and no rank calls its store again (each call to a lost store prints a C++ stack); another rank
    # killed (stage 0, whose one neighbour's receive breaks; a rank with two neighbours and a data-parallel peer is
    # the torchrun test's), Lightning's launcher leaves the ending to the watchdogs instead of SIGKILLing every rank
    # and itself
    script = Path(__file__).parent / "scripts" / "kill_rank_script.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "OUT"), str(rank)], capture_output=True,
                         text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert out.returncode == (-9 if rank == 0 else 1), out.stderr[-3000:]
    pids = [int(p.read_text()) for p in tmp_path.glob("OUT/pid*")]
    assert len(pids) == 4 and not _none_left(pids)
    _one_line_per_survivor(out.stderr, _SCRIPT_STAGES[rank],
                           [name for other, name in _SCRIPT_STAGES.items() if other != rank], call_in_flight=rank == 0)


def test_a_refused_crossing_leaves_the_failing_stages_traceback_last_and_one_line_per_other_stage(tmp_path):
    script = Path(__file__).parent / "scripts" / "in_place_skip_script.py"
    out = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=150,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert out.returncode != 0
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr[-4000:]  # the cause's only
    cause = out.stderr[out.stderr.index("Traceback (most recent call last)"):]
    assert "CrossingError: Stage 0: the output of `embed` that a later stage reads was modified in place" in cause
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in out.stderr.splitlines()]  # torch's rank prefix
    others = [line for line in lines if line.startswith("lightning_paci: stage") and "stage 0 failed" in line]
    assert others and all("stage 1" in line for line in others)  # stage 1 says in one line who failed


def _stillrunning(pids: list[int], within: float = 10.0) -> list[int]:
    """The orphans of a killed launcher among ``pids`` still running after ``within`` seconds: one that has closed
    its stderr may still be exiting when the run returns, and nothing waits for an orphan."""
    deadline = time.monotonic() + within
    while (alive := [pid for pid in pids if running_here(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


END_OF_FIT = Path(__file__).parent / "scripts" / "end_of_fit_failure_script.py"


@pytest.mark.parametrize("mode, failed, error, survivor", [
    ("drain", "stage 1", "DataMismatchError: stage 1 trained on other batches than stage 0", "stage 0"),
    ("teardown", "stage 0", "RuntimeError: boom in a strategy subclass's teardown", "stage 1"),
])
def test_a_failure_at_the_end_of_fit_ends_every_rank_with_the_launcher_and_one_line_from_the_other(
        tmp_path, mode, failed, error, survivor):
    # the default launcher, each rank its own process: global rank 0 (stage 1) fails the last drain's data check,
    # or rank 1 (stage 0) raises in the strategy's teardown, while the other waits for it in the end of fit's
    # gathers. The other rank says one line and ends; the launcher (rank 0) ends last: no rank is left running
    # when it returns, and the failing rank's traceback is the only one, without the lost connection's
    out = subprocess.run([sys.executable, str(END_OF_FIT), str(tmp_path), mode], capture_output=True, text=True,
                         timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    ended = time.time()
    pids = [int(path.read_text()) for path in tmp_path.glob("pid*")]
    assert out.returncode != 0 and len(pids) == 2, out.stderr[-3000:]
    assert not [pid for pid in pids if running_here(pid)]  # none outlives the launcher
    seconds = ended - float(tmp_path.joinpath("failed_at").read_text())
    assert seconds < 30, seconds  # measured 1-3 s with failure_timeout=3
    err = "\n".join(re.sub(r"^\[rank\d+\]: ", "", line) for line in out.stderr.splitlines())
    assert err.count("Traceback (most recent call last)") == 1, err[-4000:]
    assert error in err[err.index("Traceback (most recent call last)"):]
    assert "Connection closed" not in err and "frame #" not in err, err[-4000:]
    said = [line for line in err.splitlines()
            if line.startswith("lightning_paci: ") and (" -- stopping " in line or " stopped (" in line)]
    assert len(said) == 1 and said[0].startswith(f"lightning_paci: {failed} failed: {error}"), said
    assert said[0].endswith(f" -- stopping {survivor}")


def test_ranks_whose_launcher_was_killed_stop_each_saying_one_line(tmp_path):
    # the main process of a fork launch is SIGKILLed mid-training (it cannot tell anyone): its ranks, orphans that
    # would otherwise train on to the end, each notice their launcher is gone, say so in one line and stop. The
    # ranks hold the script's stderr: the run returns once every rank has closed it, that is, ended
    script = Path(__file__).parent / "scripts" / "killed_launcher_script.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert out.returncode == -9, out.stderr[-3000:]
    pids = [int(path.read_text()) for path in tmp_path.glob("pid*")]
    assert len(pids) == 2 and not _stillrunning(pids)
    said = sorted(line for line in out.stderr.splitlines() if " -- stopping " in line)
    assert [re.sub(r"pid \d+", "pid N", line) for line in said] == [
        f"lightning_paci: the launcher that started this process (pid N) is gone -- stopping stage {s}"
        for s in (0, 1)], out.stderr[-3000:]


def test_a_rank_whose_launcher_died_before_the_rendezvous_stops_instead_of_waiting_for_the_store(tmp_path):
    # global rank 0 is killed right after starting rank 1, before it opens the rendezvous store: rank 1 stops as
    # soon as it finds the store closed and its launcher gone (not after the 120 s process-group timeout), saying
    # so in one line. The run returns once rank 1, which holds its stderr, has ended
    script = Path(__file__).parent / "scripts" / "early_failure_script.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    pids = [int(path.read_text()) for path in tmp_path.glob("pid*")]
    assert out.returncode == -9 and len(pids) == 2, out.stderr[-3000:]
    assert not _stillrunning(pids)
    said = r"^lightning_paci: rank 1 stopped: the rendezvous store at \S+ is not open and the launcher that started "
    assert re.search(said + r"this process \(pid \d+\) is gone", out.stderr, flags=re.MULTILINE), out.stderr[-3000:]
