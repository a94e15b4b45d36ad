"""The header of a one-buffer message, and its reuse on each link.

[Note: header reuse]
A pipeline link carries the same form message after message: the same nested structure, the same shapes, dtypes
and flags; what changes is the tensors' bytes and a few Python floats (each micro-batch's logged loss rides
upstream with its gradients). Pickling the structure for every message and unpickling it on the other side was a
large part of a message's host time once the caches are cold (about 0.1 ms each side per message on a 2-core CPU
host after a 10 ms kernel; warm, 4-9 us and 6-7 us). So each sender remembers, per link, the last structure it
pickled; a message of the same structure sends no pickle, only the id of the header it repeats, and the receiver
uses the structure (and its tensor descriptions) it decoded from that header.

"The same structure" is exact: the skeletons compare equal (``==``) *and* every node has the same type in the same
place (so ``True`` never stands for ``1``, nor a tuple for a namedtuple) *and* every dict has the same keys in the
same order. Floats are not part of the structure: each becomes a :class:`FloatSlot` and its value travels as 8
bytes after the header, bit for bit. A structure holding any other kind of leaf (an arbitrary object, which may
change without comparing unequal) is pickled every time, as before. The receiver checks that a repeated header's
id is the one it holds for that link and fails naming both otherwise, so two ends can never silently disagree.

Wire format of a message (point_to_point.py sends it as one buffer, or two when it exceeds ``FIRST_BYTES``)::

    HEADER      blob bytes B (0: the link's last header again), tensor data bytes D, header id, float count K
    blob        B bytes: the pickled skeleton (tensors as TensorMeta, floats as FloatSlot)
    floats      K little-endian float64
    tensors     D bytes from the next ALIGN boundary, each tensor at its 64-byte aligned ``TensorMeta.offset``
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from lightning_paci.engine.transport.messages import ALIGN, TensorMeta, map_leaves, metas_of, rebuild_mapping, unflatten
from lightning_paci.engine.transport.pickle_guard import guarded_dumps

__all__ = ["HEADER", "FloatSlot", "HeaderReader", "HeaderWriter", "frame", "header_bytes", "place_floats"]

HEADER = struct.Struct("<QQQQ")  # blob bytes, tensor data bytes, header id, float count


@dataclass(frozen=True)
class FloatSlot:
    """A float of a message, in its skeleton: the value is the message's ``index``-th float."""

    index: int


_SLOTS = tuple(FloatSlot(i) for i in range(64))  # the common ones, not allocated per message
_PLAIN = frozenset([type(None), bool, int, str, bytes])  # immutable leaves kept in the skeleton as they are


