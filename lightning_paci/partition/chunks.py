"""Several pipeline stages (chunks) carved out of one module in one process, every parameter keeping its name.

[Note: chunks of one device]
With virtual stages ([Note: virtual stages] in schedules/virtual.py) a process runs ``v`` stages of the pipeline,
e.g. blocks 0-1 and 8-9 of 16 on the first of 4 devices. The module is carved once to the *union* of its chunks:
the modules no chunk here owns become placeholders (moved to the meta device, as for one stage), those of the
chunks stay real. That union is what the process holds at rest: ``state_dict()``, ``parameters()``, the optimizer,
checkpoints and Lightning see the device's parameters under their own names.

Each chunk is carved as one stage would be (carve.py: its placeholders, its boundary hooks, its ``StageCarve``),
except that the modules of its sibling chunks are not moved away: their placeholders run meta copies. A chunk's
forward runs the user's unchanged step with *its* layout in place -- its own modules real, every other position its
own placeholder -- so the sibling's blocks pass their input through instead of computing, and only its own hooks
fire. :meth:`StageCarve.entered` swaps that layout in for the forward and the union back after it (one dict write
per position that differs); the backward needs nothing, autograd holds the graph.

Tied weights: where one device holds stage 0 and the last stage (the V placement) the weight stays one Parameter,
used by both chunks' forwards; its gradient sums both uses and stage 0's optimizer steps it (no replica, no
exchange, no lag). Elsewhere the last stage gets its replica, as with one stage per process.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_paci.partition.carve import StageCarve, carve_stage, removed_modules, untie
from lightning_paci.partition.plan import PartitionPlan

__all__ = ["DeviceCarve", "carve_chunks", "chunk_names", "owned_names"]


def chunk_names(plan: PartitionPlan) -> list[str]:
    """Every position a stage owns or stands in for: the blocks and the outside modules with parameters."""
    return list(plan.block_names) + [name for name, _ in plan.outside]


def owned_names(plan: PartitionPlan, stage: int) -> set[str]:
    """The positions (``chunk_names``) whose module ``stage`` runs itself."""
    removed = removed_modules(plan, stage)
    return {name for name in chunk_names(plan) if name not in removed}


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` copied onto the meta device without a transient copy of its tensors and without its hooks."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    twin = copy.deepcopy(module, memo)
    for sub in twin.modules():
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks, sub._backward_hooks, sub._backward_pre_hooks):
            hooks.clear()
    return twin


class _Layout:
    """A chunk's modules put in place for one forward: ``swaps`` are (parent, child name, the chunk's module, the
    module at rest); ``hidden`` (holder, attribute, meta form) the direct parameters a sibling chunk owns, shown as
    meta tensors while the chunk runs; a context manager without a generator frame (one per forward)."""

    __slots__ = ("hidden", "swaps")

    def __init__(self, swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]],
                 hidden: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        self.swaps, self.hidden = swaps, hidden

    def __call__(self) -> _Layout:
        return self

    def __enter__(self) -> None:
        for parent, child, mine, _ in self.swaps:
            parent._modules[child] = mine
        for holder, attr, meta in self.hidden:
            holder.__dict__[attr] = meta  # found before `_parameters`: nn.Module's __getattr__ is not reached

    def __exit__(self, *_: Any) -> None:
        for parent, child, _mine, rest in self.swaps:
            parent._modules[child] = rest
        for holder, attr, _meta in self.hidden:
            del holder.__dict__[attr]


@dataclass
class DeviceCarve:
    """The chunks one process holds, each a :class:`StageCarve` (one entry for a process holding one stage)."""

    plan: PartitionPlan
    chunks: dict[int, StageCarve]  # stage -> its carve, ascending
    shared_tied: list[nn.Parameter]  # tied weights used by two chunks of this process (V placement)

    @property
    def stages(self) -> list[int]:
        return list(self.chunks)

    @property
    def first(self) -> StageCarve:
        return next(iter(self.chunks.values()))

    @property
    def last(self) -> StageCarve:
        return self.chunks[self.stages[-1]]

    @property
    def holds_last(self) -> bool:
        """Whether the pipeline's last stage (the loss, the logs) runs here."""
        return self.last.is_last

    @property
    def foreign_buffers(self) -> set[str]:
        """Buffers no chunk here computes with its own values (another process's copy is the real one)."""
        sets = [carve.foreign_buffers for carve in self.chunks.values()]
        return set.intersection(*sets) if sets else set()

    def __iter__(self) -> Iterator[StageCarve]:
        return iter(self.chunks.values())

    def chunk_parameters(self, module: nn.Module) -> dict[int, list[nn.Parameter]]:
        """Each chunk's own parameters (by the positions it owns), each Parameter in one chunk only: a weight two
        chunks use (tied under V) belongs to the lower one, which steps it; parameters at no position (registered
        on the root module) to the first chunk."""
        owners: dict[str, int] = {}
        for stage in self.stages:
            for name in owned_names(self.plan, stage):
                owners.setdefault(name, stage)
        owners.update((name, stage) for name, stage in self.plan.direct if stage in self.stages)
        owned = [(_owner(name, owners, self.stages[0]), param)
                 for name, param in module.named_parameters(remove_duplicate=False)]
        out: dict[int, list[nn.Parameter]] = {s: [] for s in self.stages}
        seen: set[int] = set()
        for stage, param in sorted(owned, key=lambda item: item[0]):  # stable: registration order within a stage
            if id(param) not in seen:
                seen.add(id(param))
                out[stage].append(param)
        return out

    def restore(self, module: nn.Module, full_state: dict[str, torch.Tensor] | None = None, *,
                materialize: bool = True) -> None:
        """Every chunk's hooks removed and the whole module back (see :meth:`StageCarve.restore`)."""
        for carve in list(self.chunks.values())[1:]:
            for handle in carve.handles:
                handle.remove()
            carve.handles.clear()
        self.first.restore(module, full_state, materialize=materialize)


