"""Gradient buckets reduced over a stage's replicas while the backward that closes a window still runs.

[Note: overlapped reduction]
A stage's gradient for a window is final, parameter by parameter, once the window's last backward has accumulated
into it: autograd runs a leaf's accumulation once per backward, after every use of the leaf in that backward, and
its post-accumulate hook fires then. The runtime arms the hooks for that one backward (``arm``). The buckets hold
whole blocks in the order the backward leaves them -- the modules after the blocks, the blocks last to first, the
modules before them -- up to ``bucket_bytes`` each (DDP's ``bucket_cap_mb``), one dtype and device per bucket. A
bucket starts its all-reduce as soon as every parameter in it has fired and every bucket before it has started, so
the replicas issue the same collectives in the same order whatever their timing, while the earlier blocks' backward,
the input gradient's send and the next actions run. The ``OPT`` (``__call__``) starts what has not started (a
parameter without a gradient in this backward, a skipped micro-batch, the tied weights whose last-stage gradient
arrives just before the step), waits for everything, and writes the averages back as the blocking average does
(data_parallel.py: the replicas' sum, divided by their number, presence flags checked on the device) -- bitwise
equal to it for two replicas, whose sum has one order. Only the ``OPT`` waits; a bucket's launch reads nothing from
the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_paci.errors import ReplicaMismatchError

__all__ = ["OverlappedGradientAverage", "ReplicaCheck", "backward_order", "pack_gradients", "plan_buckets",
           "write_averages"]


def pack_gradients(params: Sequence[nn.Parameter], members: Sequence[int]) -> torch.Tensor:
    """One flat buffer of ``params[members]``' gradients (zeros where there is none), then one presence flag each:
    ``(sum of numels + len(members),)`` in the first member's dtype, on its device. A few launches whatever the
    number of tensors: one multi-tensor copy, the flags copied from the host (nothing read from the device)."""
    sizes = [params[i].numel() for i in members]
    total = sum(sizes)
    first = params[members[0]]
    flat = torch.zeros(total + len(members), dtype=first.dtype, device=first.device)
    views = flat[:total].split(sizes)
    present = [k for k, i in enumerate(members) if params[i].grad is not None]
    if present:
        torch._foreach_copy_([views[k] for k in present],
                             [params[members[k]].grad.reshape(-1) for k in present])  # type: ignore[union-attr]
    flags = torch.tensor([float(params[i].grad is not None) for i in members], dtype=flat.dtype)
    flat[total:].copy_(flags, non_blocking=True)
    return flat


class ReplicaCheck:
    """Whether every gradient of a reduction was present on all replicas or on none, kept on the device
    (``agree``, a 0-dim bool) for the one host read before the update ([Note: one host read per update]);
    :meth:`verify` reads the summed presence flags to name a parameter that was not (a failure's path)."""

    def __init__(self, agree: torch.Tensor, buckets: Sequence[tuple[Sequence[int], torch.Tensor]],
                 params: Sequence[nn.Parameter], replicas: int, names: Sequence[str] | None) -> None:
        self.agree, self.buckets = agree, buckets
        self.params, self.replicas, self.names = params, replicas, names

    def verify(self) -> None:
        """Raise ``ReplicaMismatchError`` naming the first parameter with a gradient on some replicas only."""
        for members, counts in self.buckets:
            for i, count in zip(members, counts.tolist()):
                present = round(count)
                if present not in (0, self.replicas):
                    name = self.names[i] if self.names is not None else f"parameter {i}"
                    raise ReplicaMismatchError(
                        f"{name} has a gradient on {present} of {self.replicas} data-parallel replicas of this stage: "
                        f"the replicas must use the same parameters in every window (no data-dependent branches "
                        f"that skip a parameter on some samples), as under DDP without find_unused_parameters.")


def write_averages(params: Sequence[nn.Parameter], members: Sequence[int], flat: torch.Tensor,
                   replicas: int) -> torch.Tensor:
    """Write a reduced bucket back without reading it: ``flat`` holds the replicas' summed gradients of
    ``params[members]`` then their presence flags; each gradient present here becomes the sum divided by
    ``replicas``, one absent here stays ``None`` (the optimizer skips it, as one device would). Returns ``(counts
    agree)``, a 0-dim bool on the device: each flag sums to ``replicas`` where this replica has the gradient and
    to 0 where it has not (anything else: a parameter used by some replicas only, see :class:`ReplicaCheck`)."""
    sizes = [params[i].numel() for i in members]
    total = sum(sizes)
    local = [params[i].grad is not None for i in members]
    expected = torch.tensor([float(replicas) if here else 0.0 for here in local], dtype=flat.dtype)
    agree = torch.eq(flat[total:], expected.to(flat.device, non_blocking=True)).all()
    summed = flat[:total].div_(replicas)
    views = summed.split(sizes)
    present = [k for k, here in enumerate(local) if here]
    if present:
        torch._foreach_copy_([params[members[k]].grad.view(-1) for k in present],  # type: ignore[union-attr]
                             [views[k] for k in present])
    return agree


def backward_order(name: str, *, blocks: Sequence[str], after: Sequence[str]) -> int:
    """When the backward finishes parameter ``name`` of a stage owning ``blocks`` (their dotted names, in forward
    order): 0 for the modules after the blocks (the head), 1 for the last block, ..., ``len(blocks)`` for the first,
    then the rest."""
    if any(name.startswith(f"{module}.") for module in after):
        return 0
    for index, block in enumerate(blocks):
        if name.startswith(f"{block}."):
            return len(blocks) - index
    return 1 + len(blocks)


def plan_buckets(params: Sequence[nn.Parameter], order: Sequence[int], bucket_bytes: int,
                 late: Sequence[int] = ()) -> tuple[list[list[int]], int]:
    """Indices of ``params`` in launch order, cut into buckets: by ``order`` (stable), a new bucket when the dtype
    or device changes or the bucket would pass ``bucket_bytes`` (one block's parameters never straddle two buckets
    unless the block alone passes it); the ``late`` indices (reduced only at the step) in buckets of their own, last.
    Returns the buckets and the index of the first late one."""
    at_step = set(late)
    early = sorted((i for i in range(len(params)) if i not in at_step), key=lambda i: order[i])
    buckets: list[list[int]] = []
    first_late = 0
    for group in (early, list(late)):
        first_late = len(buckets)
        current: list[int] = []
        size = 0
        for i in group:
            p = params[i]
            nbytes = p.numel() * p.element_size()
            block_starts = not current or order[i] != order[current[-1]]
            mismatch = current and (p.dtype, p.device) != (params[current[0]].dtype, params[current[0]].device)
            if current and (mismatch or (block_starts and size + nbytes > bucket_bytes)):
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets, first_late


class OverlappedGradientAverage:
    """The stage's gradient average over its replicas, bucket by bucket during the window's last backward.

    Args:
        params: the stage's parameters stepped by its optimizer (the real ones, which receive the gradients).
        group, replicas: the stage's data-parallel process group and its size.
        buckets: ``plan_buckets``' indices; the buckets from ``first_late`` on start only at the step.
        names: for errors. all_reduce: starts a sum over the replicas of a flat tensor in place and returns what
            to ``wait()`` on (default: ``dist.all_reduce(..., async_op=True)`` on ``group``; the benchmarks
            substitute an emulated slow link).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, replicas: int, *,
                 buckets: Sequence[Sequence[int]], first_late: int, names: Sequence[str],
                 all_reduce: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.params = list(params)
        self.replicas, self.names = replicas, list(names)
        self.buckets = [list(b) for b in buckets]
        self.first_late = first_late
        self._all_reduce = all_reduce or (lambda flat: dist.all_reduce(flat, group=group, async_op=True))
        self._handles: list[Any] = []
        self._pending: list[dict[int, int]] = []  # per bucket: parameter index -> accumulations still to come
        self._next = 0  # the next bucket to start
        self._started: list[tuple[list[int], torch.Tensor, Any]] = []  # (indices, flat grads + flags, work)
        self._late_gradient: str | None = None
        self.reductions = 0
        self.started_in_backward = 0  # buckets started before the step, over the run (tests, benchmarks)

    def arm(self, times: int = 1) -> None:
        """Before the backward that closes the window: start each bucket when its parameters' gradients are final,
        after ``times`` accumulations each (a layer-major mini-batch, [Note: layered backward], accumulates once per
        micro-batch)."""
        self._pending = [{i: times for i in b} for b in self.buckets]
        for b, bucket in enumerate(self.buckets[:self.first_late]):
            for i in bucket:
                if self.params[i].requires_grad:
                    self._handles.append(self.params[i].register_post_accumulate_grad_hook(self._hook(b, i)))
                else:
                    del self._pending[b][i]
        self._start_ready()

    def _hook(self, bucket: int, index: int) -> Callable[[torch.Tensor], None]:
        def accumulated(_: torch.Tensor) -> None:
            left = self._pending[bucket].get(index)
            if bucket < self._next or left is None:  # one accumulation more than expected
                self._late_gradient = self.names[index]
            elif left > 1:
                self._pending[bucket][index] = left - 1
            else:
                del self._pending[bucket][index]
                self._start_ready()
        return accumulated

    def _start_ready(self) -> None:
        while self._next < self.first_late and not self._pending[self._next]:
            self._start(self._next)
            self.started_in_backward += 1

    def _start(self, b: int) -> None:
        members = self.buckets[b]
        flat = pack_gradients(self.params, members)
        self._started.append((members, flat, self._all_reduce(flat)))
        self._next = b + 1

    def __call__(self) -> ReplicaCheck:
        """At the window's ``OPT``: start the rest, wait for every bucket, write the averages back."""
        self.start()
        return self.finish()

    def start(self) -> None:
        """Start every bucket not started yet (the window's gradients are final)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for b in range(self._next, len(self.buckets)):
            self._start(b)

    def finish(self) -> ReplicaCheck:
        """Wait for every started bucket and write the averages back (see [Note: overlapped reduction])."""
        started, self._started, self._next = self._started, [], 0
        late, self._late_gradient = self._late_gradient, None
        if late is not None:
            raise RuntimeError(
                f"{late} received more gradient in the backward that closes a window than expected (a backward run "
                f"inside it, e.g. a reentrant torch.utils.checkpoint; under `schedule='layered'`, a parameter used by "
                f"two blocks): its reduction over the replicas had already started. Use "
                f"`torch.utils.checkpoint(..., use_reentrant=False)`, or `PACIStrategy(reduce_bucket_mb=None)` to "
                f"reduce every gradient at the step.")
        for _, _, work in started:
            work.wait()
        agree = [write_averages(self.params, members, flat, self.replicas) for members, flat, _ in started]
        self.reductions += 1
        return ReplicaCheck(torch.stack(agree).all(), [(m, flat[flat.numel() - len(m):]) for m, flat, _ in started],
                            self.params, self.replicas, self.names)
