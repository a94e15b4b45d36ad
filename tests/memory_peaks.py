"""Peak host memory (``VmHWM``) per stage process of a fork-started Trainer run of ``WideMLP``: at fit start, at
the end of training, and after what follows it (a ``save_checkpoint`` and teardown, with the peak reset when
training ends). Used by tests/test_big_model_memory.py and `python -m benchmarks memory` (benchmarks/memory.py)."""

from __future__ import annotations

import gc
import json
import os
from datetime import timedelta
from pathlib import Path

import lightning as L

from lightning_paci import PACIStrategy

from models import WideMLP, wide_loader

__all__ = ["MB", "run_peaks"]

_TEST_PROCESS = os.getpid()  # the process that imports this; forked ranks differ
MB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _peak_bytes() -> int:
    return _status("VmHWM")


class _Peaks(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module) -> None:
        own = sum(p.numel() * p.element_size() for p in pl_module.parameters() if not p.is_meta)
        self.write(trainer.global_rank, "start", _peak_bytes(), own=own)

    def on_train_end(self, trainer, pl_module) -> None:
        self.write(trainer.global_rank, "train", _peak_bytes())
        Path("/proc/self/clear_refs").write_text("5")  # the peak is the resident size from here on
        self.write(trainer.global_rank, "reset", _status("VmRSS"))
        trainer.save_checkpoint(self.directory / "sharded")

    def write(self, rank: int, when: str, peak: int, **extra) -> None:
        (self.directory / f"{when}{rank}.json").write_text(json.dumps({"peak": peak, **extra}))

    def read(self, when: str, rank: int) -> dict:
        return json.loads((self.directory / f"{when}{rank}.json").read_text())


class _PeakAfterTeardown(PACIStrategy):
    """Records each stage process's peak once the strategy has torn down (after the last gather there could be)."""

    peaks: _Peaks

    def teardown(self) -> None:
        super().teardown()
        if os.getpid() != _TEST_PROCESS:
            self.peaks.write(self.global_rank, "end", _peak_bytes())


def run_peaks(directory: Path, width: int, *, later: bool, layout: str = "sharded", devices: int = 4) -> _Peaks:
    directory.mkdir()
    peaks = _Peaks(directory)
    strategy = _PeakAfterTeardown(start_method="fork", timeout=timedelta(seconds=120), partition="uniform",
                                  checkpoint_layout=layout)
    strategy.peaks = peaks
    L.seed_everything(0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                        callbacks=[peaks])
    trainer.fit(WideMLP(width, later=later), wide_loader(2048))
    del trainer, strategy
    gc.collect()
    return peaks