def frame(structure: Any, *, split: bool = False
          ) -> tuple[Any, list[torch.Tensor], list[TensorMeta], list[float], list[Any] | None]:
    """One walk over a message: its skeleton, its tensors and their descriptions (64-byte aligned offsets), its
    floats, and its *form* -- every node's type in walk order, with each dict's keys and their types -- or
    ``None`` when a leaf is of a kind whose changes ``==`` may not show (never reused; see [Note: header reuse]).
    ``split`` (split_wire.py): CPU tensors are described as host bytes (``TensorMeta.host``, their own offsets)."""
    tensors: list[torch.Tensor] = []
    metas: list[TensorMeta] = []
    floats: list[float] = []
    form: list[Any] | None = []
    offset = host_offset = 0

    def walk(node: Any) -> Any:
        nonlocal offset, host_offset, form
        kind = type(node)
        if form is not None:
            form.append(kind)
        if kind is float:
            floats.append(node)
            index = len(floats) - 1
            return _SLOTS[index] if index < len(_SLOTS) else FloatSlot(index)
        if kind in _PLAIN:
            return node
        if kind is tuple or kind is list:
            return kind([walk(v) for v in node])
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            nbytes = node.numel() * node.element_size()
            if split and node.is_cpu:
                meta = TensorMeta(tuple(node.shape), node.dtype, node.requires_grad, host_offset, nbytes, True)
                host_offset += -(-nbytes // ALIGN) * ALIGN
            else:
                meta = TensorMeta(tuple(node.shape), node.dtype, node.requires_grad, offset, nbytes)
                offset += -(-nbytes // ALIGN) * ALIGN
            metas.append(meta)
            return meta
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
            return kind(*[walk(v) for v in node])
        if isinstance(node, (list, tuple)):
            return kind([walk(v) for v in node])
        if isinstance(node, dict):
            if form is not None:
                keys = tuple(node)
                form.append(keys)
                form.append(tuple([type(k) for k in keys]))
            return rebuild_mapping(node, {k: walk(v) for k, v in node.items()})
        form = None  # an arbitrary object: pickled every time
        return node

    skeleton = walk(structure)
    return skeleton, tensors, metas, floats, form


class HeaderWriter:
    """The sending side of [Note: header reuse]: per link, the last header pickled and its id."""

    def __init__(self) -> None:
        self._base = int.from_bytes(os.urandom(4), "little") << 32  # ids of two writers never meet
        self._count = 0
        self._last: dict[Any, tuple[int, list[Any], Any]] = {}  # link -> (id, form, skeleton)
        self.reused = 0  # messages sent with a repeated header

    def header(self, link: tuple[int, int], skeleton: Any, form: list[Any] | None, sender: int) -> tuple[bytes, int]:
        """The blob to send on ``link`` (channel, receiving stage) -- ``b""``: the receiver has it -- and the
        header's id."""
        last = self._last.get(link)
        if form is not None and last is not None and last[1] == form and last[2] == skeleton:
            self.reused += 1
            return b"", last[0]
        blob = guarded_dumps(skeleton, what=f"stage {sender}: the message to stage {link[1]}")
        self._count += 1
        header_id = self._base | self._count
        if form is not None:
            self._last[link] = (header_id, form, skeleton)
        else:
            self._last.pop(link, None)
        return blob, header_id


class HeaderReader:
    """The receiving side of [Note: header reuse]: per link, the last header decoded."""

    def __init__(self) -> None:
        self._last: dict[Any, tuple[int, Any, list[TensorMeta]]] = {}  # link -> (id, skeleton, metas)

    def read(self, link: tuple[int, int], header_id: int, blob: Any, receiver: int) -> tuple[Any, list[TensorMeta]]:
        """The skeleton and its tensor descriptions of a message on ``link`` (channel, sending stage): decoded from
        ``blob``, or the link's last if ``blob`` is empty."""
        if len(blob):
            skeleton = pickle.loads(blob)
            metas = metas_of(skeleton)
            self._last[link] = (header_id, skeleton, metas)
            return skeleton, metas
        last = self._last.get(link)
        if last is None or last[0] != header_id:
            held = "none" if last is None else f"{last[0]:#x}"
            raise AssertionError(f"stage {receiver}: the message from stage {link[1]} repeats header {header_id:#x}, "
                                 f"but the last header received on that link is {held} (both ends of a link must "
                                 f"use one DistComm each)")
        return last[1], last[2]


def header_bytes(layout: struct.Struct, *fields: int, blob: bytes, floats: list[float]) -> bytes:
    """A message's bytes before its tensors': ``layout`` packed with ``fields`` (point_to_point.py's ``HEADER``,
    split_wire.py's ``SPLIT_HEADER``), the blob (empty for a repeated header), the floats as little-endian float64."""
    return layout.pack(*fields) + blob + struct.pack(f"<{len(floats)}d", *floats)


def place_floats(skeleton: Any, tensors: list[torch.Tensor], floats: tuple[float, ...]) -> Any:
    """The received structure: every ``TensorMeta`` replaced by its tensor, every ``FloatSlot`` by its value (no
    floats: ``unflatten``'s walk)."""
    if not floats:
        return unflatten(skeleton, tensors)
    it = iter(tensors)
    leaves = (TensorMeta, FloatSlot)

    def put(leaf: Any) -> Any:
        return floats[leaf.index] if type(leaf) is FloatSlot else next(it)

    return map_leaves(skeleton, leaves, put)
