"""``PACIStrategy``: train an unchanged LightningModule with asynchronous pipeline parallelism.

``import lightning_paci`` registers ``Trainer(strategy="paci")`` (processes started like ``ddp``), ``"paci_fork"``
(forked, for CPU tests and notebooks) and ``"paci_spawn"``.

One class, as each of Lightning's strategies is, holding only Lightning's interface: properties, and hooks that
delegate in a line or two to the module that owns the concept -- the options (config.py); the process's start, its
groups and its end (integration/processes/: process_life.py, process_groups.py, shutdown.py); setup
(integration/setup/: stage_setup.py, the model's construction and the plan in stage_build.py, the Trainer's checks
in trainer_checks.py); this process's stage and everything that runs it (integration/stage/local_stage.py: the
runtime, the stream driver, [Note: no flush per Lightning batch]); the fit loop's data, drain points and patches
(integration/trainer/fit_loop.py); checkpoints (integration/checkpoints/); failures
(engine/supervision/watchdog.py); Lightning's private API (integration/trainer/lightning_api.py). Two per-batch
synchronisations would turn PACI into a flush and are avoided: Lightning's per-batch SIGTERM broadcast from rank 0
(a full barrier on gloo) is replaced by a local check (Lightning's launchers deliver the signal to every process;
the handler itself runs no collective), and logged values travel upstream with the gradients instead of being
broadcast (integration/stage/logs.py)."""

from __future__ import annotations

