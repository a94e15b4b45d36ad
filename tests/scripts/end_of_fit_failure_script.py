"""2 stages under the default launcher (each rank its own process), one rank failing at the end of ``fit``:

* ``drain``: from Lightning batch 1 on, global rank 0 (stage 1) loads other samples than rank 1 (stage 0), so the
  last drain's data check (in the last batch) raises ``DataMismatchError`` on rank 0 while rank 1 goes on into
  teardown, where it waits for rank 0 in the end of fit's gathers;
* ``teardown``: a strategy subclass raises in ``teardown`` on global rank 1 (stage 0) before the end of fit's
  gathers, which rank 0 (stage 1) waits in.

Every rank writes its pid to ``OUT/pid<rank>``; the failing rank writes ``OUT/failed_at`` (``time.time()``) as
Lightning reports its exception.

    python tests/scripts/end_of_fit_failure_script.py OUT drain|teardown
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP  # noqa: E402

OUT = Path(sys.argv[1])
MODE = sys.argv[2]


class RankDependentAfterTheFirstBatch(Dataset):
    """The same samples on every rank for Lightning batch 0 (the first-batch check passes), then shifted on global
    rank 0 in ``drain`` mode: what a dataset reading a per-process source (a PID, the clock) gives."""

    def __init__(self, size: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 8, generator=generator), torch.randn(size, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shifted = MODE == "drain" and index >= 8 and dist.is_initialized() and dist.get_rank() == 0
        return self.x[index] + float(shifted), self.y[index]


class RecordPids(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        OUT.joinpath(f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        OUT.joinpath("failed_at").write_text(repr(time.time()))


class FailsInTeardownOnRank1(PACIStrategy):
    raised = False

    def teardown(self) -> None:
        if MODE == "teardown" and self.global_rank == 1 and not self.raised:
            self.raised = True
            raise RuntimeError("boom in a strategy subclass's teardown")
        super().teardown()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    strategy = FailsInTeardownOnRank1(partition="parameters", failure_timeout=3.0, timeout=timedelta(seconds=60))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[RecordPids()])
    trainer.fit(SequentialMLP(), DataLoader(RankDependentAfterTheFirstBatch(), batch_size=8))
