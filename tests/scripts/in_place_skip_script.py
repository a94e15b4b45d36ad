"""2 stages under the default launcher, a long skip changed in place: stage 0 refuses to relay it (CrossingError)."""

import sys
from pathlib import Path

import lightning as L
import torch

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import InPlaceSkip, regression_loader  # noqa: E402

if __name__ == "__main__":
    torch.manual_seed(0)
    devices = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    trainer = L.Trainer(strategy=PACIStrategy(partition="parameters", failure_timeout=5.0), accelerator="cpu",
                        devices=devices, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(InPlaceSkip(), regression_loader())
