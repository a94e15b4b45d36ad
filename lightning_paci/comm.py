"""Point-to-point messages between neighbouring stages: nested tuples / lists / dicts of tensors and plain values.

Every message carries its own header (shapes, dtypes, ``requires_grad`` flags, and the non-tensor leaves), so sequence
lengths and batch sizes may change from one micro-batch to the next without any re-setup.

Wire format of one message from ``src`` to ``dst`` (all on one process group, in order)::

    uint8[FIRST_BYTES]  8-byte little-endian header length L, 8-byte data length D, the pickled structure (each
                        tensor replaced by _TensorMeta(shape, dtype, requires_grad, offset, nbytes)), then -- if
                        everything fits -- the tensors' bytes (64-byte aligned offsets)
    uint8[rest]         only when the above did not fit: the remaining header bytes and all tensor bytes

A small message (hidden states of a small model, gradients, log records) is one point-to-point operation, a large
one two. In a 1F1B steady state every message is on the critical path, so per-message latency *is* the pipeline
bubble: one operation per tensor plus a length message cost 3-4x more on gloo than this.

Sends never block the caller (``isend``); their handles are kept and reaped later, so two neighbours sending to each
other at the same time cannot deadlock (waiting on a send right after posting it did hang in the prototype).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_paci.schedules.rendezvous import Communicator, communicator

__all__ = ["Comm", "DistComm", "LocalComm", "StageMismatchError", "flatten", "unflatten"]


class StageMismatchError(RuntimeError):
    """A message between stages does not have the form the receiver can use."""


FIRST_BYTES = 16384
_ALIGN = 64


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    offset: int = 0  # byte offset in the packed data message
    nbytes: int = 0


def _map_leaves(node: Any, leaf_type: type, fn: Callable[[Any], Any]) -> Any:
    """Rebuild a nested tuple / namedtuple / list / dict structure with ``fn`` applied to its ``leaf_type`` leaves
    (in depth-first order); other leaves are kept as they are."""
    if isinstance(node, leaf_type):
        return fn(node)
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
        return type(node)(*(_map_leaves(v, leaf_type, fn) for v in node))
    if isinstance(node, (list, tuple)):
        return type(node)(_map_leaves(v, leaf_type, fn) for v in node)
    if isinstance(node, dict):
        return _rebuild_mapping(node, {k: _map_leaves(v, leaf_type, fn) for k, v in node.items()})
    return node


def flatten(structure: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor by a ``_TensorMeta`` (the skeleton) and return the tensors in order."""
    tensors: list[torch.Tensor] = []
    offset = 0

    def describe(tensor: torch.Tensor) -> _TensorMeta:
        nonlocal offset
        tensors.append(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        meta = _TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad, offset, nbytes)
        offset += -(-nbytes // _ALIGN) * _ALIGN
        return meta

    return _map_leaves(structure, torch.Tensor, describe), tensors


def _rebuild_mapping(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """Keep dict subclasses (e.g. transformers' ModelOutput) when their constructor accepts the items."""
    if type(original) is dict:
        return items
    try:
        return type(original)(**items)
    except TypeError:
        return items


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)
    return _map_leaves(skeleton, _TensorMeta, lambda _: next(it))


def _metas(skeleton: Any) -> list[_TensorMeta]:
    found: list[_TensorMeta] = []
    _map_leaves(skeleton, _TensorMeta, found.append)
    return found


class Comm(Protocol):
    """What the runtime needs from a transport. ``stage`` arguments are pipeline stage indices; ``channel`` 0
    carries the pipeline's activations and gradients, channel 1 the tied-weight exchange between the first and last
    stage, so the two streams can never be received out of order (for 2 stages they share the pair of ranks)."""

    def send(self, payload: Any, stage: int, channel: int = 0) -> None: ...

    def recv(self, stage: int, channel: int = 0) -> Any: ...

    def ready(self, stage: int, channel: int = 0) -> bool: ...

    def flush(self) -> None: ...


class DistComm:
    """torch.distributed transport (gloo on CPU, NCCL on CUDA). ``ranks[s]`` is the global rank of stage ``s``.

    ``groups`` maps each communicator of ``layout`` (``schedules.layout_communicators``) to its process group: with
    the ``"directed"`` layout activations and gradients of each neighbour pair travel on their own communicators,
    which the strict rendezvous model proves deadlock-free under NCCL ([Note: rendezvous]). Without ``groups``
    every message uses the default group (buffered gloo only: tests and benchmarks of the transport itself)."""

    def __init__(self, ranks: list[int], *, groups: Mapping[Communicator, dist.ProcessGroup] | None = None,
                 layout: str = "directed", replica: int = 0, device: torch.device | None = None) -> None:
        self._ranks = ranks
        self._groups = groups
        self._stage = ranks.index(dist.get_rank()) if groups is not None else -1
        self._layout, self._replica = layout, replica
        self._group_of: dict[tuple[int, int, int], dist.ProcessGroup | None] = {}  # (channel, src, dst) -> group
        self._device = device or torch.device("cpu")
        self._pending: deque[tuple[Any, list[torch.Tensor]]] = deque()

    def _group(self, channel: int, src: int, dst: int) -> dist.ProcessGroup | None:
        key = (channel, src, dst)
        if key not in self._group_of:  # once per neighbour and direction: sends and receives are per micro-batch
            kind = "T" if channel == 1 else ("F" if src < dst else "B")
            self._group_of[key] = None if self._groups is None else \
                self._groups[communicator(self._layout, kind, src, dst, self._replica)]
        return self._group_of[key]

    def send(self, payload: Any, stage: int, channel: int = 0) -> None:
        dst = self._ranks[stage]
        group = self._group(channel, self._stage, stage)
        skeleton, tensors = flatten(payload)
        metas = _metas(skeleton)
        blob = pickle.dumps(skeleton)
        data_bytes = metas[-1].offset + metas[-1].nbytes if metas else 0
        head = 16 + len(blob)
        start = -(-head // _ALIGN) * _ALIGN  # tensor bytes start aligned after the header
        total = start + data_bytes
        buffer = torch.empty(max(total, FIRST_BYTES), dtype=torch.uint8)
        buffer[:head] = torch.frombuffer(
            bytearray(len(blob).to_bytes(8, "little") + data_bytes.to_bytes(8, "little") + blob), dtype=torch.uint8
        )
        buffer = buffer.to(self._device)
        for meta, tensor in zip(metas, tensors):
            if meta.nbytes:
                flat = tensor.detach().reshape(-1)
                flat = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)
                buffer[start + meta.offset: start + meta.offset + meta.nbytes].copy_(flat)
        wire = [buffer[:FIRST_BYTES]]
        if total > FIRST_BYTES:
            wire.append(buffer[FIRST_BYTES:total])
        for tensor in wire:  # kept alive until the send completes
            self._pending.append((dist.isend(tensor, dst, group=group), [tensor]))
        self._reap()

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()

    def recv(self, stage: int, channel: int = 0) -> Any:
        src = self._ranks[stage]
        group = self._group(channel, stage, self._stage)
        first = torch.empty(FIRST_BYTES, dtype=torch.uint8, device=self._device)
        dist.recv(first, src, group=group)
        prefix = first[:16].cpu().numpy().tobytes()
        head = 16 + int.from_bytes(prefix[:8], "little")
        data_bytes = int.from_bytes(prefix[8:], "little")
        start = -(-head // _ALIGN) * _ALIGN
        total = start + data_bytes
        if total > FIRST_BYTES:
            whole = torch.empty(total, dtype=torch.uint8, device=self._device)
            whole[:FIRST_BYTES] = first
            dist.recv(whole[FIRST_BYTES:], src, group=group)
        else:
            whole = first
        skeleton = pickle.loads(whole[16:head].cpu().numpy().tobytes())
        tensors = []
        for meta in _metas(skeleton):
            chunk = whole[start + meta.offset: start + meta.offset + meta.nbytes]
            tensor = chunk.to(torch.bool) if meta.dtype == torch.bool else chunk.view(meta.dtype)
            tensor = tensor.reshape(meta.shape)
            if meta.requires_grad:
                tensor = tensor.detach().requires_grad_(True)
            tensors.append(tensor)
        self._reap()
        return unflatten(skeleton, tensors)

    def ready(self, stage: int, channel: int = 0) -> bool:
        return True  # a blocking receive simply waits

    def flush(self) -> None:
        """Wait until every posted send has completed (before a drain ends, a checkpoint, or teardown)."""
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait()


class LocalComm:
    """In-process mailboxes for the one-process reference executor: ``LocalComm.network(n)`` gives each stage its
    endpoint. A message is copied on send, as a real transport would."""

    def __init__(self, stage: int, boxes: dict[tuple[int, int, int], deque[Any]]) -> None:
        self._stage = stage
        self._boxes = boxes

    @staticmethod
    def network(num_stages: int) -> list[LocalComm]:
        boxes: dict[tuple[int, int, int], deque[Any]] = {
            (s, d, c): deque() for s in range(num_stages) for d in range(num_stages) for c in (0, 1)
        }
        return [LocalComm(s, boxes) for s in range(num_stages)]

    def send(self, payload: Any, stage: int, channel: int = 0) -> None:
        skeleton, tensors = flatten(payload)
        self._boxes[(self._stage, stage, channel)].append((skeleton, [t.detach().clone() for t in tensors]))

    def recv(self, stage: int, channel: int = 0) -> Any:
        box = self._boxes[(stage, self._stage, channel)]
        if not box:
            raise StageMismatchError(f"stage {self._stage}: nothing to receive from stage {stage} "
                                     f"(reference executor order bug)")
        skeleton, tensors = box.popleft()
        for meta, tensor in zip(_metas(skeleton), tensors):
            if meta.requires_grad:
                tensor.requires_grad_(True)
        return unflatten(skeleton, tensors)

    def ready(self, stage: int, channel: int = 0) -> bool:
        return bool(self._boxes[(stage, self._stage, channel)])

    def flush(self) -> None:
        pass


def map_tensors(structure: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    skeleton, tensors = flatten(structure)
    return unflatten(skeleton, [fn(t) for t in tensors])
