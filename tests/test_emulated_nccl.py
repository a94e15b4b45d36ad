"""The whole Trainer on the GPU code path, on the CPU, under the NCCL emulation ([Note: NCCL emulation]).

``LIGHTNING_PACI_EMULATE_NCCL=1`` (inherited by the forked ranks) makes every rank take the NCCL branch -- the world
bound to its device, the host group and the header/payload wire, NCCL data-parallel groups and mesh -- with NCCL's
rules checked on every operation. Each topology and schedule runs fit with validation, a checkpoint at every epoch,
the end of fit's gather, and a resume from the first checkpoint that must end on the uninterrupted run's weights
bit for bit.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_paci import PACIStrategy

from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


class _Momentum(SequentialMLP):
    def configure_optimizers(self):  # a state that a lost or misplaced checkpoint entry would change
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _trainer(directory, devices: int, replicas: int, schedule: str, epochs: int) -> L.Trainer:
    strategy = PACIStrategy(start_method="fork", schedule=schedule, microbatches=2, partition="parameters",
                            data_parallel_size=replicas, timeout=timedelta(seconds=60), failure_timeout=20.0)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=replicas > 1,
                     num_sanity_val_steps=0, limit_val_batches=1,
                     callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")])


@pytest.mark.parametrize("devices, replicas, schedule", [
    (2, 1, "paci"), (3, 1, "1f1b"), (4, 1, "gpipe"), (8, 1, "paci"),  # pipelines
    (4, 2, "1f1b"), (8, 2, "paci"),  # 2 stages x 2 replicas, 4 stages x 2 replicas
], ids=["2-paci", "3-1f1b", "4-gpipe", "8-paci", "2x2-1f1b", "4x2-paci"])
def test_fit_validate_checkpoint_resume_and_end_of_fit_under_nccl_rules(tmp_path, monkeypatch, devices, replicas,
                                                                      schedule):
    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
    stages = devices // replicas
    loader, val = regression_loader(num_batches=2 * replicas), regression_loader(num_batches=replicas, seed=1)
    torch.manual_seed(40)
    model = _Momentum(depth=max(4, stages + 1))
    first = copy.deepcopy(model)
    _trainer(tmp_path / "full", devices, replicas, schedule, epochs=2).fit(model, loader, val)
    _trainer(tmp_path / "part", devices, replicas, schedule, epochs=2).fit(
        first, loader, val, ckpt_path=str(tmp_path / "full" / "epoch=0.ckpt"))
    assert (tmp_path / "part" / "epoch=1.ckpt").exists()
    # the end of fit gave the test process the whole trained model, and the resume ended on the same bits
    for key, value in model.state_dict().items():
        torch.testing.assert_close(first.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    torch.manual_seed(40)
    initial = _Momentum(depth=max(4, stages + 1))
    assert any(not torch.equal(initial.state_dict()[k], v) for k, v in model.state_dict().items())  # it trained
