"""Failures: a dead or raising stage brings the others down with a message naming it; NaNs are caught at the stage
where they appear; bad input fails at setup with the argument, the value, the rule and the fix."""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_paci import PACIStrategy
from lightning_paci.engine.supervision.lost_peers import running_here
from lightning_paci.engine.supervision.watchdog import StageWatchdog

from helpers import fit
from models import LoopTransformer, SequentialMLP, regression_loader, token_loader

pytestmark = pytest.mark.distributed

class _FailsAtBatch3(SequentialMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # only the last stage gets past the forward
        if batch_idx == 3:
            raise ValueError("boom in the user's training_step")
        return loss


def test_an_exception_in_the_last_stage_stops_every_stage_naming_it(capfd):
    # forked ranks (the default launcher's path is the killed-stage test above): the failing stage reports its error
    # to the others, each of which says it in one line -- its reason, which a stopped heartbeat (after 600 s here,
    # past the test's timeout) could not give; its own exception is the one the launcher raises
    with pytest.raises(ProcessRaisedException, match=r"ValueError: boom in the user's training_step"):
        fit(_FailsAtBatch3(depth=8), regression_loader(num_batches=50), devices=4, max_steps=50,
            partition="parameters", failure_timeout=600.0)
    err = capfd.readouterr().err
    told = sorted(set(re.findall(r"lightning_paci: stage 3 failed: ValueError: boom in the user's training_step -- "
                                 r"stopping stage (\d)", err)))
    assert told == ["0", "1", "2"], err[-3000:]


def test_watchdog_declares_a_silent_stage_dead():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    alive = StageWatchdog(0, 2, store, interval=0.1, dead_after=1.0, exit_fn=exits.append)
    silent = StageWatchdog(1, 2, store, interval=0.1, dead_after=1.0, exit_fn=exits.append)
    alive.start()
    silent.start()
    time.sleep(0.5)
    silent.stop(done=False)  # stage 1 stops beating without saying it is done: as if SIGKILLed
    deadline = time.monotonic() + 60  # a hang guard: the loop ends as soon as stage 1 is declared dead
    while not exits and time.monotonic() < deadline:
        time.sleep(0.1)
    alive.stop()
    assert exits == [1]


def test_watchdog_ignores_a_stage_that_finished_cleanly():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    first = StageWatchdog(0, 2, store, interval=0.1, dead_after=0.5, exit_fn=exits.append)
    second = StageWatchdog(1, 2, store, interval=0.1, dead_after=0.5, exit_fn=exits.append)
    first.start()
    second.start()
    second.stop(done=True)
    time.sleep(1.5)
    first.stop()
    assert exits == []


def _nan_loader(batch: int = 3) -> DataLoader:
    x = torch.randn(6 * 8, 8)
    x[batch * 8 + 5, 0] = float("nan")  # one sample of batch 3: micro-batch 2 of that batch (m = 4)
    return DataLoader(TensorDataset(x, torch.randn(6 * 8, 4)), batch_size=8)


def test_a_nan_loss_stops_the_run_naming_the_stage_and_the_step():
    with pytest.raises(ProcessRaisedException,
                       match=r"stage 3: the loss of micro-batch 14 is nan at Lightning batch 3"):
        fit(SequentialMLP(), _nan_loader(), devices=4, max_steps=6, microbatches=4, partition="parameters")


def test_nonfinite_skip_drops_the_microbatch_and_training_goes_on(tmp_path):
    from helpers import DumpStageRecords, read_stage_records

    model = SequentialMLP()
    fit(model, _nan_loader(), devices=4, max_steps=6, microbatches=4, nonfinite="skip", partition="parameters",
        callbacks=[DumpStageRecords(tmp_path)])
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert read_stage_records(tmp_path, 4)[3]["optimizer_steps"] == 6


# -- bad input at setup: the message names the argument and the fix ---------------------------------------------

def test_more_stages_than_blocks():
    with pytest.raises(ProcessRaisedException,
                       match=r"Cannot split `blocks` \(ModuleList of 2 blocks\).*at most 2 devices"):
        fit(LoopTransformer(layers=2), token_loader(), devices=4)


def test_optimizer_over_parameters_that_are_not_the_modules():
    class Foreign(SequentialMLP):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)

    with pytest.raises(ProcessRaisedException,
                       match=r"not one of this stage's module parameters.*`configure_optimizers`"):
        fit(Foreign(), regression_loader(), devices=2)


