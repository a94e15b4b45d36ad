"""The structure of a message: nested tuples / lists / dicts of tensors and plain values, as a skeleton and tensors.

``flatten`` replaces every tensor by a :class:`TensorMeta` (shape, dtype, ``requires_grad``, where its bytes sit)
and returns the tensors in order; ``unflatten`` puts tensors back. The transports (point_to_point.py's one-buffer wire,
split_wire.py's host header + device payload, the reference executor's mailboxes) frame the skeleton and the
tensors; the carve and the records walk payloads with the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_paci.errors import StageMismatchError

__all__ = ["ALIGN", "FIRST_BYTES", "StageMismatchError", "TensorMeta", "as_bytes", "describe", "flatten",
           "from_bytes", "map_leaves", "map_tensors", "metas_of", "rebuild_mapping", "unflatten"]


FIRST_BYTES = 16384
ALIGN = 64


@dataclass(frozen=True)
class TensorMeta:
    """A tensor of a message, as its header describes it (the skeleton holds one in the tensor's place)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    offset: int = 0  # byte offset in the packed data message
    nbytes: int = 0
    host: bool = False  # headers on a side channel (split_wire.py): the bytes travel in the host header


def map_leaves(node: Any, leaf_type: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """Rebuild a nested tuple / namedtuple / list / dict structure with ``fn`` applied to its ``leaf_type`` leaves
    (in depth-first order); other leaves are kept as they are."""
    # list comprehensions, not generators: a message's walk is per micro-batch, and each step of a generator is
    # one more Python call
    if isinstance(node, leaf_type):
        return fn(node)
    kind = type(node)
    if kind in _PLAIN:
        return node
    if kind is tuple or kind is list:
        return kind([map_leaves(v, leaf_type, fn) for v in node])
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
        return kind(*[map_leaves(v, leaf_type, fn) for v in node])
    if isinstance(node, (list, tuple)):
        return kind([map_leaves(v, leaf_type, fn) for v in node])
    if isinstance(node, dict):
        return rebuild_mapping(node, {k: map_leaves(v, leaf_type, fn) for k, v in node.items()})
    return node


_PLAIN = frozenset([type(None), bool, int, float, str, bytes])  # leaves that are never a container


def flatten(structure: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor by a ``TensorMeta`` (the skeleton) and return the tensors in order."""
    skeleton, tensors, _ = describe(structure)
    return skeleton, tensors


def describe(structure: Any) -> tuple[Any, list[torch.Tensor], list[TensorMeta]]:
    """``flatten`` plus the metas in order (one walk: a message is described once per send)."""
    tensors: list[torch.Tensor] = []
    metas: list[TensorMeta] = []
    offset = 0

    def describe(tensor: torch.Tensor) -> TensorMeta:
        nonlocal offset
        if type(tensor) is not torch.Tensor and type(tensor).__name__ == "DTensor":  # [Note: tensor parallelism
            raise StageMismatchError(  # in a stage]: a subclass check of the name only, no import per message
                f"A DTensor of shape {tuple(tensor.shape)} ({tensor.placements}) reached a stage boundary: what "  # type: ignore[attr-defined]
                f"crosses between stages is a plain tensor, the same on every tensor-parallel rank. End the "
                f"stage's last block with a plan whose output is local and replicated (`RowwiseParallel()`, or "
                f"`use_local_output=True`).")
        tensors.append(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        meta = TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad, offset, nbytes)
        metas.append(meta)
        offset += -(-nbytes // ALIGN) * ALIGN
        return meta

    return map_leaves(structure, torch.Tensor, describe), tensors, metas


def rebuild_mapping(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """Keep dict subclasses (e.g. transformers' ModelOutput) when their constructor accepts the items."""
    if type(original) is dict:
        return items
    try:
        return type(original)(**items)
    except TypeError:
        return items


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)
    return map_leaves(skeleton, TensorMeta, lambda _: next(it))


def metas_of(skeleton: Any) -> list[TensorMeta]:
    """The tensor descriptions of a skeleton, in the order ``flatten`` found the tensors."""
    found: list[TensorMeta] = []
    map_leaves(skeleton, TensorMeta, found.append)
    return found


def map_tensors(structure: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    skeleton, tensors = flatten(structure)
    return unflatten(skeleton, [fn(t) for t in tensors])


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device (a view where possible; bool as one byte each)."""
    flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1)
    return flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)


def from_bytes(chunk: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, from its bytes (a flat uint8 tensor): a view where the dtype allows."""
    tensor = chunk.to(torch.bool) if meta.dtype == torch.bool else chunk.view(meta.dtype)
    return tensor.reshape(meta.shape)