import contextlib
import dataclasses
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
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_paci.config import PACIConfig
from lightning_paci.engine.replicas.topology import Topology
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.supervision.activity import activity
from lightning_paci.engine.supervision.watchdog import mark_setup_error
from lightning_paci.engine.transport.collectives import all_gather_object, broadcast_object, reduce_decision
from lightning_paci.integration.checkpoints.checkpoint_hooks import CheckpointHooks
from lightning_paci.integration.processes.process_groups import ProcessGroups, check_launched_world
from lightning_paci.integration.processes.process_life import ProcessLife
from lightning_paci.integration.processes.shutdown import ends_together
from lightning_paci.integration.setup.stage_build import StageBuilder, meta_stays_on_meta
from lightning_paci.integration.setup.stage_setup import build_stage, start_stage
from lightning_paci.integration.setup.tensor_parallel import deferred_configure_model
from lightning_paci.integration.stage.local_stage import LocalStage
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.fit_loop import seed_workers_alike
from lightning_paci.optim.stage_optimizer import optimizer_and_step_schedulers
from lightning_paci.partition import PartitionPlan, PartitionSpec
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
        checkpoint_layout: Literal["auto", "consolidated", "sharded"] = "auto",
        max_stream_batches: int = 256,
        freeze_gc: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        compensation: Literal["auto", "predict", "none"] = "auto",
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | None = None,
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
        whole_batch_loss: str | None = None,
    ) -> None:
        given = locals()  # the arguments above, by name: PACIConfig's fields and Lightning's (a test keeps them equal)
        self.config = PACIConfig(**{f.name: given[f.name] for f in dataclasses.fields(PACIConfig)})
        super().__init__(**{name: given[name] for name in _LIGHTNING_ARGS})
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._trainer: Trainer | None = None
        self._stage: LocalStage | None = None
        self._builder = StageBuilder(self)
        self._life = ProcessLife(self.config)  # the groups, the patches to undo, the end of the run
        self._checkpoints = CheckpointHooks(self, host=self._life.host_group, after_fit=self._life.after_fit_states,
                                            built_on_meta=self._builder.built_on_meta)

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
        ``ValueError`` naming the numbers and the fix (engine/replicas/topology.py)."""
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

    @property
    def tensor_parallel_size(self) -> int:
        return self.topology.tensor

    def rank_of(self, stage: int, lane: int | None = None) -> int:
        """The global rank that runs ``stage`` in ``lane`` (default: this process's; a lane is a (replica, tensor)
        coordinate, the replica without tensor parallelism, [Note: rank layout])."""
        return self.topology.rank_of(stage, self.topology.lane_of(self.global_rank) if lane is None else lane)

    @property
    def process_groups(self) -> ProcessGroups:
        """This process's groups (integration/processes/process_groups.py), after ``setup_environment``."""
        if self._life.groups is None:
            raise RuntimeError("PACIStrategy.process_groups is only available after the processes have started.")
        return self._life.groups

    @property
    def device_mesh(self) -> Any:
        """torch's ``DeviceMesh`` with dimensions ``("pp", "dp")`` with data parallelism, else None."""
        return None if self._life.groups is None else self._life.groups.mesh

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
        """The partition of the last ``fit`` (``validate``, ``test``, ``predict``): set at setup and kept after it,
        also in the process that called ``fit`` under ``start_method="fork"``/``"spawn"`` (rank 0 sends it)."""
        if self._life.plan is None:
            raise RuntimeError("PACIStrategy.plan is known once `trainer.fit` (or `validate`, `test`, `predict`) has "
                               "set up the stages.")
        return self._life.plan

    @property
    def weights_read(self) -> dict[str, list[str]] | None:
        """What ``weights=`` made this stage read: ``{"files": [...], "keys": [...]}`` (None without ``weights=``)."""
        return self._builder.weights_read

    @property
    def stage(self) -> LocalStage | None:
        """This process's stage of the pipeline after setup -- its carved module, runtimes, optimizer, tied-weight
        copies (``stage.tied_copies``) -- and ``stage.drain()`` to bring its last updates in; None before setup and
        after teardown. Read-only: the strategy builds and ends it."""
        return self._stage

    def undo_at_teardown(self, undo: list[Callable[[], None]]) -> None:
        """Patches of the Trainer or the module, undone at teardown in reverse order."""
        self._life.undo_at_teardown(undo)

    # -- processes (integration/processes/process_life.py) ---------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _ = self.topology  # an impossible split fails here, in the main process, before any start
        launcher = self._life.launcher(self, self.cluster_environment, self.num_processes, self.num_nodes,
                                       built_on_meta=self._builder.built_on_meta)
        if launcher is not None:
            self._launcher = launcher

    @override
    def setup_environment(self) -> None:
        assert self.cluster_environment is not None
        check_launched_world(self.cluster_environment, self.num_processes, self.num_nodes)
        _ = self.topology  # the same checks on every rank (torchrun, SLURM: no main process)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._life.join(self.cluster_environment, self.topology, rank=self.global_rank, device=self.root_device,
                        local_processes=self.num_processes)
        self._process_group_backend = self.process_groups.backend

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
        with deferred_configure_model(self.lightning_module, self.config.model_parallel), \
                self._builder.context(empty_init, lambda: super(PACIStrategy, self).tensor_init_context(empty_init)):
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a meta-built model reads its checkpoint after carving; a DCP checkpoint into the stage's shards
        return self._builder.on_meta(self.lightning_module) or self.config.model_parallel

    # -- setup (integration/setup/stage_setup.py) --------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        try:
            self._trainer = trainer
            self._stage = build_stage(self, trainer, self._builder, self._stage)
            self._life.plan = self._stage.plan  # kept after teardown
            super().setup(trainer)  # Lightning's: the optimizers hold the stage's own parameters
            start_stage(self, trainer, self._stage, self._builder, self._life.watchdog, self.optimizers)
        except (ValueError, TypeError, api.LightningAPIError) as err:  # the same on every rank: print it once
            raise mark_setup_error(err)
        activity.end()  # setup's patient base phase, begun in setup_environment

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return seed_workers_alike(dataloader, self.replica_index)

    # -- training and evaluation (integration/stage/local_stage.py) -------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        assert self._trainer is not None and self._stage is not None
        return self._stage.training_call(self._trainer, args, kwargs, accumulation=self.accumulation,
                                         device=self.root_device,
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
        self._life.freeze_heap()

    @override
    def on_validation_start(self) -> None:
        if self._stage is not None:
            self._stage.drain()

    @override
    def on_train_end(self) -> None:
        if self._stage is not None:
            self._stage.drain()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._stage is not None
        return self._stage.evaluation_call("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._stage is not None
        return self._stage.evaluation_call("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._stage is not None
        return self._stage.evaluation_call("predict_step", args, kwargs)

    def log_figures(self, figures: dict[str, float], step: int) -> None:
        """A monitor's figures of this stage (``paci/<figure>/stage_<s>``) for the Trainer's loggers on global rank 0:
        they travel with the pipeline's own messages (LightningHooks.figures)."""
        if self._stage is not None:
            self._stage.log_figures(figures, step)

    # -- collectives, never per training batch (engine/transport/collectives.py) -------------------------------------
    def pipeline_broadcast(self, obj: Any, stage: int) -> Any:
        """From ``stage`` to this replica's other stages, over the host group ([Note: host groups on a bound world])."""
        return self.process_groups.pipeline_broadcast(obj, stage, self.topology.lane_of(self.global_rank))

    @override
    def barrier(self, name: str | None = None) -> None:
        if api.distributed_is_initialized():
            with activity.collective("a barrier"):
                dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable, no device tensors), in global-rank order, on every rank: over the host
        group, never over NCCL ([Note: host groups on a bound world]); ``[obj]`` without a process group."""
        host = None if self._life.groups is None else self._life.groups.host
        return all_gather_object(obj, host, what="`strategy.all_gather_object(obj)`")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        host = None if self._life.groups is None else self._life.groups.host  # [Note: host groups on a bound world]
        return broadcast_object(obj, src, host, what="`strategy.broadcast(obj)`", host_tensors=True)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """``sync_dist=True``: over the data-parallel replicas of this rank's stage. The stages of one replica hold
        the same logged values (every rank replays the records of its replica): a pure pipeline returns the value
        as it is; the replicas of a stage replay the same records in the same order, so their group issues the
        same collectives (also under NCCL)."""
        if self.data_parallel_size == 1 or not isinstance(tensor, Tensor):
            return tensor
        return self.process_groups.reduce_over_replicas(tensor, reduce_op, group)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return reduce_decision(decision, all=all, device=self.root_device, world=self.world_size)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return api.all_gather_if_available(tensor, group=group, sync_grads=sync_grads)

    # -- checkpoints (integration/checkpoints/checkpoint_hooks.py; checkpoint.py owns the format) -------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.weights()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(lambda: super(PACIStrategy, self).optimizer_state(optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._checkpoints.load_optimizer_state(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model_state(
            checkpoint, strict, lambda: super(PACIStrategy, self).load_model_state_dict(checkpoint, strict=strict))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.pipeline.remove(filepath)

    # -- failures and teardown (integration/processes/process_life.py, [Note: ending a run]) ------------------------
    @property
    @override
    def launcher(self) -> Any:
        """Lightning's launcher, each run ending on every rank together."""
        self._launcher = ends_together(self._launcher)
        return self._launcher

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell every other stage which stage failed and why, before Lightning unwinds ([Note: a preemption's stop]
        for the one exception that is no failure)."""
        self._life.on_exception(exception)

    @override
    def teardown(self) -> None:
        self._life.end(self._stage, checkpoints=lambda: self._checkpoints.pipeline,
                       schedulers=[cfg.scheduler for cfg in self.lr_scheduler_configs],
                       replicas=self.data_parallel_size,  # tensor-parallel stages keep their shards, as meta-built
                       built_on_meta=self._builder.built_on_meta() or self.config.model_parallel,
                       optimizer_states=not self.config.model_parallel)
        self._stage = None  # the runtime goes with the stage
        with meta_stays_on_meta(self.lightning_module):
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method, description in _REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)


PACIStrategy.register_strategies(StrategyRegistry)
