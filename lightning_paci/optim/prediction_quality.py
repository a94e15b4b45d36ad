"""How well a stage's weight prediction predicts, measured while it trains; ``compensation="auto"`` decides from it.

[Note: the prediction's quality]
The weight prediction ([Note: weight prediction]) is worth its moves only where the weights it forwards with are
closer to the weights the micro-batch's backward uses than the unmoved weights are. Whether they are depends on the
model, the data and the optimizer's settings (how much of a window's gradient the known micro-batches predict, how
fast the moments turn), not on the optimizer alone, so ``"auto"`` measures it on every stage from the run itself:

* for a compensated forward of micro-batch ``j`` on stage ``s``, crossing ``k`` updates: ``w_F`` the weights before
  the move, ``P`` the move the prediction applied, ``A = w_B - w_F`` the change the next ``k`` updates actually
  made (``w_B``: the weights its backward uses, read before the update after them, so replica averages and other
  update hooks are in it). Predicting moved the forward's weights from a distance ``||A||`` of ``w_B`` to
  ``||P - A||``;
* the stage's figure over its first ``WINDOW`` (8) updates, ratio of sums so that each micro-batch counts with its
  drift: ``quality = 1 - sqrt(sum ||P - A||^2 / sum ||A||^2)``: 1 for an exact prediction, 0 where it leaves the
  forward as far from ``w_B`` as not predicting, below 0 where it moves it farther. Every compensated forward
  made before the stage's ``WINDOW``-th update is measured;
* **the rule**: at the first update check after the ``WINDOW``-th update with no measured micro-batch still in
  flight, the stage keeps the prediction if ``quality >= QUALITY_MIN`` (0.1: the move must take the forward at
  least a tenth of the way; below that it buys little and still costs its passes each forward -- on a GPU its
  memory traffic, [Note: the prediction's budget]) and switches it off for the rest of the run otherwise, saying so
  once, with the figure and the threshold. A stage none of whose forwards crossed an update (the last) has no
  figure and nothing to decide. ``"predict"`` measures nothing and keeps the prediction.

What it costs: the distances are taken over a fixed sample of the stage's weights, every ``stride``-th element of
the stage's tensors laid end to end (all of them up to ``SAMPLE`` elements, 2^18): two sample-sized buffers per
measured micro-batch in flight (2 MiB in float32), a few kernels per measured forward and per update, whatever the
number of tensors (one ``cat`` of strided views per sample), and nothing per forward once decided. Nothing is read
from the device while measuring: the two sums stay there and are read in the update check's one host read ([Note:
one host read per update]) of the update that decides. Everything is a function of the action list, the weights and
the optimizer state, so the reference executor and the processes decide alike, at the same update. Each
data-parallel replica measures its own forwards (its known gradient is its own until the step's average); a
resumed run measures again from its first update (the figure is not in the checkpoint).

``costly_regime`` names, at setup, the recipe where the prediction is known from measurements not to be enough.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["COSTLY_LR", "QUALITY_MIN", "SAMPLE", "WINDOW", "PredictionQuality", "costly_regime", "sampled"]

WINDOW = 8  # updates whose compensated forwards are measured before the decision
QUALITY_MIN = 0.1  # the least share of the drift's distance the prediction must remove to stay on
SAMPLE = 1 << 18  # at most this many weight elements per stage are compared
COSTLY_LR = 3e-3  # Adam(W) at a constant lr this high: compensated PACI measured +1.23% vs 1f1b (RESULTS.md)


def sampled(weights: Sequence[torch.Tensor], limit: int = SAMPLE) -> list[tuple[torch.Tensor, int, int]]:
    """``(tensor, first, stride)`` per tensor with elements in the sample: every ``stride``-th element of the
    tensors laid end to end, ``stride = ceil(total / limit)`` (each tensor gets its share of the sample)."""
    total = sum(w.numel() for w in weights)
    stride = max(1, math.ceil(total / limit))
    out, start = [], 0
    for w in weights:
        first = -start % stride
        if first < w.numel():
            out.append((w, first, stride))
        start += w.numel()
    return out


class PredictionQuality:
    """The measurement and the decision of [Note: the prediction's quality] for one stage
    (``WeightPrediction.quality``).

    Args:
        weights: the stage's weights the prediction moves (the real parameters of its pairs).
        window: updates whose compensated forwards are measured. minimum: ``QUALITY_MIN``. limit: ``SAMPLE``.
    """

    def __init__(self, weights: Sequence[torch.Tensor], *, window: int = WINDOW, minimum: float = QUALITY_MIN,
                 limit: int = SAMPLE) -> None:
        self.window, self.minimum = window, minimum
        self._views = sampled(weights, limit)
        self.updates = 0  # update checks passed
        self.measured = 0  # measured micro-batches completed
        self.value: float | None = None  # the figure, once decided (None: nothing measured)
        self.decided, self.keep = False, True
        self._said = False
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (update count at backward, w_F, moved)
        self._started: tuple[int, torch.Tensor] | None = None
        self._sums: list[torch.Tensor] = []  # sum ||P - A||^2, sum ||A||^2 (float64, on the weights' device)
        self._reading = False

    @property
    def measuring(self) -> bool:
        """Whether a compensated forward now is measured (before the ``window``-th update, not decided)."""
        return not self.decided and self.updates < self.window and bool(self._views)

    def sample(self) -> torch.Tensor:
        """The sampled elements of the weights as they are now (a new flat tensor)."""
        return torch.cat([w.detach().reshape(-1)[first::stride] for w, first, stride in self._views])

    def start(self, k: int) -> None:
        """Before the move of a forward crossing ``k`` updates: keep ``w_F``'s sample."""
        self._started = (self.updates + k, self.sample())

    def moved(self, did: bool) -> None:
        """After the move (``did``: whether it moved anything; before the first update there is no state)."""
        if self._started is not None and did:
            self._pending.append((*self._started, self.sample()))
        self._started = None

    def before_update(self) -> list[torch.Tensor]:
        """At an update's check, before the step: complete the measured micro-batches whose backward has run (the
        weights are still the ones it used), and return the device figures to read with the check at the update
        that decides (else nothing)."""
        if self.decided:
            return []
        due = [entry for entry in self._pending if entry[0] <= self.updates]
        if due:
            self._pending = [entry for entry in self._pending if entry[0] > self.updates]
            now = self.sample()
            for _, before, moved in due:
                actual = now - before
                error = (moved - before) - actual
                sums = [error.double().square().sum(), actual.double().square().sum()]
                self._sums = sums if not self._sums else [a + b for a, b in zip(self._sums, sums)]
            self.measured += len(due)
        if self.updates < self.window or self._pending:
            return []
        if not self._sums:  # no forward of this stage crossed an update
            self.decided = True
            return []
        self._reading = True
        return list(self._sums)

    def after_update(self, read: Sequence[float]) -> None:
        """After the step: one more update; ``read``: the figures ``before_update`` asked for, read with the check."""
        self.updates += 1
        if not self._reading:
            return
        error, drift = read
        self.value = 1.0 - math.sqrt(error / drift) if drift > 0 else (1.0 if error == 0 else -math.inf)
        self.keep = self.value >= self.minimum
        self.decided, self._reading, self._sums = True, False, []

    def verdict(self) -> tuple[float | None, bool] | None:
        """``(figure, keep)`` once, right after the update that decided; None before and after."""
        if not self.decided or self._said:
            return None
        self._said = True
        return self.value, self.keep


def costly_regime(optimizer: torch.optim.Optimizer, schedulers: Sequence[object]) -> str | None:
    """Why this configuration is in the regime where PACI, even compensated, loses loss per update (``None`` if
    it is not): Adam/AdamW at a constant learning rate of at least ``COSTLY_LR`` with no step scheduler. Measured
    (benchmarks/RESULTS.md, 3 seeds, 8 stages): AdamW at a constant 3e-3 ends +1.23% above 1f1b after 200
    updates (uncompensated +6.48%), at a constant 1e-3 +0.11%, with a warm-up and a decay +0.17% or less: the
    prediction's error grows with the step, which the step's size and the unseen part of the window set."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or schedulers:
        return None
    lr = max(float(group["lr"]) for group in optimizer.param_groups)
    if lr < COSTLY_LR:
        return None
    return (f"lightning_paci: {type(optimizer).__name__} at a constant lr={lr:g} without a learning-rate "
            f"scheduler: in this regime PACI loses loss per update to its drift even with compensation (measured "
            f"at a constant 3e-3: +1.2% loss vs the flush schedule after 200 updates; at 1e-3: +0.1%; with a "
            f"warm-up and a decay: +0.2% or less; benchmarks/RESULTS.md). Add a warm-up and a decay "
            f"(a step-interval scheduler), use lr <= 1e-3, or `schedule='1f1b'` for this recipe.")
