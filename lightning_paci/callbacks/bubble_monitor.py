"""``BubbleMonitor``: per-stage idle (bubble) time and where the rest of the time went, in TensorBoard."""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from lightning_paci.callbacks.stage_monitor import (
    StageMonitor,
    metric_tag,
    monitor_directory,
    paci_strategy,
    stage_writer,
)
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["BubbleMonitor", "bubble_window_metrics"]

_PIPELINE_PHASES = ("startup", "steady", "drain")


def bubble_window_metrics(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Figures of one window from two cumulative ``StageRuntime.time_snapshot()`` readings. Pure."""
    delta = {p: {k: after[p][k] - before[p][k] for k in after[p]} for p in _PIPELINE_PHASES}
    wall = sum(delta[p]["wall"] for p in _PIPELINE_PHASES)
    if wall <= 0:
        return {}
    total = {k: sum(delta[p][k] for p in _PIPELINE_PHASES) for k in ("compute", "wait", "comm", "optimizer")}
    out = {
        "bubble_fraction": total["wait"] / wall,
        "compute_fraction": total["compute"] / wall,
        "comm_fraction": total["comm"] / wall,
        "optimizer_fraction": total["optimizer"] / wall,
        "startup_idle_seconds": delta["startup"]["wait"],
        "drain_idle_seconds": delta["drain"]["wait"],
    }
    if delta["steady"]["wall"] > 0:
        out["steady_bubble_fraction"] = delta["steady"]["wait"] / delta["steady"]["wall"]
    return out


class BubbleMonitor(StageMonitor):
    """Log, for every pipeline stage and logging window, the fraction of wall-clock time it sat idle waiting for an
    activation or a gradient, and the fractions spent computing, sending and in the optimizer step.

    Tags (each stage's own process writes its own; no cross-stage synchronisation):

    * ``paci/bubble_fraction/stage_<s>``: seconds blocked in receives / wall-clock seconds of pipeline work in the
      window (start-up, steady state and drain; time between streams, e.g. validation, is excluded).
    * ``paci/steady_bubble_fraction/stage_<s>``: the same over the steady state only: after the stage's first
      backward of a stream, before the stream's drain. Under ``"paci"`` ~0; under ``"1f1b"`` about
      ``(N-1)/(m+N-1)``, since every batch is flushed.
    * ``paci/compute_fraction``, ``paci/comm_fraction``, ``paci/optimizer_fraction`` (``/stage_<s>``): forward +
      backward, posting sends, optimizer steps; the remainder is Lightning's own per-batch work.
    * ``paci/startup_idle_seconds``, ``paci/drain_idle_seconds`` (``/stage_<s>``): idle seconds while the pipeline
      filled and drained.

    Args:
        logging_interval: Lightning steps per window (default: the Trainer's ``log_every_n_steps``).

    Raises:
        ValueError: ``logging_interval < 1``.
        TypeError: at setup, if the Trainer's strategy is not ``PACIStrategy``.
    """

    def __init__(self, logging_interval: int | None = None) -> None:
        super().__init__(logging_interval)
        self._last: dict[str, dict[str, float]] | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = paci_strategy(trainer)
        self._writer = stage_writer(monitor_directory(trainer), strategy.stage_index, strategy.replica_index)
        self._last = _process_snapshot(strategy)

    def _log(self, trainer: L.Trainer) -> None:
        if self._writer is None or self._last is None:
            return
        strategy = paci_strategy(trainer)
        now = _process_snapshot(strategy)
        stage = strategy.stage_index
        self._write(trainer, {metric_tag(figure, stage): value
                              for figure, value in bubble_window_metrics(self._last, now).items()})
        self._last = now


def _process_snapshot(strategy: PipelineStrategy) -> dict[str, dict[str, float]]:
    """The process's time accounts: with virtual stages its stages run one action at a time, so their compute,
    waits, messages and steps add up, and the wall time of a phase is the longest any of them spent in it (each
    stage enters the steady phase at its own first backward); the figures are the process's (``stage_<p>`` is
    then the process's index, ``stage_index``)."""
    snapshots = [runtime.records.time_snapshot() for runtime in strategy.runtimes.values()]
    if len(snapshots) == 1:
        return snapshots[0]
    total: dict[str, dict[str, float]] = {}
    for snapshot in snapshots:
        for phase, accounts in snapshot.items():
            into = total.setdefault(phase, {})
            for category, seconds in accounts.items():
                combine = max if category == "wall" else float.__add__
                into[category] = combine(into.get(category, 0.0), seconds)
    return total
