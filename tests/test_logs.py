"""self.log under pipeline training: records replayed as Lightning would have combined the whole batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_paci.integration.stage.logs import LogRecord, replay_logs

from helpers import fit
from models import SequentialMLP, regression_loader


class LogsEveryReduction(SequentialMLP):
    """An ordinary module logging one batch statistic per reduction (and one with sync_dist, as a DDP user would)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("x_mean", x.mean())
        self.log("x_sum", x.sum(), reduce_fx="sum")
        self.log("x_max", x.max(), reduce_fx="max")
        self.log("x_min", x.min(), reduce_fx=torch.min)
        self.log("loss_synced", loss, sync_dist=True)
        return loss


class RecordMetrics(Callback):
    """Rank 0 writes ``callback_metrics`` after every batch (forked ranks cannot return objects)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("x_")})
            self.path.write_text(json.dumps(self.steps))


def test_micro_batch_logs_combine_as_the_whole_batch_would_on_one_device(tmp_path):
    torch.manual_seed(50)
    single = tmp_path / "single.json"
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              callbacks=[RecordMetrics(single)]).fit(LogsEveryReduction(), regression_loader(num_batches=4))
    piped = tmp_path / "piped.json"
    # 1f1b: every mini-batch's records are complete on rank 0 within its own call (paci delivers them a call later)
    fit(LogsEveryReduction(), regression_loader(num_batches=4), devices=2, max_steps=4, schedule="1f1b",
        microbatches=4, partition="parameters", callbacks=[RecordMetrics(piped)])
    expected, got = json.loads(single.read_text()), json.loads(piped.read_text())
    assert len(expected) == len(got) == 4
    for step, (want, have) in enumerate(zip(expected, got)):
        assert have.keys() == want.keys() == {"x_mean", "x_sum", "x_max", "x_min"}
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), f"step {step} {key}"


class Sink(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, float, dict[str, Any]]] = []

    def log(self, name: str, value: float, **options: Any) -> None:
        self.calls.append((name, value, options))


def test_replay_keeps_the_options_and_refuses_an_unknown_reduction():
    sink = Sink()
    records = [LogRecord("a", 1.0, 2, (("reduce_fx", "sum"), ("sync_dist", True))),
               LogRecord("a", 3.0, 1, (("reduce_fx", "sum"), ("sync_dist", True)))]
    replay_logs(sink, records)  # type: ignore[arg-type]
    assert sink.calls == [("a", 4.0, {"batch_size": 3, "reduce_fx": "sum", "sync_dist": True})]
    with pytest.raises(ValueError, match=r"`self.log\('b', \.\.\., reduce_fx=<function median"):
        replay_logs(sink, [LogRecord("b", 1.0, 1, (("reduce_fx", __import__("statistics").median),))])  # type: ignore
