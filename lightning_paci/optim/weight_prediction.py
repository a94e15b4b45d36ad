"""Staleness compensation: forward a micro-batch with the weights its backward will use, without a weight copy.

[Note: weight prediction]
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
  from the way out; it is ``lr * wd`` of a weight per update (1e-4 at lr 1e-3, wd 0.1), and momentum-carried
  decay of earlier windows is in the prediction.
* The move is done in place through the alias parameters, so no autograd version counter moves and the graphs of
  the other micro-batches in flight are untouched; the one forwarded keeps the storage, so its backward sees the
  updated weights as before.
* The way back subtracts the same ``d``, recomputed (the same bits: it reads nothing the move or the forward
  changes): ``w -> fl(w + d) -> fl(fl(w + d) - d)``. That is ``w`` again except where the first rounding dropped
  low bits of ``w`` (1.5% to 10% of the elements with AdamW at lr 1e-4 to 3e-3: where ``w + d`` reaches a larger
  binade than ``w``, or falls on a tie), and there it is off by at most **one unit in the last place of the
  larger of** ``|w|`` **and** ``|w + d|`` (tests/test_compensation.py): the size of the rounding the optimizer's
  own update makes when it adds its step to ``w``, unbiased (round to nearest even). Keeping those bits would
  need ``w``, ``fl(w + d)`` and ``d`` at once, a third temporary and a gather per pass; a float32 weight moves by
  ~1e-7 of itself per compensated forward at most. The weight prediction therefore needs float32 or float64
  weights: in bfloat16 a unit in the last place is 0.8% of a weight (``precision="bf16-mixed"`` keeps float32
  weights; ``"bf16-true"`` runs uncompensated, said at setup).

[Note: weight prediction in multi-tensor passes]
On a GPU every elementwise operation is a kernel launch costing microseconds of host time, so the move is made in a
few passes that each take many tensors (``torch._foreach_*``: on CUDA one launch per pass for up to ~100 tensors),
never per tensor or per slice. The passes run over *bins* of the stage's tensors: a bin holds at most half the
bytes of the stage's largest parameter tensor (a larger tensor is cut into flat slices across bins), because
Adam's prediction with a known gradient needs two temporaries of the bin's size (its numerator and its
denominator): the transient memory is at most the stage's largest parameter tensor (``peak_extra_bytes``). Every
scalar is folded on the host, from the step counts kept there ([Note: step counts on the host]). Passes per bin,
each way: SGD 1 (nothing known) or 2; Adam 3 (nothing known) or 5 (6 with ``amsgrad``). One GPT-2-small block
with AdamW: 7 bins, 70 operations per move and way back, 5.8 per parameter tensor, ~120 bytes read and written per
parameter (tests/test_device_costs.py).

On CUDA (where ``torch.compile`` generates Triton kernels; ``WeightPrediction(fused=...)`` elsewhere) the move and
the way back are instead *one* compiled pass per bin each, the same formula with every scalar in a small table
copied to the device once per move, and no temporary ([Note: the fused prediction pass] in
optim/fused_prediction.py): for that block 5 bins, 5 kernels each way and one scalar copy per move, 20 bytes read
and written per parameter each way (tests/test_fused_prediction.py). A tensor whose weights, state or gradient
are not contiguous, and every tensor after a pass failed to compile (said once), take the multi-tensor passes; the
CPU keeps them by default.

[Note: step counts on the host]
Adam's bias corrections need each tensor's ``step``; reading it from the device per forward would stop the host
from running ahead. The step counts are read once (all tensors in one read) and then kept on the host: a pre-step
hook adds one for every parameter the optimizer is about to step, as Adam does, and a new ``step`` tensor (a first
update, a resumed checkpoint) is noticed by identity and read again.

Everything here is a function of the list (``k``), the optimizer's state and the weights: the reference executor
and the processes compute the same bits whatever the timing.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_paci.optim.fused_prediction import (
    ADAM,
    MOST_SLICES,
    SGD,
    FusedPass,
    PassSignature,
    chunks,
    cuts,
    fused_by_default,
    fused_pass,
    kind_of,
    scalar_row,
    scalar_table,
)
from lightning_paci.optim.prediction_quality import PredictionQuality

__all__ = ["COMPENSATIONS", "WeightPrediction", "prediction_unsupported", "weight_prediction_for"]

COMPENSATIONS = ("auto", "predict", "none")

_NOTHING = contextlib.nullcontext()
_WEIGHT_DTYPES = (torch.float32, torch.float64)
_SCRATCH = 2**20  # elements a fused bin may hold at least (its compile's scratch weights): more if a tensor is larger


@dataclass
class _Bin:
    """Slices of the stage's tensors moved by the same passes: ``key`` holds the hyperparameters the passes take
    as one scalar (a fused bin: its compiled signature); per slice the weights, the state and gradient read, and the
    scalars folded per tensor."""

    key: tuple
    known: bool  # the window's gradient is part of the prediction
    room: int  # bytes left
    weights: list[torch.Tensor] = field(default_factory=list)
    first: list[torch.Tensor] = field(default_factory=list)  # SGD: momentum buffer; Adam: exp_avg
    second: list[torch.Tensor] = field(default_factory=list)  # Adam: exp_avg_sq
    peak: list[torch.Tensor] = field(default_factory=list)  # Adam with amsgrad: max_exp_avg_sq
    grads: list[torch.Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)  # the step's factor per slice
    eps: list[float] = field(default_factory=list)  # Adam: the denominator's epsilon per slice
    alpha: float = 0.0  # the gradient's (or the moment's) weight in the numerator
    square: float = 0.0  # Adam with a known gradient: the squared gradient's weight in the second moment
    beta2: float = 1.0
    # a fused bin ([Note: the fused prediction pass]): its compiled pass, its slices' rows of scalars, and the
    # move's table of them on the device (``[2, slices, ROW]``: the move's and the way back's)
    fused: FusedPass | None = None
    rows: list[tuple[float, ...]] = field(default_factory=list)
    scalars: torch.Tensor | None = None


@dataclass
class _Moved:
    """One tensor a move takes: the key of its multi-tensor bins, its tensors and its folded scalars."""

    key: tuple
    group: dict
    weight: torch.Tensor
    first: torch.Tensor
    second: torch.Tensor | None
    peak: torch.Tensor | None
    grad: torch.Tensor | None
    factor: float
    eps: float


def _slices(tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``tensor`` itself when ``[lo, hi)`` is all of it, else that flat slice (a view: no copy, no kernel)."""
    return tensor if lo == 0 and hi == tensor.numel() else tensor.view(-1)[lo:hi]


