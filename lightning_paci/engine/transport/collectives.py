"""Collectives of plain objects and reductions outside the action lists: broadcasts and gathers over the host group,
a stage's state gathered to rank 0 or everywhere, Lightning's reductions over a stage's replicas.

None runs per training batch (that would be a flush, [Note: no flush per Lightning batch]); each is named to the
failure watchdog while it waits (``activity.collective``), so a rank held in one is reported with what it waits
for. Object collectives travel over the host group of every rank under NCCL -- never through an NCCL group ([Note:
host groups on a bound world]) -- and refuse a device tensor (pickle_guard.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_paci.engine.supervision.activity import ALL, activity
from lightning_paci.engine.transport.pickle_guard import check_no_tensors

__all__ = ["all_gather_object", "broadcast_object", "broadcast_objects", "collective_waits", "gather_everywhere",
           "gather_objects", "gather_to_first", "merge_parts", "reduce_decision", "reduce_over"]


def broadcast_objects(obj: Any, src: int, ranks: Sequence[int], host: dist.ProcessGroup | None, *, what: str) -> Any:
    """``obj`` from global rank ``src`` to the other global ``ranks`` (``src`` among them; every one of them calls
    this), pickled over ``host``: the host group of every rank under NCCL, None for the world where it is a host
    group itself (gloo) -- never through an NCCL group ([Note: host groups on a bound world]; the NCCL emulation
    refuses it). Point to point from ``src`` to each of the others, so that a subset of the ranks (a stage's
    replicas, a replica's pipeline) can exchange objects on the group of every rank while the others do not take
    part. Host tensors may ride along (checkpoint state); a device tensor is refused, naming ``what``. The host
    group's tag 0, which no header uses ([Note: one tag per link])."""
    me = dist.get_rank()
    if me not in ranks or src not in ranks:
        raise AssertionError(f"rank {me}: {what} from rank {src} to ranks {list(ranks)}: the sender and every "
                             f"caller must be among them")
    if me == src:
        check_no_tensors(obj, what=what, host_tensors=True)
        for rank in ranks:
            if rank != src:
                dist.send_object_list([obj], dst=rank, group=host)
        return obj
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=host)
    return box[0]


def gather_objects(obj: Any, ranks: Sequence[int], host: dist.ProcessGroup | None, *, what: str) -> list[Any]:
    """Every one of the global ``ranks``' ``obj``, in their order, on each of them (an ``all_gather_object`` of a
    subset of the ranks over ``host``, see :func:`broadcast_objects`): one broadcast per rank in turn, the same
    order on every member, so each turn has its sender and all its receivers."""
    me = dist.get_rank()
    return [broadcast_objects(obj if rank == me else None, rank, ranks, host, what=what) for rank in ranks]


def collective_waits(watch_id: Callable[[int], int], group: Any) -> Any:
    """What a collective on ``group`` waits for, as the watchdog's ids (``watch_id`` of each global rank: stages in
    a pure pipeline, global ranks with replicas, ``Topology.watch_id``); ALL for the world (None)."""
    if group is None:
        return ALL
    return frozenset(watch_id(r) for r in dist.get_process_group_ranks(group))


def all_gather_object(obj: Any, group: Any, *, what: str) -> list[Any]:
    """Every rank's ``obj`` (pickled, host tensors allowed, no device tensor), in global-rank order, on every rank of
    ``group`` (every rank: the host group, never an NCCL one); ``[obj]`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    check_no_tensors(obj, what=what, host_tensors=True)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with activity.collective(what):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, src: int, group: Any, *, what: str, waits: Any = ALL,
                     host_tensors: bool = False, ranks: list[int] | None = None) -> Any:
    """``obj`` from global rank ``src`` to every rank of ``group`` (None: the world), or to ``ranks`` of it only
    (point to point), pickled (a device tensor would come back on the device it left from, on every rank: refused,
    and host tensors too unless ``host_tensors``); ``obj`` itself without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    check_no_tensors(obj, what=what, host_tensors=host_tensors)
    holder = [obj]
    with activity.collective(what, waits):
        if ranks is not None:
            return broadcast_objects(obj, src, ranks, group, what=what)
        dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


