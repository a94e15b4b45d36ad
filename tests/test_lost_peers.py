"""A process killed without a word is named by the others, the one whose connection to it broke included, and a
SIGTERM that reaches one rank alone ends the run through its report, not in a collective only it joins."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import re
import signal
import socket
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from lightning_paci.engine.supervision.lost_peers import PeerProcesses, is_lost_connection, machine, running_here
from lightning_paci.engine.supervision.watchdog import StageWatchdog
from lightning_paci.errors import StageFailure

from helpers import fit
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed

_CLOSED = ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29107. This is "
           "typically caused by a remote worker crashing.")


def _beat_as_stage_1(path: str) -> None:
    """A forked process watched as stage 1 of 2 that beats until it is killed."""
    store = torch.distributed.FileStore(path, -1)
    StageWatchdog(1, 2, store, interval=0.1, dead_after=60.0, exit_fn=lambda code: None).start()
    time.sleep(120)


def _killed_stage_1(tmp_path: Path) -> tuple[torch.distributed.FileStore, mp.Process]:
    """The store of a run whose stage 1 (a forked process) beat, then was SIGKILLed; the process is left unreaped
    (a zombie, as a launcher's child is until its launcher looks)."""
    path = str(tmp_path / "store")
    store = torch.distributed.FileStore(path, -1)
    child = mp.get_context("fork").Process(target=_beat_as_stage_1, args=(path,), daemon=True)
    child.start()
    deadline = time.monotonic() + 60
    while not store.check(["paci/0/heartbeat/1"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.check(["paci/0/heartbeat/1"]), "the forked stage 1 never beat"
    os.kill(child.pid, signal.SIGKILL)
    while running_here(child.pid):
        time.sleep(0.01)
    return store, child


def _line_naming_stage_1(pid: int) -> str:
    return (rf"lightning_paci: stage 1 failed: its process \(pid {pid}\) ended without reporting an error: killed "
            rf"\(SIGKILL, the out-of-memory killer\) or exited abruptly -- stopping stage 0\n")


def test_a_killed_process_of_this_machine_is_named_within_an_interval_not_after_its_silence(tmp_path, capfd):
    store, child = _killed_stage_1(tmp_path)
    exits: list[int] = []
    watchdog = StageWatchdog(0, 2, store, interval=0.1, dead_after=60.0, exit_fn=exits.append)
    watchdog.start()
    deadline = time.monotonic() + 30  # half of dead_after: a stopped heartbeat cannot be the reason
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.stop(done=False)
    child.join()
    assert exits == [1]
    assert re.fullmatch(_line_naming_stage_1(child.pid), capfd.readouterr().err)
    assert store.get("paci/0/failed").decode().startswith("1\n")  # reported for the others: stage 1 failed


def test_a_lost_connection_names_the_killed_process_it_follows_from_not_itself(tmp_path, capfd):
    # the rank whose reduction or receive broke raises first: it waits for the cause instead of reporting itself.
    # Its thread looks every 30 s here: the main thread's own look finds the dead process
    store, child = _killed_stage_1(tmp_path)
    exits: list[int] = []
    watchdog = StageWatchdog(0, 2, store, interval=30.0, dead_after=60.0, exit_fn=exits.append)
    watchdog.start()
    started = time.monotonic()
    watchdog.fail(_CLOSED, lost=True)
    waited = time.monotonic() - started
    watchdog.stop(done=False)
    child.join()
    assert exits == [1] and waited < 30  # found at once, not after dead_after
    assert re.fullmatch(_line_naming_stage_1(child.pid), capfd.readouterr().err)
    assert store.get("paci/0/failed").decode().startswith("1\n")
    assert not store.check(["paci/0/unwinding/0"])  # this process never reported itself


def test_an_exception_of_its_own_is_reported_at_once_though_a_process_of_this_machine_died(tmp_path, capfd):
    store, child = _killed_stage_1(tmp_path)
    watchdog = StageWatchdog(0, 2, store, interval=30.0, dead_after=0.5, exit_fn=lambda code: None)
    watchdog.start()
    watchdog.fail("ValueError: boom in the user's training_step")  # not a lost connection: this process's own
    atexit.unregister(watchdog._at_exit)
    watchdog.stop(done=False)
    child.join()
    assert store.get("paci/0/failed").decode() == "0\nValueError: boom in the user's training_step"
    assert capfd.readouterr().err == ""


def test_lost_connections_are_told_from_a_process_s_own_errors():
    assert is_lost_connection(RuntimeError(_CLOSED))
    assert is_lost_connection(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:926: "
                                           "Connection reset by peer."))
    wrapped = StageFailure("stage 0 (replica 1): receiving from stage 1 (replica 1) failed at 0RECV_B3")
    wrapped.__cause__ = RuntimeError(_CLOSED)
    assert is_lost_connection(wrapped)
    assert not is_lost_connection(ValueError("boom in the user's training_step"))
    assert not is_lost_connection(RuntimeError("Timed out waiting 60000ms for recv operation to complete"))


class _SigtermStage1AtBatch2(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2 and trainer.strategy.stage_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # this rank alone, as torchrun's agent signals one node's ranks


def test_a_sigterm_to_one_rank_stops_every_rank_before_one_batch_with_no_collective_in_the_handler(capfd):
    # Lightning's handler broadcasts from rank 0 inside the signal handler, a collective the other rank never joins
    # (it waits for this one in the pipeline); here the signalled rank asks for a stop, and both ranks stop before
    # the batch they agree on through the store ([Note: a preemption's stop]), each saying so
    with pytest.raises(ProcessRaisedException, match="stopped for a SIGTERM"):
        fit(SequentialMLP(depth=4), regression_loader(num_batches=20), devices=2, max_steps=20,
            failure_timeout=20.0, callbacks=[_SigtermStage1AtBatch2()])
    err = capfd.readouterr().err
    said = re.findall(r"lightning_paci: global rank (\d) stops for a SIGTERM before training batch (\d+), where every "
                      r"rank stops", err)
    assert sorted(rank for rank, _ in said) == ["0", "1"] and len({batch for _, batch in said}) == 1, err[-3000:]
    assert "broadcast" not in err and " failed: " not in err, err[-3000:]


def test_only_pids_of_this_machine_and_pid_namespace_are_looked_up():
    # a container sharing the host name (host networking) has its own pids: one of them is never judged here
    dead = mp.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()  # reaped: the pid runs nothing
    host = socket.gethostname()
    keys = {"process/1": f"{machine()}\n{dead.pid}", "process/2": f"{host}/another boot/pid:[1]\n{dead.pid}",
            "process/3": f"{machine()}\n{os.getpid()}", "done/4": "1", "process/4": f"{machine()}\n{dead.pid}"}
    peers = PeerProcesses(lambda key: keys.get(key, ""), 6, 0)  # 5: not started yet
    assert peers.gone() == (1, f"its process (pid {dead.pid}) ended without reporting an error: killed (SIGKILL, "
                               f"the out-of-memory killer) or exited abruptly")
    keys["heard/1"] = "1"  # it said it ended after all
    assert peers.gone() is None


def test_a_rank_waiting_for_the_cause_of_its_lost_connection_is_neither_judged_hung_nor_judging():
    # inside the action that raised, the rank's published activity says it waits for no one: a peer waiting for
    # it longer than dead_after does not name it hung, and it names no one
    from lightning_paci.engine.supervision.activity import ProcessActivity, decode_doing, encode_doing
    from lightning_paci.engine.supervision.watchdog import judge_progress

    now = [100.0]
    activity = ProcessActivity(clock=lambda: now[0])
    activity.source = lambda: ("0B3", None, 30.0, False)  # working inside its action for 30 s
    peer = ("1RECV_F4", frozenset([0]), 30.0, False)  # waits for it as long
    name = "stage {}".format
    assert judge_progress({0: decode_doing(encode_doing(activity.now())), 1: peer}, set(), 2, 20.0, name) == (
        0, "made no progress for 30 s: inside 0B3 while stage 1 waits for it at 1RECV_F4 (hung in a kernel, a "
           "collective or a host read)")
    with activity.aside("waiting for the failure its lost connection follows from"):
        now[0] += 25.0
        doing = decode_doing(encode_doing(activity.now()))
        assert doing[1] == frozenset() and doing[2] == 25.0
        assert judge_progress({0: doing, 1: peer}, set(), 2, 20.0, name) is None
    assert activity.now() == ("0B3", None, 30.0, False)
