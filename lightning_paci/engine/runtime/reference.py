"""The one-process reference executor: all stages' action lists in a single process, same stage code.

Tests compare every multi-process run against it, and it is the easiest place to debug a schedule: it runs the
exact lists the distributed runtime runs, interleaving the stages in one process (a stage runs until its next
action is a receive whose message has not been sent yet). Because each stage's order is fixed by its list, any
interleaving gives bit-identical results.

:func:`run_lists` executes :class:`~lightning_paci.engine.runtime.runtime.StageRuntime` objects wired by
:class:`~lightning_paci.engine.transport.local_mailbox.LocalComm` mailboxes; :class:`ReplicaAverage` and
:class:`ReplicaParameterAverage` stand in for the replicas' collectives. Building the runtimes from a
LightningModule is the integration's part
(:class:`~lightning_paci.integration.stage.reference_pipeline.ReferencePipeline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_paci.engine.replicas.data_parallel import ReplicaMismatchError
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.schedules import OPT, RECV_KINDS, Action, message_key, validate_schedule

__all__ = ["ReplicaAverage", "ReplicaParameterAverage", "run_device_lists", "run_lists"]


def run_lists(runtimes: Sequence[StageRuntime], lists: Sequence[Sequence[Action]]) -> None:
    """Execute every stage's list to the end in one process. With replicas (more runtimes than lists), ``runtimes``
    holds replica ``r``'s stage ``s`` at ``r * N + s`` (``lists`` are the ``N`` stages' lists, the same for every
    replica), and a stage's ``OPT`` waits until all its replicas have reached that update; then all of them step,
    in replica order, before anything else runs (their gradients are complete for the average their
    ``reduce_gradients`` takes, and a parameter average after the step, LocalSGD's, finds every replica stepped,
    as the processes' collectives would)."""
    n = len(lists)
    positions = [0] * len(runtimes)
    progress = True
    while progress:
        progress = False
        for index, runtime in enumerate(runtimes):
            actions = lists[index % n]
            while positions[index] < len(actions):
                action = actions[positions[index]]
                key = message_key(action, n)
                if key is not None and action.kind in RECV_KINDS and not runtime.comm.ready(key[1], int(key[0] == "T")):
                    break
                peers = range(index % n, len(runtimes), n) if action.kind is OPT else (index,)
                if len(peers) > 1 and not all(runtimes[peer].version == runtime.version
                                              and actions[positions[peer]].kind is OPT for peer in peers):
                    break
                for peer in peers:
                    runtimes[peer].execute(action)
                    positions[peer] += 1
                progress = True
    for runtime in runtimes:
        runtime.settle()
    if any(positions[i] < len(lists[i % n]) for i in range(len(runtimes))):
        validate_schedule(lists)  # raises with the grid
        raise AssertionError("reference executor stalled on a list the validator accepts")


def run_device_lists(devices: Sequence[Mapping[int, StageRuntime]], lists: Sequence[Sequence[Action]],
                     num_stages: int) -> None:
    """Execute devices' lists of a virtual schedule ([Note: virtual stages]) in one process: ``devices[d]`` maps
    each stage device ``d`` holds to its runtime, ``lists[d]`` is the device's list, each action run by the chunk
    it names. A device's own order decides what its chunks share (a tied weight's gradient, its updates), so unlike
    ``run_lists`` this keeps every device's order; any interleaving of the devices then gives the same bits."""
    positions = [0] * len(lists)
    progress = True
    while progress:
        progress = False
        for device, actions in enumerate(lists):
            while positions[device] < len(actions):
                action = actions[positions[device]]
                runtime = devices[device][action.stage]
                key = message_key(action, num_stages)
                if key is not None and action.kind in RECV_KINDS and not runtime.comm.ready(key[1], int(key[0] == "T")):
                    break
                runtime.execute(action)
                positions[device] += 1
                progress = True
    for chunks in devices:
        for runtime in chunks.values():
            runtime.settle()
    if any(positions[d] < len(lists[d]) for d in range(len(lists))):
        raise AssertionError("reference executor stalled on devices' lists; run validate_schedule() for the grid")


class ReplicaAverage:
    """The reference executor's data-parallel reduction: the first replica of a stage to step averages every
    replica's gradients (``run_lists`` lets it only when all have reached that update), as
    :func:`~lightning_paci.engine.replicas.data_parallel.average_gradients` does over processes: summed in replica
    order, then divided (for two replicas the same bits as gloo's all-reduce)."""

    def __init__(self, runtimes: list[StageRuntime]) -> None:
        self.runtimes = runtimes
        self.done = -1  # shared by the replicas: the first to step averages for all

    def __call__(self) -> None:
        version = min(runtime.version for runtime in self.runtimes)
        if version == self.done:
            return
        self.done = version
        params = [[p for _, p in runtime.optimizer.pairs] for runtime in self.runtimes]  # type: ignore[union-attr]
        for same in zip(*params):
            grads = [p.grad for p in same]
            present = sum(g is not None for g in grads)
            if present == 0:
                continue
            if present != len(grads):
                raise ReplicaMismatchError(f"a parameter has a gradient on {present} of {len(grads)} replicas")
            total = grads[0].clone()
            for grad in grads[1:]:
                total += grad
            for p in same:
                p.grad.copy_(total).div_(len(grads))


class ReplicaParameterAverage:
    """The reference executor's LocalSGD: after every ``every``-th step of a stage (called by its last replica,
    when every replica has stepped) and at the end of a run, each replica's parameters become their mean, summed
    in replica order and divided, as :func:`~lightning_paci.engine.replicas.data_parallel.average_parameters` does."""

    def __init__(self, runtimes: list[StageRuntime], every: int, *, last: bool) -> None:
        self.runtimes, self.every, self.last = runtimes, every, last

    def __call__(self, version: int) -> None:
        if version % self.every == 0:
            self.sync()

    def sync(self) -> None:
        params = [[p for _, p in runtime.optimizer.pairs] + (list(runtime.tied) if self.last else [])  # type: ignore[union-attr]
                  for runtime in self.runtimes]
        for same in zip(*params):
            total = same[0].data.clone()
            for p in same[1:]:
                total += p.data
            for p in same:
                p.data.copy_(total).div_(len(same))
