"""The optimizer state sharded over a stage's replicas (``PACIStrategy(dp_shard="optimizer")``, ZeRO stage 1).

[Note: optimizer shards]
Every replica of a stage holds the same averaged gradients after the reduction (data_parallel.py,
grad_buckets.py), so every replica would compute the same update; each instead updates only the tensors it owns
and sends them to the others. Ownership is by whole tensors, balanced by bytes (largest first, to the replica that
owns the fewest bytes so far; the same on every replica): the optimizer-state bytes per replica are about 1 / D of
the stage's, plus at most one tensor. The user's optimizer object stays whole -- its param groups, learning-rate
schedulers, Lightning's hooks and gradient clipping see every parameter, as on one device -- and is stepped with
the gradients of the tensors this replica does not own set to None: torch's optimizers skip such a parameter and
create no state for it. After the step each owner broadcasts its tensors (one flat buffer per owner and dtype) and
the others copy them in through ``.data`` (no autograd version moves, [Note: alias optimizer]). For optimizers
that update each tensor on its own (SGD, Adam, AdamW, ...) the result is bit for bit the unsharded one; an
optimizer that couples tensors (a global-norm LAMB) is not.

A checkpoint holds the whole state keyed by parameter name, as without sharding (``merge_replica_states``): it
resumes exactly, and into any number of replicas, each keeping the entries it owns. The replicas' shards meet on the
host: over the host group of every rank under NCCL, never pickled through the data-parallel NCCL group ([Note: host
groups on a bound world]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_paci.engine.transport.collectives import gather_objects

__all__ = ["OptimizerShards", "merge_replica_states", "optimizer_state_bytes", "partition_tensors"]


def partition_tensors(params: Sequence[nn.Parameter], replicas: int) -> list[int]:
    """The owning replica of each of ``params``: largest first, each to the replica owning the fewest bytes so far
    (the lowest index on a tie); parameters that need no gradient to replica 0 (they have no state)."""
    owners = [0] * len(params)
    load = [0] * replicas
    sizes = [p.numel() * p.element_size() if p.requires_grad else 0 for p in params]
    for i in sorted(range(len(params)), key=lambda i: (-sizes[i], i)):
        if not sizes[i]:
            continue
        owner = min(range(replicas), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


class OptimizerShards:
    """Which of the stage's parameters this replica updates, and the broadcast that shares the updated tensors.

    Args:
        params: the stage's parameters stepped by its optimizer (the real ones).
        replica, replicas: this replica's index and their number; group: the stage's data-parallel group.
    """

    def __init__(self, params: Sequence[nn.Parameter], replica: int, replicas: int, group: Any) -> None:
        self.params = list(params)
        self.owners = partition_tensors(self.params, replicas)
        self.replica, self.group = replica, group
        self.owned = {id(p) for p, owner in zip(self.params, self.owners) if owner == replica}
        # (owner, dtype, device) -> indices: one broadcast each, in the same order on every replica
        self._flats: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
        for i, (p, owner) in enumerate(zip(self.params, self.owners)):
            if p.requires_grad:
                self._flats.setdefault((owner, p.dtype, p.device), []).append(i)
        self._sources = {owner: dist.get_global_rank(group, owner) for owner, _, _ in self._flats} \
            if dist.is_initialized() else {}

    def share(self) -> None:
        """After the step: every owner's updated tensors to every replica of the stage."""
        for (owner, dtype, device), members in self._flats.items():
            tensors = [self.params[i].data for i in members]
            if owner == self.replica:
                flat = torch.cat([t.reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
            dist.broadcast(flat, src=self._sources[owner], group=self.group)
            if owner != self.replica:
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(part.view_as(t))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state (what sharding divides)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def merge_replica_states(local: Mapping[str, Any], owned: Sequence[str], group: Any, *,
                         host: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The stage's whole name-keyed optimizer state (checkpoint.stage_optimizer_state's entries, host tensors) from
    its replicas' shards: each name takes the entry of the replica that owns it (``owned``: this replica's names).
    ``group`` is the stage's replicas' group and says who they are; the shards travel over ``host``, the host group
    of every rank under NCCL (None: the world, a host group itself under gloo), one replica's at a time."""
    mine = {name: local[name] for name in owned}
    merged = dict(local)
    for part in gather_objects(mine, dist.get_process_group_ranks(group), host,
                               what="a replica's optimizer-state shard"):
        merged.update(part)
    return merged
