"""4 stages under the default launcher (this script re-executed per rank, as `ddp` does): global rank ``RANK`` is
SIGKILLed at its third batch (as the out-of-memory killer would). Every rank writes its pid to ``OUT/pid<rank>``.

    python tests/scripts/kill_rank_script.py OUT RANK
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402

OUT, RANK = Path(sys.argv[1]), int(sys.argv[2])


class KillOne(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        OUT.joinpath(f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch_idx == 2 and trainer.global_rank == RANK:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    strategy = PACIStrategy(microbatches=4, failure_timeout=10.0, timeout=timedelta(seconds=120))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=50, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[KillOne()])
    trainer.fit(SequentialMLP(depth=6), regression_loader(num_batches=50))
    raise SystemExit("not killed")
