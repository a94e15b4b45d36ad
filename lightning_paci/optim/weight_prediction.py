"""Staleness compensation: forward a micro-batch with the weights its backward will use, without a weight copy.

[Note: exact weight prediction]
Under PACI a micro-batch forwarded on stage ``s`` is back-propagated ``k`` local updates later (``k`` is 0 or 1 at
``a = m``; the schedule says exactly which micro-batches cross an update, see ``schedules.static_drift``). Its
backward already runs with the *current* weights (see [Note: alias optimizer]), but its activations came from the
weights ``k`` updates older: the gradient mixes two versions, and the loss per update suffers, more at higher
learning rates (benchmarks/RESULTS.md). The weight prediction moves the weights, for that micro-batch's forward only, to
where the optimizer is about to take them, ``w + k * d``, and back afterwards:

* ``d`` is the optimizer's own next update for a predicted gradient: the part of the current window already
  accumulated in ``.grad``, scaled to the whole window (its known micro-batches' mean stands for the ones still
  to come). With nothing known the moments stay put and the step is ``-lr * buf`` (SGD) or ``-lr * m_hat /
  (sqrt(v_hat) + eps)`` (Adam/AdamW); with the whole window known it is
  exactly the optimizer's next step (tests/test_compensation.py). Nothing is stored: ``d`` comes from the
  optimizer's state and the gradients, which nothing changes during a forward, and from the group's current
  ``lr`` (the schedulers have already stepped). Weight decay (AdamW's ``-lr * wd * w``, the L2 term of SGD/Adam
  in the window's known part) is left out: it depends on the weights being moved, so the way back would differ
  from the way out and undoing it exactly would need a copy; it is ``lr * wd`` of a weight per update (1e-4 at
  lr 1e-3, wd 0.1), and momentum-carried decay of earlier windows is in the prediction.
* The move is done in place through the alias parameters, so no autograd version counter moves and the graphs of
  the other micro-batches in flight are untouched; the one forwarded keeps the storage, so its backward sees the
  updated weights as before.
* Undoing it is exact, bit for bit: ``w -> fl(w + d) -> fl(fl(w + d) - d)`` returns ``w`` except for the
  elements whose rounding lost information (1.5% to 10% of them, measured with AdamW: see [Note: weight prediction
  without host reads]); those are found when the move is made and kept (index and value) until the forward is
  over. ``d`` is recomputed for the way back (the same bits: it reads
  nothing the move or the forward changes), so the move costs transient memory of two chunks of elements plus
  the kept elements (``WeightPrediction.peak_extra_bytes``), never a parameter-sized buffer.

Everything here is a function of the list (``k``), the optimizer's state and the weights: the reference executor
and the processes compute the same bits whatever the timing.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["COMPENSATIONS", "COSTLY_LR", "WeightPrediction", "costly_regime", "prediction_unsupported",
           "weight_prediction_for"]

COMPENSATIONS = ("auto", "predict", "none")

_NOTHING = contextlib.nullcontext()
COSTLY_LR = 3e-3  # Adam(W) at a constant lr this high: compensated PACI measured +1.23% vs 1f1b (RESULTS.md)
_Direction = Callable[[dict, dict, float, torch.Tensor | None, float, float], torch.Tensor | None]


def _window_gradient(grad: torch.Tensor | None, group: dict, rest: float) -> torch.Tensor | None:
    """The window's gradient predicted from its known share: the part already accumulated in ``.grad`` (each
    micro-batch's share is already ``1/a``) scaled to the whole window, ``grad / (1 - rest)``, negated for
    ``maximize`` as the optimizer does before its moments see it; ``None`` when nothing is known yet. The known
    micro-batches' mean was measured at the current weights; the momentum's rate, the other candidate for the
    share still to come, lags the current gradient by ~1/(1-beta1) updates and predicted worse (RESULTS.md:
    +0.47% vs +0.11% at a constant 1e-3, +2.13% vs +1.23% at 3e-3). Always a new tensor."""
    if grad is None or rest >= 1.0:
        return None
    return grad * ((-1.0 if group.get("maximize") else 1.0) / (1.0 - rest))


def _sgd(state: dict, group: dict, scale: float, grad: torch.Tensor | None, rest: float,
         _count: float) -> torch.Tensor | None:
    """SGD's next update for the predicted window gradient (:func:`_window_gradient`); with nothing known the
    buffer stays ``buf`` (Nesterov's ``g + mu * buf`` too): ``-lr * buf``."""
    buf = state.get("momentum_buffer")
    if buf is None:
        return None
    mu, dampening = group["momentum"], group["dampening"]
    predicted = _window_gradient(grad, group, rest)
    if predicted is None:
        return buf * (-group["lr"] * scale)
    step = buf * mu
    step.add_(predicted, alpha=1 - dampening)  # the next momentum buffer
    if group["nesterov"]:
        step.mul_(mu).add_(predicted)
    return step.mul_(-group["lr"] * scale)


def _adam(state: dict, group: dict, scale: float, grad: torch.Tensor | None, rest: float,
          step: float) -> torch.Tensor | None:
    """Adam(W)'s next update for the predicted window gradient (:func:`_window_gradient`); with nothing known both
    moments stay where they are (up to the bias correction the next step applies) and the step is ``-lr * m_hat /
    (sqrt(v_hat) + eps)``; else the second moment takes the predicted gradient's square. (``maximize`` is
    already in the moments; weight decay is left out, see [Note: exact weight prediction].) ``step``: the state's step
    count, read on the host once (``WeightPrediction._step_counts``), never per chunk."""
    if not step:
        return None
    beta1, beta2 = group["betas"]
    lr, eps = group["lr"] * scale, group["eps"]
    predicted = _window_gradient(grad, group, rest)
    if predicted is None:  # -lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), scalars folded: four elementwise passes
        second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        root = math.sqrt(1 - beta2 ** step)
        denom = torch.sqrt(second).add_(eps * root)
        return torch.div(state["exp_avg"], denom).mul_(-lr * root / (1 - beta1 ** step))
    # the predicted gradient g (maximize: the moments hold -g), the next moments m' = beta1 m + (1 - beta1) g and
    # v' = beta2 (v + (1 - beta2) / beta2 g^2), and the step -lr / bc1' * m' / (sqrt(v') / sqrt(bc2') + eps) with
    # every scalar folded into one multiplication: six elementwise passes
    denom = torch.addcmul(state["exp_avg_sq"], predicted, predicted, value=(1 - beta2) / beta2)
    if group.get("amsgrad"):
        denom = torch.maximum(denom, state["max_exp_avg_sq"].div(beta2))
    root = math.sqrt(beta2 / (1 - beta2 ** (step + 1)))  # sqrt(v') / sqrt(bc2') = root * sqrt(denom)
    denom.sqrt_().add_(eps / root)
    update = predicted.add_(state["exp_avg"], alpha=beta1 / (1 - beta1)).div_(denom)  # m' / (1 - beta1) / ...
    update.mul_(-lr * (1 - beta1) / (1 - beta1 ** (step + 1)) / root)
    return update


def _direction_of(optimizer: torch.optim.Optimizer) -> _Direction | None:
    # exact types: a subclass may change the update (the weight prediction would then predict the wrong step)
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return _sgd if all(g["momentum"] for g in optimizer.param_groups) else None
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return _adam
    return None


def prediction_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the weight prediction cannot predict this optimizer's next update (``None`` if it can)."""
    kind = type(optimizer)
    if kind is torch.optim.SGD and not all(g["momentum"] for g in optimizer.param_groups):
        return ("SGD without momentum has no state to predict its next update from (every param group needs "
                "`momentum > 0`)")
    if _direction_of(optimizer) is None:
        return (f"{kind.__module__}.{kind.__qualname__} is not one of the optimizers whose next update it predicts "
                f"(torch.optim.SGD with momentum, torch.optim.Adam, torch.optim.AdamW)")
    if any(g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups):
        return "`differentiable=True` / `capturable=True` optimizers are not supported"
    return None


_SLICED = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # per-element state


@dataclass
class _Moved:
    """What undoing one weight prediction needs beyond the optimizer's state: the elements whose rounding lost
    information, per moved tensor (flat indices and their values before the move)."""

    scale: float
    rest: float
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]]  # pair index -> (flat indices (int32), values)
    kept_bytes: int


