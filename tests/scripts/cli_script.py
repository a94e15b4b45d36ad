"""LightningCLI over an unchanged module: ``python cli_script.py fit --trainer.strategy paci ...``.

Global rank 0 writes what ran (the strategy, its stages and schedule, the steps, the last loss) as JSON to the file
named by ``PACI_CLI_RESULT``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_paci  # noqa: E402,F401  (registers "paci")

from models import SequentialMLP, regression_loader  # noqa: E402


class RegressionData(L.LightningDataModule):
    def __init__(self, num_batches: int = 4, batch_size: int = 8) -> None:
        super().__init__()
        self.num_batches, self.batch_size = num_batches, batch_size

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return regression_loader(num_batches=self.num_batches, batch_size=self.batch_size)


def main() -> None:
    torch.set_num_threads(1)
    cli = LightningCLI(SequentialMLP, RegressionData, save_config_callback=None, seed_everything_default=0)
    trainer = cli.trainer
    if trainer.is_global_zero and os.environ.get("PACI_CLI_RESULT"):
        strategy = trainer.strategy
        Path(os.environ["PACI_CLI_RESULT"]).write_text(json.dumps({
            "strategy": type(strategy).__name__, "stages": getattr(strategy, "num_stages", None),
            "schedule": getattr(getattr(strategy, "config", None), "schedule", None),
            "microbatches": getattr(strategy, "num_microbatches", None), "steps": trainer.global_step,
            "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}))


if __name__ == "__main__":
    main()
