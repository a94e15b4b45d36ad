"""Which communicator carries each message, and every process group the setup creates, in its order.

Plain values, read by the deadlock model (deadlock.py, which checks lists against them) and by the transport
(``engine/transport/groups.py``, which creates exactly these groups): one description, so what the model proves is
what the runtime builds. ``"directed"`` (the runtime's): one communicator per neighbour pair and direction;
``"shared"``: activations and gradients on one communicator, which deadlocks 1F1B under NCCL ([Note: deadlock
model] in deadlock.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HOST_GROUP", "LAYOUTS", "Communicator", "communicator", "layout_communicators", "rank_members",
           "setup_groups"]

LAYOUTS = ("directed", "shared")

Communicator = tuple[Any, ...]  # plain values: a kind, then replica, channel and stages (``communicator``)


def communicator(layout: str, channel: str, src: int, dst: int, replica: int = 0) -> Communicator:
    """The communicator that carries a message of ``channel`` (``"F"`` activations, ``"B"`` gradients, ``"T"`` tied
    weights) from stage ``src`` to stage ``dst`` of one data-parallel replica. The runtime creates one process
    group per distinct value (``process_groups.py``), so what this returns is what the model checks."""
    if layout == "directed":
        return ("p2p", replica, channel, src, dst)
    if layout == "shared":  # one communicator for activations and gradients, one for the tied weights
        return ("p2p", replica, "T" if channel == "T" else "FB")
    raise ValueError(f"`layout` must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}.")


def layout_communicators(layout: str, num_stages: int, replicas: int = 1,
                         placement: Sequence[int] | None = None) -> dict[Communicator, tuple[int, ...]]:
    """Every point-to-point communicator of ``layout`` with its members' (device) indices, per replica, in one
    deterministic order: every rank creates the process groups in this order (``torch.distributed.new_group`` is
    collective over the world). ``placement``: each stage's device with virtual stages ([Note: virtual stages]);
    a link between two chunks of one device has no communicator (its messages stay in the process)."""
    devices = tuple(placement) if placement is not None else tuple(range(num_stages))
    found: dict[Communicator, tuple[int, ...]] = {}
    last = num_stages - 1
    for replica in range(replicas):
        links = [(c, s, d) for s in range(last) for c, s, d in (("F", s, s + 1), ("B", s + 1, s))]
        links += [("T", 0, last), ("T", last, 0)] if num_stages > 1 else []
        for channel, src, dst in links:
            if devices[src] == devices[dst]:
                continue
            members = tuple(sorted({devices[src], devices[dst]})) if layout == "directed" else \
                tuple(range(max(devices) + 1))
            found.setdefault(communicator(layout, channel, src, dst, replica), members)
    return found


HOST_GROUP: Communicator = ("host",)  # the gloo group of every rank under NCCL ([Note: host groups on a bound world])


def setup_groups(num_stages: int, replicas: int, backend: str,
                 placement: Sequence[int] | None = None) -> list[tuple[Communicator, tuple[int, ...], str]]:
    """Every process group the pipeline's setup creates, in creation order: (key, members as model ranks
    ``replica * devices + device``, backend) -- under NCCL the host group first, then the directed layout's
    point-to-point groups, then with replicas each device's replicas (``("dp", device)``) and each replica's
    pipeline (``("pp", replica)``). ``placement``: each stage's device ([Note: virtual stages]). [Note: group
    creation]"""
    num_devices = max(placement) + 1 if placement is not None else num_stages
    world = num_devices * replicas
    groups: list[tuple[Communicator, tuple[int, ...], str]] = []
    if backend == "nccl":
        groups.append((HOST_GROUP, tuple(range(world)), "gloo"))
    groups += [(comm, members, backend)
               for comm, members in rank_members("directed", num_stages, replicas, placement).items()]
    if replicas > 1:
        groups += [(("dp", d), tuple(r * num_devices + d for r in range(replicas)), backend)
                   for d in range(num_devices)]
        groups += [(("pp", r), tuple(r * num_devices + d for d in range(num_devices)), backend)
                   for r in range(replicas)]
    return groups


def rank_members(layout: str, num_stages: int, replicas: int,
                   placement: Sequence[int] | None = None) -> dict[Communicator, tuple[int, ...]]:
    """``layout_communicators`` with the model's rank numbers (``replica * devices + device``)."""
    num_devices = max(placement) + 1 if placement is not None else num_stages
    return {comm: tuple(comm[1] * num_devices + d for d in members)
            for comm, members in layout_communicators(layout, num_stages, replicas, placement).items()}
