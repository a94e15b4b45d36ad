"""Messages with the header on the host and the payload on the device: no device synchronisation per message.

[Note: headers on a host side channel]
On a GPU, a message framed as one buffer (comm.py's wire) costs two full device synchronisations: the sender builds
the header on the host and copies it to the device from pageable memory, the receiver copies the header back
(``.cpu()``) before it knows the shapes, waiting for every kernel queued before the receive. So under NCCL each
directed link also gets a gloo communicator of its own for headers (``DistComm(headers=...)``):

    header (gloo, host)     uint8[FIRST_BYTES]: blob length, host bytes, device bytes (8 bytes each), the pickled
                            structure (each tensor a TensorMeta with ``host`` set where it stays on the host), then
                            the host tensors' bytes; the rest in a second operation if it did not fit
    payload (NCCL, device)  uint8[device bytes]: the device tensors' bytes (64-byte aligned offsets), only when
                            there are some

The sender packs the device tensors with device-to-device copies and posts both sends; the receiver's host waits
for the header only (its sender's host posted it when it got there, ahead of its device), then allocates the payload
on the device and posts its receive, which the compute stream waits for without the host. A CPU tensor in a message
(a leaf the user keeps on the host) arrives on the host. Headers repeat a link's structure message after message;
a header costs a few hundred bytes on a host socket. The payload communicators keep the deadlock model's order
(a header is sent just before its payload and received just before it, so it waits only where the payload would).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np
import torch

from lightning_paci.engine.messages import (
    ALIGN,
    FIRST_BYTES,
    TensorMeta,
    as_bytes,
    from_bytes,
    map_leaves,
    metas_of,
    unflatten,
)
from lightning_paci.engine.pickle_guard import guarded_dumps

__all__ = ["SplitFrame", "frame_split", "read_split_header", "unpack_split"]


class SplitFrame:
    """One framed message: the header buffers (host) and the payload buffer (the transport's device, or None)."""

    __slots__ = ("header", "payload", "nbytes")

    def __init__(self, header: list[torch.Tensor], payload: torch.Tensor | None, nbytes: int) -> None:
        self.header, self.payload, self.nbytes = header, payload, nbytes  # nbytes: header + payload, unpadded


def frame_split(payload: Any, device: torch.device, *, what: str) -> SplitFrame:
    """Frame ``payload``: tensors on ``device`` (every tensor when ``device`` is the CPU: tests of this path) go to
    the device buffer, CPU tensors of a device transport stay in the host header."""
    host_offset = device_offset = 0
    host: list[tuple[TensorMeta, torch.Tensor]] = []
    moved: list[tuple[TensorMeta, torch.Tensor]] = []

    def describe(tensor: torch.Tensor) -> TensorMeta:
        nonlocal host_offset, device_offset
        on_host = tensor.device.type == "cpu" and device.type != "cpu"
        nbytes = tensor.numel() * tensor.element_size()
        offset = host_offset if on_host else device_offset
        meta = TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad, offset, nbytes, on_host)
        (host if on_host else moved).append((meta, tensor))
        if on_host:
            host_offset += -(-nbytes // ALIGN) * ALIGN
        else:
            device_offset += -(-nbytes // ALIGN) * ALIGN
        return meta

    skeleton = map_leaves(payload, torch.Tensor, describe)
    blob = guarded_dumps(skeleton, what=what)
    start = -(-(24 + len(blob)) // ALIGN) * ALIGN
    total = start + host_offset
    header = torch.zeros(max(total, FIRST_BYTES), dtype=torch.uint8)
    raw: Any = header.numpy()  # an ndarray: a buffer (numpy declares `__buffer__` for Python >= 3.12 only)
    struct.pack_into("<QQQ", raw, 0, len(blob), host_offset, device_offset)
    raw[24:24 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    for meta, tensor in host:
        if meta.nbytes:
            raw[start + meta.offset: start + meta.offset + meta.nbytes] = as_bytes(tensor).numpy()
    parts = [header[:FIRST_BYTES], header[FIRST_BYTES:total]] if total > FIRST_BYTES else [header]
    buffer = None
    if device_offset:
        buffer = torch.empty(device_offset, dtype=torch.uint8, device=device)
        for meta, tensor in moved:
            if meta.nbytes:
                buffer[meta.offset: meta.offset + meta.nbytes].copy_(as_bytes(tensor))
    return SplitFrame(parts, buffer, total + device_offset)


def read_split_header(first: torch.Tensor, rest: Any) -> tuple[Any, list[torch.Tensor | None], int]:
    """Parse a received header: ``first`` is its first ``FIRST_BYTES`` (host), ``rest(n)`` receives the remaining
    ``n`` bytes. Returns the skeleton, the host tensors in order (None for a device tensor) and the payload's
    byte count."""
    raw: Any = first.numpy()  # an ndarray: a buffer (see above)
    blob_bytes, host_bytes, device_bytes = struct.unpack_from("<QQQ", raw)
    start = -(-(24 + blob_bytes) // ALIGN) * ALIGN
    total = start + host_bytes
    if total > FIRST_BYTES:
        raw = np.concatenate([raw, rest(total - FIRST_BYTES).numpy()])
    skeleton = pickle.loads(raw[24:24 + blob_bytes])
    tensors: list[torch.Tensor | None] = []
    for meta in metas_of(skeleton):
        if not meta.host:
            tensors.append(None)
            continue
        chunk = torch.from_numpy(raw[start + meta.offset: start + meta.offset + meta.nbytes].copy())
        tensors.append(from_bytes(chunk, meta))
    return skeleton, tensors, device_bytes


def unpack_split(skeleton: Any, host: list[torch.Tensor | None], payload: torch.Tensor | None) -> Any:
    """The received structure: host tensors as parsed, device tensors as views of ``payload``."""
    tensors = []
    for meta, tensor in zip(metas_of(skeleton), host):
        if tensor is None:
            if payload is None:
                raise AssertionError("a device tensor in a header without a payload")
            tensor = from_bytes(payload[meta.offset: meta.offset + meta.nbytes], meta)
        tensors.append(tensor.requires_grad_(True) if meta.requires_grad else tensor)
    return unflatten(skeleton, tensors)

