"""Values relayed past stage boundaries: found by one probe forward per stage at setup, carried by the stages between.

[Note: relayed crossings]
What crosses a boundary by construction is the next stage's first block call (carve.py). An unchanged model reads
more than that from earlier stages: an encoder's output read by every decoder block (T5, BART, ``nn.Transformer``),
a long skip (``head(blocks(h) + h)``), a bias computed once and passed to every block call. On stage ``s`` such a
value is the output of a placeholder (zeros), or computed from one. At setup every stage ``s > 0`` runs its part of
one step on a sample micro-batch under ``CrossingCheck(collect=True)`` (crossing.py), with fresh zeros as its first
block's inputs: each placeholder output its own code reads is *needed*, named ``module#call#leaf`` (the module's
dotted name, which of its calls in one forward, which tensor of that call's output). The stages exchange their
needs (one broadcast from each stage) and every stage derives the same :class:`RelayPlan`:

* the owner stage ``o`` of the module captures that output (a forward hook on the real module) and adds it to its
  activation message as a third element, ``(args, kwargs, {key: tensor})``;
* every stage between ``o`` and the last reader passes it on, and its placeholder for the module returns it;
* the readers' placeholders return the received tensor instead of zeros, so the code that reads it (and what is
  computed from it: a ``* scale``, a dropout) runs on the real value.

Gradients come back the same way with no extra code: a received tensor is a leaf whose gradient the stage sends
upstream, and a stage that passes a received tensor on also lists it among its outputs, so the gradient it gets
for it is added to its own reads' gradient before it goes further up. What still cannot cross is refused with the
module's name: at setup, a call that runs after its owner's stage has ended (one module used at two places); at the
first forward, a value changed in place after it was captured, or one the probe's path did not read.

[Note: late relays]
A module can be called again after its stage has ended: T5's one ``nn.Embedding`` embeds the encoder's tokens
(stage 0) and, after the encoder's last layer, the decoder's; BART's decoder embedding is tied to the encoder's and
is given to stage 0 with it (plan.py). Its owner then makes the later call too, *late*: at its egress it keeps the
next stage's block inputs and goes on through the step -- the other stages' blocks are pass-through placeholders,
next to nothing -- until the module's later call has run, then ends the forward and sends both. This holds when
that call's inputs do not derive from any placeholder (the decoder's token ids come with the batch): the setup
probe runs every stage on past its egress and records, as ``late``, the calls of its own modules made there from
clean inputs; a value read elsewhere that is neither made before the owner's end nor late is refused, naming it.
The gradient comes back with the activation's, so the owner's one backward covers both uses of the weight.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_paci.engine.transport.messages import flatten
from lightning_paci.partition.carve import CrossingError, StageCarve, StageDone, removed_modules
from lightning_paci.partition.crossing import CrossingCheck
from lightning_paci.partition.placeholder import Placeholder
from lightning_paci.partition.plan import PartitionPlan

__all__ = ["Needs", "Relay", "RelayPlan", "StageProbe", "install_relays", "plan_relays", "probe_crossings"]

Needs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # "module#call#leaf" -> shape, dtype (probe micro-batch)


@dataclass(frozen=True)
class StageProbe:
    """What one stage's probe forward found: the placeholder outputs its own part reads (``needs``, stages
    ``s > 0``), and how often each module it runs was called before the stage ended (``calls``)."""

    needs: Needs
    calls: dict[str, int]
    late: frozenset[str] = frozenset()  # "module#call": calls made after the egress from clean inputs


@dataclass(frozen=True)
class Relay:
    """One value relayed from stage ``owner`` (which runs ``module``) to stage ``last`` (its last reader)."""

    key: str  # "module#call#leaf"
    owner: int
    last: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    late: bool = False  # made after the owner's egress ([Note: late relays])

    @property
    def module(self) -> str:
        return self.key.split("#")[0]

    @property
    def call(self) -> int:
        return int(self.key.split("#")[1])

    @property
    def leaf(self) -> int:
        return int(self.key.split("#")[2])

    @property
    def nbytes(self) -> int:
        """Bytes per message at the probe's micro-batch size."""
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RelayPlan:
    """Every relayed value of a partition, the same on every stage."""

    relays: tuple[Relay, ...] = ()

    def sends(self, stage: int) -> tuple[str, ...]:
        """The keys stage ``stage``'s activation message carries: made here or received, read further down."""
        return tuple(r.key for r in self.relays if r.owner <= stage < r.last)

    def bytes_sent(self, stage: int) -> int:
        """Relayed bytes in one of the stage's activation messages (the probe's micro-batch size)."""
        return sum(r.nbytes for r in self.relays if r.owner <= stage < r.last)

    def describe(self) -> str:
        if not self.relays:
            return ""
        parts = [f"{r.module} (call {r.call}, tensor {r.leaf}, {tuple(r.shape)} {str(r.dtype).removeprefix('torch.')}"
                 f", {r.nbytes:,} B{', made late' if r.late else ''}) stage {r.owner} -> {r.last}" for r in self.relays]
        return "relayed per micro-batch: " + "; ".join(parts)


