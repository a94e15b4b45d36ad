"""Messages with the header on the host and the payload on the device: no device synchronisation per message.

[Note: headers on a host side channel]
On a GPU, a message framed as one buffer (point_to_point.py's wire) costs two full device synchronisations: the sender
builds the header on the host and copies it to the device from pageable memory, the receiver copies the header back
(``.cpu()``) before it knows the shapes, waiting for every kernel queued before the receive. So under NCCL the
headers go to the gloo group of every rank (``DistComm(headers=...)``), each link's with its own tag ([Note: one tag
per link] in groups.py), and the payloads to the link's own NCCL group:

    header (gloo, host)     uint8[FIRST_BYTES]: blob length, host bytes, device bytes, header id, float count (8
                            bytes each), the pickled structure (each tensor a TensorMeta with ``host`` set where it
                            stays on the host; nothing when the link's structure repeats, [Note: header reuse]), the
                            floats, then the host tensors' bytes; the rest in a second operation if it did not fit
    payload (NCCL, device)  uint8[device bytes]: the device tensors' bytes (64-byte aligned offsets), only when
                            there are some (a message whose device tensors are all empty has none)

The sender packs the device tensors with device-to-device copies and posts both sends; the receiver's host waits
for the header only (its sender's host posted it when it got there, ahead of its device), then allocates the payload
on the device and posts its receive, which the compute stream waits for without the host. A CPU tensor in a message
(a leaf the user keeps on the host) arrives on the host. A header costs a few dozen to a few hundred bytes on a
host socket. The payload communicators keep the deadlock model's order
(a header is sent just before its payload and received just before it, so it waits only where the payload would).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_paci.engine.transport.messages import (
    ALIGN,
    FIRST_BYTES,
    TensorMeta,
    as_bytes,
    from_bytes,
    metas_of,
)
from lightning_paci.engine.transport.pickle_guard import guarded_dumps
from lightning_paci.engine.transport.wire import HeaderReader, HeaderWriter, frame, header_bytes, place_floats

__all__ = ["SPLIT_HEADER", "SplitFrame", "SplitHeader", "frame_split", "read_split_header", "unpack_split"]

SPLIT_HEADER = struct.Struct("<QQQQQ")  # blob bytes, host bytes, device bytes, header id, float count


class SplitFrame:
    """One framed message: the header buffers (host) and the payload buffer (the transport's device, or None)."""

    __slots__ = ("header", "payload", "nbytes")

    def __init__(self, header: list[torch.Tensor], payload: torch.Tensor | None, nbytes: int) -> None:
        self.header, self.payload, self.nbytes = header, payload, nbytes  # nbytes: header + payload, unpadded


def frame_split(payload: Any, device: torch.device, *, what: str = "a message", writer: HeaderWriter | None = None,
                link: tuple[int, int] = (0, 0), sender: int = 0) -> SplitFrame:
    """Frame ``payload``: tensors on ``device`` (every tensor when ``device`` is the CPU: tests of this path) go to
    the device buffer, CPU tensors of a device transport stay in the host header. With ``writer``, the structure
    is sent once per ``link`` while it repeats ([Note: header reuse]); ``what`` names the message otherwise."""
    skeleton, tensors, metas, floats, form = frame(payload, split=device.type != "cpu")
    if writer is not None:
        blob, header_id = writer.header(link, skeleton, form, sender)
    else:
        blob, header_id = guarded_dumps(skeleton, what=what), 0
    host = [(m, t) for m, t in zip(metas, tensors) if m.host]
    moved = [(m, t) for m, t in zip(metas, tensors) if not m.host]
    host_bytes = _end(host)
    device_bytes = _end(moved)
    fields = (len(blob), host_bytes, device_bytes, header_id, len(floats))
    head = header_bytes(SPLIT_HEADER, *fields, blob=blob, floats=floats)
    start = -(-len(head) // ALIGN) * ALIGN
    total = start + host_bytes
    header = torch.zeros(max(total, FIRST_BYTES), dtype=torch.uint8)
    raw: Any = header.numpy()  # an ndarray: a buffer (numpy declares `__buffer__` for Python >= 3.12 only)
    raw[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    for meta, tensor in host:
        if meta.nbytes:
            raw[start + meta.offset: start + meta.offset + meta.nbytes] = as_bytes(tensor).numpy()
    parts = [header[:FIRST_BYTES], header[FIRST_BYTES:total]] if total > FIRST_BYTES else [header]
    buffer = None
    if device_bytes:
        buffer = torch.empty(device_bytes, dtype=torch.uint8, device=device)
        for meta, tensor in moved:
            if meta.nbytes:
                buffer[meta.offset: meta.offset + meta.nbytes].copy_(as_bytes(tensor))
    return SplitFrame(parts, buffer, total + device_bytes)


def _end(described: list[tuple[TensorMeta, torch.Tensor]]) -> int:
    """Bytes of a packed region: the last tensor's aligned end."""
    if not described:
        return 0
    meta = described[-1][0]
    return meta.offset + -(-meta.nbytes // ALIGN) * ALIGN


class SplitHeader(NamedTuple):
    """A received header, parsed: what ``unpack_split`` needs besides the payload."""

    skeleton: Any
    metas: list[TensorMeta]
    host: list[torch.Tensor | None]  # the host tensors in order, None for a device tensor
    floats: tuple[float, ...]
    device_bytes: int


def read_split_header(first: torch.Tensor, rest: Any, *, reader: HeaderReader | None = None,
                      link: tuple[int, int] = (0, 0), receiver: int = 0) -> SplitHeader:
    """Parse a received header: ``first`` is its first ``FIRST_BYTES`` (host), ``rest(n)`` receives the remaining
    ``n`` bytes; ``reader`` holds the links' structures ([Note: header reuse])."""
    raw: Any = first.numpy()  # an ndarray: a buffer (see above)
    blob_bytes, host_bytes, device_bytes, header_id, count = SPLIT_HEADER.unpack_from(raw)
    head = SPLIT_HEADER.size + blob_bytes + 8 * count
    start = -(-head // ALIGN) * ALIGN
    total = start + host_bytes
    if total > FIRST_BYTES:
        raw = np.concatenate([raw, rest(total - FIRST_BYTES).numpy()])
    blob = raw[SPLIT_HEADER.size:SPLIT_HEADER.size + blob_bytes]
    if reader is not None:
        skeleton, metas = reader.read(link, header_id, blob, receiver)
    else:
        skeleton = pickle.loads(blob)
        metas = metas_of(skeleton)
    floats = struct.unpack_from(f"<{count}d", raw, SPLIT_HEADER.size + blob_bytes) if count else ()
    tensors: list[torch.Tensor | None] = []
    for meta in metas:
        if not meta.host:
            tensors.append(None)
            continue
        chunk = torch.from_numpy(raw[start + meta.offset: start + meta.offset + meta.nbytes].copy())
        tensors.append(from_bytes(chunk, meta))
    return SplitHeader(skeleton, metas, tensors, floats, device_bytes)


def unpack_split(header: SplitHeader, payload: torch.Tensor | None, *, device: torch.device | None = None) -> Any:
    """The received structure: host tensors as parsed, device tensors as views of ``payload``. A message whose
    device tensors are all empty (no elements) has no payload: its empty tensors are made on ``device``, the
    transport's."""
    tensors = []
    for meta, tensor in zip(header.metas, header.host):
        if tensor is None:
            if payload is not None:
                tensor = from_bytes(payload[meta.offset: meta.offset + meta.nbytes], meta)
            elif not meta.nbytes and device is not None:
                tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            else:
                raise AssertionError(f"a device tensor of {meta.nbytes} bytes in a header without a payload "
                                     f"(device {device})")
        tensors.append(tensor.requires_grad_(True) if meta.requires_grad else tensor)
    return place_floats(header.skeleton, tensors, header.floats)
