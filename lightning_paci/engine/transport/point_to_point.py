"""Point-to-point messages between neighbouring stages: nested tuples / lists / dicts of tensors and plain values.

Every message carries its own header (shapes, dtypes, ``requires_grad`` flags, and the non-tensor leaves), so sequence
lengths and batch sizes may change from one micro-batch to the next without any re-setup.

Wire format of one message from ``src`` to ``dst`` (all on one process group, in order)::

    uint8[FIRST_BYTES]  the header (wire.py: blob length, tensor data length, header id, float count), the pickled
                        structure (each tensor replaced by TensorMeta(shape, dtype, requires_grad, offset, nbytes),
                        each float by a FloatSlot; nothing when the link's last structure repeats, [Note: header
                        reuse]), the floats, then -- if everything fits -- the tensors' bytes (64-byte aligned)
    uint8[rest]         only when the above did not fit: the rest

A small message (hidden states of a small model, gradients, log records) is one point-to-point operation, a large
one two. In a 1F1B steady state every message is on the critical path, so per-message latency *is* the pipeline
bubble: one operation per tensor plus a length message cost 3-4x more on gloo than this.

Sends never block the caller (``isend``); their handles are kept and reaped later, so two neighbours sending to each
other at the same time cannot deadlock (waiting on a send right after posting it did hang in the prototype).
"""

from __future__ import annotations

import contextlib
import struct
from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist

from lightning_paci.engine.transport.groups import header_tag
from lightning_paci.engine.transport.messages import (
    ALIGN,
    FIRST_BYTES,
    StageMismatchError,
    TensorMeta,
    as_bytes,
    from_bytes,
)
from lightning_paci.engine.transport.receives_ahead import HeaderWaiter
from lightning_paci.engine.transport.split_wire import SplitHeader, frame_split, read_split_header, unpack_split
from lightning_paci.engine.transport.wire import HEADER, HeaderReader, HeaderWriter, frame, header_bytes, place_floats
from lightning_paci.schedules.communicators import Communicator, communicator

__all__ = ["Comm", "DistComm", "StageMismatchError"]


class Comm(Protocol):
    """What the runtime needs from a transport. ``stage`` arguments are pipeline stage indices; ``channel`` 0
    carries the pipeline's activations and gradients, channel 1 the tied-weight exchange between the first and last
    stage, so the two streams can never be received out of order (for 2 stages they share the pair of ranks)."""

    def send(self, payload: Any, stage: int, channel: int = 0) -> None: ...

    def recv(self, stage: int, channel: int = 0) -> Any: ...

    def ready(self, stage: int, channel: int = 0) -> bool: ...

    def post(self, stage: int) -> None:
        """Receive the next channel-0 message from ``stage`` in the background, ahead of the ``recv`` that takes it
        (a no-op where the transport cannot)."""

    def flush(self) -> None: ...


