"""The optimizer state sharded over a stage's replicas (``dp_shard="optimizer"``): the same training bit for bit,
about half the optimizer-state bytes per rank at 2 replicas, checkpoints that hold the whole state and resume
exactly, also into another number of replicas."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_paci.engine.replicas.optimizer_shards import optimizer_state_bytes, partition_tensors

from helpers import fit
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


class AdamMLP(SequentialMLP):
    """Adam keeps two tensors of state per parameter: what sharding divides."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class RecordStateBytes(L.Callback):
    """Every rank writes its optimizer-state bytes and its number of state entries at the end of training."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.strategy.runtime.optimizer.optimizer
        figures = [optimizer_state_bytes(optimizer), len(optimizer.state)]
        (self.directory / f"state{trainer.global_rank}.txt").write_text(" ".join(map(str, figures)))

    def read(self, ranks: int) -> list[list[int]]:
        return [list(map(int, (self.directory / f"state{r}.txt").read_text().split())) for r in range(ranks)]


def test_tensors_are_shared_out_by_bytes_largest_first():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 3, 8, 2, 1)]
    params[4].requires_grad_(False)
    assert partition_tensors(params, 2) == [0, 1, 1, 0, 0]  # 10 | 8, then 3 to the lighter (8), 2 to 0 (10 vs 11)
    assert partition_tensors(params, 1) == [0] * 5


def test_sharded_optimizer_trains_bit_for_bit_as_unsharded_with_half_the_state_per_rank(tmp_path):
    torch.manual_seed(8)
    model = AdamMLP(depth=6)
    unsharded = copy.deepcopy(model)
    loader = regression_loader(num_batches=12, batch_size=4)
    shape = dict(devices=4, max_steps=4, schedule="paci", microbatches=2, data_parallel_size=2,
                 trainer_kwargs={"use_distributed_sampler": True}, reduce_bucket_mb=1e-6, compensation="none")
    sharded_bytes, whole_bytes = RecordStateBytes(tmp_path / "sharded"), RecordStateBytes(tmp_path / "whole")
    for record in (sharded_bytes, whole_bytes):
        record.directory.mkdir()
    fit(model, loader, dp_shard="optimizer", callbacks=[sharded_bytes], **shape)
    fit(unsharded, loader, callbacks=[whole_bytes], **shape)
    for key, value in unsharded.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    sharded, whole = sharded_bytes.read(4), whole_bytes.read(4)
    # ranks 2s and 2s+1 are stage s's replicas ([Note: rank layout]); one tensor is at most 16 x 16 floats
    for stage in range(2):
        pair = [sharded[2 * stage][0], sharded[2 * stage + 1][0]]
        assert sum(pair) == whole[2 * stage][0] == whole[2 * stage + 1][0]
        assert max(pair) <= whole[2 * stage][0] / 2 + 2 * 16 * 16 * 4
        assert sharded[2 * stage][1] + sharded[2 * stage + 1][1] == whole[2 * stage][1]


def test_a_sharded_checkpoint_holds_the_whole_state_and_resumes_exactly_and_into_other_replicas(tmp_path):
    loader = regression_loader(num_batches=4, batch_size=4)
    kwargs = dict(devices=4, schedule="paci", microbatches=2, accumulation=3, data_parallel_size=2,
                  dp_shard="optimizer", compensation="none")
    run = {"use_distributed_sampler": True, "max_steps": -1}
    torch.manual_seed(5)
    whole = AdamMLP(depth=4)
    first = copy.deepcopy(whole)
    fit(whole, loader, trainer_kwargs={**run, "max_epochs": 2, "enable_checkpointing": True,
                                       "default_root_dir": str(tmp_path / "whole")}, **kwargs)
    fit(first, loader, trainer_kwargs={**run, "max_epochs": 1, "enable_checkpointing": True,
                                       "default_root_dir": str(tmp_path)}, **kwargs)
    path = next((tmp_path / "checkpoints").iterdir())
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["paci"]["params"]
    assert all(entry["state"] for entry in saved.values()), "every parameter's Adam state is in the checkpoint"
    for dp_shard in ("optimizer", "none"):  # the same shape, sharded or not: exact
        resumed = AdamMLP(depth=4)
        fit(resumed, loader, trainer_kwargs={**run, "max_epochs": 2}, ckpt_path=str(path),
            **{**kwargs, "dp_shard": dp_shard})
        for key, value in whole.state_dict().items():
            assert torch.equal(resumed.state_dict()[key], value), (dp_shard, key)
    record = RecordStateBytes(tmp_path)  # 2 stages x 1 replica: each rank takes the whole state of its stage
    fit(AdamMLP(depth=4), loader, devices=2, schedule="paci", microbatches=2, accumulation=3, dp_shard="optimizer",
        compensation="none", ckpt_path=str(path), callbacks=[record], trainer_kwargs={"max_steps": -1,
                                                                                       "max_epochs": 2})
    entries = [count for _, count in record.read(2)]
    assert min(entries) > 0 and sum(entries) == len(saved) == 8  # every tensor's state, on its stage's one rank


def test_the_weight_prediction_is_refused_with_a_sharded_state_when_asked_for():
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match=r"`compensation='predict'` with `dp_shard='optimizer'`.*every "
                                                     r"tensor's optimizer state.*Pass `compensation='none'`"):
        fit(AdamMLP(depth=4), regression_loader(num_batches=4, batch_size=4), devices=4, max_steps=1,
            data_parallel_size=2, dp_shard="optimizer", compensation="predict",
            trainer_kwargs={"use_distributed_sampler": True})


def _drift_scalars(directory: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for run in ("stage_0", "stage_1"):
        events = EventAccumulator(str(directory / run))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            if "weight_drift" in tag:
                out[f"{run}:{tag}"] = [e.value for e in events.Scalars(tag)]
    return out


def test_drift_monitor_measures_the_same_weight_drift_with_a_sharded_state(tmp_path):
    # the measured update of a tensor another replica owns is read after that replica's broadcast
    from lightning_paci import DriftMonitor

    figures = []
    for dp_shard in ("optimizer", "none"):
        torch.manual_seed(7)
        logger = L.pytorch.loggers.TensorBoardLogger(tmp_path / dp_shard, name="tb", version=0)
        fit(AdamMLP(depth=4), regression_loader(num_batches=8, batch_size=4), devices=4, max_steps=3,
            microbatches=2, data_parallel_size=2, dp_shard=dp_shard, compensation="none",
            callbacks=[DriftMonitor()],
            trainer_kwargs={"logger": logger, "log_every_n_steps": 1, "use_distributed_sampler": True})
        figures.append(_drift_scalars(tmp_path / dp_shard / "tb" / "version_0"))
    sharded, whole = figures
    assert sorted(sharded) == sorted(whole) and any("stage_0" in k for k in whole)
    assert any(v > 0 for values in whole.values() for v in values)
    for key, values in whole.items():
        torch.testing.assert_close(sharded[key], values, msg=key)
