"""One device running several pipeline stages (chunks) in its own list's order ([Note: virtual stages]).

Each chunk is a whole :class:`~lightning_paci.engine.runtime.runtime.StageRuntime` -- its own carved module, stage
optimizer, records, in-flight micro-batches and transport -- so every stage-level rule (drift, updates after
every ``a`` local backwards, the checks of a message) holds per chunk unchanged. What the device adds is the
order: its list interleaves the chunks' actions, and :class:`DeviceRuntime` hands each action to the chunk it
names. A message between two chunks of the device never reaches a process group: :class:`ChunkComm` delivers it
through in-process mailboxes (copied, as a transport would), and every other message goes through that chunk's
own :class:`~lightning_paci.engine.transport.point_to_point.DistComm`, on the communicator of its link (one per pair of
chunks and direction, so two chunks' messages between the same two devices can never be taken out of order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.engine.transport.point_to_point import Comm
from lightning_paci.engine.transport.receives_ahead import ReceivesAhead
from lightning_paci.schedules import Action, F

__all__ = ["ChunkComm", "DeviceRuntime", "local_network"]


class ChunkComm:
    """A chunk's transport: ``local`` (in-process mailboxes) for the stages in ``local_stages``, ``remote`` for
    every other."""

    def __init__(self, remote: Comm, local: LocalComm, local_stages: frozenset[int]) -> None:
        self.remote, self.local, self.local_stages = remote, local, local_stages
        self.advances = bool(getattr(remote, "advances", False))  # [Note: payloads received early]

    def _to(self, stage: int) -> Comm:
        return self.local if stage in self.local_stages else self.remote

    def send(self, payload: Any, stage: int, channel: int = 0) -> None:
        self._to(stage).send(payload, stage, channel)

    def recv(self, stage: int, channel: int = 0) -> Any:
        return self._to(stage).recv(stage, channel)

    def ready(self, stage: int, channel: int = 0) -> bool:
        return self._to(stage).ready(stage, channel)

    def post(self, stage: int) -> None:
        self._to(stage).post(stage)

    def flush(self) -> None:
        self.remote.flush()


def local_network(stages: Sequence[int], num_stages: int) -> dict[int, LocalComm]:
    """In-process mailboxes between the chunks ``stages`` of one device: each chunk's endpoint."""
    endpoints = LocalComm.network(num_stages)
    return {stage: endpoints[stage] for stage in stages}


class DeviceRuntime:
    """Runs a device's list: each action by the chunk it names; each chunk's next activation and gradient receive
    posted ahead as a lone stage's are ([Note: receives posted ahead])."""

    def __init__(self, runtimes: Mapping[int, StageRuntime], *, index: int = 0, num_devices: int = 1,
                 virtual_stages: int = 1, placement: str = "loop") -> None:
        self.runtimes = dict(sorted(runtimes.items()))  # stage -> its runtime
        # where this device sits: its index among ``num_devices``, ``virtual_stages`` chunks each under ``placement``
        self.index, self.num_devices = index, num_devices
        self.virtual_stages, self.placement = virtual_stages, placement
        # with the chunks' activation meters on (``records.measure(activation_bytes=True)``): the most bytes the
        # device's chunks held at once, summed over the chunks after each forward
        self.peak_activation_bytes = 0

    def run(self, actions: Sequence[Action]) -> None:
        """Execute ``actions`` (this device's, in order) to the end."""
        mine: dict[int, list[Action]] = {}
        for action in actions:
            mine.setdefault(action.stage, []).append(action)
        unknown = set(mine) - set(self.runtimes)
        if unknown:
            raise ValueError(f"the device's list names stages {sorted(unknown)}, which it does not hold "
                             f"(it holds {sorted(self.runtimes)})")
        ahead = {stage: ReceivesAhead(self.runtimes[stage].comm, stage, chunk) for stage, chunk in mine.items()}
        records = [runtime.records for runtime in self.runtimes.values() if runtime.records.activations]
        for action in actions:
            self.runtimes[action.stage].execute(action)
            ahead[action.stage].taken(action)
            if records and action.kind is F:
                held = sum(sum(r.activation_bytes.values()) for r in records)
                self.peak_activation_bytes = max(self.peak_activation_bytes, held)
        for runtime in self.runtimes.values():
            runtime.settle()

    def flush(self) -> None:
        """Wait until every chunk's sends have completed."""
        for runtime in self.runtimes.values():
            runtime.comm.flush()
