"""``PACIStrategy``: train an unchanged LightningModule with asynchronous pipeline parallelism.

``import lightning_paci`` registers ``Trainer(strategy="paci")`` (processes started like ``ddp``), ``"paci_fork"``
(forked, for CPU tests and notebooks) and ``"paci_spawn"``.

One class, as each of Lightning's strategies is: every hook delegates to the module that owns the concept -- options
(config.py), processes and collectives (integration/processes.py), the model's construction and the plan
(integration/stage_build.py), this process's stage and everything that runs it (integration/local_stage.py: runtime,
stream driver, [Note: no flush per Lightning batch]), the Trainer's checks (integration/trainer_checks.py), the fit
loop's data, drain points and patches (integration/fit_loop.py), checkpoints (integration/checkpoint.py), failures
(engine/supervision.py) and Lightning's private API (integration/lightning_api.py). Two per-batch synchronisations
would turn PACI into a flush and are avoided: Lightning's per-batch SIGTERM broadcast from rank 0 (a full barrier on
gloo) is replaced by a local check (Lightning's launchers deliver the signal to every process; the handler itself
runs no collective), and logged values travel upstream with the gradients instead of being broadcast (logs.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_paci.config import PACIConfig
from lightning_paci.engine.activity import activity
from lightning_paci.engine.runtime import StageRuntime
from lightning_paci.engine.supervision import mark_setup_error
from lightning_paci.engine.topology import Topology
from lightning_paci.integration import lightning_api as api
from lightning_paci.integration.checkpoint import (
    PARTITION_KEY,
    PipelineCheckpoints,
    after_fit_message,
    cpu_state,
    receive_after_fit,
)
from lightning_paci.integration.clipping import clipping_by_norm
from lightning_paci.integration.fit_loop import (
    ends_epoch,
    must_drain,
    patch_for_pipeline,
    same_data_on_every_stage,
    seed_workers_alike,
)
from lightning_paci.integration.lightning_callbacks import batch_outputs, needs_every_stage_loss
from lightning_paci.integration.lightning_program import LightningHooks
from lightning_paci.integration.local_stage import LocalStage, StageLinks
from lightning_paci.integration.optimizer_layout import OptimizerLayout
from lightning_paci.integration.processes import (
    ProcessGroups,
    broadcast_object,
    check_launched_world,
    collective_waits,
    reduce_decision,
    reduce_over,
    start_process_groups,
)
from lightning_paci.integration.shutdown import end_teardown, ends_together, finish_fit, preempted, report_failure
from lightning_paci.integration.stage_build import StageBuilder, meta_stays_on_meta
from lightning_paci.integration.trainer_checks import check_trainer
from lightning_paci.integration.weight_averaging import average_per_stage
from lightning_paci.optim.stage_optimizer import optimizer_and_step_schedulers
from lightning_paci.partition import PartitionPlan, PartitionSpec
from lightning_paci.partition.chunks import carve_chunks
from lightning_paci.schedules import ScheduleName, stage_devices
from lightning_paci.schedules.virtual import Placement

__all__ = ["PACIStrategy", "optimizer_and_step_schedulers"]

log = logging.getLogger(__name__)


_REGISTERED = (  # Trainer(strategy=...) names: one class, different process start methods (as ddp / ddp_fork)
    ("paci", "popen", "PACI asynchronous pipeline parallelism, one process per stage"),
    ("paci_spawn", "spawn", "PACI, processes started with spawn"),
    ("paci_fork", "fork", "PACI, processes forked (CPU tests, notebooks)"),
)
_LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


class PACIStrategy(ParallelStrategy):
    """Pipeline-parallel training with PACI's asynchronous, flush-free 1F1B schedule (one process per stage).

    The pipeline options are :class:`~lightning_paci.config.PACIConfig`'s fields (same names, types and defaults;
    documented and checked there); ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``
    and ``precision_plugin`` are Lightning's usual strategy arguments.

    Raises:
        ValueError: at construction for bad options, at setup for modules or Trainer settings that cannot run.

    Example: ``L.Trainer(strategy="paci", devices=4).fit(model)`` (after ``import lightning_paci``).
    """

    strategy_name = "paci"

    def __init__(
        self,
        *,
        schedule: ScheduleName = "paci",
        microbatches: int | None = None,
        accumulation: int | None = None,
        partition: PartitionSpec = "parameters",
        block_container: str | Sequence[str] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        failure_timeout: float = 20.0,
        nonfinite: Literal["raise", "skip"] = "raise",
        checkpoint_layout: Literal["consolidated", "sharded"] = "consolidated",
        max_stream_batches: int = 256,
        freeze_gc: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        compensation: Literal["auto", "predict", "none"] = "auto",
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_size: int | Literal["auto"] = "auto",
        local_sgd_steps: int | None = None,
        reduce_bucket_mb: float | None = 25.0,
        dp_shard: Literal["none", "optimizer"] = "none",
        deferred_update: bool = False,
        recompute: Literal["off", "blocks"] = "off",
        recompute_stages: int | None = None,
        compile: Literal["off", "blocks"] = "off",
        compile_backend: str = "inductor",
        model_init: Literal["stage", "full"] = "stage",
        weights: str | os.PathLike[str] | None = None,
        virtual_stages: int = 1, placement: Placement = "loop",
        plan: Literal["off", "auto"] = "off", memory_budget: float | str | None = None,
    ) -> None:
        given = locals()  # the arguments above, by name: PACIConfig's fields and Lightning's (a test keeps them equal)
        self.config = PACIConfig(**{f.name: given[f.name] for f in dataclasses.fields(PACIConfig)})
        super().__init__(**{name: given[name] for name in _LIGHTNING_ARGS})
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._groups: ProcessGroups | None = None
        self._trainer: Trainer | None = None
        self._stage: LocalStage | None = None
        self._builder = StageBuilder(self)
        self._undo_patches: list[Callable[[], None]] = []
        # after `fit`: rank 0's gathered optimizer and scheduler states, for `trainer.save_checkpoint` after `fit`
        self._after_fit: dict[str, list[Any]] | None = None
        self._failed = self._froze_gc = False

    # -- ranks, stages and replicas ([Note: rank layout]) ------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def topology(self) -> Topology:
        """Pipeline stages x data-parallel replicas over ``devices x num_nodes`` processes; an impossible split is a
        ``ValueError`` naming the numbers and the fix (engine/topology.py)."""
        return self.config.topology(self.num_processes, self.num_nodes)

    @property
    def num_stages(self) -> int:
        """Processes per pipeline; the model is cut into ``len(stage_devices)`` stages, ``virtual_stages`` each."""
        return self.topology.pipeline

    @property
    def stage_devices(self) -> tuple[int, ...]:  # the process (`stage_index`) of each of the pipeline's stages
        return stage_devices(self.num_stages, self.config.virtual_stages, self.config.placement)

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data

    @property
    def stage_index(self) -> int:
        """This process's stage. Stages run in reverse rank order: global rank 0 -- where Lightning's loggers,
        progress bar and ``is_global_zero`` callbacks live -- holds the *last* stage, which computes mini-batch k's
        loss and logs in its own call k ([Note: the logging rank])."""
        return self.topology.stage_of(self.global_rank)

    @property
    def replica_index(self) -> int:
        """This process's data-parallel coordinate (0 without data parallelism)."""
        return self.topology.replica_of(self.global_rank)

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """The global rank that runs ``stage`` of ``replica`` (default: this process's replica)."""
        return self.topology.rank_of(stage, self.replica_index if replica is None else replica)

    @property
    def process_groups(self) -> ProcessGroups:
        """This process's groups (integration/processes.py), after ``setup_environment``."""
        if self._groups is None:
            raise RuntimeError("PACIStrategy.process_groups is only available after the processes have started.")
        return self._groups

    @property
    def device_mesh(self) -> Any:
        """torch's ``DeviceMesh`` with dimensions ``("pp", "dp")`` with data parallelism, else None."""
        return None if self._groups is None else self._groups.mesh

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one replica sees the same batches; replicas see disjoint shards
        return {"num_replicas": self.data_parallel_size, "rank": self.replica_index}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    # -- the pipeline ------------------------------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        return self.config.microbatches or self.num_stages

    @property
    def accumulation(self) -> int:
        """Local backwards per optimizer step, Trainer's ``accumulate_grad_batches`` included."""
        factor = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
        return (self.config.accumulation or self.num_microbatches) * factor

    @property
    def runtime(self) -> StageRuntime:
        """This process's stage's runtime (its first stage's with ``virtual_stages > 1``: see ``runtimes``)."""
        return next(iter(self.runtimes.values()))

    @property
    def runtimes(self) -> dict[int, StageRuntime]:
        """The runtime of each stage this process runs, by stage (one, or ``virtual_stages``)."""
        if self._stage is None or not self._stage.runtimes:
            raise RuntimeError("PACIStrategy.runtime is only available after `trainer.fit` has set up the stage.")
        return self._stage.runtimes

    @property
    def plan(self) -> PartitionPlan:
        if self._stage is None:
            raise RuntimeError("PACIStrategy.plan is only available after setup.")
        return self._stage.plan

    @property
    def weights_read(self) -> dict[str, list[str]] | None:
        """What ``weights=`` made this stage read: ``{"files": [...], "keys": [...]}`` (None without ``weights=``)."""
        return self._builder.weights_read

    def undo_at_teardown(self, undo: list[Callable[[], None]]) -> None:
        """Patches of the Trainer or the module, undone at teardown in reverse order."""
        self._undo_patches += undo

    # -- processes -----------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _ = self.topology  # an impossible split fails here, in the main process, before any start
        if self.config.start_method != "popen":
            self._launcher = api.multiprocessing_launcher(
                self, self.config.start_method, send=self._send_after_fit, receive=self._receive_after_fit,
                on_exception=self.on_exception, freeze_heap=self.config.freeze_gc)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = api.SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _send_after_fit(self, trainer: Trainer) -> dict[str, Any]:
        return after_fit_message(trainer, self._after_fit)

    def _receive_after_fit(self, trainer: Trainer, sent: Mapping[str, Any]) -> None:
        self._after_fit = receive_after_fit(trainer, sent)

    @override
    def setup_environment(self) -> None:
        assert self.cluster_environment is not None
        check_launched_world(self.cluster_environment, self.num_processes, self.num_nodes)
        topology = self.topology  # the same checks on every rank (torchrun, SLURM: no main process)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._groups = start_process_groups(self.cluster_environment, topology, rank=self.global_rank,
                                            device=self.root_device, local_processes=self.num_processes,
                                            config=self.config)
        self._process_group_backend = self._groups.backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # as Lightning

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Lightning's, plus [Note: stage-only construction] for ``configure_model`` and ``init_module``."""
        with self._builder.context(empty_init, lambda: super(PACIStrategy, self).tensor_init_context(empty_init)):
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self._builder.on_meta(self.lightning_module)  # a meta-built model reads its checkpoint after carving

    # -- setup -------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        try:
            self._setup(trainer)
        except (ValueError, TypeError, api.LightningAPIError) as err:  # the same on every rank: print it once
            raise mark_setup_error(err)
        activity.end()  # setup's patient base phase, begun in setup_environment

    def _setup(self, trainer: Trainer) -> None:
        self._trainer = trainer
        module = self.lightning_module
        assert module is not None
        check_trainer(trainer, module, self.num_stages, self.config.start_method)
        same_data_on_every_stage(trainer, self.broadcast, self.data_parallel_size)
        if self._stage is None:
            plan = self._builder.plan_stages(trainer, module)  # and logged
            # one device's optimizer layout, read off the whole module before carving
            layout = OptimizerLayout.of(module) if trainer.state.fn == TrainerFn.FITTING else None
            carve = carve_chunks(module, plan, self.topology.stages_on(self.stage_index))
            self._builder.materialize(module, carve, has_checkpoint=trainer.ckpt_path is not None)
            self._stage = LocalStage(
                module, plan, carve, config=self.config, num_microbatches=self.num_microbatches, layout=layout,
                links=StageLinks.of(self), broadcast=self.pipeline_broadcast,
                eval_context=self.precision_plugin.val_step_context, index=self.stage_index)
        super().setup(trainer)
        watchdog = self._groups.watchdog if self._groups is not None else None
        stop = watchdog.preemption if watchdog is not None else None  # [Note: a preemption's stop]
        self.undo_at_teardown([api.sigterm_without_a_collective(trainer, stop.request if stop else None)])
        self._stage.prepare_relays(self, self._builder.take_sample())  # on the device, in the step's precision
        if trainer.state.fn == TrainerFn.FITTING:
            owned = [cfg.scheduler for cfg in self.lr_scheduler_configs if cfg.interval == "step"]
            self._stage.start_training(self.optimizers, schedulers=owned, accumulation=self.accumulation,
                                       hooks=lambda stage: LightningHooks(module, trainer, stage),
                                       train_context=self.precision_plugin.train_step_context)
            self.undo_at_teardown(patch_for_pipeline(trainer, module, owned, stop, self.config.failure_timeout)
                                  + clipping_by_norm(trainer, self)
                                  + average_per_stage(trainer, self))
            activity.source = self._stage.activity()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return seed_workers_alike(dataloader, self.replica_index)

    # -- training and evaluation -------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        trainer, stage = self._trainer, self._stage
        assert trainer is not None and stage is not None
        # an epoch's end steps an open window as Lightning does when windows are whole Lightning batches; a window
        # of `accumulation` micro-batches not a multiple of the batch's is PACI's own and carries on across epochs
        closes_windows = self.accumulation % self.num_microbatches == 0
        loss, minibatch = stage.train(batch, batch_idx,
                                      label=f"Lightning batch {batch_idx} (global step {trainer.global_step})",
                                      drain=must_drain(trainer, batch_idx), accumulation=self.accumulation,
                                      close_window=closes_windows and ends_epoch(trainer, batch_idx))
        return batch_outputs(loss, minibatch, precision=str(trainer.precision), device=self.root_device,
                             every_stage=needs_every_stage_loss(trainer), holds_last=stage.carve.holds_last,
                             from_last=lambda sent: self.pipeline_broadcast(sent, self.stage_devices[-1]))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss  # the schedule already ran every backward inside training_step

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the stage optimizer steps inside the schedule (OPT); the closure runs training_step

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._stage is not None:
            self._stage.install_resumed_gradients()
        if self.config.freeze_gc and not self._froze_gc:
            gc.collect(1)  # young generations only: a full collection costs 0.5-0.6 s per rank (PACIConfig.freeze_gc)
            gc.freeze()  # full collections then skip everything alive now
            self._froze_gc = True

    @override
    def on_validation_start(self) -> None:
        self._drain()

    @override
    def on_train_end(self) -> None:
        self._drain()

    def _drain(self) -> None:
        if self._stage is not None:
            self._stage.drain()

    def _evaluate(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        batch = kwargs.pop("batch", args[0] if args else None)
        assert self._stage is not None
        return self._stage.evaluate(step_name, batch, args[1:] if args else tuple(kwargs.values()))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("predict_step", args, kwargs)

    def log_figures(self, figures: dict[str, float], step: int) -> None:
        """A monitor's figures of this stage (``paci/<figure>/stage_<s>``) for the Trainer's loggers on global rank 0:
        they travel with the pipeline's own messages (LightningHooks.figures)."""
        if self._stage is not None and self._stage.hooks is not None:
            self._stage.hooks.figures(figures, step, last_stage=self._stage.carve.holds_last)

    # -- collectives (never per training batch) ----------------------------------------------------------------------
    def pipeline_broadcast(self, obj: Any, stage: int) -> Any:
        """From ``stage`` to this replica's other stages, over the host group ([Note: host groups on a bound world])."""
        ranks = None if self.data_parallel_size == 1 else [self.rank_of(p) for p in range(self.topology.pipeline)]
        groups = self.process_groups  # without replicas the pipeline is every rank: the host group's own broadcast
        return broadcast_object(obj, self.rank_of(stage), groups.host, what=f"a broadcast from stage {stage}",
                                ranks=ranks, waits=collective_waits(self.topology, ranks and groups.pipeline))

    @override
    def barrier(self, name: str | None = None) -> None:
        if api.distributed_is_initialized():
            with activity.collective("a barrier"):
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        host = None if self._groups is None else self._groups.host  # [Note: host groups on a bound world]
        return broadcast_object(obj, src, host, what="`strategy.broadcast(obj)`", host_tensors=True)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """``sync_dist=True``: over the data-parallel replicas of this rank's stage. The stages of one replica hold
        the same logged values (every rank replays the records of its replica): a pure pipeline returns the value
        as it is; the replicas of a stage replay the same records in the same order, so their group issues the
        same collectives (also under NCCL)."""
        if self.data_parallel_size == 1 or not isinstance(tensor, Tensor):
            return tensor
        group = self.process_groups.data if group is None else group
        return reduce_over(tensor, reduce_op, group, self.data_parallel_size, collective_waits(self.topology, group))

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return reduce_decision(decision, all=all, device=self.root_device, world=self.world_size)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return api.all_gather_if_available(tensor, group=group, sync_grads=sync_grads)

    # -- checkpoints (integration/checkpoint.py owns the format) -------------------------------------------------------
    @property
    def _checkpoints(self) -> PipelineCheckpoints:
        return PipelineCheckpoints(self.config.checkpoint_layout, self.stage_index, self.num_stages,
                                   self.checkpoint_io, rank=self.global_rank, first_replica=self.replica_index == 0,
                                   replicas=self.data_parallel_size,
                                   group=None if self._groups is None else self._groups.host)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._drain()
        assert self.lightning_module is not None
        if not api.distributed_is_initialized():
            return cpu_state(self.lightning_module)
        foreign = self._stage.carve.foreign_buffers if self._stage is not None else set()
        return self._checkpoints.weights(self.lightning_module, foreign)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._drain()
        if self._stage is not None and self._stage.runtime is not None:
            return self._stage.optimizer_state(self._checkpoints)
        if self._after_fit is not None:  # `trainer.save_checkpoint` after `fit`: what teardown gathered
            return self._after_fit["optimizer_states"][0]
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._stage is None or self._stage.runtime is None:
            raise ValueError("Resuming optimizer state needs a fitting PACIStrategy (`trainer.fit(ckpt_path=...)`).")
        self._stage.load_optimizer_state(self._checkpoints, checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        for key, states in (self._after_fit or {}).items():  # the main process of a fork/spawn run has no optimizer
            if key in checkpoint and not checkpoint[key]:
                checkpoint[key] = states
        if self._stage is not None:  # the split, reused by a resume of a measured one (partition="time")
            checkpoint[PARTITION_KEY] = {"num_stages": self._stage.plan.num_stages, "cut": self._stage.plan.cut}
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # a model built on the meta device reads its stage's tensors only: memory-mapped, never whole
        return self._checkpoints.load(checkpoint_path, weights_only, mmap=self._builder.built is not None)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A carved stage (a model built on the meta device restores after setup) takes its own keys only."""
        module = self.lightning_module
        assert module is not None
        if self._stage is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        own = module.state_dict(keep_vars=True)
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in own}, strict=strict)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.remove(filepath)

    # -- failures and teardown (integration/shutdown.py, [Note: ending a run]) -----------------------------------------
    @property
    @override
    def launcher(self) -> Any:
        """Lightning's launcher, each run ending on every rank together."""
        self._launcher = ends_together(self._launcher)
        return self._launcher

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell every other stage which stage failed and why, before Lightning unwinds; a preemption's agreed stop
        is no failure: the run ends on every rank together after teardown ([Note: a preemption's stop])."""
        if preempted(self._groups, exception):
            return
        self._failed = True
        report_failure(self._groups, exception)

    @override
    def teardown(self) -> None:
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        if not self._failed:  # still watched: a failure here stops every rank as one in training does
            self._after_fit = finish_fit(
                self._stage, drain=self._drain, undo=self._undo_patches, checkpoints=lambda: self._checkpoints,
                schedulers=[cfg.scheduler for cfg in self.lr_scheduler_configs], replicas=self.data_parallel_size,
                built_on_meta=self._builder.built is not None, group=self._groups and self._groups.host,
            ) or self._after_fit
        activity.source, self._stage = None, None  # the runtime goes with the stage
        end_teardown(self._groups, failed=self._failed)
        with meta_stays_on_meta(self.lightning_module):
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method, description in _REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)


PACIStrategy.register_strategies(StrategyRegistry)
