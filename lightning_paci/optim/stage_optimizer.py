"""The stage's own optimizer: stepped in place without a parameter copy and without bumping autograd versions.

[Note: alias optimizer]
A micro-batch still in flight saved these weights in its graph; a plain in-place ``optimizer.step()`` bumps their
version counters and its backward would fail ("modified by an inplace operation"). The user's optimizer is
re-pointed at *alias* parameters ``nn.Parameter(p.data)``: same storage (no copy), own version counter. At a step
the real gradients are handed over, the optimizer updates the shared storage in place, and the in-flight backward
uses the updated weights (PACI's "backward with current weights", see docs/paci-algorithm.md sec. 3-4). Because the
optimizer only sees the aliases, Lightning's own ``zero_grad`` cannot wipe gradients the schedule is still
accumulating.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["StageOptimizer", "Step", "optimizer_and_step_schedulers"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a tensor-parallel stage's gradient), any other tensor itself: the checks of
    an update read each rank's own part."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def optimizer_and_step_schedulers(output: Any) -> tuple[torch.optim.Optimizer, list[Any]]:
    """The single optimizer and the per-step LR schedulers of a ``configure_optimizers`` return value (used by the
    reference executor; the strategy reads Lightning's parsed configuration)."""
    if isinstance(output, torch.optim.Optimizer):
        return output, []
    if isinstance(output, dict):
        scheduler = output.get("lr_scheduler")
        if isinstance(scheduler, dict):
            scheduler = scheduler["scheduler"]
        return output["optimizer"], [scheduler] if scheduler is not None else []
    if isinstance(output, (list, tuple)) and len(output) == 2 and isinstance(output[0], (list, tuple)):
        return output[0][0], [s["scheduler"] if isinstance(s, dict) else s for s in output[1]]
    if isinstance(output, (list, tuple)) and len(output) == 1:
        return optimizer_and_step_schedulers(output[0])
    raise ValueError(f"Unsupported `configure_optimizers` return value for pipeline training: {type(output).__name__}.")


class Step(NamedTuple):
    """What :meth:`StageOptimizer.step` did: ``done`` is False when a check failed and nothing changed;
    ``squares``: the measured update's per-tensor squared norms, ``(tensors, 2)``, or None; ``values``: the 0-dim
    ``values`` passed to the step, read in the check's host read."""

    done: bool
    squares: torch.Tensor | None = None
    values: tuple[float, ...] = ()


class StageOptimizer:
    """The user's optimizer over this stage's parameters, stepped through aliases (see [Note: alias optimizer]).

    Args:
        optimizer: built by ``configure_optimizers`` from the carved module's ``parameters()``.
        params: the stage's own parameters (the optimizer may hold only these).
        schedulers: step-interval LR schedulers, stepped after every local update.
        before_step: called with the optimizer right before each update, its parameters holding the window's
            gradients (Lightning's ``on_before_optimizer_step`` and gradient clipping).
        exclude: tied-weight replicas on the last stage: stage 0 updates them (see [Note: tied weights]).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[nn.Parameter],
        *,
        schedulers: Sequence[Any] = (),
        before_step: Callable[[torch.optim.Optimizer], None] | None = None,
        exclude: Sequence[nn.Parameter] = (),
    ) -> None:
        owned = {id(p): p for p in params}
        skipped = {id(p) for p in exclude}
        self.optimizer = optimizer
        self.schedulers = list(schedulers)
        self.before_step = before_step
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (alias, real)
        for group in optimizer.param_groups:
            aliases = []
            for p in group["params"]:
                if id(p) in skipped:
                    continue
                if id(p) not in owned:
                    raise ValueError(
                        f"The optimizer holds a parameter of shape {tuple(p.shape)} that is not one of this stage's "
                        f"module parameters. `configure_optimizers` must build its optimizer from `self.parameters()` "
                        f"(or named subsets of it), which the strategy restricts to the stage's own parameters."
                    )
                alias = nn.Parameter(p.data, requires_grad=p.requires_grad)
                aliases.append(alias)
                self.pairs.append((alias, p))
            group["params"] = aliases
        if optimizer.state:
            raise ValueError("The optimizer already has state; build it fresh in `configure_optimizers`.")
        self._owned: set[int] | None = None  # sharded over replicas: ids of the parameters this replica updates
        self._share: Callable[[], None] | None = None
        self._clock: _HyperparameterClock | None = None  # a chunk's view of a device's optimizer (see `chunk`)
        self.updates = 0  # steps taken (a chunk's own, for its view)
        # DTensor parameters (the module's own parallelism, [Note: tensor parallelism in a stage])
        self._sharded = any(isinstance(p, DTensor) for _, p in self.pairs)

    def chunk(self, params: Sequence[nn.Parameter], before_step: Callable[[torch.optim.Optimizer], None] | None
              ) -> StageOptimizer:
        """The view of one chunk of a device ([Note: chunks of one device] in partition/chunks.py): the same
        optimizer and state, stepping only ``params``' gradients (the others' aliases hold none, so per-tensor
        optimizers leave those tensors and their state untouched), with its own ``before_step``. The schedulers
        advance once per update *version* across the chunks: a chunk's ``k``-th update uses the hyperparameters
        the schedulers gave for step ``k``, whichever chunk reached it first, as one device would."""
        mine = {id(p) for p in params}
        view = copy.copy(self)
        view.pairs = [(alias, p) for alias, p in self.pairs if id(p) in mine]
        view.before_step = before_step
        if self.schedulers and self._clock is None:
            self._clock = _HyperparameterClock(self.optimizer, self.schedulers)
        view._clock, view.schedulers, view.updates = self._clock, [], 0
        if view._clock is not None:
            view._clock.views.append(view)
        return view

    def add_param_group(self, group: dict[str, Any], params: Sequence[nn.Parameter]) -> None:
        """A param group added while training (a fine-tuning schedule's): ``params``, the stage's own parameters of
        it, join through aliases (see [Note: alias optimizer]), any already stepped left out. The group is added
        even when none are left, so that every stage's optimizer has one device's groups (code that reads
        ``param_groups[-1]`` reads the same group on every stage)."""
        known = {id(p) for _, p in self.pairs}
        aliases = []
        for p in params:
            if id(p) in known:
                continue
            alias = nn.Parameter(p.data, requires_grad=p.requires_grad)
            aliases.append(alias)
            self.pairs.append((alias, p))
            known.add(id(p))
        # the class's own method: the instance's `add_param_group` may be the caller
        type(self.optimizer).add_param_group(self.optimizer, {**group, "params": aliases})

    def own_hyperparameters(self) -> None:
        """Put this view's update count's hyperparameters in the groups (before a weight prediction reads them)."""
        if self._clock is not None:
            self._clock.use(self.updates)

    def resume_at(self, steps: int) -> None:
        """A checkpoint's ``steps`` updates were made before this run: a chunk's view counts from there, and the
        schedulers' clock takes the groups as they are when the next update comes (the checkpoint's)."""
        self.updates = steps
        if self._clock is not None:
            self._clock.version, self._clock.kept = steps, {}

    def shard(self, owned: set[int], share: Callable[[], None]) -> None:
        """Update only the parameters whose ids are in ``owned`` (the others' gradients are hidden from the
        optimizer, which then keeps no state for them) and call ``share`` after each update to receive the rest
        ([Note: optimizer shards] in engine/replicas/optimizer_shards.py)."""
        self._owned, self._share = owned, share
        for alias, p in self.pairs:
            if id(p) not in owned:
                self.optimizer.state.pop(alias, None)

    def _steps(self, p: nn.Parameter) -> bool:
        return self._owned is None or id(p) in self._owned

    def nonfinite(self, extra: Sequence[torch.Tensor] = (), flags: Sequence[torch.Tensor] = ()) -> bool:
        """Whether a gradient (the parameters' or ``extra``) holds a NaN or inf or a 0-dim bool in ``flags`` is
        false: one host read for all of them."""
        return self.check_reading(extra, flags)[0]

    def check_reading(self, extra: Sequence[torch.Tensor] = (), flags: Sequence[torch.Tensor] = (),
                      values: Sequence[torch.Tensor] = ()) -> tuple[bool, tuple[float, ...]]:
        """:meth:`nonfinite`, and the 0-dim ``values`` (e.g. [Note: the prediction's quality]) read in the same host
        read: ``(failed, values)``."""
        grads = self.gradients() + list(extra)
        if self._sharded:  # [Note: tensor parallelism in a stage]: each rank checks its own shards
            grads = [_local(g) for g in grads]
        grads = [g for g in grads if g.numel()]
        checks = list(flags)
        if grads:  # a max-norm is finite iff every element is (NaN propagates); one multi-tensor pass, no overflow
            checks.append(torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).all())
        if not values:
            return bool(checks) and not bool(torch.stack(checks).all()), ()
        ok = torch.stack(checks).all() if checks else torch.ones((), dtype=torch.bool, device=values[0].device)
        read = torch.stack([ok.double(), *(v.double() for v in values)]).tolist()
        return not read[0], tuple(read[1:])

    def nonfinite_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradient holds a NaN or inf (to name them in an error)."""
        return [p for _, p in self.pairs if p.grad is not None and not torch.isfinite(_local(p.grad)).all()]

    def gradients(self) -> list[torch.Tensor]:
        """The real parameters' accumulated gradients (those that have one)."""
        return [p.grad for _, p in self.pairs if p.grad is not None]

    def step(self, *, measure: bool = False, extra: Sequence[torch.Tensor] = (),
             flags: Sequence[torch.Tensor] = (), values: Sequence[torch.Tensor] = ()) -> Step:
        """One update with the accumulated gradients, then the schedulers; gradients are cleared afterwards -- if
        every gradient (the parameters' and ``extra``: tied weights' gradients kept elsewhere) is finite and every
        0-dim bool in ``flags`` holds, checked in one host read, which also reads the 0-dim ``values``
        (``Step.values``). Otherwise nothing changes and the result says so (``done=False``): the caller names what
        failed and may step again.

        With ``measure`` the parameters are stepped one tensor at a time so that the update's size needs at most
        one tensor's transient copy; the result holds, per tensor, the float32 squared norms of its update and of
        its new value, ``(tensors, 2)`` on the parameters' device, not read (``StageRecords.record_update``).
        Stepping per tensor is equivalent for per-parameter optimizers (SGD, Adam, AdamW, ...), not for ones that
        couple parameters (e.g. a global-norm LAMB).
        """
        failed, read = self.check_reading(extra, flags, values)
        if failed:
            return Step(done=False)
        if self._clock is not None:
            self._clock.use(self.updates)
        for alias, p in self.pairs:  # the same tensors: what hooks and clipping do to them, the update sees
            alias.grad = p.grad
        if self.before_step is not None:
            self.before_step(self.optimizer)
        if self._owned is not None:
            for alias, p in self.pairs:
                if id(p) not in self._owned:
                    alias.grad = None
        before = {i: p.detach().clone() for i, (_, p) in enumerate(self.pairs)
                  if measure and p.grad is not None and not self._steps(p)}  # updated by their owners
        squares = self._step_measuring() if measure else None
        if not measure:
            self.optimizer.step()
        if self._share is not None:
            self._share()
        if squares is not None:
            for i, old in before.items():
                new = self.pairs[i][1].detach()
                squares[i, 0] = (new - old).float().pow(2).sum()
                squares[i, 1] = new.float().pow(2).sum()
        for scheduler in self.schedulers:
            scheduler.step()
        self.updates += 1
        if self._clock is not None:
            self._clock.reached(self.updates)
        for alias, p in self.pairs:
            alias.grad = None
            p.grad = None
        return Step(done=True, squares=squares, values=read)

    def _step_measuring(self) -> torch.Tensor | None:
        """The update in bins of at most half the largest tensor's bytes: per bin one multi-tensor copy of the
        weights, the optimizer's step on the bin's tensors alone, one multi-tensor difference, norms and squares
        (a handful of launches per bin, whatever its number of tensors; the copy is the only transient). Norms in
        the weights' dtype (float32 accumulation inside), as float32."""
        if not self.pairs:
            return None
        for alias, _ in self.pairs:
            alias.grad = None
        zero = torch.zeros((), device=self.pairs[0][1].device)
        updates: list[torch.Tensor] = [zero] * len(self.pairs)  # squared norms per tensor, (update's, weight's)
        weights: list[torch.Tensor] = [zero] * len(self.pairs)
        largest = max(p.numel() * p.element_size() for _, p in self.pairs)
        bins: list[list[int]] = [[]]
        skipped: list[int] = []  # without a gradient; or another replica's to update
        room = largest // 2
        for i, (_, p) in enumerate(self.pairs):
            if p.grad is None or not self._steps(p):
                skipped.append(i)
                continue
            size = p.numel() * p.element_size()
            if bins[-1] and size > room:
                bins.append([])
                room = largest // 2
            bins[-1].append(i)
            room -= size
        for members in [skipped, *bins]:
            if not members:
                continue
            tensors = [self.pairs[i][1].detach() for i in members]
            if members is not skipped:
                before = torch._foreach_mul(tensors, 1.0)  # the bin's transient copy
                for i in members:
                    self.pairs[i][0].grad = self.pairs[i][1].grad
                self.optimizer.step()
                for i in members:
                    self.pairs[i][0].grad = None
                torch._foreach_sub_(before, tensors)  # old - new
                moved = torch._foreach_norm(before)
                del before
                for i, norm in zip(members, torch._foreach_mul(moved, moved)):
                    updates[i] = norm
            norms = torch._foreach_norm(tensors)
            for i, norm in zip(members, torch._foreach_mul(norms, norms)):
                weights[i] = norm
        return torch.stack([torch.stack(updates), torch.stack(weights)], dim=1).float()

    def weight_norm(self) -> float:
        """||theta|| over the stage's parameters."""
        return float(sum(p.detach().float().pow(2).sum() for _, p in self.pairs)) ** 0.5


class _HyperparameterClock:
    """The schedulers of a device's optimizer, stepped once per update version across its chunks' views: each
    version's group hyperparameters are kept until every view has used them (at most the versions the chunks are
    apart, a few)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedulers: Sequence[Any]) -> None:
        self.optimizer, self.schedulers = optimizer, list(schedulers)
        self.views: list[StageOptimizer] = []
        self.version = 0
        self.kept: dict[int, list[dict[str, Any]]] = {0: self._groups()}

    def _groups(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def use(self, version: int) -> None:
        """Set the groups' hyperparameters to those of update ``version``."""
        if not self.kept:  # resumed: the groups hold the checkpoint's values
            self.kept[self.version] = self._groups()
        for group, kept in zip(self.optimizer.param_groups, self.kept[version], strict=True):
            group.update(kept)

    def reached(self, version: int) -> None:
        """A view made its update ``version``: step the schedulers up to it (from the newest version's values)."""
        if version > self.version:
            self.use(self.version)
            while self.version < version:
                for scheduler in self.schedulers:
                    scheduler.step()
                self.version += 1
                self.kept[self.version] = self._groups()
        oldest = min(view.updates for view in self.views)
        for old in [v for v in self.kept if v < oldest]:
            del self.kept[old]
