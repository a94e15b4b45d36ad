"""2 stages under the default launcher (this script re-executed per rank), 8 steps of one batch per epoch, with
``OnExceptionCheckpoint(OUT/<mode>-ckpt)``. ``stop AT``: global rank 0 sends SIGTERM to every rank at step ``AT`` (as
SLURM signals every task of a preempted job); ``full``: run to the end; ``resume``: resume from the checkpoint
the stop wrote. After a run that ends, rank 0 writes the trained weights to ``OUT/<mode>.pt``; every rank writes
its pid to ``OUT/<mode>-pid<rank>``.

    python tests/scripts/preempt_script.py OUT stop AT | full | resume
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402

OUT, MODE = Path(sys.argv[1]), sys.argv[2]


class SigtermEveryRank(L.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 0 and trainer.global_step == self.at:
            for path in sorted(OUT.glob(f"{MODE}-pid*")):
                os.kill(int(path.read_text()), signal.SIGTERM)


class Pids(L.Callback):
    def setup(self, trainer, pl_module, stage):
        OUT.joinpath(f"{MODE}-pid{trainer.global_rank}").write_text(str(os.getpid()))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = SequentialMLP(depth=6)
    callbacks = [Pids(), OnExceptionCheckpoint(OUT / f"{MODE}-ckpt")]  # (removed by its teardown if no exception)
    if MODE == "stop":
        callbacks.append(SigtermEveryRank(int(sys.argv[3])))
    strategy = PACIStrategy(schedule="1f1b", microbatches=2, partition="parameters", failure_timeout=10.0,
                            timeout=timedelta(seconds=120))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=8, max_epochs=-1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(OUT / MODE),
                        callbacks=callbacks)
    # one batch per epoch: the stop falls at an epoch's start, which Lightning resumes exactly from a plain loader
    trainer.fit(model, regression_loader(num_batches=1, batch_size=8),
                ckpt_path=str(OUT / "stop-ckpt" / "on_exception.ckpt") if MODE == "resume" else None)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), OUT / f"{MODE}.pt")
