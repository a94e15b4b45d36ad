"""The whole Trainer on the GPU code path, on the CPU, under the NCCL emulation ([Note: NCCL emulation]).

``LIGHTNING_PACI_EMULATE_NCCL=1`` (inherited by the forked ranks) makes every rank take the NCCL branch -- the world
bound to its device, the host group and the header/payload wire, NCCL data-parallel groups and mesh -- with NCCL's
rules checked on every operation. Each topology and schedule runs fit with validation, a checkpoint at every epoch,
the end of fit's gather, and a resume from the first checkpoint that must end on the uninterrupted run's weights
bit for bit. With virtual stages, where two pipeline links join the same two processes in the same direction
([Note: one tag per link]), each placement and schedule trains and validates as the same run off the emulation does,
bit for bit: the same arithmetic, only the wire differs.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_paci import PACIStrategy

from helpers import KeepMetrics, fit
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


class _Momentum(SequentialMLP):
    def configure_optimizers(self):  # a state that a lost or misplaced checkpoint entry would change
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _trainer(directory, devices: int, replicas: int, schedule: str, epochs: int, dp_shard: str = "none"
             ) -> L.Trainer:
    strategy = PACIStrategy(start_method="fork", schedule=schedule, microbatches=2, partition="parameters",
                            data_parallel_size=replicas, dp_shard=dp_shard, timeout=timedelta(seconds=60),
                            failure_timeout=20.0)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=replicas > 1,
                     num_sanity_val_steps=0, limit_val_batches=1,
                     callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")])


@pytest.mark.parametrize("devices, replicas, schedule, dp_shard", [
    (2, 1, "paci", "none"), (3, 1, "1f1b", "none"), (4, 1, "gpipe", "none"), (8, 1, "paci", "none"),  # pipelines
    (4, 2, "1f1b", "none"), (8, 2, "paci", "none"),  # 2 stages x 2 replicas, 4 stages x 2 replicas
    (4, 2, "1f1b", "optimizer"),  # each checkpoint merges the replicas' optimizer shards over the host group
], ids=["2-paci", "3-1f1b", "4-gpipe", "8-paci", "2x2-1f1b", "4x2-paci", "2x2-1f1b-sharded"])
def test_fit_validate_checkpoint_resume_and_end_of_fit_under_nccl_rules(tmp_path, monkeypatch, devices, replicas,
                                                                      schedule, dp_shard):
    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
    stages = devices // replicas
    loader, val = regression_loader(num_batches=2 * replicas), regression_loader(num_batches=replicas, seed=1)
    torch.manual_seed(40)
    model = _Momentum(depth=max(4, stages + 1))
    first = copy.deepcopy(model)
    _trainer(tmp_path / "full", devices, replicas, schedule, epochs=2, dp_shard=dp_shard).fit(model, loader, val)
    _trainer(tmp_path / "part", devices, replicas, schedule, epochs=2, dp_shard=dp_shard).fit(
        first, loader, val, ckpt_path=str(tmp_path / "full" / "epoch=0.ckpt"))
    assert (tmp_path / "part" / "epoch=1.ckpt").exists()
    # the end of fit gave the test process the whole trained model, and the resume ended on the same bits
    for key, value in model.state_dict().items():
        torch.testing.assert_close(first.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    torch.manual_seed(40)
    initial = _Momentum(depth=max(4, stages + 1))
    assert any(not torch.equal(initial.state_dict()[k], v) for k, v in model.state_dict().items())  # it trained


def _doubles(num_batches: int, batch_size: int, seed: int = 0) -> torch.utils.data.DataLoader:
    x, y = regression_loader(num_batches=num_batches, batch_size=batch_size, seed=seed).dataset.tensors
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.double(), y.double()), batch_size=batch_size)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("devices, replicas, virtual_stages, placement, schedule", [
    (2, 1, 2, "loop", "interleaved"), (2, 1, 2, "loop", "paci"), (2, 1, 2, "v", "bfs"), (2, 1, 2, "v", "paci"),
    (2, 1, 3, "v", "bfs"),  # the V's 0 -> 1 and 4 -> 5 join the same two processes
    (4, 1, 2, "loop", "interleaved"), (4, 1, 3, "v", "paci"),
    (4, 2, 2, "loop", "paci"), (4, 2, 3, "v", "bfs"),  # 2 processes x 2 replicas
], ids=lambda value: str(value))
def test_virtual_stages_train_and_validate_under_nccl_rules_as_off_the_emulation(tmp_path, monkeypatch, devices,
                                                                                  replicas, virtual_stages, placement,
                                                                                  schedule):
    # float64 and plain SGD: the emulated run (host headers with a tag per link, payloads on the links' groups,
    # objects over the host group) and the plain gloo run do the same arithmetic and must agree bit for bit
    stages = devices // replicas * virtual_stages
    loader, val = _doubles(3 * replicas, 4 * devices), _doubles(replicas, 4 * devices, seed=1)
    torch.manual_seed(41)
    initial = SequentialMLP(width=8, depth=stages).double()  # a Linear per stage at least
    trained, metrics = {}, {}
    for emulated in (True, False):
        monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1" if emulated else "0")
        model = copy.deepcopy(initial)
        keep = KeepMetrics(tmp_path / f"metrics{emulated}.json")
        fit(model, loader, devices=devices, max_steps=3, schedule=schedule, microbatches=devices // replicas,
            partition="parameters", virtual_stages=virtual_stages, placement=placement, data_parallel_size=replicas,
            val_dataloaders=val, callbacks=[keep], trainer_kwargs={
                "limit_val_batches": 1, "val_check_interval": 3, "use_distributed_sampler": replicas > 1})
        trained[emulated], metrics[emulated] = model.state_dict(), json.loads(keep.path.read_text())
    for key, value in trained[False].items():
        torch.testing.assert_close(trained[True][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
        if key.endswith("weight"):
            assert not torch.equal(value, initial.state_dict()[key]), f"{key} did not train"
    assert set(metrics[True]) == {"train_loss", "val_loss"} and metrics[True] == metrics[False]


def test_save_pretrained_gathers_its_index_over_the_host_group_under_nccl_rules(tmp_path, monkeypatch):
    # the shards' names and sizes are objects: gathered over the host group (gloo), never over the NCCL world,
    # which NCCL's rule for objects refuses
    from safetensors.torch import load_file

    from lightning_paci import SavePretrained

    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
    torch.manual_seed(0)
    model = _Momentum(depth=4)
    fit(model, regression_loader(num_batches=2), devices=2, max_steps=2, partition="parameters",
        callbacks=[SavePretrained(tmp_path / "export", prefix="")])
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    for key, value in model.state_dict().items():  # the trained weights, as the end of fit handed them back
        written = load_file(tmp_path / "export" / index["weight_map"][key])[key]
        torch.testing.assert_close(written, value, rtol=0, atol=0)
