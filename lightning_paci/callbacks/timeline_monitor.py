"""``TimelineMonitor``: the pipeline's recent work as a Gantt picture in TensorBoard and a Chrome/Perfetto trace.

Every ``every_n_steps`` Lightning steps each stage writes the intervals of its last micro-batches (forward,
backward, optimizer step, send, waits) to ``<dir>/timeline/stage_<s>.json`` (atomically: write, then rename);
global rank 0 then merges the files that exist, draws them with the simulator's drawing code into TensorBoard's
image tab (tag ``paci/timeline``) and writes ``<dir>/timeline/trace.json`` (open in ui.perfetto.dev or
chrome://tracing). No stage waits for another: rank 0 may draw another stage's previous window. All stages must
share the directory (one node, or a shared file system); times come from ``time.perf_counter`` (CLOCK_MONOTONIC,
common to the processes of one machine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
from typing_extensions import override

from lightning_paci.callbacks.stage_monitor import StageMonitor, monitor_directory, paci_strategy, stage_writer
from lightning_paci.schedules import Interval
from lightning_paci.simulation.timeline import draw_timeline, write_chrome_trace

__all__ = ["TimelineMonitor", "recent_intervals"]


def recent_intervals(intervals: list[Interval], last_microbatches: int) -> list[Interval]:
    """The intervals from the start of the ``last_microbatches``-th newest forward on this stage onwards."""
    forwards = [iv for iv in intervals if iv.kind == "F"]
    if not forwards:
        return list(intervals)
    start = forwards[-min(last_microbatches, len(forwards))].start
    return [iv for iv in intervals if iv.end >= start]


class TimelineMonitor(StageMonitor):
    """Draw the last ``last_microbatches`` micro-batches of every stage every ``every_n_steps`` steps.

    Args:
        every_n_steps: Lightning steps between pictures.
        last_microbatches: how many of the newest micro-batches each stage contributes.

    Raises:
        ValueError: for arguments < 1.
    """

    def __init__(self, every_n_steps: int = 50, last_microbatches: int = 16) -> None:
        super().__init__(every_n_steps, argument="every_n_steps")
        if last_microbatches < 1:
            raise ValueError(f"`last_microbatches` must be >= 1, got {last_microbatches}.")
        self.last_microbatches = last_microbatches
        self.directory: Path | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        base = monitor_directory(trainer)
        self.directory = Path(base) / "timeline"
        self.directory.mkdir(parents=True, exist_ok=True)
        if trainer.is_global_zero:
            strategy = paci_strategy(trainer)
            self._writer = stage_writer(base, strategy.stage_index, strategy.replica_index)

    def _log(self, trainer: L.Trainer) -> None:
        if self.directory is not None:
            self._record(trainer)

    def _record(self, trainer: L.Trainer) -> None:
        assert self.directory is not None
        strategy = paci_strategy(trainer)
        if strategy.replica_index:  # the picture shows replica 0's pipeline (its replicas run the same lists)
            return
        # with virtual stages a row per process, its stages' intervals in its order ([Note: virtual stages])
        runtimes, devices = strategy.runtimes, strategy.stage_devices
        order = {stage: rank for rank, stage in enumerate(runtimes)}
        own = [iv for runtime in runtimes.values()
               for iv in recent_intervals(list(runtime.records.intervals), self.last_microbatches)]
        mine = [Interval(devices[iv.stage], iv.kind, iv.microbatch, iv.start, iv.end) for iv in own]
        chunks = [order[iv.stage] for iv in own]
        path = self.directory / f"stage_{strategy.stage_index}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps([[*iv, chunk] for iv, chunk in zip(mine, chunks, strict=True)]))
        os.replace(tmp, path)
        if self._writer is not None:
            self._draw(trainer, mine)

    def _draw(self, trainer: L.Trainer, mine: list[Interval]) -> None:
        import matplotlib.pyplot as plt

        assert self.directory is not None
        num_stages = paci_strategy(trainer).num_stages
        every: list[tuple[Interval, int]] = []
        for s in range(num_stages):
            path = self.directory / f"stage_{s}.json"
            if path.exists():
                every += [(Interval(*iv[:5]), iv[5]) for iv in json.loads(path.read_text())]
        if not every or not mine:
            return
        lo, hi = min(iv.start for iv in mine), max(iv.end for iv in mine)
        kept = [(Interval(iv.stage, iv.kind, iv.microbatch, iv.start - lo, iv.end - lo), chunk)
                for iv, chunk in every if iv.end >= lo and iv.start <= hi]
        window = [iv for iv, _ in kept]
        write_chrome_trace(window, self.directory / "trace.json")
        virtual = paci_strategy(trainer).config.virtual_stages > 1
        figure = draw_timeline(window, num_stages, time_unit="seconds",
                               title=f"pipeline timeline at step {trainer.global_step}",
                               chunks=[chunk for _, chunk in kept] if virtual else None)
        self._writer.add_figure("paci/timeline", figure, trainer.global_step)
        figure.savefig(self.directory / "timeline.png", dpi=110)
        plt.close(figure)
        self._writer.flush()
