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
from lightning_paci.microbatch import loss_scale_for, split_weighted
from lightning_paci.partition import PartitionPlan, carve_stage
from lightning_paci.program import LightningStageProgram
from lightning_paci.runtime import StageRuntime
from lightning_paci.schedules import RECV_KINDS, Action, ActionKind, Schedule, message_key, static_drift, validate
from lightning_paci.stage_optimizer import StageOptimizer, optimizer_and_step_schedulers

__all__ = ["ReferencePipeline", "run_lists"]


def run_lists(runtimes: Sequence[StageRuntime], lists: Sequence[Sequence[Action]]) -> None:
    """Execute every stage's list to the end in one process."""
    positions = [0] * len(runtimes)
    progress = True
    while progress:
        progress = False
        for s, runtime in enumerate(runtimes):
            actions = lists[s]
            while positions[s] < len(actions):
                action = actions[positions[s]]
                key = message_key(action, len(runtimes))
                if key is not None and action.kind in RECV_KINDS and not runtime.comm.ready(key[1], int(key[0] == "T")):
                    break
                runtime.execute(action)
                positions[s] += 1
                progress = True
    if any(positions[s] < len(lists[s]) for s in range(len(runtimes))):
        validate(lists)  # raises with the grid
        raise AssertionError("reference executor stalled on a list the validator accepts")


class ReferencePipeline:
    """N carved deep copies of a LightningModule, each with its stage optimizer, wired by in-process mailboxes.

    ``optimizer_factory(module)`` returns ``(optimizer, schedulers)`` for a carved copy; by default it calls the
    module's own ``configure_optimizers`` (a single optimizer, optionally with step-interval schedulers).
    ``compensation`` is ``PACIStrategy``'s option of that name (see compensation.py), with the same default.
    """

    def __init__(
        self,
        module: LightningModule,
        plan: PartitionPlan,
        *,
        optimizer_factory: Callable[[LightningModule], tuple[torch.optim.Optimizer, list[Any]]] | None = None,
        compensation: str = "auto",
    ) -> None:
        self.plan = plan
        self.modules: list[LightningModule] = []
        self.runtimes: list[StageRuntime] = []
        self._accumulation = 1
        comms = LocalComm.network(plan.num_stages)
        factory = optimizer_factory or _configured_optimizer
        for stage in range(plan.num_stages):
            copy_ = copy.deepcopy(module)
            carve = carve_stage(copy_, plan, stage)
            optimizer, schedulers = factory(copy_)
            replicas = carve.tied_params if stage == plan.num_stages - 1 else []
            stage_optimizer = StageOptimizer(optimizer, list(copy_.parameters()), schedulers=schedulers,
                                             exclude=replicas)
            runtime = StageRuntime(stage, plan.num_stages, LightningStageProgram(copy_, carve), comms[stage],
                                   stage_optimizer, loss_scale=1.0, tied=carve.tied_params)
            runtime.lookahead = lookahead_for(compensation, optimizer, stage_optimizer.pairs, warn=None)
            self.modules.append(copy_)
            self.runtimes.append(runtime)

    def run(self, schedule: Schedule, batches: Sequence[Any], *, accumulation_scale: int | None = None) -> None:
        """Feed ``batches`` (one per mini-batch) and run the schedule's lists to the end."""
        if len(batches) != schedule.num_minibatches:
            raise ValueError(f"{len(batches)} batches for a schedule of {schedule.num_minibatches} mini-batches")
        has_tied_messages = any(a.kind in (ActionKind.SEND_T, ActionKind.RECV_T) for a in schedule.actions[0])
        if bool(self.plan.tied) and not has_tied_messages:
            raise ValueError(
                f"The plan ties {self.plan.tied[0][0]} = {self.plan.tied[0][1]} across the first and last stage, "
                f"but the {schedule.name!r} lists were built without tied-weight messages: the replica would never "
                f"be updated. Build them with `build(..., tied=True)`."
            )
        scale = loss_scale_for(accumulation_scale or schedule.accumulation)
        base = self.runtimes[0].microbatch_base
        for runtime in self.runtimes:
            runtime.loss_scale = scale
            for k, batch in enumerate(batches):
                for i, (part, weight) in enumerate(split_weighted(batch, schedule.num_microbatches)):
                    runtime.add_microbatch(k * schedule.num_microbatches + i, part, k, weight=weight)
        for runtime, actions in zip(self.runtimes, schedule.actions):
            runtime.crossings = static_drift(actions).__getitem__  # read from the list itself (the driver counts)
        run_lists(self.runtimes, schedule.actions)
        for runtime in self.runtimes:
            runtime.microbatch_base = base + schedule.total_microbatches

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The union of the stages' state dicts: the full model's keys (a tied weight from stage 0, its owner). A
        carved copy's state dict holds only its stage's own tensors (placeholders keep theirs out of it)."""
        full: dict[str, torch.Tensor] = {}
        for module in reversed(self.modules):
            full.update(module.state_dict())
        return full


def _configured_optimizer(module: LightningModule) -> tuple[torch.optim.Optimizer, list[Any]]:
    return optimizer_and_step_schedulers(module.configure_optimizers())
