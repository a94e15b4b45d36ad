"""The one-process reference executor: all stages' action lists in a single process, same stage code.

Tests compare every multi-process run against it, and it is the easiest place to debug a schedule: it runs the
exact lists the distributed runtime runs, interleaving the stages in one process (a stage runs until its next
action is a receive whose message has not been sent yet). Because each stage's order is fixed by its list, any
interleaving gives bit-identical results.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_paci.comm import LocalComm
from lightning_paci.compensation import lookahead_for
from lightning_paci.data_parallel import ReplicaMismatchError
from lightning_paci.microbatch import loss_scale_for, split_weighted
from lightning_paci.partition import PartitionPlan, carve_stage
from lightning_paci.program import LightningStageProgram
from lightning_paci.recompute import RECOMPUTE_MODES, BlockRecompute, recomputes
from lightning_paci.runtime import StageRuntime
from lightning_paci.schedules import OPT, RECV_KINDS, Action, ActionKind, Schedule, message_key, static_drift, validate
from lightning_paci.stage_optimizer import StageOptimizer, optimizer_and_step_schedulers

__all__ = ["ReferencePipeline", "run_lists"]


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
        validate(lists)  # raises with the grid
        raise AssertionError("reference executor stalled on a list the validator accepts")


class ReferencePipeline:
    """N carved deep copies of a LightningModule, each with its stage optimizer, wired by in-process mailboxes.

    ``optimizer_factory(module)`` returns ``(optimizer, schedulers)`` for a carved copy; by default it calls the
    module's own ``configure_optimizers`` (a single optimizer, optionally with step-interval schedulers).
    ``compensation`` is ``PACIStrategy``'s option of that name (see compensation.py), with the same default;
    ``recompute`` and ``recompute_stages`` too (recompute.py).
    """

    def __init__(
        self,
        module: LightningModule,
        plan: PartitionPlan,
        *,
        optimizer_factory: Callable[[LightningModule], tuple[torch.optim.Optimizer, list[Any]]] | None = None,
        compensation: str = "auto",
        replicas: int = 1,
        local_sgd_steps: int | None = None,
        recompute: str = "off",
        recompute_stages: int | None = None,
    ) -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"`recompute` must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, got {recompute!r}.")
        self.plan = plan
        self.replicas = replicas
        # replica_modules[r][s], replica_runtimes[r][s]; ``modules``/``runtimes``: replica 0's
        self.replica_modules: list[list[LightningModule]] = []
        self.replica_runtimes: list[list[StageRuntime]] = []
        factory = optimizer_factory or _configured_optimizer
        for replica in range(replicas):
            comms = LocalComm.network(plan.num_stages)
            modules, runtimes = [], []
            for stage in range(plan.num_stages):
                copy_ = copy.deepcopy(module)
                carve = carve_stage(copy_, plan, stage)
                if recomputes(recompute, recompute_stages, stage):
                    BlockRecompute(copy_.get_submodule(plan.container), plan.blocks(stage))
                optimizer, schedulers = factory(copy_)
                tied_replica = carve.tied_params if stage == plan.num_stages - 1 else []
                stage_optimizer = StageOptimizer(optimizer, list(copy_.parameters()), schedulers=schedulers,
                                                 exclude=tied_replica)
                runtime = StageRuntime(stage, plan.num_stages, LightningStageProgram(copy_, carve), comms[stage],
                                       stage_optimizer, loss_scale=1.0, tied=carve.tied_params)
                runtime.lookahead = lookahead_for(compensation, optimizer, stage_optimizer.pairs, warn=None)
                runtime.replica = replica
                modules.append(copy_)
                runtimes.append(runtime)
            self.replica_modules.append(modules)
            self.replica_runtimes.append(runtimes)
        self._parameter_averages: list[_ReplicaParameterAverage] = []
        for stage in range(plan.num_stages if replicas > 1 else 0):
            group = [runtimes[stage] for runtimes in self.replica_runtimes]
            if local_sgd_steps is None:
                average_gradients = _ReplicaAverage(group)
                for runtime in group:
                    runtime.reduce_gradients = average_gradients
                continue
            average = _ReplicaParameterAverage(group, local_sgd_steps, last=stage == plan.num_stages - 1)
            group[-1].update_hooks.append(average)  # the last replica to step (run_lists steps them in order)
            self._parameter_averages.append(average)
        self.modules, self.runtimes = self.replica_modules[0], self.replica_runtimes[0]

    def run(self, schedule: Schedule, batches: Sequence[Any], *, accumulation_scale: int | None = None) -> None:
        """Feed ``batches`` (one per mini-batch; with replicas, ``batches[r]`` is replica ``r``'s) and run the
        schedule's lists to the end."""
        per_replica = [batches] if self.replicas == 1 else list(batches)
        if len(per_replica) != self.replicas:
            raise ValueError(f"{len(per_replica)} batch lists for {self.replicas} replicas: pass one per replica")
        if any(len(b) != schedule.num_minibatches for b in per_replica):
            raise ValueError(f"{[len(b) for b in per_replica]} batches for a schedule of "
                             f"{schedule.num_minibatches} mini-batches")
        has_tied_messages = any(a.kind in (ActionKind.SEND_T, ActionKind.RECV_T) for a in schedule.actions[0])
        if bool(self.plan.tied) and not has_tied_messages:
            raise ValueError(
                f"The plan ties {self.plan.tied[0][0]} = {self.plan.tied[0][1]} across the first and last stage, "
                f"but the {schedule.name!r} lists were built without tied-weight messages: the replica would never "
                f"be updated. Build them with `build(..., tied=True)`."
            )
        scale = loss_scale_for(accumulation_scale or schedule.accumulation)
        base = self.runtimes[0].microbatch_base
        everyone = [runtime for runtimes in self.replica_runtimes for runtime in runtimes]
        for runtime in everyone:
            runtime.loss_scale = scale
            for k, batch in enumerate(per_replica[runtime.replica]):
                for i, (part, weight) in enumerate(split_weighted(batch, schedule.num_microbatches)):
                    runtime.add_microbatch(k * schedule.num_microbatches + i, part, k, weight=weight)
            # read from the list itself (the driver counts)
            runtime.crossings = static_drift(schedule.actions[runtime.stage]).__getitem__
        run_lists(everyone, schedule.actions)
        for average in self._parameter_averages:  # the end of a run is a drain
            average.sync()
        for runtime in everyone:
            runtime.microbatch_base = base + schedule.total_microbatches

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The union of the stages' state dicts: the full model's keys (a tied weight from stage 0, its owner). A
        carved copy's state dict holds only its stage's own tensors (placeholders keep theirs out of it)."""
        full: dict[str, torch.Tensor] = {}
        for module in reversed(self.modules):
            full.update(module.state_dict())
        return full


class _ReplicaAverage:
    """The reference executor's data-parallel reduction: the first replica of a stage to step averages every
    replica's gradients (``run_lists`` lets it only when all have reached that update), as
    :func:`~lightning_paci.data_parallel.average_gradients` does over processes: summed in replica order, then
    divided (for two replicas the same bits as gloo's all-reduce)."""

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
            total = grads[0].clone()  # type: ignore[union-attr]
            for grad in grads[1:]:
                total += grad
            for p in same:
                p.grad.copy_(total).div_(len(grads))  # type: ignore[union-attr]


class _ReplicaParameterAverage:
    """The reference executor's LocalSGD: after every ``every``-th step of a stage (called by its last replica,
    when every replica has stepped) and at the end of a run, each replica's parameters become their mean, summed
    in replica order and divided, as :func:`~lightning_paci.data_parallel.average_parameters` does."""

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


def _configured_optimizer(module: LightningModule) -> tuple[torch.optim.Optimizer, list[Any]]:
    return optimizer_and_step_schedulers(module.configure_optimizers())