def probe_crossings(module: nn.Module, carve: StageCarve, run_step: Callable[[], Any]) -> StageProbe:
    """Run stage ``carve.stage``'s part of one step (``run_step``: the user's step on a sample micro-batch, no
    backward; the caller undoes side effects) and report what it reads from modules it does not run and how
    often it calls the modules it does run."""
    calls: dict[str, int] = {}  # before the egress
    every: dict[str, int] = {}  # before and after it
    late: set[str] = set()
    removed = set(carve.removed)
    check = CrossingCheck(module, carve, collect=True)
    boundary = carve.boundary

    def count(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            call = every[name] = every.get(name, 0) + 1
            if not boundary.past_egress:
                calls[name] = call
            elif check.clean((args, kwargs)):
                late.add(f"{name}#{call - 1}")
        return hook

    handles = [sub.register_forward_pre_hook(count(name), with_kwargs=True) for name, sub in module.named_modules()
               if name and name not in removed and not isinstance(sub, Placeholder)]  # (a sibling chunk's)
    boundary.begin(None)
    boundary.probing = True
    try:
        # with gradients on, as the training step runs: a stage boundary inside an autograd Function shows here
        with check.watch(), contextlib.suppress(StageDone):
            try:
                run_step()
            except Exception:
                if not boundary.past_egress:
                    raise
                # past the egress the step runs on other stages' placeholders, only to find the late calls: code
                # that fails on their zeros ends the probe there
    finally:
        boundary.probing = False
        boundary.end()
        for handle in handles:
            handle.remove()
    return StageProbe({} if carve.is_first else dict(check.needed), calls, frozenset(late))


def plan_relays(plan: PartitionPlan, probes: Mapping[int, StageProbe]) -> RelayPlan:
    """Combine every stage's probe (``probes[stage]``) into one plan: a value read on several stages travels once,
    to the last of them. A value its owner does not make before its stage ends is refused here, naming it."""
    found: dict[str, Relay] = {}
    for stage in sorted(probes):
        owners = removed_modules(plan, stage)
        for key, (shape, dtype) in sorted(probes[stage].needs.items()):
            name, call = key.split("#")[0], int(key.split("#")[1])
            owner = owners[name][0]
            if owner > stage:
                raise CrossingError(
                    f"Stage {stage} reads the output of `{name}`, which the partition places on the later stage "
                    f"{owner}: it runs before the code that reads it. Place it earlier with `partition=` split "
                    f"indices, or compute it inside the blocks.")
            made = probes[owner].calls.get(name, 0) if owner in probes else call + 1
            late = owner in probes and f"{name}#{call}" in probes[owner].late and call >= made
            if call >= made and not late:
                raise CrossingError(
                    f"Stage {stage} reads call {call} of `{name}` (a module used at {call + 1} places), but `{name}` "
                    f"lives on stage {owner}, which ends after {made} call(s) of it: a module called again after its "
                    f"stage has ended cannot have its output relayed. Give each place its own module, or keep both "
                    f"places on one stage with `partition=`.")
            previous = found.get(key)
            found[key] = Relay(key, owner, max(stage, previous.last if previous else stage), tuple(shape), dtype,
                               late)
    return RelayPlan(tuple(found[k] for k in sorted(found, key=_order)))


def _order(key: str) -> tuple[str, int, int]:
    name, call, leaf = key.split("#")
    return name, int(call), int(leaf)


def install_relays(module: nn.Module, carve: StageCarve, relays: RelayPlan) -> None:
    """Make stage ``carve.stage`` send, pass on and capture its part of ``relays``: capture hooks on the modules
    it runs whose outputs travel (removed with the carve's other hooks)."""
    stage, boundary = carve.stage, carve.boundary
    boundary.sends = relays.sends(stage)
    boundary.late = frozenset(f"{r.module}#{r.call}" for r in relays.relays if r.owner == stage and r.late)
    wanted: dict[str, dict[int, list[Relay]]] = {}
    for relay in relays.relays:
        if relay.owner == stage:
            wanted.setdefault(relay.module, {}).setdefault(relay.call, []).append(relay)
    for name, calls in wanted.items():
        carve.handles.append(module.get_submodule(name).register_forward_hook(
            _capture(boundary, name, calls, stage)))


def _capture(boundary: Any, name: str, calls: dict[int, list[Relay]], stage: int) -> Callable[..., None]:
    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        call = boundary.calls.get(name, 0)
        boundary.calls[name] = call + 1
        for relay in calls.get(call, ()):
            tensors = flatten(output)[1]
            tensor = tensors[relay.leaf]
            boundary.relay_out[relay.key] = tensor
            boundary.versions[relay.key] = tensor._version
        if boundary.past_egress and boundary.late and boundary.late_made():
            boundary.finish(stage)  # the last value made late: the stage ends here
    return hook
