"""``DriftMonitor``: per-stage version gap and relative weight drift of the micro-batches, in TensorBoard."""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning as L
from typing_extensions import override

from lightning_paci.callbacks.stage_monitor import (
    StageMonitor,
    metric_tag,
    monitor_directory,
    paci_strategy,
    stage_writer,
)
from lightning_paci.engine.runtime.records import BackwardRecord
from lightning_paci.schedules import build_schedule, chunk_drift_bounds, derived_drift_bound, static_tied_lags

__all__ = ["DriftMonitor", "drift_window_metrics"]


def drift_window_metrics(records: Sequence[BackwardRecord], bound: int) -> dict[str, float]:
    """Figures of one logging window from ``(micro-batch, version gap, relative weight drift, exact)`` records of
    the backwards that ran in it. Pure, so it is tested directly."""
    gaps = [r[1] for r in records]
    drifts = [r[2] for r in records if not math.isnan(r[2])]
    out = {"drift_max": float(max(gaps)), "drift_mean": sum(gaps) / len(gaps), "drift_bound": float(bound)}
    if drifts:
        out["weight_drift_max"] = max(drifts)
        out["weight_drift_mean"] = sum(drifts) / len(drifts)
        out["weight_drift_exact"] = float(all(r[3] for r in records if not math.isnan(r[2])))
    return out


class DriftMonitor(StageMonitor):
    """Log, for every pipeline stage and logging window, how inconsistent its micro-batches were.

    Each stage's own process writes its figures (no cross-stage synchronisation), under the tags:

    * ``paci/drift_max/stage_<s>``, ``paci/drift_mean/stage_<s>``: version gap of the micro-batches whose backward
      ran in the window: the number of this stage's optimizer steps between a micro-batch's forward and backward.
    * ``paci/drift_bound/stage_<s>``: the bound read from the stage's action list; ``ceil((N-1-s)/a)`` under
      ``"paci"``, 0 under flush schedules whose steps fall on mini-batch boundaries.
    * ``paci/weight_drift_max/stage_<s>``, ``paci/weight_drift_mean/stage_<s>``: ``||theta_B - theta_F|| /
      ||theta_B||`` over the stage's parameters, theta_F / theta_B the weights at the micro-batch's forward /
      backward. Measured without a copy of the weights (at most one tensor's transient copy, during the step).
      Exact when at most one step falls between forward and backward (``a >= N - 1``); otherwise the sum of the
      update norms, an upper bound, and ``paci/weight_drift_exact/stage_<s>`` is 0.
      With ``PACIStrategy(recompute="blocks")`` the gap and drift mean something more: the backward recomputes the
      stage's blocks at theta_B from their saved inputs (made at theta_F), so its activations inside the blocks
      are theta_B's while the upstream gradient and the block inputs are theta_F's ([Note: recomputation under
      PACI] in recompute.py); with stored activations the backward differentiates theta_F's forward exactly.
    * ``paci/tied_lag_max/stage_<N-1>``: with tied weights, how many updates behind the last stage's replica was.
    * ``paci/tied_lag_bound/stage_<N-1>``: the largest such lag the last stage's action list allows (read from the
      list: 1 for N = m = a = 8 under ``"paci"``, 4 for N = 8, m = a = 2; 0 under flush schedules with a = m).
    * ``paci/prediction_quality/stage_<s>``: under ``compensation="auto"``, from the update that decided on: the
      weight prediction's measured quality, ``1 - ||P - A|| / ||A||`` over its first updates (P the moves, A the
      weight changes the backwards then saw; 1 exact, 0 no closer than not predicting), and the prediction stays on
      where it is at least 0.1 ([Note: the prediction's quality] in optim/prediction_quality.py).

    With ``virtual_stages=v`` every stage of the ``v x P`` gets its figures (``stage_<s>``, written by the process
    running it), its bound read from its own actions in the process's list (docs/virtual-stages.md); under the V
    placement a tied weight is one Parameter, so there is no lag to report.

    Args:
        logging_interval: Lightning steps per window (default: the Trainer's ``log_every_n_steps``).
        weight_drift: measure the relative weight drift (steps the optimizer one tensor at a time, which is exact
            for per-parameter optimizers such as SGD, Adam and AdamW).

    Raises:
        ValueError: ``logging_interval < 1``.
        TypeError: at setup, if the Trainer's strategy is not ``PACIStrategy``.

    Example::

        trainer = L.Trainer(strategy="paci", devices=8, callbacks=[lightning_paci.DriftMonitor()])
    """

    def __init__(self, logging_interval: int | None = None, weight_drift: bool = True) -> None:
        super().__init__(logging_interval)
        self.weight_drift = weight_drift
        self._seen: dict[int, int] = {}  # per stage of this process: backwards already logged
        self._bound: dict[int, int] = {}
        self._seen_lags: dict[int, int] = {}
        self._tied_bound: dict[int, int] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = paci_strategy(trainer)
        self._writer = stage_writer(monitor_directory(trainer), strategy.stage_index, strategy.replica_index)
        tied, config = bool(strategy.plan.tied), strategy.config
        schedule = build_schedule(config.schedule, strategy.num_stages, strategy.num_microbatches,
                                  strategy.accumulation, 4 + 2 * strategy.accumulation, tied=tied,
                                  virtual_stages=config.virtual_stages, placement=config.placement,
                                  whole_batch=config.whole_batch_loss is not None)
        last, deferred = schedule.num_stages - 1, config.deferred_update
        # with virtual stages a stage's gaps are read off its actions in its process's order (the peak-based bound
        # assumes one backward between two forwards, which a process running several stages need not keep)
        exact = chunk_drift_bounds(schedule, deferred=deferred) if config.virtual_stages > 1 else None
        for stage, runtime in strategy.runtimes.items():
            records = runtime.records
            records.measure(weight_drift=self.weight_drift)
            own = schedule.stage_actions(stage)
            self._bound[stage] = exact[stage] if exact is not None else derived_drift_bound(
                own, strategy.accumulation, deferred=deferred)
            if tied and stage == last and runtime.tied:
                self._tied_bound[stage] = max(static_tied_lags(own).values(), default=0)
            self._seen[stage] = records.num_backwards
            self._seen_lags[stage] = records.tied_lags.count

    def _log(self, trainer: L.Trainer) -> None:
        if self._writer is None:
            return
        figures: dict[str, float] = {}
        for stage, runtime in paci_strategy(trainer).runtimes.items():
            records = runtime.records
            backwards = records.backwards_since(self._seen[stage])
            if not backwards:
                continue
            self._seen[stage] = records.num_backwards
            figures.update({metric_tag(figure, stage): value
                            for figure, value in drift_window_metrics(backwards, self._bound[stage]).items()})
            lags = records.tied_lags_since(self._seen_lags[stage])
            self._seen_lags[stage] = records.tied_lags.count
            if lags:
                figures[metric_tag("tied_lag_max", stage)] = max(lags)
            if stage in self._tied_bound:
                figures[metric_tag("tied_lag_bound", stage)] = self._tied_bound[stage]
            if records.prediction_quality is not None:  # [Note: the prediction's quality]
                figures[metric_tag("prediction_quality", stage)] = records.prediction_quality
        self._write(trainer, figures)
