"""Carve one pipeline stage out of an unchanged module, in place, keeping every parameter's name.

[Note: stage boundaries are block inputs]
A model's ``forward`` is left as the user wrote it. Stage ``s`` owns the blocks ``start .. end-1`` of the repeated-
block container (an ``nn.Sequential``, or an ``nn.ModuleList`` that ``forward`` loops over); every other block is
replaced by a parameter-free ``Placeholder`` so that the union of the stages' state dicts is the full state dict.
Two forward pre-hooks mark the boundaries:

* ingress (stage ``s > 0``, on block ``start``): replaces that block's ``(args, kwargs)`` by the ones received from
  stage ``s - 1``;
* egress (stage ``s < N - 1``, on the placeholder at block ``end``): captures the ``(args, kwargs)`` the next stage's
  first block would get and ends the forward by raising ``StageDone``.

What crosses a boundary is therefore exactly what the next block is called with: hidden states, attention masks,
rotary position embeddings, ints -- but never a key/value cache ([Note: no cache across stages]) -- plus the values
relayed past the boundary ([Note: relayed crossings] in relay.py). Modules with parameters that run before the
container (an embedding) live on stage 0, those that run after it (final norm, LM head) on the last stage;
parameter-free modules stay everywhere. On other stages every removed module is a placeholder (placeholder.py) that
returns zeros of the real output's form (a block whose output has its input's form passes the input through), which
the ingress hook then replaces::

    stage 0:  embed -> [b0 b1] -> (egress: capture args of b2, stop)
    stage 1:  (placeholder) -> [pass pass] -> (ingress: args of b2) b2 b3 -> norm -> head -> loss
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_paci.engine.transport.messages import flatten, map_tensors
from lightning_paci.partition.placeholder import BoundaryState, CrossingError, Placeholder, StageDone
from lightning_paci.partition.plan import PartitionPlan

__all__ = ["BoundaryState", "CrossingError", "StageCarve", "StageDone", "carve_stage", "removed_modules",
           "removed_parameters", "share_tied_weights", "untie"]


def _without_caches(args: tuple[Any, ...], kwargs: dict[str, Any],
                    stage: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """[Note: no cache across stages]
    A transformers model left with ``use_cache=True`` (its config's default) makes a ``Cache`` in its ``forward``
    and hands it to every block, which appends its keys and values. At a stage boundary that object would be the
    next block's argument like any other and cross to the next stage whole, inside the message header, with the
    keys and values of every upstream layer (and keep them alive per micro-batch in flight). Training and
    evaluation never read a cache they did not fill in the same forward, so the boundary passes ``None`` in its
    place: the next stage's blocks run as under ``use_cache=False`` (same losses, same bytes per message), and the
    model's returned cache holds nothing of the other stages. A cache that held positions *before* this forward
    (a prefix passed in by the step) cannot be split over stages: stage 0 refuses it."""
    cache_type = _cache_type()
    if cache_type is None:
        return args, kwargs

    def drop(value: Any) -> Any:
        if not isinstance(value, cache_type):
            return value
        if stage > 0:  # a later stage's cache is its own model's, partly filled: nothing to read there
            return None
        # stage 0 ran block 0, so layer 0 of its cache holds every position it knows; the hidden states (the first
        # tensor of two or more dimensions, (batch, positions, ...)) hold this forward's
        held = value.get_seq_length(0)
        tokens = next((t.shape[-2] for t in flatten((args, kwargs))[1] if t.dim() >= 2), None)
        if tokens is not None and held > tokens:
            raise ValueError(
                f"stage {stage}: a transformers {type(value).__name__} with {held} positions reaches the stage "
                f"boundary, more than this forward's {tokens}: a cache of earlier positions cannot be split over "
                f"pipeline stages. Train without `past_key_values` (a prefix in the step), or on one device."
            )
        return None

    return tuple(drop(a) for a in args), {k: drop(v) for k, v in kwargs.items()}


def _cache_type() -> type[Any] | None:
    """transformers' ``Cache`` base class if transformers is loaded (a model built with it imports it first)."""
    module = sys.modules.get("transformers.cache_utils")
    return getattr(module, "Cache", None) if module is not None else None


@dataclass
class StageCarve:
    """A module carved down to one stage, with what is needed to put it back together."""

    plan: PartitionPlan
    stage: int
    boundary: BoundaryState
    removed: dict[str, nn.Module]
    handles: list[Any]
    tied_params: list[nn.Parameter] = field(default_factory=list)  # stage 0: the owned weights; last: replicas
    # buffers outside the container that ran on placeholder zeros here (partition/crossing.py): another stage's copy
    # is the real one, so this stage leaves them out of gathered states
    foreign_buffers: set[str] = field(default_factory=set)
    # several stages in one process ([Note: chunks of one device] in chunks.py): puts this stage's modules in place
    # for one forward; None for a process holding one stage, whose modules are always in place
    enter: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    # other names of removed modules (-> their first name), and removed direct parameters (on meta) by name
    aliased: dict[str, str] = field(default_factory=dict)
    removed_params: dict[str, nn.Parameter] = field(default_factory=dict)
    # modules a sibling chunk of this process owns (chunks.py), by name: their meta copies, behind this stage's
    # placeholders; the real ones stay in the module, so they are not ``removed``
    shadowed: dict[str, nn.Module] = field(default_factory=dict)
    # direct parameters a sibling chunk owns, by name: their meta form, shown in this stage's layout (the real ones
    # stay at rest)
    shadowed_params: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def stand_ins(self) -> dict[str, nn.Module]:
        """Every module this stage runs a placeholder for, by name -> its meta copy: the removed ones and a sibling
        chunk's. What a placeholder returns is another stage's value, whichever of the two it stands for."""
        return {**self.removed, **self.shadowed}

    def entered(self) -> contextlib.AbstractContextManager[Any]:
        """Around every forward of this stage (and every hook installed for it): its own modules in place."""
        return self.enter() if self.enter is not None else _IN_PLACE

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.plan.num_stages - 1

    def restore(self, module: nn.Module, full_state: dict[str, torch.Tensor] | None = None, *,
                materialize: bool = True) -> None:
        """Remove the hooks and put the removed modules back (materialised from ``full_state`` when given). When not
        ``materialize`` the placeholders stay (the model was built on the meta device and no rank holds more than
        its stage; a later carve takes their modules back)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if not materialize:
            return
        device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
        for name, original in self.removed.items():
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            original.to_empty(device=device)
            parent._modules[child] = original
        for alias, name in self.aliased.items():
            parent_name, _, child = alias.rpartition(".")
            (module.get_submodule(parent_name) if parent_name else module)._modules[child] = self.removed[name]
        for name, param in self.removed_params.items():
            holder_name, _, attr = name.rpartition(".")
            holder = module.get_submodule(holder_name) if holder_name else module
            holder.__dict__.pop(attr, None)
            holder._parameters[attr] = nn.Parameter(torch.empty_like(param, device=device),
                                                    requires_grad=param.requires_grad)
        self.removed.clear()
        self.aliased.clear()
        self.removed_params.clear()
        if full_state is not None:
            module.load_state_dict(full_state, strict=False)
        for first, last_name in self.plan.tied:  # tie again: one Parameter object under both names
            owner_name, _, attr = last_name.rpartition(".")
            setattr(module.get_submodule(owner_name), attr, module.get_parameter(first))


def removed_modules(plan: PartitionPlan, stage: int) -> dict[str, tuple[int, bool]]:
    """The dotted names of the modules ``stage`` does not own -> (the stage that owns it, whether it is a block);
    a module registered under several names appears under its first (``plan.aliases`` lists the others)."""
    keep = set(plan.blocks(stage))
    out: dict[str, tuple[int, bool]] = {}
    for i, name in enumerate(plan.block_names):
        if i not in keep:
            out[name] = (plan.block_stage(i), True)
    out.update({name: (owner, False) for name, owner in plan.outside if owner != stage})
    return out


def removed_parameters(plan: PartitionPlan, stage: int) -> dict[str, int]:
    """Parameters held directly by a module on the path to a container that ``stage`` does not own -> owner."""
    return {name: owner for name, owner in plan.direct if owner != stage}


_IN_PLACE = contextlib.nullcontext()


def untie(module: nn.Module, plan: PartitionPlan) -> None:
    """Give the last stage's names of each tied weight their own copy: stage 0's user keeps the shared Parameter,
    the last stage's user gets a replica that its optimizer skips and that receives stage 0's updates (see [Note:
    tied weights] in schedules.py)."""
    replicas: dict[str, nn.Parameter] = {}  # one replica per tied weight, under all its last-stage names
    for first, last_name in plan.tied:
        owner_name, _, attr = last_name.rpartition(".")
        holder = module.get_submodule(owner_name)
        shared = getattr(holder, attr)
        if first not in replicas:
            replicas[first] = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
        setattr(holder, attr, replicas[first])


def carve_stage(module: nn.Module, plan: PartitionPlan, stage: int, *, untie_weights: bool = True,
                shadows: Mapping[str, nn.Module] | None = None,
                shadowed_params: frozenset[str] = frozenset()) -> StageCarve:
    """Keep only ``stage``'s parameters in ``module`` (in place) and install the boundary hooks.

    Removed modules are moved to the meta device (their memory is freed) and kept for :meth:`StageCarve.restore`.
    ``shadows``: modules another stage of this process owns, by name, as meta copies for their placeholders: the
    real ones stay (chunks.py puts them back after this carve); ``shadowed_params``: direct parameters another
    stage of this process owns, left in place (chunks.py shows their meta form in this stage's layout);
    ``untie_weights``: False where the caller unties.
    """
    last = plan.num_stages - 1
    removed: dict[str, nn.Module] = {}
    shadows = shadows or {}
    if untie_weights:
        untie(module, plan)

    def swap(name: str, owner: str, *, is_block: bool = False) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        original = parent._modules[child]
        assert original is not None
        if isinstance(original, Placeholder):  # carved before (a model that stays on the meta device after fit)
            original = original.__dict__["_shadow"]
        device = next((t.device for t in [*original.parameters(), *original.buffers()] if not t.is_meta),
                      next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu")))
        if name in shadows:
            shadow = shadows[name]
        else:
            shadow = removed[name] = original.to("meta")
        parent._modules[child] = Placeholder(owner, shadow, may_pass_through=is_block, name=name,
                                              boundary=boundary, device=device)

    boundary = BoundaryState()
    for name, (owner, is_block) in removed_modules(plan, stage).items():
        swap(name, f"stage {owner}", is_block=is_block)
    aliased = {alias: name for alias, name in plan.aliases if name in removed or name in shadows}
    for alias, name in aliased.items():  # one placeholder under every name: its calls are counted once
        parent_name, _, child = alias.rpartition(".")
        (module.get_submodule(parent_name) if parent_name else module)._modules[child] = module.get_submodule(name)
    removed_params, kept_params = _remove_parameters(module, plan, stage, shadowed_params)

    handles = []
    blocks = plan.blocks(stage)
    first_block = module.get_submodule(plan.block_names[blocks.start])
    if stage > 0:
        def ingress(_module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if boundary.probing:  # fresh zeros of the block's own inputs: what they hold is received in a real run
                return map_tensors((args, kwargs), lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device))
            if boundary.incoming is None:
                raise AssertionError(f"stage {stage}: block {blocks.start} ran without a received input")
            return boundary.incoming

        handles.append(first_block.register_forward_pre_hook(ingress, with_kwargs=True))
    if stage < last:
        def egress(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if boundary.grad_at_begin and not torch.is_grad_enabled():
                raise CrossingError(
                    f"Stage {stage} ends at block `{plan.block_names[blocks.stop]}`, which runs without gradients "
                    f"although the step began with them: the blocks run inside an autograd Function (a reversible "
                    f"residual stack computing its own backward, as Reformer's) or a `torch.no_grad()` block, and no "
                    f"gradient could come back across the boundary. Such a model trains on one device or with data "
                    f"parallelism; a container whose blocks autograd sees can be named with `block_container=`.")
            args, kwargs = _without_caches(tuple(args), dict(kwargs), stage)
            if boundary.probing or boundary.late:  # go on: values made later here ([Note: late relays])
                boundary.held = (args, kwargs)
                return
            boundary.outgoing = (args, kwargs, boundary.relayed(stage)) if boundary.sends else (args, kwargs)
            raise StageDone

        handles.append(module.get_submodule(plan.block_names[blocks.stop]).register_forward_pre_hook(
            egress, with_kwargs=True))
    names = dict(module.named_parameters(remove_duplicate=False))
    firsts = dict(plan.tied)  # first name -> one of its last-stage names (a weight once, however many names)
    tied_local = [names[first if stage == 0 else last_name] for first, last_name in firsts.items()
                  if stage in (0, last)]
    return StageCarve(plan=plan, stage=stage, boundary=boundary, removed=removed, handles=handles,
                      tied_params=tied_local, aliased=aliased, removed_params=removed_params,
                      shadowed={name: shadows[name] for name in removed_modules(plan, stage) if name in shadows},
                      shadowed_params=kept_params)


def _remove_parameters(module: nn.Module, plan: PartitionPlan, stage: int, keep: frozenset[str] = frozenset()
                       ) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """Take the direct parameters another stage owns out of ``module`` (onto meta, kept for ``restore``); the
    attribute stays readable as a meta tensor, which the first forward's check refuses to compute with, naming it
    (crossing.py). Those in ``keep`` (a sibling chunk's) stay: only their meta form is returned, for the chunk's
    layout. One taken out by a sibling chunk's carve before this one is already a meta attribute."""
    out: dict[str, nn.Parameter] = {}
    kept: dict[str, torch.Tensor] = {}
    for name in removed_parameters(plan, stage):
        holder_name, _, attr = name.rpartition(".")
        holder = module.get_submodule(holder_name) if holder_name else module
        param = holder._parameters.get(attr)
        if param is None:  # a sibling chunk's carve took it out: the same meta attribute stands for it here
            meta = holder.__dict__[attr]
            out[name] = nn.Parameter(meta, requires_grad=True)
            continue
        if name in keep:
            kept[name] = param.detach().to("meta")
            continue
        del holder._parameters[attr]
        out[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        holder.__dict__[attr] = out[name].detach()
    return out, kept



def share_tied_weights(first: nn.Module, last: nn.Module, plan: PartitionPlan) -> list[nn.Parameter]:
    """Make the last stage's copy ``last`` use the first stage's tied parameters themselves, where one device holds
    both stages (the V placement of virtual stages, [Note: virtual stages] in schedules/virtual.py): both uses then
    add to one gradient, the first stage's optimizer steps it, and the last stage computes with the current weights
    (no replica, no exchange, no lag). Returns the shared parameters: the last stage's optimizer leaves them out."""
    shared = []
    for first_name, last_name in plan.tied:
        param = first.get_parameter(first_name)
        owner, _, attr = last_name.rpartition(".")
        setattr(last.get_submodule(owner) if owner else last, attr, param)
        shared.append(param)
    return shared
