"""4 stages under the default launcher; stage 2 SIGKILLs itself at batch 3."""

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402


class KillStage2(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 3 and trainer.strategy.stage_index == 2:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    Path(sys.argv[1]).joinpath(f"pid{os.environ.get('LOCAL_RANK', '0')}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    trainer = L.Trainer(strategy=PACIStrategy(failure_timeout=5.0), accelerator="cpu", devices=4, max_steps=50,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[KillStage2()])
    trainer.fit(SequentialMLP(depth=8), regression_loader(num_batches=50))
