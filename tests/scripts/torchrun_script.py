"""One of two torchrun "nodes" (2 processes each): train, checkpoint and resume as pipeline 2 x data 2, then as
pipeline 4 x data 1 from that checkpoint, checkpoint and resume again, then run the Tuner's ``lr_find`` as pipeline
2 x data 2 (every rank writes its suggestion to ``OUT/lr<rank>``); or, with ``kill RANK``, SIGKILL global rank
``RANK`` at its third batch (rank 1 runs stage 1 of replica 1).

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:PORT \\
        tests/scripts/torchrun_script.py OUT [kill RANK]
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.tuner import Tuner

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402


class KillOne(L.Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(pipeline: int, max_steps: int, **kwargs) -> L.Trainer:
    strategy = PACIStrategy(pipeline_parallel_size=pipeline, microbatches=2, failure_timeout=5.0,
                            timeout=timedelta(seconds=90))
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)  # the docs' command names a directory that may not exist yet
    rank = int(os.environ["RANK"])
    out.joinpath(f"pid{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    if sys.argv[2:3] == ["kill"]:
        killing = trainer(2, 50, callbacks=[KillOne(int(sys.argv[3]))])
        killing.fit(SequentialMLP(depth=6), regression_loader(num_batches=50))
        raise SystemExit("not killed")
    loader = regression_loader(num_batches=8, batch_size=4)
    first = trainer(2, 3)
    first.fit(SequentialMLP(depth=6), loader)
    path = out / "pp2xdp2.ckpt"
    first.save_checkpoint(path)
    resumed = trainer(2, 5)
    resumed.fit(SequentialMLP(depth=6), loader, ckpt_path=path)
    assert resumed.global_step == 5, resumed.global_step
    reshaped = trainer(4, 5)  # the same 4 processes as 4 stages x 1 replica, from the 2 x 2 checkpoint
    reshaped.fit(SequentialMLP(depth=6), loader, ckpt_path=path)
    assert reshaped.global_step == 5, reshaped.global_step
    reshaped.save_checkpoint(out / "pp4xdp1.ckpt")
    again = trainer(4, 7)
    again.fit(SequentialMLP(depth=6), loader, ckpt_path=out / "pp4xdp1.ckpt")
    assert again.global_step == 7, again.global_step
    # the finder's results are broadcast from global rank 0: every rank takes the same learning rate
    finder = Tuner(trainer(2, 7, default_root_dir=out)).lr_find(
        SequentialMLP(depth=6), regression_loader(num_batches=24, batch_size=4), num_training=20, min_lr=1e-3)
    assert finder is not None
    out.joinpath(f"lr{rank}").write_text(repr(finder.suggestion()))
    print(f"OK rank {rank}: pipeline 2 x data 2 and pipeline 4 x data 1 trained, saved, resumed", flush=True)
