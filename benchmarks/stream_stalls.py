"""Step times along one long stream on the emulated cluster: no step may stall the pipeline.

    cd benchmarks && python stream_stalls.py [--stages 8] [--microbatches 8] [--batches 256] [--json out.json]

Trains ``--batches`` Lightning batches as one stream (``max_stream_batches`` = the batch count, so the only drain is
the last call) through the real Trainer on sleep-emulated blocks (forward/backward 10/20 ms, 2 blocks per stage), and
records on every stage the time of each Lightning call (from one ``on_train_batch_end`` to the next). Prints, per
stage, the median and the largest steady-state step (calls ``N .. K-2``: after the fill, before the drain) and the
call where the largest one happened. Every stage used to rebuild all stages' action lists at doubling horizons
(calls 7, 15, 31, 63, 127), which stalled every stage at once for 0.7-1.0 s at call 127.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_paci import PACIStrategy

from emulated import EmulatedModel, OneThread, emulated_loader


class StepTimes(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = [b - a for a, b in zip(self.ends, self.ends[1:])]  # step k: call k+1's duration and Lightning's
        (self.directory / f"stage{trainer.strategy.stage_index}.json").write_text(json.dumps(steps))


def run(stages: int, microbatches: int, batches: int, schedule: str) -> list[list[float]]:
    torch.manual_seed(0)
    model = EmulatedModel(2 * stages, 0.010, 0.020)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=microbatches, start_method="fork",
                                  partition="parameters", max_stream_batches=batches, timeout=timedelta(seconds=120)),
            accelerator="cpu", devices=stages, max_steps=batches, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            use_distributed_sampler=False, callbacks=[OneThread(), StepTimes(Path(tmp))])
        trainer.fit(model, emulated_loader(batches, batch_size=2 * microbatches))
        return [json.loads((Path(tmp) / f"stage{s}.json").read_text()) for s in range(stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batches", type=int, default=256)
    parser.add_argument("--schedule", default="paci")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    per_stage = run(args.stages, args.microbatches, args.batches, args.schedule)
    rows = []
    for s, steps in enumerate(per_stage):
        steady = steps[args.stages - 1:-1]  # step k lies between calls k and k+1; the last one holds the drain
        largest = max(range(len(steady)), key=steady.__getitem__)
        median = statistics.median(steady)
        rows.append({"stage": s, "median_s": median, "max_s": steady[largest], "max_at_call": largest + args.stages,
                     "max_over_median": steady[largest] / median})
    print(f"schedule={args.schedule} stages={args.stages} microbatches={args.microbatches} batches={args.batches}")
    print(f"{'stage':>5} {'median s':>9} {'max s':>7} {'at call':>7} {'max/median':>10}")
    for r in rows:
        print(f"{r['stage']:>5} {r['median_s']:>9.3f} {r['max_s']:>7.3f} {r['max_at_call']:>7} "
              f"{r['max_over_median']:>10.2f}")
    print(f"worst max/median over stages: {max(r['max_over_median'] for r in rows):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "stages": rows}, indent=1))


if __name__ == "__main__":
    main()
