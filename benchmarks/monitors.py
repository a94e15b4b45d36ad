"""BubbleMonitor's steady-state bubble against the simulator, and the monitors' overhead, on the emulated cluster.

    cd benchmarks && python monitors.py [--stages 4] [--microbatches 8] [--minibatches 10] [--json out.json]
    # add --timeline-png ../docs/timeline-measured-n4.png to save a measured Gantt picture

Each block sleeps 30 / 60 ms in forward / backward (2 blocks per stage). For "paci" and "1f1b" it trains once with
DriftMonitor + BubbleMonitor (one logging window over the whole run) and reads every stage's
paci/steady_bubble_fraction back from TensorBoard, next to the simulator's prediction for the same schedule and
costs. The overhead is the step time with the monitors over the step time without them, alternating runs and taking
the median of each.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import warnings
from pathlib import Path

import lightning as L
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_paci import BubbleMonitor, DriftMonitor, TimelineMonitor, build, simulate

from emulated import run_emulated, run_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--timeline-png")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    n, m, k = args.stages, args.microbatches, args.minibatches
    rows = []
    for schedule in ("paci", "1f1b"):
        tmp = Path(tempfile.mkdtemp())
        logger = L.pytorch.loggers.TensorBoardLogger(tmp, name="tb", version=0)
        callbacks = [DriftMonitor(logging_interval=k), BubbleMonitor(logging_interval=k)]
        if args.timeline_png and schedule == "paci":
            callbacks.append(TimelineMonitor(every_n_steps=k, last_microbatches=2 * m))
        run_emulated(num_stages=n, schedule=schedule, num_microbatches=m, num_minibatches=k, forward_ms=30,
                     backward_ms=60, callbacks=callbacks, logger=logger)
        measured = []
        for s in range(n):
            acc = EventAccumulator(str(tmp / "tb" / "version_0" / f"stage_{s}"))
            acc.Reload()
            measured.append(acc.Scalars(f"paci/steady_bubble_fraction/stage_{s}")[-1].value)
        predicted = [r.steady_bubble_fraction for r in simulate(build(schedule, n, m, m, k), forward_cost=60,
                                                                backward_cost=120).stages]
        rows.append({"schedule": schedule, "measured": measured, "predicted": predicted,
                     "max_abs_difference": max(abs(a - b) for a, b in zip(measured, predicted))})
        if args.timeline_png and schedule == "paci":
            shutil.copy(tmp / "tb" / "version_0" / "timeline" / "timeline.png", args.timeline_png)
        shutil.rmtree(tmp, ignore_errors=True)
    with_monitors, without = [], []
    for _ in range(args.repeats):
        tmp = Path(tempfile.mkdtemp())
        logger = L.pytorch.loggers.TensorBoardLogger(tmp, name="tb", version=0)
        with_monitors.append(run_seconds(run_emulated(
            num_stages=n, schedule="paci", num_microbatches=m, num_minibatches=k, forward_ms=30, backward_ms=60,
            callbacks=[DriftMonitor(logging_interval=1), BubbleMonitor(logging_interval=1)], logger=logger)) / k)
        without.append(run_seconds(run_emulated(num_stages=n, schedule="paci", num_microbatches=m, num_minibatches=k,
                                            forward_ms=30, backward_ms=60)) / k)
        shutil.rmtree(tmp, ignore_errors=True)
    overhead = statistics.median(with_monitors) / statistics.median(without) - 1
    print(f"\nN={n} m={m} {k} batches, per-stage steady-state bubble: BubbleMonitor (TensorBoard) vs simulator")
    for row in rows:
        print(f"  {row['schedule']:>5} measured  " + " ".join(f"{v:.3f}" for v in row["measured"]))
        print(f"  {row['schedule']:>5} predicted " + " ".join(f"{v:.3f}" for v in row["predicted"])
              + f"   max |difference| = {row['max_abs_difference']:.3f}")
    print(f"step time with DriftMonitor+BubbleMonitor (window = 1 step): {statistics.median(with_monitors):.3f} s, "
          f"without: {statistics.median(without):.3f} s, overhead {100 * overhead:+.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "step_s_with": with_monitors, "step_s_without": without,
                                               "overhead": overhead}, indent=2))


if __name__ == "__main__":
    main()
