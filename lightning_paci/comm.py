"""Point-to-point messages between neighbouring stages: nested tuples / lists / dicts of tensors and plain values.

Every message carries its own header (shapes, dtypes, ``requires_grad`` flags, and the non-tensor leaves), so sequence
lengths and batch sizes may change from one micro-batch to the next without any re-setup.

Wire format of one message from ``src`` to ``dst`` (all on one process group, in order)::

    int64[1]   header length L
    uint8[L]   pickled structure; each tensor replaced by _TensorMeta(shape, dtype, requires_grad)
    tensor_i   one message per tensor, in structure order

Sends never block the caller (``isend``); their handles are kept and reaped later, so two neighbours sending to each
other at the same time cannot deadlock (waiting on a send right after posting it did hang in the prototype).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Comm", "DistComm", "LocalComm", "StageMismatchError", "flatten", "unflatten"]


class StageMismatchError(RuntimeError):
    """A message between stages does not have the form the receiver can use."""


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def flatten(structure: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor by a ``_TensorMeta`` (the skeleton) and return the tensors in order."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return _TensorMeta(tuple(node.shape), node.dtype, node.requires_grad)
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
            return type(node)(*(walk(v) for v in node))
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(structure), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)

    def walk(node: Any) -> Any:
        if isinstance(node, _TensorMeta):
            return next(it)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(walk(v) for v in node))
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton)


def _metas(skeleton: Any) -> list[_TensorMeta]:
    found: list[_TensorMeta] = []

    def walk(node: Any) -> None:
        if isinstance(node, _TensorMeta):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)

    walk(skeleton)
    return found


class Comm(Protocol):
    """What the runtime needs from a transport. ``stage`` arguments are pipeline stage indices."""

    def send(self, payload: Any, stage: int) -> None: ...

    def recv(self, stage: int) -> Any: ...

    def ready(self, stage: int) -> bool: ...

    def flush(self) -> None: ...


class DistComm:
    """torch.distributed transport (gloo on CPU, NCCL on CUDA). ``ranks[s]`` is the global rank of stage ``s``."""

    def __init__(self, ranks: list[int], *, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        self._ranks = ranks
        self._group = group
        self._device = device or torch.device("cpu")
        self._pending: deque[tuple[Any, list[torch.Tensor]]] = deque()

    def send(self, payload: Any, stage: int) -> None:
        dst = self._ranks[stage]
        skeleton, tensors = flatten(payload)
        header = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8).to(self._device)
        length = torch.tensor([header.numel()], dtype=torch.int64, device=self._device)
        # detached, contiguous and on the transport's device; kept alive until the send completes
        wire = [length, header] + [t.detach().to(self._device).contiguous() for t in tensors]
        for tensor in wire:
            work = dist.isend(tensor, dst, group=self._group)
            self._pending.append((work, [tensor]))
        self._reap()

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def recv(self, stage: int) -> Any:
        src = self._ranks[stage]
        length = torch.empty(1, dtype=torch.int64, device=self._device)
        dist.recv(length, src, group=self._group)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
        dist.recv(header, src, group=self._group)
        skeleton = pickle.loads(header.cpu().numpy().tobytes())
        tensors = []
        for meta in _metas(skeleton):
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self._device)
            dist.recv(tensor, src, group=self._group)
            if meta.requires_grad:
                tensor.requires_grad_(True)
            tensors.append(tensor)
        self._reap()
        return unflatten(skeleton, tensors)

    def ready(self, stage: int) -> bool:
        return True  # a blocking receive simply waits

    def flush(self) -> None:
        """Wait until every posted send has completed (before a drain ends, a checkpoint, or teardown)."""
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait()


class LocalComm:
    """In-process mailboxes for the one-process reference executor: ``LocalComm.network(n)`` gives each stage its
    endpoint. A message is copied on send, as a real transport would."""

    def __init__(self, stage: int, boxes: dict[tuple[int, int], deque[Any]]) -> None:
        self._stage = stage
        self._boxes = boxes

    @staticmethod
    def network(num_stages: int) -> list[LocalComm]:
        boxes: dict[tuple[int, int], deque[Any]] = {(s, d): deque() for s in range(num_stages) for d in range(num_stages)}
        return [LocalComm(s, boxes) for s in range(num_stages)]

    def send(self, payload: Any, stage: int) -> None:
        skeleton, tensors = flatten(payload)
        self._boxes[(self._stage, stage)].append((skeleton, [t.detach().clone() for t in tensors]))

    def recv(self, stage: int) -> Any:
        box = self._boxes[(stage, self._stage)]
        if not box:
            raise StageMismatchError(f"stage {self._stage}: nothing to receive from stage {stage} (reference executor order bug)")
        skeleton, tensors = box.popleft()
        for meta, tensor in zip(_metas(skeleton), tensors):
            if meta.requires_grad:
                tensor.requires_grad_(True)
        return unflatten(skeleton, tensors)

    def ready(self, stage: int) -> bool:
        return bool(self._boxes[(stage, self._stage)])

    def flush(self) -> None:
        pass


def map_tensors(structure: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    skeleton, tensors = flatten(structure)
    return unflatten(skeleton, [fn(t) for t in tensors])
