"""Data parallelism per stage: the replicas of a stage average their accumulated gradients right before each of
their local optimizer steps.

PACI has no global step, so its data parallelism stays per stage: the replicas of stage ``s`` run the same action
list, reach their ``k``-th ``OPT`` after the same ``a`` backwards, and average what those backwards accumulated --
one all-reduce per local step over the stage's data-parallel group, nothing between stages. A micro-batch backward
never synchronises (torchtitan's ``no_sync`` micro-batches, done here by owning the reduction instead of wrapping
the stage in DDP). Averaged gradients equal those of one replica fed all replicas' samples of the window, so a flush
schedule over ``D`` replicas of ``b`` samples equals one device on the ``D * b`` samples; gradient clipping, the
finite check and the step then see the same gradients on every replica, and the replicas stay equal bit for bit.

One bucket per dtype and device: the gradients are copied into one flat buffer (bytes of the stage's gradients,
the size of DDP's buckets together), reduced once, and copied back. Each parameter's slot carries a presence flag:
a parameter with a gradient on some replicas and not on others (data-dependent control flow) is an error naming
it, instead of a silently skewed average; one without a gradient anywhere keeps ``grad = None`` so the optimizer
skips it as one device would.

LocalSGD (``PACIStrategy(local_sgd_steps=k)``, as Accelerate's ``LocalSGD``): the replicas step on their own
gradients and average their *parameters* after every ``k``-th local step of the stage (and at every drain, so
checkpoints, validation and the end of ``fit`` see one model): ``1/k`` of the collectives, for interconnects too
slow for one all-reduce per step. The optimizer states stay each replica's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_paci.engine.replicas.grad_buckets import (
    OverlappedGradientAverage,
    ReplicaCheck,
    pack_gradients,
    plan_buckets,
    write_averages,
)
from lightning_paci.engine.replicas.optimizer_shards import OptimizerShards
from lightning_paci.errors import ReplicaMismatchError

__all__ = ["GradientAverage", "ParameterAverage", "ReplicaMismatchError", "average_gradients", "average_parameters",
           "join_replicas"]


def _buckets(params: Sequence[nn.Parameter]) -> list[list[int]]:
    """Indices of ``params`` grouped by dtype and device: one flat buffer, one all-reduce each."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dtype, p.device), []).append(i)
    return list(groups.values())


def average_gradients(params: Sequence[nn.Parameter], replicas: int,
                      all_reduce: Callable[[torch.Tensor], None], *, names: Sequence[str] | None = None
                      ) -> ReplicaCheck:
    """Average ``params``' gradients over ``replicas`` in place, through ``all_reduce`` (a sum over the replicas of
    a flat tensor, in place). Gradients are summed, then divided by ``replicas``, as one device's mean over the
    replicas' samples is (each replica's gradient already is the mean over its own samples). Nothing is read
    from the device: the returned check's flag joins the update's one read ([Note: one host read per update])."""
    buckets, agree = [], []
    for members in _buckets(params):
        flat = pack_gradients(params, members)
        all_reduce(flat)
        agree.append(write_averages(params, members, flat, replicas))
        buckets.append((members, flat[flat.numel() - len(members):]))
    flag = torch.stack(agree).all() if agree else torch.ones((), dtype=torch.bool)
    return ReplicaCheck(flag, buckets, params, replicas, names)


class GradientAverage:
    """The stage's reduction over its data-parallel process group, called by the runtime before each ``OPT``."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, replicas: int,
                 names: Sequence[str] | None = None) -> None:
        self.params = list(params)
        self.group = group
        self.replicas = replicas
        self.names = names
        self.reductions = 0

    def __call__(self) -> ReplicaCheck:
        check = average_gradients(self.params, self.replicas, lambda flat: dist.all_reduce(flat, group=self.group),
                                  names=self.names)
        self.reductions += 1
        return check


def average_parameters(params: Sequence[nn.Parameter], replicas: int,
                       all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Average ``params`` over ``replicas`` in place (one flat buffer per dtype and device, summed by
    ``all_reduce``, then divided), through ``.data``: no autograd version counter moves (see [Note: alias
    optimizer])."""
    for bucket in _buckets(params):
        members = [params[i] for i in bucket]
        flat = torch.cat([p.data.reshape(-1) for p in members])
        all_reduce(flat)
        for p, part in zip(members, flat.split([p.numel() for p in members])):
            p.data.copy_(part.view_as(p)).div_(replicas)


class ParameterAverage:
    """LocalSGD's reduction, an update hook of the stage: every ``every``-th local step, and on ``sync()``."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, replicas: int, every: int) -> None:
        self.params, self.group, self.replicas, self.every = list(params), group, replicas, every
        self.averages = 0

    def __call__(self, version: int) -> None:
        if version % self.every == 0:
            self.sync()

    def sync(self) -> None:
        average_parameters(self.params, self.replicas, lambda flat: dist.all_reduce(flat, group=self.group))
        self.averages += 1


def join_replicas(runtime: Any, driver: Any, group: dist.ProcessGroup, replicas: int, replica: int, *,
                  local_sgd_steps: int | None, last_stage: bool, names: Mapping[int, str],
                  bucket_bytes: int | None = None, order: Callable[[str], int] | None = None,
                  late: Sequence[nn.Parameter] = (), shard_optimizer: bool = False,
                  deferred: bool = False) -> OptimizerShards | None:
    """Make a stage's runtime (``runtime.StageRuntime``) one of ``replicas``: its forwards draw replica ``replica``'s
    random streams, its errors name the replica, and its gradients are averaged before every local step -- or,
    with ``local_sgd_steps``, its parameters every that many steps and at every drain of ``driver``.

    With ``bucket_bytes`` the average runs bucket by bucket during the backward that closes each window
    ([Note: overlapped reduction]): ``order(name)`` is when the backward finishes a parameter
    (``grad_buckets.backward_order``), ``late`` the parameters whose gradient is complete only at the step (stage
    0's tied weights, which the last stage's gradient joins right before it). With ``shard_optimizer`` each replica
    updates its share of the parameters ([Note: optimizer shards]); the shards are returned. With ``deferred`` (and
    ``bucket_bytes``) each update waits for the stage's next backward ([Note: deferred update]).
    """
    params = [p for _, p in runtime.optimizer.pairs] if runtime.optimizer is not None else []
    labels = [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)]
    shards = None
    if shard_optimizer and runtime.optimizer is not None and local_sgd_steps is None:
        shards = OptimizerShards(params, replica, replicas, group)
        runtime.optimizer.shard(shards.owned, shards.share)
    if local_sgd_steps is None and bucket_bytes is not None and params:
        position = [order(label) if order is not None else 0 for label in labels]
        at_step = [i for i, p in enumerate(params) if any(p is q for q in late)]
        buckets, first_late = plan_buckets(params, position, bucket_bytes, at_step)
        overlapped = OverlappedGradientAverage(params, group, replicas, buckets=buckets, first_late=first_late,
                                               names=labels)
        runtime.join_replicas(replica, overlapped, arm=overlapped.arm, deferred=overlapped if deferred else None)
        return shards
    if local_sgd_steps is None:
        runtime.join_replicas(replica, GradientAverage(params, group, replicas, names=labels))
        return shards
    runtime.join_replicas(replica, None)
    # the last stage's copy of tied weights too: at a drain it then equals stage 0's average
    average = ParameterAverage(params + (list(runtime.tied) if last_stage else []), group, replicas,
                               local_sgd_steps)
    runtime.on_update(average)
    check = driver.on_drain

    def on_drain() -> None:
        if check is not None:
            check()
        average.sync()

    driver.on_drain = on_drain
    return None
