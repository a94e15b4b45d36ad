"""LightningCLI over an unchanged module: ``python cli_script.py fit --trainer.strategy paci ...`` (Lightning
re-launches this script once per extra rank, as a user's script).

Global rank 0 writes what ran (the strategy, its stages and schedule, the steps, the last loss, the weights it ends
with) as JSON to the file named by ``PACI_CLI_RESULT``; with ``PACI_CLI_CHECKPOINT`` every rank then saves a
checkpoint after ``fit`` and runs ``trainer.predict``, and rank 0 checks the predictions against the model's."""

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
    trainer, model = cli.trainer, cli.model
    result: dict[str, object] = {}
    if trainer.is_global_zero:
        strategy = trainer.strategy
        result.update({"strategy": type(strategy).__name__, "stages": getattr(strategy, "num_stages", None),
                       "schedule": getattr(getattr(strategy, "config", None), "schedule", None),
                       "microbatches": getattr(strategy, "num_microbatches", None), "steps": trainer.global_step,
                       "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
                       "keys": sorted(model.state_dict())})  # rank 0 ends with every stage's weights
    if os.environ.get("PACI_CLI_CHECKPOINT"):
        # Lightning's documented pattern, on every rank: a checkpoint after fit holds every stage's optimizer state
        trainer.save_checkpoint(os.environ["PACI_CLI_CHECKPOINT"])
        if trainer.is_global_zero:
            saved = torch.load(os.environ["PACI_CLI_CHECKPOINT"], weights_only=False)["optimizer_states"][0]
            result["saved"] = [saved["paci"]["num_stages"], len(saved["paci"]["params"]),
                               [len(g["params"]) for g in saved["param_groups"]]]
        # trainer.predict returns the last stage's predictions on global rank 0, in batch order
        loader = regression_loader(num_batches=3)
        predictions = trainer.predict(model, loader)
        if trainer.is_global_zero:
            with torch.no_grad():
                expected = [model(x) for x, _ in loader]
            result["predictions"] = len(predictions)
            for got, want in zip(predictions, expected):
                torch.testing.assert_close(got, want)
    if trainer.is_global_zero and os.environ.get("PACI_CLI_RESULT"):
        Path(os.environ["PACI_CLI_RESULT"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