def test_unsupported_precision():
    with pytest.raises(ProcessRaisedException, match=r"`Trainer\(precision='16-true'\)` is not supported.*bf16-mixed"):
        fit(SequentialMLP(), regression_loader(), devices=2, trainer_kwargs={"precision": "16-true"})
    # "16-mixed" reaches the same rule only on a GPU (on a CPU Lightning turns it into "bf16-mixed" first): the
    # rule's table, which the check above reads, leaves it out
    from lightning_paci.integration.setup.trainer_checks import SUPPORTED_PRECISION

    assert "16-mixed" not in SUPPORTED_PRECISION and "16-true" not in SUPPORTED_PRECISION
    assert {"32-true", "64-true", "bf16-mixed", "bf16-true"} <= set(SUPPORTED_PRECISION)


def test_cuda_requested_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(MisconfigurationException, match=r"(?i)cuda.*not available|can not run on your system"):
        L.Trainer(strategy="paci", accelerator="cuda", devices=2)


def test_devices_not_matching_the_torchrun_world_size(monkeypatch):
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(strategy="paci", accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"`Trainer\(devices=4, num_nodes=1\)` asks for 4 processes \(pipeline "
                                         r"stages x data-parallel replicas\), but the launcher started 2.*pass "
                                         r"`devices=2`"):
        trainer.fit(SequentialMLP(), regression_loader())


@pytest.mark.parametrize("kwargs,argument",
                         [({"nonfinite": "ignore"}, "nonfinite"), ({"failure_timeout": 0}, "failure_timeout")])
