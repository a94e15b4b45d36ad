"""Values that reach a stage's own code from modules it does not run: found at the stage's first forward.

On stage ``s > 0`` every module another stage owns is a placeholder returning zeros (carve.py). That is harmless
while those zeros only feed other placeholders and the block inputs the ingress hook replaces. It is a silent
error when they reach code this stage really runs:

* after the ingress (this stage's own blocks, the code between them, the head and the loss): a long skip
  (``head(blocks(h) + h)``), or a value made before the container and passed to every block call (only the first
  local block's inputs are received from the previous stage) -- refused with :class:`CrossingError`;
* before the ingress, a module with buffers outside the container that runs on those zeros (a parameter-free
  ``BatchNorm1d(affine=False)`` after the embedding) updates its running statistics on zeros: it is *foreign* here,
  and its buffers are left out of what this stage contributes to gathered states, so stage 0's copy is kept.

:class:`CrossingCheck` follows the data of one forward: the placeholders' outputs are tainted, and a
``TorchFunctionMode`` taints every result of an op with a tainted input. Metadata reads (``x.shape``, ``x.dtype``)
are not ops, so masks and position embeddings built from an input's form are clean. The mode runs in the first
training forward of each stage only: no cost afterwards.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_paci.partition.carve import CrossingError, StageCarve

__all__ = ["CrossingCheck", "CrossingError"]

Source = frozenset[str]  # the "module#call#leaf" keys of the placeholder outputs a tensor derives from


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _Taint(TorchFunctionMode):
    """Marks every result of an op that reads a tainted tensor; in the local phase, such an op is an error."""

    def __init__(self, check: CrossingCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.check.refuse_foreign_weights(func, (args, kwargs))
        sources = [s for t in _tensors((args, kwargs)) if (s := self.check.source(t)) is not None]
        out = func(*args, **kwargs)
        if self.check._derived:  # the result of an op on another stage's weights alone stands for them too
            _, name = self.check._derived.pop()
            for tensor in _tensors(out):
                if tensor.is_meta:
                    self.check._foreign[id(tensor)] = name
                    self.check._keep.append(tensor)
        if sources:
            source = frozenset().union(*sources)
            if self.check.local:
                self.check.refuse(source, getattr(func, "__name__", str(func)))
            for tensor in _tensors(out):
                self.check.taint(tensor, source)
        return out


class CrossingCheck:
    """One watched forward of a carved stage ``s > 0`` (use :meth:`watch` around it). With ``collect`` the
    placeholder outputs its own part reads are gathered in ``needed`` (the setup probe, partition/relay.py)
    instead of refused."""

    def __init__(self, module: nn.Module, carve: StageCarve, *, collect: bool = False) -> None:
        self.module, self.carve = module, carve
        self.containers = [module.get_submodule(path) for path in carve.plan.containers]
        self.collect = collect
        self.local = False  # after the ingress: this stage's own computation
        self.foreign_buffers: set[str] = set()  # "module.buffer" names whose updates ran on placeholder zeros
        self.needed: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # key -> shape, dtype (collect)
        self._made: dict[str, torch.Tensor] = {}  # key -> the placeholder's output tensor (collect: its form)
        self._tainted: dict[int, tuple[weakref.ref[torch.Tensor], Source]] = {}
        self._foreign: dict[int, tuple[str, str]] = {}  # id of a placeholder's meta tensor -> (owner, dotted name)
        self._derived: list[tuple[Any, tuple[str, str]]] = []  # the op now running reads only foreign meta tensors
        self._keep: list[torch.Tensor] = []  # meta tensors derived from foreign ones: alive while their ids count

    def source(self, tensor: torch.Tensor) -> Source | None:
        entry = self._tainted.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def taint(self, tensor: torch.Tensor, source: Source, *, made: bool = False) -> None:
        """Mark ``tensor`` as derived from ``source``; the first source is kept (the op that made it), except for a
        placeholder's output (``made``), which is that module's value whatever ops the placeholder ran."""
        if made or self.source(tensor) is None:
            self._tainted[id(tensor)] = (weakref.ref(tensor), source)

    def clean(self, value: Any) -> bool:
        """Whether no tensor in ``value`` derives from a placeholder's output."""
        return all(self.source(t) is None for t in _tensors(value))

    def refuse_foreign_weights(self, func: Any, arguments: Any) -> None:
        """An op computing with a parameter or buffer read off a placeholder (a meta tensor of a module another
        stage owns, [Note: placeholders answer attribute reads] in placeholder.py) next to real tensors: stop, naming
        it."""
        if self.carve.boundary.in_shadow:
            return  # a placeholder finding its output's form: every tensor there is meant to be meta
        tensors = list(_tensors(arguments))
        if not any(t.is_meta for t in tensors):
            return
        name = next((self._foreign[id(t)] for t in tensors if t.is_meta and id(t) in self._foreign), None)
        if name is None:
            return
        if all(t.is_meta for t in tensors):  # a view or a function of another stage's weight (`weight.T`, then `@`)
            self._derived.append((func, name))
            return
        owner, tensor = name
        raise CrossingError(
            f"Stage {self.carve.stage} computes with `{tensor}` (in `{getattr(func, '__name__', func)}`), a "
            f"parameter or buffer of a module that {owner} runs: this stage holds only its form. Call the module "
            f"and use its output (which can cross stages) instead of reading its weights, or keep the code that reads "
            f"them on the same stage with `partition=` split indices.")

    def refuse(self, source: Source, op: str) -> None:
        if self.collect:
            for key in source:
                made = self._made[key]
                self.needed[key] = (tuple(made.shape), made.dtype)
            return
        plan = self.carve.plan
        stage, first = self.carve.stage, plan.block_names[plan.blocks(self.carve.stage).start]
        name = min(source).split("#")[0]
        raise CrossingError(
            f"Stage {stage} would compute with zeros: `{op}` in its own part of the step (block `{first}` "
            f"onwards) reads a value computed by `{name}`, which "
            f"{getattr(self.module.get_submodule(name), 'owner', 'another stage')} runs; this stage holds only a "
            f"placeholder for it, and the value was not found as crossing when the stages were set up (the setup "
            f"probe's forward took another path). Make the step's control flow independent of the data, or "
            f"compute the value inside the blocks (carry it as part of their input and output)."
        )

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        handles = []

        calls: dict[str, int] = {}

        def tainting(name: str) -> Any:
            def hook(_module: nn.Module, args: Any, output: Any) -> None:
                call = calls.get(name, 0)
                calls[name] = call + 1
                # a pass-through block returns its input, a relayed value is the real one: neither is new
                real = {id(t) for t in _tensors(args)} | {id(t) for t in self.carve.boundary.relay_in.values()}
                for leaf, tensor in enumerate(_tensors(output)):
                    if id(tensor) not in real:
                        key = f"{name}#{call}#{leaf}"
                        self._made[key] = tensor
                        self.taint(tensor, frozenset((key,)), made=True)
            return hook

        def ingress(*_: Any) -> None:
            self.local = True

        def buffered(name: str) -> Any:
            def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
                if self.carve.boundary.past_egress:
                    return
                if not self.local and any(self.source(t) for t in _tensors((args, kwargs))):
                    self.foreign_buffers.update(f"{name}.{b}" if name else b for b, _ in
                                                _module.named_buffers(recurse=False))
            return hook

        inside = {id(m) for container in self.containers for m in container.modules()}
        stand_ins = self.carve.stand_ins  # a sibling chunk's modules too: their placeholders return its values
        for name, shadow in stand_ins.items():
            owner = getattr(self.module.get_submodule(name), "owner", "another stage")
            for tensor_name, tensor in [*shadow.named_parameters(), *shadow.named_buffers()]:
                self._foreign[id(tensor)] = (owner, f"{name}.{tensor_name}")
        for name in [*self.carve.removed_params, *self.carve.shadowed_params]:  # read in the chunk's layout
            holder, _, attr = name.rpartition(".")
            meta = (self.module.get_submodule(holder) if holder else self.module).__dict__.get(attr)
            if isinstance(meta, torch.Tensor):
                owner = f"stage {dict(self.carve.plan.direct)[name]}"
                self._foreign[id(meta)] = (owner, name)
        for name in stand_ins:
            handles.append(self.module.get_submodule(name).register_forward_hook(tainting(name)))
        for name, sub in self.module.named_modules():
            if id(sub) not in inside and any(True for _ in sub.buffers(recurse=False)):
                handles.append(sub.register_forward_pre_hook(buffered(name), with_kwargs=True))
        def egress(_module: nn.Module, args: Any, kwargs: Any) -> None:
            # what the next stage's first block gets is read there: a placeholder's zeros must not travel on
            sources = [s for t in _tensors((args, kwargs)) if (s := self.source(t)) is not None]
            if sources:
                self.refuse(frozenset().union(*sources), "the inputs sent to the next stage")
            self.local = False  # what runs after it (values made late, [Note: late relays]) is not read here

        plan = self.carve.plan
        blocks = plan.blocks(self.carve.stage)
        if not self.carve.is_first:  # after carve's ingress
            handles.append(self.module.get_submodule(plan.block_names[blocks.start]).register_forward_pre_hook(
                ingress))
        if not self.carve.is_last:  # before carve's egress hook, which ends the forward
            handles.append(self.module.get_submodule(plan.block_names[blocks.stop]).register_forward_pre_hook(
                egress, with_kwargs=True, prepend=True))
        try:
            # compiled blocks (compile="blocks") run eagerly under the check: the taint mode sees each op, and the
            # compiler does not trace the mode's Python (a dozen recompiles) for a forward that runs once
            with torch.compiler.set_stance("force_eager"), _Taint(self):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._tainted.clear()
            self._made.clear()
            self._foreign.clear()
            self._keep.clear()
            self.local = False
