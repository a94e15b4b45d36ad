"""DistComm over real gloo process groups (forked ranks): messages arrive whole and in order, with their structure,
dtypes and flags, for payloads below and above the single-operation size and for messages whose tensors are all
empty; a flush waits for each send once."""

from __future__ import annotations

import contextlib
import os
import struct
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.engine.transport.messages import FIRST_BYTES, flatten
from lightning_paci.engine.transport.point_to_point import DistComm
from lightning_paci.engine.transport.receives_ahead import ReceivesAhead
from lightning_paci.engine.transport.wire import HeaderReader, HeaderWriter, frame
from lightning_paci.schedules import layout_communicators

from helpers import run_forked_ranks

pytestmark = pytest.mark.distributed


class Pair(NamedTuple):
    first: Any
    second: Any


class Opaque:
    """A leaf of no known kind: pickled with every message, whatever ``==`` says."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)  # equal to every other Opaque: only the pickle carries ``value``

    __hash__ = None  # type: ignore[assignment]


def _messages() -> list[Any]:
    """Deterministic payloads: nested structures, several dtypes, one crossing FIRST_BYTES, non-tensor leaves; then
    runs of one structure with new floats and tensors (headers repeated, [Note: header reuse]) broken by forms that
    compare equal but are not the same: True for 1, a namedtuple for a tuple, a dict's keys reordered, an object."""
    g = torch.Generator().manual_seed(0)
    big = FIRST_BYTES // 4 + 1000  # float32 elements: the message needs a second operation

    def grads(loss: float, skip: Any = False) -> dict[str, Any]:
        return {"grads": [torch.randn(4, 8, generator=g)], "logs": [("loss", loss, 4, ())], "skip": skip}

    return [
        {"grads": [torch.randn(4, 8, generator=g)], "logs": [("loss", 1.5, 4, ())], "skip": False},
        (torch.randn(big, generator=g), {"mask": torch.rand(3, 5, generator=g) > 0.5, "n": 7}),
        [torch.randint(0, 255, (6, 9), generator=g), None, "text"],
        torch.randn(2, big, generator=g).requires_grad_(True),
        {"grads": [torch.randn(1, 3, generator=g).to(torch.bfloat16)], "logs": [], "skip": True},
        grads(0.25), grads(float("nan")), grads(-0.0), grads(float("inf")), grads(1e-300),  # 4 repeats
        grads(0.5, skip=0), grads(0.5, skip=False),  # 0 == False: sent whole both times
        (torch.randn(2, big, generator=g), 3.5), (torch.randn(2, big, generator=g), 2.5),  # two operations, repeated
        Pair(torch.randn(3, generator=g), 1), (torch.randn(3, generator=g), 1), Pair(torch.randn(3, generator=g), 1),
        {"a": torch.randn(2, generator=g), "b": 1}, {"b": 1, "a": torch.randn(2, generator=g)},
        {"b": 1, "a": torch.randn(2, generator=g)},  # the third repeats the second
        (Opaque(1), torch.randn(2, generator=g)), (Opaque(2), torch.randn(2, generator=g)),
        # every tensor empty: no payload on the host-header wire, the receiver makes them; the second repeats
        {"x": torch.zeros(0, 4).requires_grad_(True), "ids": torch.zeros(2, 0, dtype=torch.int64)},
        {"x": torch.zeros(0, 4).requires_grad_(True), "ids": torch.zeros(2, 0, dtype=torch.int64)},
        [torch.zeros(0), torch.randn(3, generator=g), torch.zeros(0, 2)],  # empty ones beside bytes
    ]


REPEATED = 7  # the messages above whose header repeats the previous one's


def _strictly_equal(a: Any, b: Any) -> bool:
    """The same types everywhere, the same dict key order, floats bit for bit, tensors bit-equal with the same
    dtype, shape and ``requires_grad``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a.detach().view(torch.uint8), b.detach().view(torch.uint8)))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_strictly_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_strictly_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Opaque):
        return a.value == b.value
    return a == b


@contextlib.contextmanager
def _two_ranks(rank: int, path: str, errors: Any) -> Iterator[None]:
    """This forked rank in a 2-rank gloo world (one intra-op thread) for the block, then a barrier and the world
    left; a failure's traceback goes to ``errors``, for the test process."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        yield
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _directed(*, split: bool = False) -> DistComm:
    """Two stages' transport on the "directed" layout; ``split``: headers on the host group of every rank, a tag
    per link ([Note: headers on a host side channel], forced on the CPU)."""
    groups = {key: dist.new_group(list(members)) for key, members in layout_communicators("directed", 2).items()}
    return DistComm([0, 1], groups=groups, headers=dist.new_group([0, 1]) if split else None)