def test_bad_failure_options(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        PACIStrategy(**kwargs)


assert timedelta


def test_a_setup_error_is_printed_in_full_by_rank_0_and_in_one_line_by_the_others(capsys, monkeypatch):

    from lightning_paci.errors import mark_setup_error
    from lightning_paci.integration.processes.process_groups import print_setup_errors_once

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    print_setup_errors_once(0)
    assert sys.excepthook is sys.__excepthook__  # rank 0 keeps the full traceback
    print_setup_errors_once(3)
    error = mark_setup_error(ValueError("Cannot split `blocks` into 4 stages.\nPass `devices=2`."))
    sys.excepthook(ValueError, error, None)
    assert capsys.readouterr().err == ("lightning_paci: rank 3 stopped at setup with the error rank 0 reports in "
                                       "full: ValueError: Cannot split `blocks` into 4 stages.\n")
    sys.excepthook(RuntimeError, RuntimeError("stage 3 only"), None)  # not a setup error: reported as before
    assert capsys.readouterr().err == "RuntimeError: stage 3 only\n"


class _HangsOnStage1(SequentialMLP):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.trainer.strategy.stage_index == 1:
            time.sleep(120)  # inside stage 1's forward, while its watchdog thread goes on beating
        return super().training_step(batch, batch_idx)


def test_a_stage_hung_inside_an_action_is_named_though_its_heartbeat_goes_on(capfd):
    # a heartbeat only says the watchdog's thread is alive; the actions' progress says whether the stage is: stage
    # 1 stays inside its forward while stage 2's receive waits for it, and every rank stops naming stage 1
    from torch.multiprocessing import ProcessExitedException

    # the line names the hang (no progress inside stage 1's forward), which neither the sleep's end nor the 60 s
    # process-group timeout would say: no wall-clock bound needed
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        fit(_HangsOnStage1(depth=6), regression_loader(num_batches=20), devices=3, max_steps=20,
            partition="parameters", failure_timeout=3.0)
    err = capfd.readouterr().err
    assert re.search(r"lightning_paci: stage 1 failed: made no progress for \d+ s: inside 1F\d+ while stage "
                     r"(0 waits for it at 0RECV_B|2 waits for it at 2RECV_F)\d+", err), err[-2000:]


def test_errors_name_a_process_of_virtual_stages_by_the_stages_it_runs():
    from lightning_paci.config import PACIConfig

    v = PACIConfig(virtual_stages=2, placement="v").topology(2, 1)
    assert [v.watch_name(i) for i in range(2)] == ["process 0 (stages 0 and 3)", "process 1 (stages 1 and 2)"]
    loop = PACIConfig(virtual_stages=3, placement="loop", data_parallel_size=2).topology(4, 1)
    assert [loop.watch_name(r) for r in (0, 3)] == ["process 1 (stages 1, 3 and 5, replica 0)",
                                                     "process 0 (stages 0, 2 and 4, replica 1)"]
    plain = PACIConfig(data_parallel_size=2).topology(4, 1)
    assert [plain.watch_name(r) for r in (0, 3)] == ["stage 1 (replica 0)", "stage 0 (replica 1)"]


def test_a_process_of_virtual_stages_hung_inside_an_action_is_named_by_its_stages(capfd):
    # under virtual stages a process runs several stages: the actions in the message carry stage indices, so the
    # processes are named by the stages they run, not by an index that reads like a stage's
    from torch.multiprocessing import ProcessExitedException

    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        fit(_HangsOnStage1(depth=8), regression_loader(num_batches=20), devices=2, max_steps=20,
            partition="parameters", failure_timeout=3.0, virtual_stages=2, placement="v")
    err = capfd.readouterr().err
    assert re.search(r"lightning_paci: process 1 \(stages 1 and 2\) failed: made no progress for \d+ s: inside "
                     r"[12]F\d+ while process 0 \(stages 0 and 3\) waits for it", err), err[-2000:]


class _HoldRank1InSetup(L.Callback):
    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:
            time.sleep(120)  # held inside setup (a user hook); the others wait at Lightning's post-setup barrier


@pytest.mark.heavy
def test_a_rank_held_at_setup_is_named_by_the_others(capfd):
    # the watchdog runs from the store's creation on and judges setup too: rank 1 (stage 1 of 3) stays inside its
    # setup while stages 0 and 2 wait for it at the barrier; setup work is patient (10 x failure_timeout = 10 s)
    from torch.multiprocessing import ProcessExitedException

    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        fit(SequentialMLP(depth=6), regression_loader(), devices=3, partition="parameters", failure_timeout=1.0,
            callbacks=[_HoldRank1InSetup()])
    err = capfd.readouterr().err
    assert re.search(r"lightning_paci: stage 1 failed: made no progress for \d+ s: inside setup while stage [02] "
                     r"waits for it at a barrier #\d+ .*past the patience given to setup", err), err[-2000:]


# -- the end of a run: the last drain, teardown, leaving together ([Note: ending a run]) -----------------------------

class _ShiftedOnRank0AfterBatch0(Dataset):
    """The same samples on every rank for Lightning batch 0 (the first-batch check passes), then shifted on global
    rank 0 (the last stage): what a dataset reading a per-process source gives."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        shifted = index >= 8 and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0
        return self.x[index] + float(shifted), self.y[index]


class _RecordPids(L.Callback):
    def __init__(self, directory, *, fail_in_teardown_on: int | None = None) -> None:
        self.directory, self.fail_on = directory, fail_in_teardown_on

    def setup(self, trainer, pl_module, stage):
        (self.directory / f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def teardown(self, trainer, pl_module, stage):
        if trainer.global_rank == self.fail_on:  # after the strategy's teardown: the other ranks wait at the end
            raise RuntimeError("boom in the user's teardown hook")


def _stopping_lines(err: str) -> list[str]:
    return [line for line in err.splitlines()
            if line.startswith("lightning_paci: ") and (" -- stopping " in line or " stopped (" in line)]


def test_a_failure_at_the_last_drain_ends_every_stage_each_saying_one_line(tmp_path, capfd):
    # 3 stages, forked: the last stage (global rank 0) loads other samples from batch 1 on; the data check of the
    # last batch's drain raises on it while stages 0 and 1, past the check, wait for it in the end of fit's
    # gathers. Each of them says one line naming stage 2 and its error, and ends; the launcher raises stage 2's own
    # exception (its traceback is the only one)
    with pytest.raises(ProcessRaisedException, match=r"DataMismatchError: stage 2 trained on other batches than "
                                                     r"stage 0 \(fingerprints of the batches since Lightning batch 1"):
        fit(SequentialMLP(depth=6), DataLoader(_ShiftedOnRank0AfterBatch0(), batch_size=8), devices=3, max_steps=3,
            partition="parameters", failure_timeout=3.0, callbacks=[_RecordPids(tmp_path)])
    pids = [int(path.read_text()) for path in tmp_path.glob("pid*")]
    assert len(pids) == 3 and not [pid for pid in pids if running_here(pid)]
    err = capfd.readouterr().err
    lines = _stopping_lines(err)
    assert len(lines) == 2, err[-3000:]
    for line, survivor in zip(sorted(lines, key=lambda line: line[-1]), (0, 1)):
        assert re.fullmatch(rf"lightning_paci: stage 2 failed: DataMismatchError: stage 2 trained on other batches "
                            rf"than stage 0 .* -- stopping stage {survivor}", line), line
    assert "Traceback" not in err and "Connection closed" not in err, err[-3000:]


def test_a_failure_in_a_teardown_hook_ends_every_stage_each_saying_one_line(tmp_path, capfd):
    # the user's teardown hook raises on global rank 1 (stage 1 of 3) after the strategy's teardown: the other
    # ranks, done with their run, wait for it at the end of the run, say their line and end; the run fails
    with pytest.raises(ProcessRaisedException, match=r"RuntimeError: boom in the user's teardown hook"):
        fit(SequentialMLP(depth=6), regression_loader(), devices=3, max_steps=3, partition="parameters",
            failure_timeout=3.0, callbacks=[_RecordPids(tmp_path, fail_in_teardown_on=1)])
    pids = [int(path.read_text()) for path in tmp_path.glob("pid*")]
    assert len(pids) == 3 and not [pid for pid in pids if running_here(pid)]
    err = capfd.readouterr().err
    assert sorted(_stopping_lines(err)) == [
        f"lightning_paci: stage 1 failed: RuntimeError: boom in the user's teardown hook -- stopping stage {s}"
        for s in (0, 2)], err[-3000:]


def test_watchdogs_end_a_run_together_and_a_failure_reaches_one_waiting_at_the_end(capfd):
    # stage 0 is done with its run and waits at its end; stage 1 then fails (a teardown hook): stage 0 says its
    # line and ends, and stage 1's report returns once stage 0 heard it. Then a clean end: both leave, no exit
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    # dead_after: long enough that no thread starved on a busy machine looks dead; stage 0 follows the failed
    # stage's end at most that long after hearing it
    waiting, failing = (StageWatchdog(s, 2, store, interval=0.1, dead_after=5.0, exit_fn=exits.append, run=1)
                        for s in (0, 1))
    waiting.start()
    failing.start()
    end = threading.Thread(target=waiting.leave)
    end.start()
    time.sleep(0.5)
    assert end.is_alive() and exits == []  # stage 1 is not done: stage 0 stays
    failing.fail("RuntimeError: boom in a teardown hook")
    assert waiting.said  # before stage 1's report returned
    end.join(timeout=60)
    atexit.unregister(failing._at_exit)
    failing.stop(done=False)
    assert exits == [1]
    assert capfd.readouterr().err == ("lightning_paci: stage 1 failed: RuntimeError: boom in a teardown hook -- "
                                      "stopping stage 0\n")
    together = [StageWatchdog(s, 2, store, interval=0.1, dead_after=5.0, exit_fn=exits.append, run=2)
                for s in (0, 1)]
    for watchdog in together:
        watchdog.start()
    ends = [threading.Thread(target=watchdog.leave) for watchdog in together]
    for thread in ends:
        thread.start()
    for thread in ends:
        thread.join(timeout=60)
    assert exits == [1] and not any(thread.is_alive() for thread in ends)
    assert store.check(["paci/2/left/1"])  # stage 0, which hosts the store, waited for stage 1's last read


def test_a_process_done_with_its_run_is_never_judged_hung_nor_held():
    # stage 0 waits at the end of the run (done) while stage 1 waits in the end of fit's gather: different labels,
    # each waiting for everyone, but no cycle -- stage 0's part is over; stage 1 working that long would be judged
    from lightning_paci.engine.supervision.activity import ALL
    from lightning_paci.engine.supervision.watchdog import judge_progress

    doing = {0: ("the end of the run", ALL, 9.0, False), 1: ("the end of fit's gather of the weights #1", ALL, 9.0,
                                                              False)}
    assert judge_progress(doing, set(), 2, 3.0, "stage {}".format) is not None  # without knowing 0 is done
    assert judge_progress(doing, {0}, 2, 3.0, "stage {}".format) is None
    working = {**doing, 1: ("teardown", None, 31.0, True)}  # a hook inside teardown, past the patience
    assert judge_progress(working, {0}, 2, 3.0, "stage {}".format) == (1, (
        "made no progress for 31 s: inside teardown while stage 0 waits for it at the end of the run (hung in a "
        "kernel, a collective or a host read, past the patience given to setup and first steps)"))


def test_each_run_is_wrapped_once_to_end_together_whatever_started_the_processes():
    # the strategy's launcher wraps the run's function once (the end of the run, [Note: ending a run]), however
    # often Lightning reads it: Lightning's own launcher, or one that runs the function in place where torchrun,
    # SLURM or Lightning's launcher started this process
    from lightning_paci.integration.processes.shutdown import InPlaceLauncher, ends_together

    in_place = ends_together(None)
    assert isinstance(in_place, InPlaceLauncher) and ends_together(in_place) is in_place
    ran: list[int] = []
    assert in_place.launch(lambda step: ran.append(step) or "result", 3, trainer=None) == "result" and ran == [3]
    strategy = L.Trainer(strategy="paci", accelerator="cpu", devices=2, logger=False).strategy
    launcher = strategy.launcher
    assert strategy.launcher is launcher and type(launcher).__name__ == "_SubprocessScriptLauncher"
    assert vars(launcher)["launch"].launcher is launcher  # Lightning's launch, wrapped once


def test_a_launcher_whose_run_failed_before_the_store_opened_ends_after_the_ranks_it_started():
    # no rank it started could have learned the failure (no store, no watchdog yet): they are terminated and waited
    # for, so none outlives the launcher; ranks that joined are only waited for (they stop by themselves)
    import subprocess

    from lightning_paci.engine.supervision.watchdog import LAUNCHED
    from lightning_paci.integration.processes.shutdown import wait_for_launched

    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    LAUNCHED[:] = started
    try:
        wait_for_launched(0.1, joined=True)  # they do not stop by themselves: waited for 1 s only
        assert [process.poll() for process in started] == [None, None]
        wait_for_launched(3.0, joined=False)
        assert [process.poll() for process in started] == [-15, -15]
    finally:
        LAUNCHED.clear()
        for process in started:
            process.kill()
            process.wait()


def test_an_error_while_the_groups_are_made_is_reported_not_taken_for_a_killed_process(capfd, monkeypatch):
    # rank 1 raises after its watchdog started, before its process groups exist: it reports its exception, and the
    # others name it with that exception -- not as a process that ended without a word
    from torch.multiprocessing import ProcessExitedException

    from lightning_paci.integration.processes import process_groups as processes

    setup = processes.PipelineLinks.setup

    def failing_on_rank_1(*args, **kwargs):
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("boom while the pipeline's groups were made")
        return setup(*args, **kwargs)

    monkeypatch.setattr(processes.PipelineLinks, "setup", failing_on_rank_1)  # the forked ranks inherit it
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        fit(SequentialMLP(depth=6), regression_loader(), devices=3, partition="parameters", failure_timeout=2.0)
    err = capfd.readouterr().err
    lines = _stopping_lines(err)
    assert lines and all("stage 1 failed: RuntimeError: boom while the pipeline's groups were made" in line
                         for line in lines), err[-3000:]
    assert "ended without reporting an error" not in err, err[-3000:]