def _owner(name: str, owners: Mapping[str, int], default: int) -> int:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the name itself first: a parameter the model holds directly
        owner = owners.get(".".join(parts[:i]))
        if owner is not None:
            return owner
    return default


def carve_chunks(module: nn.Module, plan: PartitionPlan, stages: Sequence[int]) -> DeviceCarve:
    """Carve ``module`` in place to the stages ``stages`` of ``plan`` ([Note: chunks of one device]); one stage is
    :func:`~lightning_paci.partition.carve.carve_stage` itself."""
    stages = sorted(stages)
    if len(stages) == 1:
        return DeviceCarve(plan, {stages[0]: carve_stage(module, plan, stages[0])}, [])
    last = plan.num_stages - 1
    names = chunk_names(plan)
    own = {s: owned_names(plan, s) for s in stages}
    mine = set().union(*own.values())
    shadows = {name: _meta_copy(module.get_submodule(name)) for name in mine}
    shared: list[nn.Parameter] = []
    if last in stages and 0 not in stages:
        untie(module, plan)
    elif last in stages:
        shared = list({id(p): p for p in (module.get_parameter(first) for first, _ in plan.tied)}.values())
    place_of = {name: _place(module, name) for name in names}
    rest = {name: _at(parent, child) for name, (parent, child) in place_of.items()}
    carves: dict[int, StageCarve] = {}
    layouts: dict[int, dict[str, nn.Module]] = {}
    direct = dict(plan.direct)  # a parameter the model holds itself -> its stage
    hidden: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}
    for stage in stages:
        siblings = frozenset(name for name, owner in direct.items() if owner in stages and owner != stage)
        carve = carve_stage(module, plan, stage, untie_weights=False,
                            shadows={name: shadows[name] for name in mine - own[stage]}, shadowed_params=siblings)
        hidden[stage] = [(*_place(module, name), meta) for name, meta in carve.shadowed_params.items()]
        if shared:
            carve.tied_params = []  # one Parameter, stepped by stage 0's optimizer, nothing to exchange
        layouts[stage] = {name: _at(parent, child) for name, (parent, child) in place_of.items()}
        for name in mine:  # the union again before the next chunk
            parent, child = place_of[name]
            parent._modules[child] = rest[name]
        carves[stage] = carve
    at_rest = {name: _at(parent, child) for name, (parent, child) in place_of.items()}
    for stage, carve in carves.items():
        carve.enter = _Layout([(parent, child, layouts[stage][name], at_rest[name])
                               for name, (parent, child) in place_of.items()
                               if layouts[stage][name] is not at_rest[name]], hidden[stage])
    return DeviceCarve(plan, carves, shared)


def _at(parent: nn.Module, child: str) -> nn.Module:
    module = parent._modules[child]
    assert module is not None
    return module


def _place(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (module.get_submodule(parent_name) if parent_name else module), child