def _worker(rank: int, path: str, errors: Any) -> None:
    with _two_ranks(rank, path, errors):
        comm = DistComm([0, 1])
        expected = _messages()
        if rank == 0:
            for message in expected:
                comm.send(message, 1)
            comm.flush()
            assert comm.reused_headers == REPEATED, comm.reused_headers
        else:
            for message in expected:
                _assert_same(comm.recv(0), message)


def _assert_same(received: Any, sent: Any) -> None:
    """The same structure, types and non-tensor leaves (floats bit for bit), the same shapes, dtypes and
    requires_grad flags, and bit-equal tensors."""
    assert _strictly_equal(received, sent), f"{received!r} != {sent!r}"


@pytest.mark.timeout(60)
def test_messages_arrive_whole_and_in_order(tmp_path: Path) -> None:
    run_forked_ranks(_worker, 2, tmp_path / "rdv")


def _directed_worker(rank: int, path: str, errors: Any) -> None:
    """Two stages on the "directed" layout: stage 1 posts its next activation receive ahead while stage 0 sends a
    tied-weight message (channel 1) first and then a run of activations, small and large; stage 1 then sends the
    gradients back, taken through receives posted ahead on stage 0."""
    with _two_ranks(rank, path, errors):
        comm = _directed(split=os.environ.get("PACI_TEST_SPLIT") == "1")
        messages = _messages() * 3  # more sends than spare buffers: reused buffers must not change a message
        if rank == 0:
            comm.send([torch.full((3,), 7.0)], 1, channel=1)
            for message in messages:
                comm.send(message, 1)
            comm.flush()
            assert comm.reused_headers == 3 * REPEATED, comm.reused_headers  # both wires repeat headers
            for message in messages:
                comm.post(1)
                comm.post(1)  # a second post of the same link waits for the first to be taken: no-op
                assert comm.posted == 1
                _assert_same(comm.recv(1), message)
        else:
            comm.post(0)  # the activation link's next message, ahead of the tied one on its own link
            _assert_same(comm.recv(0, channel=1), [torch.full((3,), 7.0)])
            for i, message in enumerate(messages):
                _assert_same(comm.recv(0), message)
                if i + 1 < len(messages):
                    comm.post(0)
            assert comm.posted == 0
            for message in messages:
                comm.send(message, 0)
            comm.flush()
            assert comm.reused_headers == 3 * REPEATED, comm.reused_headers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split", [False, True], ids=["one-buffer", "host-header"])
def test_receives_posted_ahead_take_their_own_links_messages_in_order(tmp_path: Path, monkeypatch, split) -> None:
    # host-header: the wire NCCL runs use, header on the host group (a tag per link), payload on the link's group
    monkeypatch.setenv("PACI_TEST_SPLIT", "1" if split else "0")
    run_forked_ranks(_directed_worker, 2, tmp_path / "rdv")


def test_local_comm_copies_and_keeps_order() -> None:
    ends = LocalComm.network(2)
    payload = _messages()
    for message in payload:
        ends[0].send(message, 1)
    for message in payload:
        _assert_same(ends[1].recv(0), message)


