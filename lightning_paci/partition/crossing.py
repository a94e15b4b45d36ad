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

from lightning_paci.partition.carve import StageCarve

__all__ = ["CrossingCheck", "CrossingError"]


class CrossingError(ValueError):
    """A value computed by a module this stage does not run reaches code it does run."""


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
        source = next((s for t in _tensors((args, kwargs)) if (s := self.check.source(t)) is not None), None)
        out = func(*args, **kwargs)
        if source is not None:
            if self.check.local:
                self.check.refuse(source, getattr(func, "__name__", str(func)))
            for tensor in _tensors(out):
                self.check.taint(tensor, source)
        return out


class CrossingCheck:
    """One watched forward of a carved stage ``s > 0`` (use :meth:`watch` around it)."""

    def __init__(self, module: nn.Module, carve: StageCarve, container: nn.Module) -> None:
        self.module, self.carve, self.container = module, carve, container
        self.local = False  # after the ingress: this stage's own computation
        self.foreign_buffers: set[str] = set()  # "module.buffer" names whose updates ran on placeholder zeros
        self._tainted: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

    def source(self, tensor: torch.Tensor) -> str | None:
        entry = self._tainted.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def taint(self, tensor: torch.Tensor, source: str) -> None:
        if self.source(tensor) is None:  # keep the first source: the module whose output it really is
            self._tainted[id(tensor)] = (weakref.ref(tensor), source)

    def refuse(self, source: str, op: str) -> None:
        stage, first = self.carve.stage, self.carve.plan.blocks(self.carve.stage).start
        raise CrossingError(
            f"Stage {stage} would compute with zeros: `{op}` in its own part of the step (block {first} of "
            f"`{self.carve.plan.container}` onwards) reads a value computed by `{source}`, which "
            f"{getattr(self.module.get_submodule(source), 'owner', 'another stage')} runs; this stage holds only a "
            f"placeholder for it. A value made "
            f"before the block container and used after it (a long skip such as `head(blocks(h) + h)`), or passed "
            f"to every block call, cannot cross the pipeline: only the inputs of each stage's first block travel. "
            f"Compute it inside the blocks (carry it as part of their input and output) or after the container."
        )

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        handles = []

        def tainting(name: str) -> Any:
            def hook(_module: nn.Module, args: Any, output: Any) -> None:
                passed = {id(t) for t in _tensors(args)}  # a pass-through block returns its input: not new
                for tensor in _tensors(output):
                    if id(tensor) not in passed:
                        self.taint(tensor, name)
            return hook

        def ingress(*_: Any) -> None:
            self.local = True

        def buffered(name: str) -> Any:
            def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
                if not self.local and any(self.source(t) for t in _tensors((args, kwargs))):
                    self.foreign_buffers.update(f"{name}.{b}" if name else b for b, _ in
                                                _module.named_buffers(recurse=False))
            return hook

        inside = {id(m) for m in self.container.modules()}
        for name in self.carve.removed:
            handles.append(self.module.get_submodule(name).register_forward_hook(tainting(name)))
        for name, sub in self.module.named_modules():
            if id(sub) not in inside and any(True for _ in sub.buffers(recurse=False)):
                handles.append(sub.register_forward_pre_hook(buffered(name), with_kwargs=True))
        start = self.carve.plan.blocks(self.carve.stage).start
        handles.append(self.container[start].register_forward_pre_hook(ingress))  # after carve's ingress hook
        try:
            with _Taint(self):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._tainted.clear()
            self.local = False
