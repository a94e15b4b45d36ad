"""``ReferencePipeline``: a LightningModule carved into all its stages in one process, run by the reference executor.

Each stage is a carved deep copy with its own stage optimizer and runtime, the same objects the strategy builds
per process; :func:`~lightning_paci.engine.runtime.reference.run_lists` then executes the lists. Tests compare every
multi-process run against it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_paci.engine.blocks.recompute import RECOMPUTE_MODES, BlockRecompute, recomputes
from lightning_paci.engine.runtime.microbatch import loss_scale_for, split_weighted
from lightning_paci.engine.runtime.norm_table import NormTable
from lightning_paci.engine.runtime.reference import (
    ReplicaAverage,
    ReplicaParameterAverage,
    run_device_lists,
    run_lists,
)
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.runtime.whole_batch import WholeBatch
from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.integration.stage.lightning_program import LightningStageProgram
from lightning_paci.integration.stage.setup_probe import Sample, run_sample, without_side_effects
from lightning_paci.optim.stage_optimizer import StageOptimizer, optimizer_and_step_schedulers
from lightning_paci.optim.weight_prediction import weight_prediction_for
from lightning_paci.partition import PartitionPlan, StageCarve, carve_stage, share_tied_weights
from lightning_paci.partition.chunks import carve_chunks
from lightning_paci.partition.relay import RelayPlan, install_relays, plan_relays, probe_crossings
from lightning_paci.schedules import ActionKind, Schedule, static_drift

__all__ = ["ReferencePipeline"]


class ReferencePipeline:
    """N carved deep copies of a LightningModule, each with its stage optimizer, wired by in-process mailboxes.

    ``optimizer_factory(module)`` returns ``(optimizer, schedulers)`` for a carved copy; by default it calls the
    module's own ``configure_optimizers`` (a single optimizer, optionally with step-interval schedulers).
    ``compensation`` is ``PACIStrategy``'s option of that name (see optim/weight_prediction.py), with the same default;
    ``recompute`` and ``recompute_stages`` too (recompute.py). ``gradient_clip_val``: clip by norm at every update as
    ``Trainer(gradient_clip_val=...)`` does under ``"paci"``, by the norm over every stage's latest squared norms
    that the messages carry ([Note: norm table] in engine/runtime/norm_table.py), whatever the lists (under the flush
    schedules the Trainer clips by the exact global norm instead: compare those with one device); None: no clipping
    (the reference runs no Lightning hooks). ``device_stages``: the stages each process holds (e.g. ``[[0, 3], [1,
    2]]`` for 2 devices x 2 chunks in a V, :attr:`Schedule.devices`): each process's stages are carved into one
    copy as the strategy carves a device ([Note: chunks of one device] in partition/chunks.py), one optimizer
    stepped per chunk; None: one copy per stage. ``whole_batch_loss``: ``PACIStrategy``'s option ([Note: the
    whole-batch loss]); run it with lists built ``whole_batch=True``.
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
        gradient_clip_val: float | None = None,
        device_stages: Sequence[Sequence[int]] | None = None,
        whole_batch_loss: str | None = None,
    ) -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"`recompute` must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, got {recompute!r}.")
        self.plan = plan
        self.replicas = replicas
        self.gradient_clip_val = gradient_clip_val
        # replica_modules[r][s], replica_runtimes[r][s]; ``modules``/``runtimes``: replica 0's
        self.replica_modules: list[list[LightningModule]] = []
        self.replica_runtimes: list[list[StageRuntime]] = []
        self._carves: list[list[StageCarve]] = []
        self.relays: RelayPlan | None = None  # found at the first run, on its first micro-batch
        self._shared = False  # tied weights shared by the first and last stage's copies (virtual stages in a V)
        factory = optimizer_factory or _configured_optimizer
        if device_stages is not None:
            if replicas != 1 or recompute != "off" or gradient_clip_val is not None or whole_batch_loss is not None:
                raise ValueError("`device_stages` runs one replica without recomputation, clipping or a whole-batch "
                                 "loss")
            self._carve_devices(module, plan, device_stages, factory, compensation)
            return
        for replica in range(replicas):
            comms = LocalComm.network(plan.num_stages)
            modules, runtimes, carves = [], [], []
            for stage in range(plan.num_stages):
                copy_ = copy.deepcopy(module)
                carve = carve_stage(copy_, plan, stage)
                carves.append(carve)
                if recomputes(recompute, recompute_stages, stage):
                    BlockRecompute(plan.block_modules(copy_, stage))
                optimizer, schedulers = factory(copy_)
                tied_replica = carve.tied_params if stage == plan.num_stages - 1 else []
                table = None if gradient_clip_val is None else NormTable.for_parameters(stage, plan.num_stages,
                                                                                        copy_.parameters())
                stage_optimizer = StageOptimizer(optimizer, list(copy_.parameters()), schedulers=schedulers,
                                                 exclude=tied_replica, before_step=_clipping(table, gradient_clip_val))
                program = LightningStageProgram(copy_, carve, whole_batch_loss=whole_batch_loss)
                whole = None if program.whole_batch_loss is None else WholeBatch(
                    program.whole_loss, 1, program.whole_batch_loss)  # m: the schedule's, set by `run`
                runtime = StageRuntime(stage, plan.num_stages, program, comms[stage],
                                       stage_optimizer, loss_scale=1.0, tied=carve.tied_params,
                                       prediction=weight_prediction_for(compensation, optimizer, stage_optimizer.pairs,
                                                               warn=None), whole_batch=whole)
                runtime.carry_norms(table)
                if replicas > 1:
                    runtime.join_replicas(replica, None)
                modules.append(copy_)
                runtimes.append(runtime)
            self.replica_modules.append(modules)
            self.replica_runtimes.append(runtimes)
            self._carves.append(carves)
        self._parameter_averages: list[ReplicaParameterAverage] = []
        for stage in range(plan.num_stages if replicas > 1 else 0):
            group = [runtimes[stage] for runtimes in self.replica_runtimes]
            if local_sgd_steps is None:
                average_gradients = ReplicaAverage(group)
                for runtime in group:
                    runtime.join_replicas(runtime.replica, average_gradients)
                continue
            average = ReplicaParameterAverage(group, local_sgd_steps, last=stage == plan.num_stages - 1)
            group[-1].on_update(average)  # the last replica to step (run_lists steps them in order)
            self._parameter_averages.append(average)
        self.modules, self.runtimes = self.replica_modules[0], self.replica_runtimes[0]

    def _carve_devices(self, module: LightningModule, plan: PartitionPlan, device_stages: Sequence[Sequence[int]],
                       factory: Callable[[LightningModule], tuple[torch.optim.Optimizer, list[Any]]],
                       compensation: str) -> None:
        """One copy per process, carved to its chunks, one optimizer viewed per chunk: what the strategy builds
        (integration/stage/local_stage.py), wired by in-process mailboxes."""
        held = sorted(s for stages in device_stages for s in stages)
        if held != list(range(plan.num_stages)):
            raise ValueError(f"`device_stages` {device_stages} must hold each of the plan's {plan.num_stages} stages "
                             f"once")
        comms = LocalComm.network(plan.num_stages)
        modules: dict[int, LightningModule] = {}
        runtimes: dict[int, StageRuntime] = {}
        carves: dict[int, StageCarve] = {}
        for stages in device_stages:
            copy_ = copy.deepcopy(module)
            device = carve_chunks(copy_, plan, stages)
            optimizer, schedulers = factory(copy_)
            replicas = device.last.tied_params if device.holds_last else []  # the last stage's tied replicas
            base = StageOptimizer(optimizer, list(copy_.parameters()), schedulers=schedulers, exclude=replicas)
            owned = device.chunk_parameters(copy_)
            for carve in device:
                view = base if len(device.chunks) == 1 else base.chunk(owned[carve.stage], None)
                prediction = weight_prediction_for(compensation, optimizer, view.pairs, warn=None)
                if prediction is not None and len(device.chunks) > 1:
                    prediction.before = view.own_hyperparameters
                runtimes[carve.stage] = StageRuntime(carve.stage, plan.num_stages,
                                                     LightningStageProgram(copy_, carve), comms[carve.stage], view,
                                                     loss_scale=1.0, tied=carve.tied_params, prediction=prediction)
                modules[carve.stage], carves[carve.stage] = copy_, carve
            self._shared = self._shared or bool(device.shared_tied)
        order = range(plan.num_stages)
        self.replica_modules = [[modules[s] for s in order]]
        self.replica_runtimes = [[runtimes[s] for s in order]]
        self._carves = [[carves[s] for s in order]]
        self._parameter_averages = []
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
        # each stage's own list: with virtual stages a device's list holds several, and in one process any
        # interleaving of the stages' lists gives the same bits (engine/runtime/reference.py)
        lists = [schedule.stage_actions(s) for s in range(schedule.num_stages)]
        if len(lists) != self.plan.num_stages:
            raise ValueError(f"the schedule has {len(lists)} stages, the plan {self.plan.num_stages}: plan the "
                             f"partition with one stage per chunk (devices x virtual_stages)")
        if self.gradient_clip_val is not None and schedule.virtual_stages > 1:
            raise ValueError(f"`gradient_clip_val` clips by the norms every stage's messages carry, one stage per "
                             f"device, and the schedule has `virtual_stages={schedule.virtual_stages}`, where the "
                             f"Trainer clips each stage by its own norm: run it with `gradient_clip_val=None`.")
        has_tied_messages = any(a.kind in (ActionKind.SEND_T, ActionKind.RECV_T) for a in lists[0])
        devices = schedule.devices
        # the V placement of virtual stages: the first and last stage on one device use one tied Parameter
        shares = bool(self.plan.tied) and schedule.virtual_stages > 1 and devices[0] == devices[-1]
        if shares and not self._shared:
            for modules in self.replica_modules:
                share_tied_weights(modules[0], modules[-1], self.plan)
            self._shared = True
        if bool(self.plan.tied) and not has_tied_messages and not shares:
            raise ValueError(
                f"The plan ties {self.plan.tied[0][0]} = {self.plan.tied[0][1]} across the first and last stage, "
                f"but the {schedule.name!r} lists were built without tied-weight messages: the replica would never "
                f"be updated. Build them with `build_schedule(..., tied=True)`."
            )
        if self.relays is None:
            self._find_relays(split_weighted(per_replica[0][0], schedule.num_microbatches)[0][0])
        scale = loss_scale_for(accumulation_scale or schedule.accumulation)
        base = self.runtimes[0].microbatch_base
        everyone = [runtime for runtimes in self.replica_runtimes for runtime in runtimes]
        for runtime in everyone:
            if runtime.whole is not None:
                runtime.whole.num_microbatches = schedule.num_microbatches
            # crossings read from the list itself (the driver counts); the window's backwards carry on
            runtime.begin_stream(static_drift(lists[runtime.stage]).__getitem__, runtime.window_backwards,
                                 scale)
            for k, batch in enumerate(per_replica[runtime.replica]):
                for i, (part, weight) in enumerate(split_weighted(batch, schedule.num_microbatches)):
                    runtime.add_microbatch(k * schedule.num_microbatches + i, part, k, weight=weight)
        if schedule.virtual_stages > 1 and self.replicas == 1:  # each device's order decides what chunks share
            chunks = [{s: self.runtimes[s] for s in range(len(devices)) if devices[s] == d}
                      for d in range(schedule.num_devices)]
            run_device_lists(chunks, schedule.actions, schedule.num_stages)
        else:
            run_lists(everyone, lists)
        for average in self._parameter_averages:  # the end of a run is a drain
            average.sync()
        for runtime in everyone:
            runtime.end_stream(base + schedule.total_microbatches - runtime.microbatch_base)

    def _find_relays(self, sample: Any) -> None:
        """The setup probe of every stage on ``sample`` ([Note: relayed crossings] in partition/relay.py)."""
        probes = {}
        for stage, (module, carve) in enumerate(zip(self.modules, self._carves[0])):
            with without_side_effects(module, cuda_devices=[]), carve.entered():
                probes[stage] = probe_crossings(module, carve, run_sample(module, Sample(sample, 1, "training_step"),
                                                                         contextlib.nullcontext))
        self.relays = plan_relays(self.plan, probes)
        for modules, carves in zip(self.replica_modules, self._carves):
            for module, carve in zip(modules, carves):
                with carve.entered():
                    install_relays(module, carve, self.relays)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The union of the stages' state dicts: the full model's keys (a tied weight from stage 0, its owner). A
        carved copy's state dict holds only its stage's own tensors (placeholders keep theirs out of it)."""
        full: dict[str, torch.Tensor] = {}
        for module in reversed(self.modules):
            full.update(module.state_dict())
        return full


def _clipping(table: NormTable | None, clip_val: float | None) -> Callable[[torch.optim.Optimizer], None] | None:
    """A stage optimizer's ``before_step`` clipping by ``table`` as the Trainer's precision plugin does
    (integration/trainer/clipping.py: the parameters in the optimizer's group order), or None."""
    if table is None or clip_val is None:
        return None
    return lambda optimizer: table.clip((p for group in optimizer.param_groups for p in group["params"]), clip_val)


def _configured_optimizer(module: LightningModule) -> tuple[torch.optim.Optimizer, list[Any]]:
    return optimizer_and_step_schedulers(module.configure_optimizers())