_OPS = {"mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


def reduce_over(tensor: Tensor, reduce_op: Any, group: Any, size: int, waits: Any) -> Tensor:
    """``tensor`` reduced with ``reduce_op`` over ``group`` (``size`` ranks): a mean, sum, max or min, in the
    tensor's dtype (integers travel as float64)."""
    op = str(getattr(reduce_op, "name", reduce_op)).lower()
    if op not in _OPS:
        raise ValueError(f"`reduce_op={reduce_op!r}` is not supported across data-parallel replicas: use "
                         f"'mean', 'sum', 'max' or 'min'.")
    result = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().double()
    with activity.collective("a reduction over the replicas", waits):
        dist.all_reduce(result, op=_OPS[op], group=group)
    if op in ("mean", "avg"):
        result = result / size
    return result if tensor.is_floating_point() or op in ("mean", "avg") else result.to(tensor.dtype)


def reduce_decision(decision: bool, *, all: bool, device: torch.device, world: int) -> bool:
    """Lightning's ``reduce_boolean_decision`` over every rank: whether all (``all``) or any decided so."""
    if not (dist.is_available() and dist.is_initialized()):
        return decision
    value = torch.tensor(int(decision), device=device)
    with activity.collective("reduce_boolean_decision"):
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return bool(value == world) if all else bool(value > 0)


def _merge_order(world: int, replicas: int) -> list[int]:
    """The ranks in the order their parts are merged, the winner of a key several hold last (:func:`merge_parts`)."""
    return sorted(range(world), key=lambda rank: (-(rank % replicas), rank))


def merge_parts(parts: Sequence[dict[str, Any]], replicas: int = 1) -> dict[str, Any]:
    """The ranks' name-keyed dicts (``parts[rank]``) as one. A key held by several ranks takes the value of the
    first data-parallel replica (the copy the sharded layout keeps) and, within it, of the highest rank: stage 0,
    the owner of a tied weight the last stage (rank 0) holds a replica of ([Note: rank layout])."""
    return {k: v for rank in _merge_order(len(parts), replicas) for k, v in parts[rank].items()}


def gather_to_first(local: dict[str, Any], replicas: int = 1, group: Any = None) -> dict[str, Any] | None:
    """Every stage's name-keyed dict, merged on global rank 0 (:func:`merge_parts`); None on the other ranks, which
    send their own part and never receive another stage's (their peak memory stays their own stage). Rank 0
    receives the parts one rank at a time and merges each before the next: its peak is the merged whole plus one
    part in transit, where a ``gather_object`` held every part's pickle and its tensors at once (measured on a
    268 MB model: ``python -m benchmarks memory --measure host``). ``group``: the host group of every rank under
    NCCL ([Note: host groups on a bound world]; None: the world, a host group itself), so no part passes through GPU
    memory."""
    if not dist.is_available() or not dist.is_initialized():
        return local
    check_no_tensors(local, what="a checkpoint's gather to rank 0", host_tensors=True)
    with activity.collective("a checkpoint's gather to rank 0"):
        if dist.get_rank() != 0:
            dist.send_object_list([local], dst=0, group=group)
            return None
        merged: dict[str, Any] = {}
        for rank in _merge_order(dist.get_world_size(), replicas):
            if rank == 0:
                merged.update(local)
                continue
            box: list[Any] = [None]
            dist.recv_object_list(box, src=rank, group=group)
            merged.update(box.pop())
        return merged


def gather_everywhere(local: dict[str, Any], replicas: int = 1, group: Any = None) -> dict[str, Any]:
    """Every stage's name-keyed dict merged on every rank (:func:`merge_parts`), one rank's part at a time over
    ``group`` (see :func:`gather_to_first`): each rank holds the merged whole plus one part in transit."""
    if not dist.is_available() or not dist.is_initialized():
        return local
    check_no_tensors(local, what="the teardown's gather of the stages' weights", host_tensors=True)
    merged: dict[str, Any] = {}
    me = dist.get_rank()
    with activity.collective("the end of fit's gather of the weights"):
        for rank in _merge_order(dist.get_world_size(), replicas):
            box: list[Any] = [local if rank == me else None]
            dist.broadcast_object_list(box, src=rank, group=group)
            merged.update(box.pop())
    return merged