def _flat(tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The flat slice ``[lo, hi)`` of a contiguous tensor, always one-dimensional (a view: the fused pass's input)."""
    return tensor.view(-1)[lo:hi]


def prediction_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the weight prediction cannot predict this optimizer's next update (``None`` if it can)."""
    kind = type(optimizer)
    if kind is torch.optim.SGD and not all(g["momentum"] for g in optimizer.param_groups):
        return ("SGD without momentum has no state to predict its next update from (every param group needs "
                "`momentum > 0`)")
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):  # a subclass may change the update
        return (f"{kind.__module__}.{kind.__qualname__} is not one of the optimizers whose next update it predicts "
                f"(torch.optim.SGD with momentum, torch.optim.Adam, torch.optim.AdamW)")
    if any(g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups):
        return "`differentiable=True` / `capturable=True` optimizers are not supported"
    dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"]} - set(_WEIGHT_DTYPES)
    if dtypes:
        return (f"it needs float32 or float64 weights, and this stage has {', '.join(sorted(map(str, dtypes)))} "
                f"ones (its way back is within one unit in the last place: 0.8% of a bfloat16 weight per forward; "
                f"`precision='bf16-mixed'` keeps float32 weights)")
    return None


class WeightPrediction:
    """Moves a stage's weights to ``w + k * d`` for one forward and back (see [Note: weight prediction]), in one
    compiled pass per bin ([Note: the fused prediction pass]) or a few multi-tensor passes ([Note: weight prediction
    in multi-tensor passes]).

    Args:
        optimizer: the stage optimizer (its ``param_groups`` hold the aliases, see [Note: alias optimizer]).
        pairs: ``(alias, real)`` parameter pairs of the stage optimizer (its own list: pairs it gains later are
            moved from the next move on).
        gradient: use the window's gradient accumulated so far in the prediction (else the momentum alone).
        fused: one compiled pass per bin (``None``: on CUDA where ``torch.compile`` generates Triton kernels, else
            the multi-tensor passes); a pass that fails to compile falls back to the multi-tensor passes, said once.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], *,
                 gradient: bool = True, fused: bool | None = None) -> None:
        reason = prediction_unsupported(optimizer)
        if reason is not None:
            raise ValueError(f"compensation='predict': {reason}.")
        self.optimizer = optimizer
        self.adam = type(optimizer) is not torch.optim.SGD
        # the stage optimizer's own list: a param group added while training (a fine-tuning schedule's,
        # ``StageOptimizer.add_param_group``) appends its pairs there, and the next move takes them in
        self._pairs = pairs
        self.entries: list[tuple[nn.Parameter, nn.Parameter, dict]] = []
        self.gradient = gradient
        self.bin_bytes = 1024
        # the most the weight prediction held beyond the model (bytes): its temporaries
        self.peak_extra_bytes = 0
        self.moves = 0  # forwards run ahead
        # step counts on the host ([Note: step counts on the host]): per entry, and the tensors they were read from
        self._steps: list[float] = []
        self._step_tensors: list[object] = []
        if self.adam:
            optimizer.register_step_pre_hook(self._count_step)
        # called before each prediction: a stage's view of a process's optimizer puts its own update count's
        # hyperparameters in the groups (StageOptimizer.own_hyperparameters)
        self.before: Callable[[], None] | None = None
        # on CUDA under compensation="auto": times the first move and way back (optim/prediction_cost.py,
        # [Note: the prediction's budget])
        self.timer: Any = None
        # under compensation="auto": measures how close the moves come ([Note: the prediction's quality])
        self.quality: PredictionQuality | None = None
        self._follow_groups()
        self.fused = fused if fused is not None else fused_by_default([alias.device for alias, _, _ in self.entries])

    def _follow_groups(self) -> None:
        """Take in the pairs joined since the last move (all of them at construction), each with its group."""
        if len(self._pairs) == len(self.entries):
            return
        group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        self.entries += [(alias, real, group_of[id(alias)]) for alias, real in self._pairs[len(self.entries):]]
        largest = max((alias.numel() * alias.element_size() for alias, _, _ in self.entries), default=0)
        self.bin_bytes = max(self.bin_bytes, largest // 2)  # two temporaries of a bin's size: the largest tensor's
        self._step_tensors = []  # the step counts are read again, with the new entries', at the next move

    def moved(self, k: int, rest: float = 1.0) -> contextlib.AbstractContextManager[None]:
        """A context in which the weights are ``k`` predicted updates ahead (nothing happens for ``k == 0``);
        ``rest``: the share of the current window's gradient not accumulated yet."""
        return _NOTHING if k <= 0 else self._ahead(k, rest)

    @contextlib.contextmanager
    def _ahead(self, k: int, rest: float) -> Iterator[None]:
        if self.before is not None:
            self.before()
        timer = self.timer if self.timer is not None and self.timer.timing and self.optimizer.state else None
        if (probe := self.quality if self.quality is not None and self.quality.measuring else None) is not None:
            probe.start(k)  # [Note: the prediction's quality], outside the timed move
        if timer is not None and self.fused:
            self._bins(float(k), rest)  # a fused pass's first compile, outside the timed move
        if timer is not None:
            timer.mark()
        bins = self.apply(k, rest)
        if timer is not None:
            timer.mark()
        if probe is not None:
            probe.moved(bool(bins))
        self.moves += 1
        try:
            yield
        finally:
            if timer is not None:
                timer.mark()
            self.revert(bins)
            if timer is not None:
                timer.mark()

    @torch.no_grad()
    def apply(self, k: int, rest: float = 1.0) -> list[_Bin]:
        """Move every weight with optimizer state by ``k`` predicted updates; returns what :meth:`revert` needs
        (the bins: views and scalars, no tensor of its own)."""
        bins = self._bins(float(k), rest)
        self._move(bins, 1.0)
        return bins

    @torch.no_grad()
    def revert(self, bins: list[_Bin]) -> None:
        """Undo :meth:`apply`: every weight within one unit in the last place of where it was ([Note: weight
        prediction])."""
        self._move(bins, -1.0)

    @torch.no_grad()
    def _move(self, bins: list[_Bin], sign: float) -> None:
        """Add ``sign * d`` to every bin's weights; the move (``sign > 0``) first puts the fused bins' scalars on the
        device, one table per dtype and device with the way back's rows too."""
        if sign > 0:
            self._scalars(bins)
        for one in bins:
            if one.fused is None:
                self._pass(one, sign)
            else:
                assert one.scalars is not None
                one.fused(one.weights, one.first, one.second, one.peak, one.grads, one.scalars[0 if sign > 0 else 1])

    def _scalars(self, bins: list[_Bin]) -> None:
        """One host-to-device copy per dtype and device for the fused bins' rows; each bin gets its view."""
        tables: dict[tuple, list[_Bin]] = {}
        for one in bins:
            if one.fused is not None:
                tables.setdefault((one.fused.signature.dtype, one.fused.signature.device), []).append(one)
        for (dtype, device), members in tables.items():
            table = scalar_table([row for one in members for row in one.rows], dtype, device)
            self.peak_extra_bytes = max(self.peak_extra_bytes, table.numel() * table.element_size())
            start = 0
            for one in members:
                one.scalars = table[:, start:start + len(one.rows)]
                start += len(one.rows)

    def _pass(self, one: _Bin, sign: float) -> None:
        """Add ``sign * d`` to the bin's weights: the same operations both ways, so ``d`` has the same bits."""
        if not self.adam:
            if not one.known:  # -lr * buf: no temporary
                torch._foreach_add_(one.weights, one.first, alpha=sign * one.scales[0])
                return
            step = torch._foreach_add(one.first, one.grads, alpha=one.alpha)  # buf + beta * g
            self._held(step)
            torch._foreach_add_(one.weights, step, alpha=sign * one.scales[0])
            return
        scales = [sign * s for s in one.scales]
        if not one.known:  # -lr / bc1 * m / (sqrt(v) + eps * sqrt(bc2)), sqrt(bc2) folded into the scale
            denom = torch._foreach_sqrt(one.peak or one.second)
            torch._foreach_add_(denom, one.eps)
            self._held(denom)
            torch._foreach_addcdiv_(one.weights, one.first, denom, scales)
            return
        # the next moments for the predicted gradient p = c * g: v' = beta2 v + (1 - beta2) p^2 (amsgrad: the
        # maximum with max_exp_avg_sq), m' = (1 - beta1) c (g + beta1 / ((1 - beta1) c) m); the step
        # -lr / bc1' * m' / (sqrt(v') / sqrt(bc2') + eps), every scalar folded into `scales` and `eps`
        if one.peak:
            denom = torch._foreach_mul(one.second, one.beta2)
            torch._foreach_addcmul_(denom, one.grads, one.grads, value=one.square * one.beta2)
            torch._foreach_maximum_(denom, one.peak)
        else:  # v' / beta2, its square root's factor in `scales` and `eps`
            denom = torch._foreach_addcmul(one.second, one.grads, one.grads, value=one.square)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, one.eps)
        numerator = torch._foreach_add(one.grads, one.first, alpha=one.alpha)
        self._held(denom, numerator)
        torch._foreach_addcdiv_(one.weights, numerator, denom, scales)

    def _held(self, *temporaries: Sequence[torch.Tensor]) -> None:
        held = sum(t.numel() * t.element_size() for tensors in temporaries for t in tensors)
        self.peak_extra_bytes = max(self.peak_extra_bytes, held)

    def _bins(self, scale: float, rest: float) -> list[_Bin]:
        """Every moved tensor's slices in bins: fused ones ([Note: the fused prediction pass]) where the fused pass is
        on and the tensor is contiguous, else bins of at most ``bin_bytes`` per temporary, one kind of pass and one
        set of scalar hyperparameters per bin."""
        moved = self._moved(scale, rest)
        fusable = [m for m in moved if self.fused and _contiguous(m)]
        bins = self._fused_bins(fusable, rest) if fusable else []
        if bins is None:  # the compile failed: said once, the multi-tensor passes from now on
            fusable, bins = [], []
        if len(fusable) < len(moved):
            taken = {id(m) for m in fusable}
            bins += self._packed([m for m in moved if id(m) not in taken], rest)
        return bins

    def _moved(self, scale: float, rest: float) -> list[_Moved]:
        """Every tensor the move takes (with optimizer state that predicts a step), its tensors and scalars."""
        self._follow_groups()
        steps = self._step_counts()
        moved: list[_Moved] = []
        known_share = rest < 1.0 and self.gradient
        for i, (alias, real, group) in enumerate(self.entries):
            state = self.optimizer.state.get(alias)
            if not state:
                continue
            grad = real.grad if known_share else None
            folded = self._fold(state, group, scale, rest, steps[i] if steps else 0.0, grad is not None)
            if folded is None:
                continue
            key, factor, eps = folded
            key = (*key, grad is not None, alias.device, alias.dtype)
            second = state["exp_avg_sq"] if self.adam else None
            peak = state["max_exp_avg_sq"] if self.adam and group.get("amsgrad") else None
            moved.append(_Moved(key, group, alias.data, state["momentum_buffer" if not self.adam else "exp_avg"],
                                second, peak, grad, factor, eps))
        return moved

    def _packed(self, moved: list[_Moved], rest: float) -> list[_Bin]:
        """Bins for the multi-tensor passes: at most ``bin_bytes`` per temporary, a tensor cut across bins."""
        open_bins: dict[tuple, _Bin] = {}
        bins: list[_Bin] = []
        for m in moved:
            size, numel = m.weight.element_size(), m.weight.numel()
            lo = 0
            while lo < numel:
                one = open_bins.get(m.key)
                if one is None or one.room < size:
                    one = open_bins[m.key] = _Bin(m.key, m.grad is not None, self.bin_bytes)
                    self._hyperparameters(one, m.group, rest)
                    bins.append(one)
                hi = min(numel, lo + one.room // size)
                one.room -= (hi - lo) * size
                one.weights.append(_slices(m.weight, lo, hi))
                one.first.append(_slices(m.first, lo, hi))
                if m.second is not None:
                    one.second.append(_slices(m.second, lo, hi))
                if m.peak is not None:
                    one.peak.append(_slices(m.peak, lo, hi))
                if m.grad is not None:
                    one.grads.append(_slices(m.grad, lo, hi))
                one.scales.append(m.factor)
                one.eps.append(m.eps)
                lo = hi
        return bins

    def _fused_bins(self, moved: list[_Moved], rest: float) -> list[_Bin] | None:
        """Bins of the fused pass: per kind, dtype and device, the tensors cut into slices of few common lengths
        (``fused_prediction.cuts``), each length's slices in bins of at most ``MOST_SLICES`` slices and of at most
        the largest tensor's size or 2^20 elements (the compile's scratch); every signature compiled before any
        weight moves (``None`` where one fails)."""
        groups: dict[tuple, list[_Moved]] = {}
        for m in moved:
            kind = kind_of(self.adam, m.grad is not None, bool(m.group.get("amsgrad")))
            groups.setdefault((kind, m.weight.dtype, m.weight.device), []).append(m)
        most = max(_SCRATCH, *(m.weight.numel() for m in moved))  # elements per bin: the compile's scratch
        bins: list[_Bin] = []
        for (kind, dtype, device), members in groups.items():
            rows = [self._row(kind, m, rest) for m in members]
            lengths: dict[int, list[tuple[int, int, int]]] = {}  # length -> (member, lo, hi)
            for j, pieces in enumerate(cuts([m.weight.numel() for m in members], members[0].weight.element_size())):
                for lo, hi in pieces:
                    lengths.setdefault(hi - lo, []).append((j, lo, hi))
            for length, slices in lengths.items():
                start = 0
                for count in chunks(len(slices), max(1, min(MOST_SLICES, most // length))):
                    signature = PassSignature(kind, count, length, dtype, device)
                    one = _Bin(signature, kind not in (SGD, ADAM), 0, fused=fused_pass(signature))
                    for j, lo, hi in slices[start:start + count]:
                        m = members[j]
                        one.weights.append(_flat(m.weight, lo, hi))
                        one.first.append(_flat(m.first, lo, hi))
                        if kind == ADAM:  # nothing known: amsgrad's max_exp_avg_sq in exp_avg_sq's place
                            read = m.peak if m.peak is not None else m.second
                            assert read is not None
                            one.second.append(_flat(read, lo, hi))
                        elif m.second is not None:
                            one.second.append(_flat(m.second, lo, hi))
                            if m.peak is not None:
                                one.peak.append(_flat(m.peak, lo, hi))
                        if m.grad is not None:
                            one.grads.append(_flat(m.grad, lo, hi))
                        one.rows.append(rows[j])
                    start += count
                    bins.append(one)
        for one in bins:
            assert one.fused is not None
            if one.fused.compiled:
                continue
            try:
                scratch = one.fused.compile(one.first, one.second, one.peak, one.grads)
            except Exception as error:  # whatever the compiler raised: the multi-tensor passes work
                self.fused = False
                warnings.warn(f"lightning_paci: the fused weight prediction did not compile ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); the weight prediction runs "
                              f"in multi-tensor passes instead.", stacklevel=2)
                return None
            self.peak_extra_bytes = max(self.peak_extra_bytes, scratch)
        return bins

    def _row(self, kind: str, m: _Moved, rest: float) -> tuple[float, ...]:
        """A tensor's row of the fused pass's scalars: the multi-tensor passes' folded scalars."""
        alpha, square, beta2 = self._constants(m.group, rest) if m.grad is not None else (0.0, 0.0, 1.0)
        return scalar_row(kind, m.factor, m.eps, alpha, square, beta2)

    def _fold(self, state: dict, group: dict, scale: float, rest: float, step: float,
              known: bool) -> tuple[tuple, float, float] | None:
        """``(the bin key's hyperparameters, the step's factor, the denominator's epsilon)`` for one tensor, or
        None when its state predicts nothing (no momentum buffer, no Adam step yet)."""
        lr = group["lr"] * scale
        if not self.adam:
            if state.get("momentum_buffer") is None:
                return None
            mu = group["momentum"]
            # the step buf' = mu buf + (1 - dampening) p (Nesterov: mu buf' + p) as A (buf + beta g); -lr * A
            factor = mu * mu if group["nesterov"] and known else mu if known else 1.0
            return (lr, mu, group["dampening"], group["nesterov"], group.get("maximize", False)), -lr * factor, 0.0
        if not step:
            return None
        beta1, beta2 = group["betas"]
        key = (beta1, beta2, bool(group.get("amsgrad")), bool(group.get("maximize")))
        if not known:  # the moments as they are: step count `step`
            root = math.sqrt(1 - beta2 ** step)
            return key, -lr * root / (1 - beta1 ** step), group["eps"] * root
        c = _window_factor(group, rest)
        root = math.sqrt(1 - beta2 ** (step + 1))  # sqrt(bc2')
        shrink = 1.0 if group.get("amsgrad") else math.sqrt(beta2)  # the denominator holds sqrt(v' / beta2)
        return key, -lr * (1 - beta1) * c * root / (1 - beta1 ** (step + 1)) / shrink, group["eps"] * root / shrink

    def _hyperparameters(self, one: _Bin, group: dict, rest: float) -> None:
        """The scalars a bin's passes take once (the same for every tensor of the bin's key)."""
        if one.known:
            one.alpha, one.square, one.beta2 = self._constants(group, rest)

    def _constants(self, group: dict, rest: float) -> tuple[float, float, float]:
        """``(alpha, square, beta2)`` of a known gradient: the gradient's (SGD) or the moment's (Adam) weight in the
        numerator, the squared gradient's weight in the second moment, and beta2."""
        c = _window_factor(group, rest)
        if not self.adam:
            mu, damping = group["momentum"], group["dampening"]
            return ((mu * (1 - damping) + 1) / (mu * mu) if group["nesterov"] else (1 - damping) / mu) * c, 0.0, 1.0
        beta1, beta2 = group["betas"]
        return beta1 / ((1 - beta1) * c), (1 - beta2) * c * c / beta2, beta2

    def _step_counts(self) -> list[float]:
        """Every entry's ``step`` count (0 without state), read from the device only when a ``step`` tensor is not
        the one last read (one read for all of them)."""
        if not self.adam:
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


def _contiguous(m: _Moved) -> bool:
    """Whether a tensor's weights, state and gradient are all contiguous: the fused pass takes flat slices."""
    return all(t is None or t.is_contiguous() for t in (m.weight, m.first, m.second, m.peak, m.grad))


def _window_factor(group: dict, rest: float) -> float:
    """The factor from the window's accumulated gradient to the predicted window gradient: the known share scaled
    to the whole window, ``1 / (1 - rest)`` (each micro-batch's share is already ``1/a``), negated for
    ``maximize`` as the optimizer does before its moments see it. The known micro-batches' mean was measured at the
    current weights; the momentum's rate, the other candidate for the share still to come, lags the current
    gradient by ~1/(1-beta1) updates and predicted worse (RESULTS.md: +0.47% vs +0.11% at a constant 1e-3, +2.13%
    vs +1.23% at 3e-3)."""
    return (-1.0 if group.get("maximize") else 1.0) / (1.0 - rest)


def weight_prediction_for(compensation: str, optimizer: torch.optim.Optimizer, pairs: Sequence[tuple[nn.Parameter,
                          nn.Parameter]], *, warn: Callable[[str], None] | None) -> WeightPrediction | None:
    """The stage's weight prediction for ``PACIStrategy(compensation=...)``: ``"none"`` -> none; ``"predict"`` -> one,
    or a ``ValueError`` naming why the optimizer is not supported; ``"auto"`` -> one that measures its quality and is
    switched off where it does not help ([Note: the prediction's quality]) when supported, else a ``warn``-ing (where
    the schedule has drift) that the run is not compensated."""
    if compensation not in COMPENSATIONS:
        raise ValueError(f"`compensation` must be one of {', '.join(map(repr, COMPENSATIONS))}, got "
                         f"{compensation!r}.")
    if compensation == "none":
        return None
    reason = prediction_unsupported(optimizer)
    if reason is None:
        prediction = WeightPrediction(optimizer, pairs)
        if compensation == "auto":
            prediction.quality = PredictionQuality([real for _, real in pairs])
        return prediction
    if compensation == "predict":
        raise ValueError(f"`PACIStrategy(compensation='predict')`: {reason}. Use one of those optimizers or pass "
                         f"`compensation='none'`.")
    if warn is not None:
        warn(f"lightning_paci: no staleness compensation for this run: {reason}. PACI then loses some loss per "
             f"update to its drift (see docs/semantics.md); pass `compensation='none'` to "
             f"silence this warning.")
    return None