def test_host_header_wire_keeps_cpu_leaves_on_the_host_and_device_tensors_in_the_payload() -> None:
    # [Note: headers on a host side channel] without process groups: the "device" is meta here (the only other
    # device a CPU machine has), so CPU tensors must travel in the host header and arrive on the CPU, bit for bit
    from lightning_paci.engine.transport.split_wire import frame_split, read_split_header, unpack_split

    big = torch.arange(FIRST_BYTES, dtype=torch.float32)  # the header no longer fits one buffer
    message = {"host": [torch.tensor([1.5, -2.0]), big], "mask": torch.tensor([True, False]),
               "device": torch.empty(3, 4, device="meta").requires_grad_(True), "n": 7}
    frame = frame_split(message, torch.device("meta"), what="a test message")
    assert len(frame.header) == 2 and frame.payload is not None and frame.payload.device.type == "meta"
    rest = iter(frame.header[1:])
    header = read_split_header(frame.header[0].clone(), lambda n: next(rest)[:n])
    assert header.device_bytes == 64  # 3 x 4 float32, 64-byte aligned
    got = unpack_split(header, frame.payload)
    assert got["n"] == 7 and got["device"].device.type == "meta" and got["device"].shape == (3, 4)
    assert got["device"].requires_grad
    for name, expected in (("mask", message["mask"]), ("host", message["host"])):
        assert [t.device.type for t in flatten(got[name])[1]] == ["cpu"] * len(flatten(expected)[1])
        for a, b in zip(flatten(got[name])[1], flatten(expected)[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_repeated_header_the_receiver_does_not_hold_fails_naming_both_ends() -> None:
    writer, reader = HeaderWriter(), HeaderReader()
    skeleton, _, _, floats, form = frame({"grads": [torch.zeros(2)], "logs": [("loss", 0.5, 2, ())]})
    blob, first = writer.header((0, 1), skeleton, form, 0)
    assert blob and floats == [0.5]
    assert reader.read((0, 0), first, blob, 1)[0] == skeleton
    repeat, same = writer.header((0, 1), skeleton, form, 0)
    assert repeat == b"" and same == first
    assert reader.read((0, 0), same, repeat, 1)[0] == skeleton
    with pytest.raises(AssertionError, match=r"stage 1: the message from stage 0 repeats header .* the last header "
                                             r"received on that link is none"):
        HeaderReader().read((0, 0), same, repeat, 1)


class _DeviceSend:
    """A send as NCCL's ``Work`` behaves for the host: ``wait()`` returns at once (it only makes the current stream
    wait), and the send completes ``lag`` seconds after it was posted, once gloo's real send has."""

    def __init__(self, work: Any, lag: float) -> None:
        self.work, self.done_at, self.waits = work, time.monotonic() + lag, 0

    def wait(self) -> bool:
        self.waits += 1
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.monotonic() >= self.done_at


def _flush_worker(rank: int, path: str, errors: Any) -> None:
    with _two_ranks(rank, path, errors):
        comm = _directed()
        if rank == 0:  # this forked rank's sends behave as NCCL's (the test process is not patched)
            sends: list[_DeviceSend] = []
            send = dist.ProcessGroup.send

            def device_send(group: Any, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> _DeviceSend:
                sends.append(_DeviceSend(send(group, tensors, peer, tag), lag=0.2))
                return sends[-1]

            dist.ProcessGroup.send = device_send  # type: ignore[method-assign]
            for message in _messages()[:3]:
                comm.send(message, 1)
            comm.flush()
            assert [s.waits for s in sends] == [1] * len(sends), [s.waits for s in sends]  # no loop re-waiting
        else:
            for message in _messages()[:3]:
                _assert_same(comm.recv(0), message)


@pytest.mark.timeout(60)
def test_flush_waits_for_each_send_once_where_wait_returns_before_the_send_completes(tmp_path: Path) -> None:
    # NCCL's wait() returns at once: a flush that looped on is_completed() called it again thousands of times while
    # the device sent (a busy host, and one more stream wait queued per turn)
    run_forked_ranks(_flush_worker, 2, tmp_path / "rdv")


def _early_payload_worker(rank: int, path: str, errors: Any) -> None:
    """[Note: payloads received early], on the host-header wire forced on the CPU: stage 1 runs RECV_F 0, F 0,
    RECV_F 1, F 1 through ``ReceivesAhead``; once message 1's header is in, the action before its consumer (F 0)
    posts its payload's receive, so the consumer finds it posted."""
    from lightning_paci.schedules.actions import RECV_F, Action, F

    with _two_ranks(rank, path, errors):
        comm = _directed(split=True)
        messages = [{"x": torch.arange(12.0).reshape(3, 4) + i, "i": i} for i in range(2)]
        if rank == 0:
            for message in messages:
                comm.send(message, 1)
            comm.flush()
        else:
            actions = [Action(1, RECV_F, 0), Action(1, F, 0), Action(1, RECV_F, 1), Action(1, F, 1)]
            ahead = ReceivesAhead(comm, 1, actions)  # posts message 0's header
            order: list[str] = []
            for action in actions:
                if action.kind is RECV_F:
                    order.append(f"recv {action.microbatch}, payloads posted {comm.payloads_posted}")
                    _assert_same(comm.recv(0), messages[action.microbatch])
                else:  # the compute before the next receive; it starts once the next header is in
                    deadline = time.monotonic() + 20
                    while action.microbatch == 0 and not comm.arrived(0) and time.monotonic() < deadline:
                        time.sleep(0.001)
                    order.append(f"F {action.microbatch}")
                    torch.ones(8, 8) @ torch.ones(8, 8)
                ahead.taken(action)
            # message 0's payload is posted by its own receive (no action ran before it); message 1's by F 0
            assert order == ["recv 0, payloads posted 0", "F 0", "recv 1, payloads posted 2", "F 1"], order
            assert comm.posted == 0


@pytest.mark.timeout(60)
def test_a_payload_receive_is_posted_before_the_compute_that_precedes_its_consumer(tmp_path: Path) -> None:
    run_forked_ranks(_early_payload_worker, 2, tmp_path / "rdv")