class WeightPrediction:
    """Moves a stage's weights to ``w + k * d`` for one forward and back (see [Note: exact weight prediction]).

    The work is elementwise and done a chunk at a time (``chunk`` elements: ``1/128`` of the stage's parameters,
    at least 4096), so its temporaries are two chunks, never a parameter-sized buffer.

    [Note: weight prediction without host reads]
    On an accelerator every host read of a device value waits for the device, so the host could never run ahead.
    Two reads were per chunk and forward: the optimizer's ``step`` count (``float(state["step"])``) and the elements
    the way back misses (``missed.any()``, then ``nonzero()``). The step counts are read once (all tensors in one
    read) and then kept on the host: a pre-step hook adds one for every parameter the optimizer is about to step,
    as Adam does, and a new ``step`` tensor (a first update, a resumed checkpoint) is noticed by identity and read
    again. With ``static`` (the default off the CPU) the missed elements are gathered with ``nonzero_static`` into
    ``capacity`` slots per chunk (a slot left over holds element 0 of the chunk with its value before the move,
    which the way back writes harmlessly), and whether any chunk missed more than ``capacity`` is an ``overflow``
    flag on the device, read with the stage's other checks before its next update (``take_overflow``). Measured
    on a tied GPT-2 with AdamW, the way back misses 1.5% (lr 1e-4) to 10% (3e-3) of the elements, at most 17% of a
    chunk of 1024 or more; ``capacity`` is a quarter of a chunk (transient: up to half the moved float32 bytes
    while a compensated forward runs, against the actual misses on the dynamic path). A chunk that missed more
    leaves the excess elements a rounding error off the unmoved weights: the runtime counts it
    (``inexact_reverts``) and warns once; the reference executor and the processes still compute the same bits.
    Without overflow the bits are the dynamic path's (tests/test_host_reads.py).

    Args:
        optimizer: the stage optimizer (its ``param_groups`` hold the aliases, see [Note: alias optimizer]).
        pairs: ``(alias, real)`` parameter pairs of the stage optimizer.
        gradient: use the window's gradient accumulated so far in the prediction (else the momentum alone).
        static: gather the missed elements without a host read (None: when the parameters are not on the CPU).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], *,
                 gradient: bool = True, static: bool | None = None) -> None:
        reason = prediction_unsupported(optimizer)
        if reason is not None:
            raise ValueError(f"compensation='predict': {reason}.")
        self.optimizer = optimizer
        self.direction: _Direction = _direction_of(optimizer)  # type: ignore[assignment]
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self.entries = [(alias, real, group_of[id(alias)]) for alias, real in pairs]
        self.gradient = gradient
        total = sum(alias.numel() for alias, _ in pairs)
        self.chunk = max(4096, -(-total // 128))
        self._temporaries = 2 * max((min(a.numel(), self.chunk) * a.element_size() for a, _ in pairs), default=0)
        # the most the weight prediction held beyond the model (bytes): kept elements plus two chunks of temporaries
        self.peak_extra_bytes = 0
        self.moves = 0  # forwards run ahead
        self.static = static if static is not None else any(a.device.type != "cpu" for a, _ in pairs)
        self.capacity = max(64, self.chunk // 4)  # missed elements kept per chunk on the static path
        self.inexact_reverts = 0  # updates before which an overflow was found (static path)
        self.overflow: torch.Tensor | None = None  # (): a chunk missed more than `capacity` since the last check
        # step counts on the host ([Note: weight prediction without host reads]): per entry, and the tensors they were
        # read from
        self._steps: list[float] = []
        self._step_tensors: list[object] = []
        if self.direction is _adam:
            optimizer.register_step_pre_hook(self._count_step)
        # called before each prediction: a stage's view of a process's optimizer puts its own update count's
        # hyperparameters in the groups (StageOptimizer.own_hyperparameters)
        self.before: Callable[[], None] | None = None

    def moved(self, k: int, rest: float = 1.0) -> contextlib.AbstractContextManager[None]:
        """A context in which the weights are ``k`` predicted updates ahead (nothing happens for ``k == 0``);
        ``rest``: the share of the current window's gradient not accumulated yet."""
        return _NOTHING if k <= 0 else self._ahead(k, rest)

    @contextlib.contextmanager
    def _ahead(self, k: int, rest: float) -> Iterator[None]:
        if self.before is not None:
            self.before()
        moved = self.apply(k, rest)
        self.moves += 1
        self.peak_extra_bytes = max(self.peak_extra_bytes, moved.kept_bytes + self._temporaries)
        try:
            yield
        finally:
            self.revert(moved)

    def _step_counts(self) -> list[float]:
        """Every entry's ``step`` count (0 without state), read from the device only when a ``step`` tensor is not
        the one last read (one read for all of them)."""
        if self.direction is not _adam:
            return self._steps
        tensors = [self.optimizer.state.get(alias, {}).get("step") for alias, _, _ in self.entries]
        if len(tensors) != len(self._step_tensors) or any(a is not b for a, b in zip(tensors, self._step_tensors)):
            present = [t for t in tensors if t is not None]
            values = iter(torch.stack([torch.as_tensor(t, dtype=torch.float64).reshape(()) for t in present])
                          .tolist() if present else [])
            self._steps = [next(values) if t is not None else 0.0 for t in tensors]
            self._step_tensors = tensors
        return self._steps

    def _count_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        """Before every optimizer step: the parameters with a gradient are stepped, so their counts go up by one."""
        if len(self._steps) == len(self.entries):
            for i, (alias, _, _) in enumerate(self.entries):
                if alias.grad is not None:
                    self._steps[i] += 1.0

    def inexact(self, who: str, before: str) -> None:
        """Count, and say once, that a way back left some elements a rounding error off (an overflow)."""
        self.inexact_reverts += 1
        if self.inexact_reverts == 1:
            warnings.warn(f"lightning_paci: {who}: a weight prediction lost more than {self.capacity} elements of a "
                          f"chunk on its way back (before {before}): those beyond are a rounding error off the unmoved "
                          f"weights ([Note: weight prediction without host reads]). Counted in `runtime.prediction."
                          f"inexact_reverts`; pass `PACIStrategy(compensation='none')` for no weight prediction.",
                          stacklevel=3)

    def take_overflow(self) -> torch.Tensor | None:
        """The static path's overflow flag since the last call (a 0-dim bool tensor, or None), and a fresh start."""
        flag, self.overflow = self.overflow, None
        return flag

    def _chunks(self, moved: _Moved) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """``(entry, start, weights chunk, delta chunk)`` for every parameter with optimizer state; the weights
        chunk is a flat view of the alias's storage (the alias's own version counter)."""
        steps = self._step_counts()
        for i, (alias, real, group) in enumerate(self.entries):
            state = self.optimizer.state.get(alias)
            if not state:
                continue
            step = steps[i] if steps else 0.0
            flat = alias.data.view(-1)  # (numel,)
            grad = real.grad if self.gradient else None  # (parameter shape), like the state
            if flat.numel() <= self.chunk:  # most tensors: one chunk, no slicing
                delta = self.direction(state, group, moved.scale, grad, moved.rest, step)
                if delta is not None:
                    yield i, 0, flat, delta.view(-1)
                continue
            grad = None if grad is None else grad.view(-1)
            for lo in range(0, flat.numel(), self.chunk):
                hi = lo + self.chunk
                part = {k: (v.view(-1)[lo:hi] if k in _SLICED and torch.is_tensor(v) else v) for k, v in state.items()}
                delta = self.direction(part, group, moved.scale, None if grad is None else grad[lo:hi], moved.rest,
                                       step)
                if delta is not None:
                    yield i, lo, flat[lo:hi], delta

    @torch.no_grad()
    def apply(self, k: int, rest: float = 1.0) -> _Moved:
        """Move every weight with optimizer state by ``k`` predicted updates; returns what :meth:`revert` needs."""
        moved = _Moved(float(k), rest, {}, 0)
        for i, lo, w, delta in self._chunks(moved):
            target = w + delta  # (chunk,)
            missed = torch.sub(target, delta, out=delta).ne_(w)  # (chunk,) where the way back misses w
            if self.static:
                self._keep_static(moved, i, lo, w, missed)
            elif missed.any():
                lost = missed.nonzero().view(-1)  # (lost,) positions
                values = w.index_select(0, lost)
                lost = lost.add_(lo).to(torch.int32 if lo + w.numel() < 2**31 else torch.int64)
                if i in moved.kept:
                    lost = torch.cat([moved.kept[i][0], lost])
                    values = torch.cat([moved.kept[i][1], values])
                moved.kept[i] = (lost, values)
            w.copy_(target)
            del target, missed
        moved.kept_bytes = sum(x.numel() * x.element_size() + v.numel() * v.element_size()
                               for x, v in moved.kept.values())
        return moved

    def _keep_static(self, moved: _Moved, i: int, lo: int, w: torch.Tensor, missed: torch.Tensor) -> None:
        """The missed elements of one chunk in ``capacity`` slots, no host read ([Note: a weight prediction without host
        reads]): spare slots hold the chunk's element 0 and its own value."""
        size = min(self.capacity, w.numel())
        lost = torch.nonzero_static(missed, size=size, fill_value=0).view(-1)  # (size,)
        values = w.index_select(0, lost)
        over = missed.sum() > size  # (): more missed than kept
        self.overflow = over if self.overflow is None else self.overflow | over
        lost = lost.add_(lo).to(torch.int32 if lo + w.numel() < 2**31 else torch.int64)
        if i in moved.kept:
            lost, values = torch.cat([moved.kept[i][0], lost]), torch.cat([moved.kept[i][1], values])
        moved.kept[i] = (lost, values)

    @torch.no_grad()
    def revert(self, moved: _Moved) -> None:
        """Undo :meth:`apply`: the weights are bit for bit those before it."""
        for _, _, w, delta in self._chunks(moved):  # the same bits as on the way out: nothing they read changed
            w.sub_(delta)
        for i, (lost, values) in moved.kept.items():
            self.entries[i][0].data.view(-1).index_copy_(0, lost.long(), values)


def weight_prediction_for(compensation: str, optimizer: torch.optim.Optimizer,
                  pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], *,
                  warn: Callable[[str], None] | None) -> WeightPrediction | None:
    """The stage's weight prediction for ``PACIStrategy(compensation=...)``: ``"none"`` -> none; ``"predict"`` -> one,
    or a ``ValueError`` naming why the optimizer is not supported; ``"auto"`` -> one when supported, else a
    ``warn``-ing (where the schedule has drift) that the run is not compensated."""
    if compensation not in COMPENSATIONS:
        raise ValueError(f"`compensation` must be one of {', '.join(map(repr, COMPENSATIONS))}, got "
                         f"{compensation!r}.")
    if compensation == "none":
        return None
    reason = prediction_unsupported(optimizer)
    if reason is None:
        return WeightPrediction(optimizer, pairs)
    if compensation == "predict":
        raise ValueError(f"`PACIStrategy(compensation='predict')`: {reason}. Use one of those optimizers or pass "
                         f"`compensation='none'`.")
    if warn is not None:
        warn(f"lightning_paci: no staleness compensation for this run: {reason}. PACI then loses some loss per "
             f"update to its drift (see docs/semantics.md); pass `compensation='none'` to "
             f"silence this warning.")
    return None


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