class DistComm:
    """torch.distributed transport (gloo on CPU, NCCL on CUDA). ``ranks[s]`` is the global rank of stage ``s``.

    ``groups`` maps each communicator of ``layout`` (``schedules.layout_communicators``) to its process group: with
    the ``"directed"`` layout activations and gradients of each neighbour pair travel on their own communicators,
    which the strict deadlock model proves deadlock-free under NCCL ([Note: deadlock model]). Without ``groups``
    every message uses the default group (buffered gloo only: tests and benchmarks of the transport itself).
    ``device`` is where the wire's bytes live (the host under gloo); ``deliver``, where received tensors go when
    that is another device (GPUs over gloo: every message staged through host memory)."""

    def __init__(self, ranks: list[int], *, groups: Mapping[Communicator, dist.ProcessGroup] | None = None,
                 layout: str = "directed", replica: int = 0, device: torch.device | None = None,
                 deliver: torch.device | None = None,
                 headers: dist.ProcessGroup | None = None, stage: int | None = None) -> None:
        self._ranks = ranks
        self._groups = groups
        # ``stage``: which of this rank's stages speaks through it, where the rank holds several ([Note: virtual
        # stages]); otherwise the rank's one stage
        self._stage = stage if stage is not None else ranks.index(dist.get_rank()) if groups is not None else -1
        self._layout, self._replica = layout, replica
        # [Note: headers on a host side channel]: the gloo group of every rank for the headers, a tag per link
        # (NCCL runs; [Note: host groups on a bound world], [Note: one tag per link])
        self._headers = headers
        # (channel, src, dst, header?) -> (group, the peer's rank in it, tag)
        self._routes: dict[tuple[int, int, int, bool], tuple[dist.ProcessGroup, int, int]] = {}
        self._device = device or torch.device("cpu")
        self._host = self._device.type == "cpu"  # messages are built and read through NumPy views (see send)
        # received tensors move there (gloo with GPUs: bytes staged through the host, engine/transport/groups.py)
        self._deliver = deliver if deliver is not None and deliver != self._device else None
        # sends in flight: work, buffer, and for a reusable host buffer its NumPy view (else None)
        self._pending: deque[tuple[Any, torch.Tensor, Any]] = deque()
        self._spare: list[tuple[torch.Tensor, Any]] = []  # FIRST_BYTES host buffers (and views) free for reuse
        # [Note: receives posted ahead]: stage -> (work, buffer) of the posted receive of its next channel-0 message
        self._posted: dict[int, tuple[Any, torch.Tensor]] = {}
        self._can_post = groups is not None and layout == "directed"
        # [Note: payloads received early]: stage -> the next channel-0 message whose header is read and whose
        # payload's receive is posted; the communication stream (CUDA, made at first use); receives so posted
        self._early: dict[int, _Arriving] = {}
        self._stream: Any = None
        self.advances = self._can_post and headers is not None  # ReceivesAhead advances its posted receives
        self._waiters: dict[int, HeaderWaiter] = {}  # by the stage a link receives from
        self.payloads_posted = 0
        self.sent_messages = self.sent_bytes = 0  # framed bytes (header + payload) of every message sent
        self._writer, self._reader = HeaderWriter(), HeaderReader()  # [Note: header reuse]

    def _route(self, channel: int, src: int, dst: int, header: bool = False) -> tuple[dist.ProcessGroup, int, int]:
        """The process group of a message, the peer's rank in it and the tag, looked up once per link and direction
        (sends and receives are per micro-batch; ``dist.isend``'s checks and rank translation cost ~0.1 ms of cold
        host time per call on a 2-core CPU host, so messages go to ``ProcessGroup.send``/``recv`` directly)."""
        key = (channel, src, dst, header)
        route = self._routes.get(key)
        if route is None:
            kind = "T" if channel == 1 else ("F" if src < dst else "B")
            peer = self._ranks[dst if src == self._stage else src]
            if header:  # one host group of every rank: the peer's global rank, the link's tag ([Note: one tag
                assert self._headers is not None  # per link]: two links may join the same two processes)
                route = (self._headers, dist.get_group_rank(self._headers, peer),
                         header_tag(kind, src, dst, len(self._ranks)))
            else:
                table = self._groups
                group = dist.group.WORLD if table is None else table[communicator(self._layout, kind, src, dst,
                                                                                    self._replica)]
                assert group is not None, "DistComm needs an initialised default process group"
                route = (group, peer if table is None else dist.get_group_rank(group, peer), 0)
            self._routes[key] = route
        return route

    def send(self, payload: Any, stage: int, channel: int = 0) -> None:
        """Frame ``payload`` and post it; never blocks. A small message on the host is written into a reused buffer
        through one NumPy view (a handful of operations: after each emulated kernel the caches are cold, and every
        distinct torch call then costs tens of microseconds on the critical path)."""
        group, peer, _ = self._route(channel, self._stage, stage)
        if self._headers is not None:
            return self._send_split(payload, stage, channel, group, peer)
        skeleton, tensors, metas, floats, form = frame(payload)
        blob, header_id = self._writer.header((channel, stage), skeleton, form, self._stage)  # [Note: header reuse]
        data_bytes = metas[-1].offset + metas[-1].nbytes if metas else 0
        header = header_bytes(HEADER, len(blob), data_bytes, header_id, len(floats), blob=blob, floats=floats)
        start = -(-len(header) // ALIGN) * ALIGN  # tensor bytes start aligned after the header
        total = start + data_bytes
        self.sent_messages += 1
        self.sent_bytes += total
        if self._host and total <= FIRST_BYTES and all([t.is_cpu for t in tensors]):
            if self._spare:
                buffer, raw = self._spare.pop()
            else:  # raw: an ndarray, a buffer (numpy declares `__buffer__` for Python >= 3.12 only)
                buffer = torch.empty(FIRST_BYTES, dtype=torch.uint8)
                raw = buffer.numpy()
            raw[:len(header)] = np.frombuffer(header, dtype=np.uint8)
            for meta, tensor in zip(metas, tensors):
                if meta.nbytes:
                    raw[start + meta.offset: start + meta.offset + meta.nbytes] = _host_bytes(tensor)
            self._pending.append((group.send([buffer], peer, 0), buffer, raw))
        else:
            for part in self._device_wire(header, start, total, metas, tensors):
                self._pending.append((group.send([part], peer, 0), part, None))
        self._reap()

    def _device_wire(self, header: bytes, start: int, total: int, metas: list[TensorMeta],
                     tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A message in one buffer on the transport's device (CUDA, or larger than ``FIRST_BYTES``), cut into the
        first ``FIRST_BYTES`` and the rest; ``header``: its bytes before the tensors'."""
        buffer = torch.empty(max(total, FIRST_BYTES), dtype=torch.uint8)
        buffer[:len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        buffer = buffer.to(self._device)
        for meta, tensor in zip(metas, tensors):
            if meta.nbytes:
                buffer[start + meta.offset: start + meta.offset + meta.nbytes].copy_(as_bytes(tensor))
        return [buffer[:FIRST_BYTES], buffer[FIRST_BYTES:total]] if total > FIRST_BYTES else [buffer]

    def _send_split(self, payload: Any, stage: int, channel: int, group: dist.ProcessGroup, peer: int) -> None:
        """[Note: headers on a host side channel]: the header to the link's gloo group, the payload (if any) to its
        device group; neither waits for the device."""
        frame = frame_split(payload, self._device, writer=self._writer, link=(channel, stage), sender=self._stage)
        header_group, header_peer, tag = self._route(channel, self._stage, stage, header=True)
        for part in frame.header:
            self._pending.append((header_group.send([part], header_peer, tag), part, None))
        if frame.payload is not None:
            self._pending.append((group.send([frame.payload], peer, 0), frame.payload, None))
        self.sent_messages += 1
        self.sent_bytes += frame.nbytes
        self._reap()

    def _recv_split(self, stage: int, channel: int, group: dist.ProcessGroup, peer: int,
                    first: torch.Tensor | None) -> Any:
        return self._take_payload(self._post_payload(stage, channel, group, peer, first))

    def _post_payload(self, stage: int, channel: int, group: dist.ProcessGroup, peer: int,
                      first: torch.Tensor | None) -> _Arriving:
        """Read a message's header (received into ``first`` already, or now) and post its payload's receive: on
        CUDA on the transport's communication stream, so it waits for no compute ([Note: payloads received
        early])."""
        header_group, header_peer, tag = self._route(channel, stage, self._stage, header=True)
        if first is None:
            first = torch.empty(FIRST_BYTES, dtype=torch.uint8)
            header_group.recv([first], header_peer, tag).wait()

        def rest(count: int) -> torch.Tensor:
            more = torch.empty(count, dtype=torch.uint8)
            header_group.recv([more], header_peer, tag).wait()
            return more

        header = read_split_header(first, rest, reader=self._reader, link=(channel, stage), receiver=self._stage)
        if not header.device_bytes:
            return _Arriving(header, None, None)
        with self._communication_stream():
            payload = torch.empty(header.device_bytes, dtype=torch.uint8, device=self._device)
            work = group.recv([payload], peer, 0)
        self.payloads_posted += 1
        return _Arriving(header, payload, work)

    def _take_payload(self, arriving: _Arriving) -> Any:
        """The message whose payload receive :meth:`_post_payload` posted: the current stream waits for it (under
        NCCL the stream waits, not the host), and the payload, made on the communication stream, is marked used
        by the current one (the allocator keeps its block until the current stream is done with it)."""
        header, payload, work = arriving
        if work is not None:
            work.wait()
            if self._stream is not None and payload is not None:
                payload.record_stream(torch.cuda.current_stream(self._device))
        self._reap()
        return unpack_split(header, payload, device=self._device)

    def _communication_stream(self) -> Any:
        """A context on the transport's communication stream (made at first use), on CUDA; nothing elsewhere."""
        if self._device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return torch.cuda.stream(self._stream)

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            _, buffer, view = self._pending.popleft()
            if view is not None and len(self._spare) < _SPARE:
                self._spare.append((buffer, view))

    def post(self, stage: int) -> None:
        """[Note: receives posted ahead]
        A message that arrives before its receive is posted waits in the socket until the receive comes, and is then
        read by gloo's thread, which wakes the caller: ~0.2 ms per message on a 2-core CPU host, on the critical
        path, against ~0.03 ms when the receive was posted first and the bytes are already in its buffer. The
        runtime posts each stage's next activation and gradient receive as soon as the previous one on that link
        completed and the next is in the actions it was given (``StageRuntime.run``), so every posted receive is
        taken by the same call: none is left between streams, where an evaluation uses the same process groups.
        Only with the ``"directed"`` layout: each link's communicator then carries nothing but this sequence of
        messages, in order, so a receive issued early changes no order on any communicator and the rendezvous proof
        ([Note: deadlock model]) still holds; on one shared group it could take a message of the other channel."""
        if not self._can_post or stage in self._early:
            return
        if stage in self._posted:
            if self.advances:
                self._advance(stage)
            return
        header = self._headers is not None  # then the header is what is posted, on the host
        group, peer, tag = self._route(0, stage, self._stage, header=header)
        buffer = torch.empty(FIRST_BYTES, dtype=torch.uint8, device="cpu" if header else self._device)
        try:
            work: Any = group.recv([buffer], peer, tag)
            # gloo's receive says it completed only once waited for: a thread waits, the host reads its flag
            if header:  # one thread per link: a link's headers arrive in order, two links' in any
                work = self._waiters.setdefault(stage, HeaderWaiter()).watch(work)
            self._posted[stage] = (work, buffer)
        except (RuntimeError, ConnectionError) as err:  # a dead peer: told by the receive that takes it, which
            self._posted[stage] = (err, buffer)  # the runtime reports naming the peer, the action and the step

    def _advance(self, stage: int) -> None:
        """[Note: payloads received early]
        Under NCCL the header of a posted receive arrives on the host long before the host reaches the action that
        takes the message (the host runs ahead of its device); if its payload's receive were posted only then, it
        would start behind every kernel queued before it on the stream. So each time the stage has run an action
        (``ReceivesAhead.taken``) the posted header is checked without waiting (``is_completed``, a host flag); once
        it is in, the header is read and the payload's receive posted at once, on the communication stream, where
        it waits for nothing queued for compute. The action that takes the message makes the compute stream wait
        for that receive (an event, not the host) and marks the payload used on that stream (``record_stream``),
        since it was allocated on the other. The order on each link's communicator is the order of its messages,
        as before (the deadlock model's proof holds: a payload is received after its header, by the call that
        posted it). On the CPU the same code posts the payload's gloo or emulated receive early: counted by
        ``payloads_posted`` and tested (tests/test_communicators.py)."""
        if not self._header_in(stage):
            return
        work, first = self._posted.pop(stage)
        try:
            work.wait()
            group, peer, _ = self._route(0, stage, self._stage)
            self._early[stage] = self._post_payload(stage, 0, group, peer, first)
        except (RuntimeError, ConnectionError) as err:  # a dead peer: told by the receive that takes it
            self._posted[stage] = (err, first)

    def arrived(self, stage: int) -> bool:
        """Whether the posted receive of ``stage``'s next channel-0 message has its header (or all of it, on one
        buffer) in: a host flag, no wait."""
        return stage in self._early or self._header_in(stage)

    def _header_in(self, stage: int) -> bool:
        """Whether ``stage``'s posted receive (header, or the whole message on one buffer) completed: no wait."""
        posted = self._posted.get(stage)
        return posted is not None and not isinstance(posted[0], BaseException) and posted[0].is_completed()

    @property
    def reused_headers(self) -> int:
        """Messages sent without a pickled structure, repeating their link's last ([Note: header reuse])."""
        return self._writer.reused

    @property
    def posted(self) -> int:
        """Receives posted ahead and not yet taken."""
        return len(self._posted) + len(self._early)

    def recv(self, stage: int, channel: int = 0) -> Any:
        group, peer, _ = self._route(channel, stage, self._stage)
        early = self._early.pop(stage, None) if channel == 0 else None
        if early is not None:  # [Note: payloads received early]
            return self._take_payload(early)
        ahead = self._posted.pop(stage, None) if channel == 0 else None
        if ahead is not None:
            work, first = ahead
            if isinstance(work, BaseException):
                raise work
            if self._headers is not None:
                work.wait()
                return self._recv_split(stage, channel, group, peer, first)
        elif self._headers is not None:
            return self._recv_split(stage, channel, group, peer, None)
        else:
            first = torch.empty(FIRST_BYTES, dtype=torch.uint8, device=self._device)
            work = group.recv([first], peer, 0)
        work.wait()
        # CUDA: the first part's host copy (the header); an ndarray, a buffer (see above)
        raw: Any = first.numpy() if self._host else first.cpu().numpy()
        blob_bytes, data_bytes, header_id, count = HEADER.unpack_from(raw)
        head = HEADER.size + blob_bytes + 8 * count
        start = -(-head // ALIGN) * ALIGN
        total = start + data_bytes
        if total > FIRST_BYTES:
            whole = torch.empty(total, dtype=torch.uint8, device=self._device)
            whole[:FIRST_BYTES] = first
            group.recv([whole[FIRST_BYTES:]], peer, 0).wait()
            raw = whole.numpy() if self._host else raw
        else:
            whole = first
        header: Any = raw[:head] if self._host or head <= FIRST_BYTES else whole[:head].cpu().numpy()
        skeleton, metas = self._reader.read((channel, stage), header_id, header[HEADER.size:HEADER.size + blob_bytes],
                                            self._stage)  # [Note: header reuse]
        floats = struct.unpack_from(f"<{count}d", header, HEADER.size + blob_bytes) if count else ()
        tensors = []
        for meta in metas:
            a, b = start + meta.offset, start + meta.offset + meta.nbytes
            numpy_dtype = _NUMPY.get(meta.dtype) if self._host else None
            if numpy_dtype is not None:  # a view of the received bytes, one torch call
                tensor = torch.from_numpy(raw[a:b].view(numpy_dtype).reshape(meta.shape))
            else:
                tensor = from_bytes(whole[a:b], meta)
            if self._deliver is not None:
                tensor = tensor.to(self._deliver)
            if meta.requires_grad:
                tensor.requires_grad_(True)
            tensors.append(tensor)
        self._reap()
        return place_floats(skeleton, tensors, floats)

    def ready(self, stage: int, channel: int = 0) -> bool:
        return True  # a blocking receive simply waits

    def flush(self) -> None:
        """Wait until every posted send has completed (before a drain ends, a checkpoint, or teardown).

        Each send is waited for once. gloo's ``wait()`` returns when the send completed; NCCL's only makes the
        current stream wait for it and returns at once, so a loop on ``is_completed()`` would spin the host and
        queue one more stream wait per turn: where a send is still running after its ``wait()``, one
        synchronisation of the stream (which now waits for all of them) blocks the host instead."""
        pending, self._pending = self._pending, deque()
        for work, _, _ in pending:
            work.wait()
        if self._device.type == "cuda" and any(not work.is_completed() for work, _, _ in pending):
            torch.cuda.current_stream(self._device).synchronize()
        for _, buffer, view in pending:
            if view is not None and len(self._spare) < _SPARE:
                self._spare.append((buffer, view))


class _Arriving(NamedTuple):
    """A message whose header is read and whose payload's receive is posted ([Note: payloads received early])."""

    header: SplitHeader
    payload: torch.Tensor | None
    work: Any  # the payload's receive (None without a payload)


_SPARE = 8  # host send buffers kept for reuse
# torch dtypes NumPy can view received bytes as (others, e.g. bfloat16, go through torch views)
_NUMPY: dict[torch.dtype, Any] = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
    torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}


def _host_bytes(tensor: torch.Tensor) -> Any:
    """A CPU tensor's bytes as a flat uint8 NumPy array (a view where possible)."""
    tensor = tensor.detach()
    if tensor.dtype in _NUMPY and not tensor.is_conj() and not tensor.is_neg():
        return tensor.numpy().reshape(-1).view(np.uint8)
    return as_bytes(tensor).numpy()
