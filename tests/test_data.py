"""Data under the pipeline: the user's own sampler is kept, so the batches come in the order one device sees."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from test_logs import LogsEveryReduction, RecordMetrics
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from helpers import fit


def _shuffled_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x[:, :4])), batch_size=8, shuffle=True)


class RecordSampler(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(type(trainer.train_dataloader.sampler).__name__)


class DesynchronizeRNG(L.Callback):
    """Before the strategy's setup, ranks other than 0 move to RNG states of their own (as unseeded processes)."""

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank > 0:
            torch.manual_seed(1000 + trainer.global_rank)


def test_a_shuffled_loader_keeps_its_sampler_and_the_order_of_one_device(tmp_path):
    torch.manual_seed(60)
    single = tmp_path / "single.json"
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              callbacks=[RecordMetrics(single)]).fit(LogsEveryReduction(), _shuffled_loader())
    torch.manual_seed(60)
    piped = tmp_path / "piped.json"
    fit(LogsEveryReduction(), _shuffled_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=4,
        partition="parameters", trainer_kwargs={"max_epochs": 2, "use_distributed_sampler": True},
        callbacks=[DesynchronizeRNG(), RecordMetrics(piped), RecordSampler(tmp_path / "sampler.txt")])
    assert (tmp_path / "sampler.txt").read_text() == RandomSampler.__name__ != DistributedSampler.__name__
    expected, got = json.loads(single.read_text()), json.loads(piped.read_text())
    assert len(expected) == len(got) == 8  # 4 batches, 2 epochs, reshuffled between them
    # the same batches in the same order (sums of micro-batch sums: equal up to float rounding), though the ranks
    # started from different RNG states: x_sum is logged by the last stage, from the batch its own loader gave it
    assert [step["x_sum"] for step in got] == pytest.approx([step["x_sum"] for step in expected], rel=1e-5)
