"""`Trainer(strategy="paci", devices=2)` as a user writes it: Lightning re-launches this script once per extra rank."""

import os
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_paci  # noqa: F401  (registers strategy "paci")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402

if __name__ == "__main__":
    torch.manual_seed(0)
    model = SequentialMLP()
    trainer = L.Trainer(strategy="paci", accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, regression_loader())
    if trainer.is_global_zero:
        full = model.state_dict()
        assert set(full) == {f"net.{i}.{p}" for i in (0, 2, 4, 6) for p in ("weight", "bias")}, sorted(full)
        print(f"OK rank0 keys={len(full)} train_loss={float(trainer.callback_metrics['train_loss']):.4f}")
    # Lightning's documented pattern, on every rank: a checkpoint after fit holds every stage's optimizer state
    trainer.save_checkpoint(os.environ["PACI_TEST_CHECKPOINT"])
    if trainer.is_global_zero:
        saved = torch.load(os.environ["PACI_TEST_CHECKPOINT"], weights_only=False)["optimizer_states"][0]
        assert saved["paci"]["num_stages"] == 2 and len(saved["paci"]["params"]) == 8, saved
        assert [len(g["params"]) for g in saved["param_groups"]] == [8], saved["param_groups"]
        print("OK save after fit")
    # trainer.predict returns the last stage's predictions on global rank 0, in batch order
    loader = regression_loader(num_batches=3)
    predictions = trainer.predict(model, loader)
    if trainer.is_global_zero:
        with torch.no_grad():
            expected = [model(x) for x, _ in loader]
        assert len(predictions) == 3
        for got, want in zip(predictions, expected):
            torch.testing.assert_close(got, want)
        print("OK predict")
