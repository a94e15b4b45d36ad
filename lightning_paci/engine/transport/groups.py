"""The pipeline's point-to-point communicators: created in one order, connected in one order, counted.

Every rank creates every process group of the ``"directed"`` layout (``torch.distributed.new_group`` is collective
over the world) in ``schedules.layout_communicators`` order, then connects its own ones in that same order with
one small exchange each (:func:`warm_communicators`), before any action list runs. That second step exists for
NCCL, which creates a group's point-to-point communicator at a rank's first operation on it and holds the host
there until the peer's first operation: left to the lists, the receives posted ahead deadlock at batch 0 (see
[Note: communicator creation] in schedules/deadlock.py, where the model checks the warm-up order too). On gloo,
which connects when a group is created, the exchange is a few tiny messages at setup.

This module also says where a message's bytes travel (:func:`transport_device`): gloo carries CPU tensors only.

[Note: host groups on a bound world]
Under NCCL the world is bound to the stage's GPU (``init_process_group(device_id=...)``), and from then on torch 2.13
makes every ``new_group`` collective over the world's NCCL communicator: a rank outside the new group performs a
no-color ``ncclCommSplit``, the members of a group with an NCCL part join that split with their color, and the
members of a plain gloo group do not -- they connect over gloo (``distributed_c10d._new_process_group_helper``). A
two-rank gloo group made after binding therefore leaves every other rank in a split its members never enter: at 3
stages or more, setup hangs (pytorch/pytorch#145376). The host side channel ([Note: headers on a host side channel])
is therefore **one gloo group of every rank** (:attr:`PipelineLinks.host`), with a tag per link ([Note: one tag per
link]): no rank is outside it, so nobody splits, and it costs one gloo context instead of one per link. The
alternatives were weighed against torch's rules: a ``"cpu:gloo,cuda:nccl"`` group per link also satisfies the split,
but builds an NCCL communicator per header link that is never used (GPU memory and a proxy thread each); creating the
gloo groups before binding is not possible (a group needs the initialised world); clearing the bound device around
their creation relies on torch's private state. Checkpoint gathers, the end-of-fit gather and the merge of sharded
optimizer states go through the same group, so a stage's state never passes through GPU memory: no Python object
is pickled into an NCCL group. ``LIGHTNING_PACI_EMULATE_NCCL=1`` checks these rules on the CPU ([Note: NCCL
emulation]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_paci.engine.supervision.activity import activity
from lightning_paci.schedules.communicators import HOST_GROUP, Communicator, setup_groups

__all__ = ["HEADER_KINDS", "PipelineLinks", "connections_warning", "create_communicators", "header_tag", "new_group",
           "transport_device", "warm_communicators"]

HEADER_KINDS = ("F", "B", "T")  # a link's message kinds: activations, gradients, tied weights
_MAX_TAG = 2**31 - 1  # gloo takes a non-negative C int as a point-to-point tag


def header_tag(kind: str, src: int, dst: int, num_stages: int) -> int:
    """The host group's tag of the headers of ``kind`` from stage ``src`` to stage ``dst`` ([Note: one tag per
    link]); the same on both ends, different for every link and kind of a pipeline of ``num_stages`` stages.

    [Note: one tag per link]
    gloo matches a receive to a send by (peer, tag), first posted first matched. With virtual stages two links join
    the same two processes in the same direction -- stages 0 -> 1 and 2 -> 3 of the loop placement on 2 devices, or
    the V's 0 -> 1 and 4 -> 5 at 3 virtual stages -- so a tag per message kind would let a header land in the
    other chunk's posted receive while its payload waits on its own link's group (seen as "repeats header ...,
    but the last header received on that link is none" at batch 0). The tag therefore names the link: ``1 +
    kind + 3 * (src * num_stages + dst)``, kind 0, 1, 2 for F, B, T. Tag 0 stays for the object operations on the
    host group (checkpoint gathers), which never share a tag with a header."""
    if kind not in HEADER_KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(map(repr, HEADER_KINDS))}, got {kind!r}.")
    if not (0 <= src < num_stages and 0 <= dst < num_stages) or src == dst:
        raise ValueError(f"A link joins two different stages of the {num_stages}, got `src={src}`, `dst={dst}`.")
    tag = 1 + HEADER_KINDS.index(kind) + 3 * (src * num_stages + dst)
    if tag > _MAX_TAG:
        raise ValueError(f"{num_stages} stages need header tags up to {tag}, past gloo's {_MAX_TAG}: use at most "
                         f"{int((_MAX_TAG / 3) ** 0.5)} stages.")
    return tag


def create_communicators(num_stages: int, replicas: int, rank_of: Callable[[int, int], int], *, backend: str,
                         timeout: timedelta) -> dict[Communicator, dist.ProcessGroup]:
    """Every communicator of the directed layout as a process group, on every rank, in the layout's order
    (``rank_of(stage, replica)`` is a stage's global rank). A rank outside a group gets a placeholder, as
    ``new_group`` gives it; the dict keeps the layout's order, which :func:`warm_communicators` follows."""
    entries = [entry for entry in setup_groups(num_stages, replicas, backend) if entry[0][0] == "p2p"]
    return _create(entries, num_stages, rank_of, timeout)


def _create(entries: list[tuple[Communicator, tuple[int, ...], str]], num_stages: int,
            rank_of: Callable[[int, int], int], timeout: timedelta) -> dict[Communicator, dist.ProcessGroup]:
    """``schedules.setup_groups`` entries (members as model ranks ``replica * num_stages + stage``) as process
    groups, in their order, on every rank."""
    return {key: new_group([rank_of(m % num_stages, m // num_stages) for m in members], backend=kind, timeout=timeout)
            for key, members, kind in entries}


def new_group(ranks: list[int], *, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """``torch.distributed.new_group``, as the watchdog sees it: a numbered collective of every rank ([Note:
    judging progress]), so a rank held in one creation while the others wait in the next is named."""
    with activity.collective("creating process group"):
        return dist.new_group(ranks, backend=backend, timeout=timeout)


def warm_communicators(groups: Mapping[Communicator, dist.ProcessGroup], rank_of: Callable[[int, int], int], *,
                       device: torch.device, placement: Sequence[int] | None = None) -> int:
    """Connect this rank's communicators, one after the other in the layout's order: on each, its sender (the
    message direction's source) sends one byte and its receiver takes it. Returns how many this rank connected.

    One global order makes this deadlock-free whatever NCCL blocks on: the first communicator of the order that is
    not connected yet has both its ranks waiting on it (each finished everything before it in the order).
    ``placement``: each stage's process with virtual stages (a link names stages)."""
    where = (lambda stage: placement[stage]) if placement is not None else (lambda stage: stage)
    me = dist.get_rank()
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    count = 0
    for comm, group in groups.items():
        _, replica, _, src, dst = comm
        sender, receiver = rank_of(where(src), replica), rank_of(where(dst), replica)
        if me == sender:
            group.send([token], dist.get_group_rank(group, receiver), 0).wait()
        elif me == receiver:
            group.recv([token], dist.get_group_rank(group, sender), 0).wait()
        else:
            continue
        count += 1
    return count


def transport_device(backend: str | None, device: torch.device) -> torch.device:
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
    """A rank's pipeline communicators after setup: every group of the directed layout, the host group of every rank
    under NCCL ([Note: host groups on a bound world]; None otherwise: the world is already a host group), with
    replicas its stage's replicas' group and its replica's pipeline group, and how many of its own point-to-point
    communicators it connected."""

    groups: dict[Communicator, dist.ProcessGroup]
    host: dist.ProcessGroup | None
    connected: int
    data: dist.ProcessGroup | None = None
    pipeline: dist.ProcessGroup | None = None

    @classmethod
    def setup(cls, num_stages: int, replicas: int, rank_of: Callable[[int, int], int], *, device: torch.device,
              backend: str, timeout: timedelta, stage: int = 0, replica: int = 0,
              placement: Sequence[int] | None = None) -> PipelineLinks:
        """Create every group of ``schedules.setup_groups`` on every rank, in its order ([Note: group creation]:
        the order the model checks), then connect this rank's point-to-point ones in the layout's order ([Note:
        communicator creation]). ``stage``/``replica``: this rank's, for its data-parallel groups. With virtual
        stages ``num_stages`` counts the processes and ``placement`` gives each stage's."""
        stages = len(placement) if placement is not None else num_stages
        made = _create(setup_groups(stages, replicas, backend, placement), num_stages, rank_of, timeout)
        groups = {key: group for key, group in made.items() if key[0] == "p2p"}
        connected = warm_communicators(groups, rank_of, device=transport_device(backend, device), placement=placement)
        return cls(groups, made.get(HOST_GROUP), connected, made.get(("dp", stage)), made.get(("pp", replica)))
