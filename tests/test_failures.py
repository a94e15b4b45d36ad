"""Failures: a dead or raising stage brings the others down with a message naming it; NaNs are caught at the stage
where they appear; bad input fails at setup with the argument, the value, the rule and the fix."""

from __future__ import annotations

import re
import sys
import time
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_paci import PACIStrategy
from lightning_paci.engine.supervision import StageWatchdog

from helpers import fit
from models import LoopTransformer, SequentialMLP, regression_loader, token_loader

pytestmark = pytest.mark.distributed

class _FailsAtBatch3(SequentialMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # only the last stage gets past the forward
        if batch_idx == 3:
            raise ValueError("boom in the user's training_step")
        return loss


def test_an_exception_in_the_last_stage_stops_every_stage_naming_it():
    # forked ranks (the default launcher's path is the killed-stage test above): the failing stage reports its error
    # to the others at once, not only through a heartbeat that stops (60 s here); its own exception is the one the
    # launcher raises
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match=r"ValueError: boom in the user's training_step"):
        fit(_FailsAtBatch3(depth=8), regression_loader(num_batches=50), devices=4, max_steps=50,
            partition="parameters", failure_timeout=60.0)
    assert time.monotonic() - start < 40  # far below the 60 s a stopped heartbeat would take


def test_watchdog_declares_a_silent_stage_dead():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    exits: list[int] = []
    alive = StageWatchdog(0, 2, store, interval=0.1, dead_after=1.0, exit_fn=exits.append)
    silent = StageWatchdog(1, 2, store, interval=0.1, dead_after=1.0, exit_fn=exits.append)
    alive.start()
    silent.start()
    time.sleep(0.5)
    silent.stop(done=False)  # stage 1 stops beating without saying it is done: as if SIGKILLed
    deadline = time.monotonic() + 5
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

    from lightning_paci.engine.supervision import mark_setup_error, print_setup_errors_once

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

    start = time.monotonic()
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        fit(_HangsOnStage1(depth=6), regression_loader(num_batches=20), devices=3, max_steps=20,
            partition="parameters", failure_timeout=3.0)
    assert time.monotonic() - start < 60  # far below the sleep and the 60 s process-group timeout
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


def test_a_rank_held_at_setup_is_named_by_the_others(capfd):
    # the watchdog runs from the store's creation on and judges setup too: rank 1 (stage 1 of 3) stays inside its
    # setup while stages 0 and 2 wait for it at the barrier; setup work is patient (10 x failure_timeout = 10 s)
    from torch.multiprocessing import ProcessExitedException

    start = time.monotonic()
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        fit(SequentialMLP(depth=6), regression_loader(), devices=3, partition="parameters", failure_timeout=1.0,
            callbacks=[_HoldRank1InSetup()])
    assert time.monotonic() - start < 60
    err = capfd.readouterr().err
    assert re.search(r"lightning_paci: stage 1 failed: made no progress for \d+ s: inside setup while stage [02] "
                     r"waits for it at a barrier #\d+ .*past the patience given to setup", err), err[-2000:]
