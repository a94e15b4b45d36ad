"""``StageLinks``: this process's connections, as its stage builds its transport from them.

The process groups are made once at setup (integration/processes/process_groups.py); a stage reads here which rank
runs each of its neighbours, which groups carry its messages, where received tensors go, and, with virtual stages,
which neighbours are chunks of its own process, whose messages stay in the process ([Note: chunks of one device]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_paci.engine.runtime.virtual_stages import ChunkComm, local_network
from lightning_paci.engine.transport.groups import transport_device
from lightning_paci.engine.transport.point_to_point import Comm, DistComm
from lightning_paci.integration.processes.process_groups import ProcessGroups

__all__ = ["StageLinks"]


@dataclass(frozen=True)
class StageLinks:
    """This process's connections, made by the strategy at setup (integration/processes/process_groups.py): what the
    stage builds its communicators and its replicas' averaging from."""

    ranks: list[int]  # global rank of each stage of this process's lane
    groups: Mapping[Any, Any]  # the pipeline's point-to-point process groups by Communicator
    replica: int = 0  # the data-parallel coordinate
    replicas: int = 1
    lane: int = 0  # this rank's pipeline for the messages: its (replica, tensor) coordinate ([Note: rank layout])
    lanes: int = 1
    replica_group: Any = None  # this stage's replicas (with data parallelism)
    deliver: torch.device | None = None  # where received tensors go (the stage's device)
    transport: torch.device | None = None  # where tensors travel (host memory on gloo)
    headers: Any = None  # the host group for message headers under NCCL

    # with virtual stages: each stage's process index in the pipeline ([Note: chunks of one device])
    devices: tuple[int, ...] | None = None

    @classmethod
    def of(cls, groups: ProcessGroups, rank: int, device: torch.device, devices: Sequence[int]) -> StageLinks:
        """The connections of global ``rank`` (on ``device``) after its process groups started; ``devices``: the
        process of each of the pipeline's stages (``stage_devices``; one stage each without virtual stages)."""
        topology = groups.topology
        lane = topology.lane_of(rank)
        virtual = len(devices) > topology.pipeline
        return cls([topology.rank_of(d, lane) for d in devices], groups.p2p, replica=topology.replica_of(rank),
                   replicas=topology.data, lane=lane, lanes=topology.lanes, replica_group=groups.data, deliver=device,
                   transport=transport_device(groups.backend, device), headers=groups.host,
                   devices=tuple(devices) if virtual else None)

    def connect(self, stage: int | None = None) -> DistComm:
        """A transport for this process's ``stage`` (None: its only one)."""
        return DistComm(self.ranks, groups=self.groups, replica=self.lane, deliver=self.deliver,
                        device=self.transport, headers=self.headers, stage=stage)

    def connect_chunks(self, stages: Sequence[int]) -> dict[int, Comm]:
        """Each of this process's ``stages``' transport: messages between two of them stay in the process."""
        if len(stages) == 1:
            return {stages[0]: self.connect()}
        local = local_network(stages, len(self.ranks))
        return {s: ChunkComm(self.connect(s), local[s], frozenset(t for t in stages if t != s)) for s in stages}

    def watched(self, stage: int) -> int:
        """The failure watchdog's id of ``stage`` of this lane ([Note: judging progress]): its process's."""
        if self.lanes > 1:
            return self.ranks[stage]
        return self.devices[stage] if self.devices is not None else stage
