"""The weight prediction's cost against the stage's own compute, on CUDA under ``compensation="auto"``.

[Note: the prediction's budget]
The weight prediction reads and writes ~120 bytes per parameter per compensated forward (AdamW with a known
gradient, float32 weights: tests/test_device_costs.py), while a transformer stage's forward and backward cost ~6
FLOPs per parameter and token. By arithmetic on an H200 (~200 FLOPs per byte of memory bandwidth; not measured
here) that is 25-50% of a stage's forward+backward at 8 x 1024 tokens per micro-batch, a few percent at 64k: whether
the compensation pays depends on the shape, so ``"auto"`` measures instead of assuming. On CUDA the stage times its
first compensated forward's move and way back with CUDA events, and at its next update -- after that update's one
host read ([Note: one host read per update]) the events are complete, so reading them waits for nothing -- compares
them with the mean forward+backward device time recorded so far ([Note: device clocks]). Above ``share`` (10%) the
prediction is switched off on that stage for the rest of the run, said once; ``compensation="predict"`` keeps it
whatever it costs. The decision is made once, at a point fixed by the action list, and is stage-local.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PREDICTION_SHARE", "PredictionTiming", "prediction_pays"]

PREDICTION_SHARE = 0.10  # the most of a forward+backward a compensated forward's move and way back may cost


class PredictionTiming:
    """Events around the first move and way back of a weight prediction (``WeightPrediction.timer``).

    Args:
        share: the budget, a fraction of the stage's mean forward+backward.
        event: the event factory (``torch.cuda.Event`` with timing on).
    """

    def __init__(self, share: float = PREDICTION_SHARE, event: Callable[[], Any] | None = None) -> None:
        self.share = share
        self._event = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))
        self.events: list[Any] = []  # move start, move end, way back start, way back end
        self.decided = False

    @property
    def timing(self) -> bool:
        """Whether the next move is timed (the first one only)."""
        return not self.decided and len(self.events) < 4

    def mark(self) -> None:
        event = self._event()
        event.record()
        self.events.append(event)

    def seconds(self) -> float:
        """The timed move's and way back's device seconds (the events must be complete)."""
        start, moved, back, done = self.events
        return (start.elapsed_time(moved) + back.elapsed_time(done)) / 1e3


def prediction_pays(runtime: Any) -> bool:
    """After an update's check: whether the stage's weight prediction stays on -- decided once, when the first
    compensated forward has been timed ([Note: the prediction's budget]), and said where it does not."""
    timer: PredictionTiming | None = runtime.prediction.timer
    if timer is None or timer.decided or len(timer.events) < 4:
        return True
    timer.decided = True
    spans: dict[str, list[float]] = {"F": [], "B": []}
    for interval in runtime.records.intervals:
        if interval.kind in spans:
            spans[interval.kind].append(interval.end - interval.start)
    if not spans["F"] or not spans["B"]:
        return True
    compute = sum(spans["F"]) / len(spans["F"]) + sum(spans["B"]) / len(spans["B"])
    cost = timer.seconds()
    if cost <= timer.share * compute:
        return True
    warnings.warn(f"lightning_paci: stage {runtime.stage}: the weight prediction costs {cost * 1e3:.2f} ms per "
                  f"compensated forward, {cost / compute:.0%} of the stage's forward+backward ({compute * 1e3:.2f} "
                  f"ms), more than {timer.share:.0%}: compensation is off on this stage after optimizer step "
                  f"{runtime.version + 1}. Longer micro-batches make it relatively cheaper; "
                  f"`PACIStrategy(compensation='predict')` keeps it on.", stacklevel=3)
    return False
