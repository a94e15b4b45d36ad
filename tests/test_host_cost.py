"""The host work of a steady micro-batch, counted rather than timed, so that it cannot creep back.

A profiler hook (``sys.setprofile``) on each stage's main thread counts the Python function calls made between the
start of Lightning batch 2 and that of batch 5 of a 3-stage ``"paci"`` run (3 Lightning batches of 4 micro-batches
each, every stage past its pipeline fill): everything the host runs per micro-batch -- Lightning's loop, the
strategy's per-batch work, the runtime's actions, messages, records, the user's step. The counts do not depend on
timing (the same lists, the same code paths), so the budgets below are exact ceilings, each set about 10% above the
count measured with lightning 2.6.6 and torch 2.13.0 on 2026-12-03. Raising one is a decision to be made with the
per-action host-cost figures at hand (``python -m benchmarks overhead --host --torch``), not to make a test pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest

import lightning_paci

from helpers import fit
from models import SequentialMLP, regression_loader

PACKAGE = str(Path(lightning_paci.__file__).resolve().parent)
FIRST, LAST, MICROBATCHES, STAGES = 2, 5, 4, 3

# Python calls per micro-batch, per stage (stage 0, middle, last): the package's own, and every Python call
OURS_BUDGET = (180, 290, 225)
ALL_BUDGET = (555, 690, 625)


class CountCalls(L.Callback):
    """Counts the main thread's Python calls between the starts of Lightning batches ``FIRST`` and ``LAST``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ours = self.total = 0

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.total += 1
            if frame.f_code.co_filename.startswith(PACKAGE):
                self.ours += 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == FIRST:
            sys.setprofile(self._count)
        elif batch_idx == LAST:
            sys.setprofile(None)
            microbatches = (LAST - FIRST) * MICROBATCHES
            stage = trainer.strategy.stage_index  # type: ignore[attr-defined]
            (self.directory / f"calls{stage}.json").write_text(
                json.dumps({"ours": self.ours / microbatches, "all": self.total / microbatches}))


def _counts(tmp_path: Path) -> list[dict[str, float]]:
    model = SequentialMLP(depth=6)
    fit(model, regression_loader(num_batches=LAST + 2), devices=STAGES, max_steps=LAST + 2, microbatches=MICROBATCHES,
        partition="parameters", callbacks=[CountCalls(tmp_path)])
    return [json.loads((tmp_path / f"calls{s}.json").read_text()) for s in range(STAGES)]


@pytest.mark.timeout(120)
def test_python_calls_per_steady_microbatch_stay_within_budget(tmp_path):
    counts = _counts(tmp_path)
    ours = tuple(c["ours"] for c in counts)
    every = tuple(c["all"] for c in counts)
    assert all(o <= b for o, b in zip(ours, OURS_BUDGET)), f"package calls per micro-batch {ours} > {OURS_BUDGET}"
    assert all(o <= b for o, b in zip(every, ALL_BUDGET)), f"Python calls per micro-batch {every} > {ALL_BUDGET}"
    assert all(c["ours"] > 0 for c in counts)  # the hook saw the package's code on every stage
