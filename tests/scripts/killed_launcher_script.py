"""2 stages forked (``paci_fork``) by this script's process, which one rank then kills (SIGKILL, as an out-of-memory
kill or a closed notebook would) before it blocks in a barrier the other rank never joins: both ranks wait inside
torch's C++ code, where the SIGINT torch sends a fork's ranks when their parent dies is never handled. Left without
their launcher, they must stop by themselves. Every rank writes its pid to ``OUT/pid<rank>``.

    python tests/scripts/killed_launcher_script.py OUT
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch.distributed as dist

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402

OUT = Path(sys.argv[1])


class KillTheLauncher(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        OUT.joinpath(f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch_idx == 2 and trainer.global_rank == 1:
            os.kill(os.getppid(), signal.SIGKILL)  # the main process, which forked the ranks
            dist.barrier()  # rank 0 waits for this rank's activations meanwhile


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    strategy = PACIStrategy(start_method="fork", partition="parameters", failure_timeout=3.0,
                            timeout=timedelta(seconds=60))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=10_000, max_epochs=-1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[KillTheLauncher()])
    trainer.fit(SequentialMLP(), regression_loader(num_batches=50))
