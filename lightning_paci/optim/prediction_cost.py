"""The weight prediction's cost against the stage's own compute, on CUDA under ``compensation="auto"``.

[Note: the prediction's budget]
The weight prediction's multi-tensor passes read and write ~120 bytes per parameter per compensated forward (AdamW
with a known gradient, float32 weights, move and way back: tests/test_device_costs.py); the fused pass, the default
on CUDA, 40 (20 each way: [Note: the fused prediction pass]). A transformer stage's forward and backward cost ~6
FLOPs per parameter and token. By arithmetic at ~120 FLOPs per byte of memory bandwidth (an H100 at 40% of its
bf16 peak; not measured here) that is ~2400/T of a stage's forward+backward for T tokens per micro-batch on the
multi-tensor passes (29% at 8 x 1024 tokens), ~800/T fused (10%), a few percent at 64k: whether the compensation
pays depends on the shape, so ``"auto"`` measures instead of assuming. On CUDA the stage times its
first compensated forward's move and way back with CUDA events, and at its next update -- after that update's one
host read ([Note: one host read per update]) the events are complete, so reading them waits for nothing -- compares
them with the mean forward+backward device time recorded so far ([Note: device clocks]). Above ``share`` (10%) the
prediction is switched off on that stage for the rest of the run, said once; ``compensation="predict"`` keeps it
whatever it costs. The decision is made once, at a point fixed by the action list, and is stage-local. The same
call, after every update's check, applies the decision ``"auto"`` makes from the prediction's measured quality on
every device ([Note: the prediction's quality] in optim/prediction_quality.py): there the point, the figure and so
the outcome are fixed by the list and the weights, not by timing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_paci.optim.prediction_quality import PredictionQuality

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
    """After an update's check: whether the stage's weight prediction stays on -- decided once from its measured
    quality ([Note: the prediction's quality]) and, on CUDA, once the first compensated forward has been timed
    ([Note: the prediction's budget]); said where it does not."""
    quality: PredictionQuality | None = runtime.prediction.quality
    verdict = quality.verdict() if quality is not None else None
    if quality is not None and verdict is not None:
        value, keep = verdict
        runtime.records.prediction_quality = value
        if not keep:
            warnings.warn(f"lightning_paci: stage {runtime.stage}: the weight prediction's quality is {value:.3f} "
                          f"(1 - ||predicted - actual|| / ||actual|| over the weight changes of its first "
                          f"{quality.measured} compensated forwards), below {quality.minimum}: it does not bring the "
                          f"forwards closer to the weights their backwards use, so compensation is off on this stage "
                          f"after optimizer step {runtime.version + 1}. `PACIStrategy(compensation='predict')` keeps "
                          f"it on.", stacklevel=3)
            return False
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
