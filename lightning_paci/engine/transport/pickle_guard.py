"""No tensor through pickle: message headers and object collectives carry plain values only.

A tensor that reaches ``pickle`` travels the slow way (its bytes inside the pickle) and, worse, comes back on the
device it was pickled on: a CUDA log value broadcast with ``broadcast_object_list`` lands on ``cuda:0`` of every
rank (a context on GPU 0 per process; a foreign-device tensor in a later collective). A message header pickles the
structure of a payload with its tensors taken out (point_to_point.py), so a tensor inside it means a non-tensor object
that holds tensors -- a transformers ``Cache`` with every upstream layer's keys and values, say -- rode along unseen.

:func:`guarded_dumps` pickles and refuses either case with :class:`TensorPickleError`, naming where the tensor sits
(``what``, then the attribute path, shape, dtype, device). The check costs one substring search of the pickle on
the hot path: every pickled tensor or storage names ``torch._utils`` or ``torch.storage``; only where one appears
(or a plain value happens to contain the words) is the object walked. :func:`check_no_tensors` is the same check
for an object a collective will pickle itself (``broadcast_object_list``, ``gather_object``).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from lightning_paci.errors import TensorPickleError

__all__ = ["TensorPickleError", "check_no_tensors", "guarded_dumps"]

_MARKERS = (b"torch._utils", b"torch.storage")  # every pickled tensor or storage refers to one of them
_DEPTH = 12  # how deep the naming walk looks


def guarded_dumps(obj: Any, *, what: str, host_tensors: bool = False) -> bytes:
    """``pickle.dumps(obj)``, refusing tensors and storages (with ``host_tensors``: refusing those not on the CPU,
    for the few object collectives that carry host state dicts, e.g. checkpoint gathers)."""
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if any(marker in blob for marker in _MARKERS):
        _refuse(obj, what, host_tensors)
    return blob


def check_no_tensors(obj: Any, *, what: str, host_tensors: bool = False) -> None:
    """Raise :class:`TensorPickleError` if pickling ``obj`` would pickle a tensor or storage (with
    ``host_tensors``: one not on the CPU)."""
    _refuse(obj, what, host_tensors)


def _forbidden(value: Any, host_tensors: bool) -> bool:
    if isinstance(value, torch.UntypedStorage):
        return not (host_tensors and value.device.type == "cpu")
    if isinstance(value, torch.TypedStorage):
        return not (host_tensors and value._untyped_storage.device.type == "cpu")
    return isinstance(value, torch.Tensor) and not (host_tensors and value.device.type == "cpu")


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def _allowed() -> None:
    return None


class _Detector(pickle.Pickler):
    """A pickler into nothing that stops at the first forbidden tensor or storage (the authoritative check); an
    allowed host tensor is reduced to a stand-in, so a state dict's bytes are never copied."""

    def __init__(self, host_tensors: bool) -> None:
        super().__init__(_Sink(), protocol=pickle.HIGHEST_PROTOCOL)
        self.host_tensors = host_tensors
        self.found: Any = None

    def reducer_override(self, obj: Any) -> Any:
        if _forbidden(obj, self.host_tensors):
            self.found = obj
            raise _Found
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return _allowed, ()
        return NotImplemented


class _Found(Exception):
    pass


def _refuse(obj: Any, what: str, host_tensors: bool) -> None:
    detector = _Detector(host_tensors)
    try:
        detector.dump(obj)
    except _Found:
        pass
    if detector.found is None:
        return  # the markers were in a plain value
    found = detector.found
    where = _path_to(obj, found) or f"<inside a {type(obj).__name__}>"
    kind = "storage" if not isinstance(found, torch.Tensor) else "tensor"
    shape = f" of shape {tuple(found.shape)} {found.dtype}" if isinstance(found, torch.Tensor) else ""
    device = found.device if not isinstance(found, torch.TypedStorage) else found._untyped_storage.device
    raise TensorPickleError(
        f"{what}: {where} is a {kind}{shape} on {device}, and it would be pickled. Message headers and "
        f"object collectives carry plain values only: a tensor in a non-tensor object crosses stages inside the "
        f"pickle (slowly, and onto the device it was pickled on). Send tensors as tensors (in tuples, lists, "
        f"dicts or namedtuples), or plain numbers (`float(value)`) where a value is only logged."
    )


def _path_to(root: Any, target: Any) -> str | None:
    """The index / attribute path from ``root`` to ``target`` (depth-first, bounded), e.g.
    ``[0][2]<DynamicCache>.layers[1]<DynamicLayer>.keys``."""
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if node is target:
            return path or "the object itself"
        if id(node) in seen or depth >= _DEPTH or isinstance(node, (str, bytes, int, float, torch.Tensor)):
            continue
        seen.add(id(node))
        children: list[tuple[Any, str]] = []
        if isinstance(node, dict):
            children = [(v, f"{path}[{k!r}]") for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(node)]
        else:
            attrs = getattr(node, "__dict__", None)
            if isinstance(attrs, dict):
                children = [(v, f"{path}<{type(node).__name__}>.{k}") for k, v in attrs.items()]
        stack.extend((child, child_path, depth + 1) for child, child_path in reversed(children))
    return None
