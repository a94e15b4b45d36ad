"""The pipeline's point-to-point communicators: created in one order, connected in one order, counted.

Every rank creates every process group of the ``"directed"`` layout (``torch.distributed.new_group`` is collective
over the world) in ``schedules.layout_communicators`` order, then connects its own ones in that same order with
one small exchange each (:func:`warm_communicators`), before any action list runs. That second step exists for
NCCL, which creates a group's point-to-point communicator at a rank's first operation on it and holds the host
there until the peer's first operation: left to the lists, the receives posted ahead deadlock at batch 0 (see
[Note: communicator creation] in schedules/rendezvous.py, where the model checks the warm-up order too). On gloo,
which connects when a group is created, the exchange is a few tiny messages at setup.

This module also says where a message's bytes travel (:func:`transport_device`): gloo carries CPU tensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_paci.schedules.rendezvous import Communicator, layout_communicators

__all__ = ["PipelineLinks", "connections_warning", "create_communicators", "transport_device", "warm_communicators"]


def create_communicators(num_stages: int, replicas: int, rank_of: Callable[[int, int], int], *, backend: str,
                         timeout: timedelta) -> dict[Communicator, dist.ProcessGroup]:
    """Every communicator of the directed layout as a process group, on every rank, in the layout's order
    (``rank_of(stage, replica)`` is a stage's global rank). A rank outside a group gets a placeholder, as
    ``new_group`` gives it; the dict keeps the layout's order, which :func:`warm_communicators` follows."""
    return {
        comm: dist.new_group([rank_of(s, comm[1]) for s in members], backend=backend, timeout=timeout)
        for comm, members in layout_communicators("directed", num_stages, replicas).items()
    }


def warm_communicators(groups: Mapping[Communicator, dist.ProcessGroup], rank_of: Callable[[int, int], int], *,
                       device: torch.device) -> int:
    """Connect this rank's communicators, one after the other in the layout's order: on each, its sender (the
    message direction's source) sends one byte and its receiver takes it. Returns how many this rank connected.

    One global order makes this deadlock-free whatever NCCL blocks on: the first communicator of the order that is
    not connected yet has both its ranks waiting on it (each finished everything before it in the order)."""
    me = dist.get_rank()
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    count = 0
    for comm, group in groups.items():
        _, replica, _, src, dst = comm
        sender, receiver = rank_of(src, replica), rank_of(dst, replica)
        if me == sender:
            group.send([token], dist.get_group_rank(group, receiver), 0).wait()
        elif me == receiver:
            group.recv([token], dist.get_group_rank(group, sender), 0).wait()
        else:
            continue
        count += 1
    return count


def transport_device(backend: str, device: torch.device) -> torch.device:
    """Where a message's bytes live on the wire: the device itself under NCCL, the host under gloo, whose
    send/recv take CPU tensors only. With GPUs over gloo (several processes sharing one GPU, where NCCL cannot run
    two ranks) each message is staged through host memory: ``DistComm(device=<this>, deliver=<the GPU>)`` copies
    the payload to the host buffer on send and the received tensors back to the GPU."""
    return torch.device("cpu") if backend == "gloo" else device


def connections_warning(backend: str, device: torch.device, environ: Mapping[str, str]) -> str | None:
    """A warning for ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (set by Megatron / Transformer Engine recipes) under NCCL, or
    None. With one hardware queue the kernels of every stream share one ordering, so a receive spinning on the GPU
    can hold back the compute that leads to its own matching send on the other side; each stage here has 4
    point-to-point communicators with receives posted ahead."""
    if backend != "nccl" or device.type != "cuda" or environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        return None
    return ("lightning_paci: CUDA_DEVICE_MAX_CONNECTIONS=1 is set: every CUDA stream then shares one hardware queue, "
            "so a pipeline receive posted ahead (an NCCL kernel waiting for its peer) can hold back this stage's own "
            "compute and stall the pipeline. Unset it for pipeline runs (it is meant for tensor-parallel overlap), "
            "or set it to 8 or more.")


@dataclass(frozen=True)
class PipelineLinks:
    """A rank's pipeline communicators after setup: every group of the directed layout, the header side channel's
    gloo groups under NCCL ([Note: headers on a host side channel]; None otherwise), and how many of its own
    point-to-point communicators it connected."""

    groups: dict[Communicator, dist.ProcessGroup]
    headers: dict[Communicator, dist.ProcessGroup] | None
    connected: int

    @classmethod
    def setup(cls, num_stages: int, replicas: int, rank_of: Callable[[int, int], int], *, device: torch.device,
              backend: str, timeout: timedelta) -> PipelineLinks:
        """Create every group in the layout's order on every rank, then connect this rank's own ones in that order
        ([Note: communicator creation]); under NCCL also the headers' gloo groups (gloo connects at creation)."""
        groups = create_communicators(num_stages, replicas, rank_of, backend=backend, timeout=timeout)
        connected = warm_communicators(groups, rank_of, device=transport_device(backend, device))
        headers = create_communicators(num_stages, replicas, rank_of, backend="gloo", timeout=timeout) \
            if backend == "nccl" else None
        return cls(groups, headers, connected)
