"""``PACIStrategy``: train an unchanged LightningModule with asynchronous pipeline parallelism.

``import lightning_paci`` registers ``Trainer(strategy="paci")`` (processes started like ``ddp``), ``"paci_fork"``
(forked, for CPU tests and notebooks) and ``"paci_spawn"``.

This module is Lightning plumbing only; each hook delegates to the module that owns the concept: options
(config.py), carving (partition/), one stage's execution (runtime.py), streams and drains (driver.py, see
[Note: no flush per Lightning batch]), logging (logs.py), evaluation (evaluation.py), checkpoints (checkpoint.py),
failures (supervision.py) and Lightning's private API (lightning_api.py). Two per-batch synchronisations would turn
PACI into a flush and are avoided: Lightning's per-batch SIGTERM broadcast from rank 0 (a full barrier on gloo) is
replaced by a local check (Lightning's launchers deliver the signal to every process), and logged values travel
upstream with the gradients instead of being broadcast (logs.py).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
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
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_paci import lightning_api as api
from lightning_paci.checkpoint import PipelineCheckpoints, cpu_state
from lightning_paci.comm import DistComm
from lightning_paci.config import PACIConfig
from lightning_paci.driver import StreamDriver
from lightning_paci.evaluation import PipelineEvaluator
from lightning_paci.logs import LogRelay
from lightning_paci.microbatch import loss_scale_for
from lightning_paci.partition import PartitionPlan, PartitionSpec, StageCarve, carve_stage, plan_partition
from lightning_paci.program import LightningStageProgram
from lightning_paci.runtime import StageRuntime
from lightning_paci.trainer_glue import check_trainer, clip_function, measure_block_costs, must_drain
from lightning_paci.stage_optimizer import StageOptimizer, optimizer_and_step_schedulers
from lightning_paci.supervision import StageWatchdog, connect_store

__all__ = ["PACIStrategy", "optimizer_and_step_schedulers"]

log = logging.getLogger(__name__)


class PACIStrategy(ParallelStrategy):
    """Pipeline-parallel training with PACI's asynchronous, flush-free 1F1B schedule (one process per stage).

    The options (``schedule``, ``microbatches``, ``accumulation``, ``partition``, ``block_container``, ``timeout``,
    ``failure_timeout``, ``nonfinite``, ``checkpoint_layout``, ``max_stream_batches``, ``freeze_gc``,
    ``start_method``, ``process_group_backend``) are documented on :class:`~lightning_paci.config.PACIConfig`, which
    checks them here; the rest are Lightning's usual strategy arguments.

    Raises:
        ValueError: at construction for bad options, at setup for modules or Trainer settings that cannot run.

    Gradient clipping (``Trainer(gradient_clip_val=...)``) is applied per stage to the stage's own gradients; there
    is no cross-stage global norm (that would need a per-step collective).

    Example::

        import lightning as L, lightning_paci
        trainer = L.Trainer(strategy="paci", devices=4)
        trainer.fit(model)
    """

    strategy_name = "paci"

    def __init__(
        self,
        *,
        schedule: Literal["paci", "1f1b", "gpipe"] = "paci",
        microbatches: int | None = None,
        accumulation: int | None = None,
        partition: PartitionSpec = "balanced",
        block_container: str | None = None,
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
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.config = PACIConfig(
            schedule=schedule, microbatches=microbatches, accumulation=accumulation, partition=partition,
            block_container=block_container, process_group_backend=process_group_backend, timeout=timeout,
            failure_timeout=failure_timeout, nonfinite=nonfinite, checkpoint_layout=checkpoint_layout,
            max_stream_batches=max_stream_batches, freeze_gc=freeze_gc, start_method=start_method)
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._p2p_groups: list[dist.ProcessGroup | None] = [None, None]
        self._watchdog: StageWatchdog | None = None
        self._failed = self._froze_gc = False
        self._trainer: Trainer | None = None
        self._plan: PartitionPlan | None = None
        self._carve: StageCarve | None = None
        self._runtime: StageRuntime | None = None
        self._driver: StreamDriver | None = None
        self._relay: LogRelay | None = None
        self._evaluator: PipelineEvaluator | None = None
        self._undo_patches: list[Callable[[], None]] = []

    # -- topology -------------------------------------------------------------------------------------------------
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
    def num_stages(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def stage_index(self) -> int:
        return self.global_rank

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # pure pipeline parallelism: every stage sees the same batches

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def schedule_name(self) -> str:
        return self.config.schedule

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
        if self._runtime is None:
            raise RuntimeError("PACIStrategy.runtime is only available after `trainer.fit` has set up the stage.")
        return self._runtime

    @property
    def plan(self) -> PartitionPlan:
        if self._plan is None:
            raise RuntimeError("PACIStrategy.plan is only available after setup.")
        return self._plan

    # -- processes ------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.config.start_method != "popen":
            self._launcher = api.MultiProcessingLauncher(self, start_method=self.config.start_method)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = api.SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        environment = self.cluster_environment
        assert environment is not None
        stages = self.num_processes * self.num_nodes
        if environment.creates_processes_externally and stages != environment.world_size():
            expected = environment.world_size()  # torchrun, SLURM, ...: check before the rendezvous
            raise ValueError(
                f"`Trainer(devices={self.num_processes}, num_nodes={self.num_nodes})` starts {stages} pipeline stages, "
                f"but the launcher started {expected} processes (WORLD_SIZE={expected}). One process runs one stage: "
                f"pass `devices={max(1, expected // self.num_nodes)}` (per node) or launch {stages} processes."
            )
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"timeout": self.config.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        api.init_dist_connection(environment, self._process_group_backend, **kwargs)
        # pipeline messages on their own communicators, apart from Lightning's collectives: one for activations and
        # gradients, one for the tied-weight exchange (independent message order, also under NCCL)
        self._p2p_groups = [dist.new_group(backend=self._process_group_backend, timeout=self.config.timeout)
                            for _ in range(2)]
        store = connect_store()
        if store is not None:
            self._watchdog = StageWatchdog(self.stage_index, self.num_stages, store,
                                           dead_after=self.config.failure_timeout)
            self._watchdog.start()
        else:
            log.warning("lightning_paci: no rendezvous store reachable (MASTER_ADDR/MASTER_PORT); a dead stage "
                        "will only be noticed after the process-group timeout")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- collectives (never per training batch) -------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if api.distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not api.distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        # one data-parallel replica: a reduce over it is the identity (logged values are the same on every rank)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not api.distributed_is_initialized():
            return decision
        value = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value > 0)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return api.all_gather_if_available(tensor, group=group, sync_grads=sync_grads)

    # -- setup ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        self._trainer = trainer
        module = self.lightning_module
        assert module is not None
        check_trainer(trainer, module, self.num_stages)
        if self._carve is None:
            measured = measure_block_costs(self, trainer) if self.config.partition == "balanced" else None
            self._plan = plan_partition(module, self.num_stages, container=self.config.block_container,
                                        partition=self.config.partition, measured=measured)
            rank_zero_info(f"lightning_paci: {self.num_stages} stages, schedule={self.config.schedule!r}, "
                           f"microbatches={self.num_microbatches}, accumulation={self.accumulation}; "
                           f"{self._plan.describe()}")
            self._carve = carve_stage(module, self._plan, self.stage_index)
        super().setup(trainer)
        comm = DistComm(list(range(self.world_size)), groups=self._p2p_groups, device=self.root_device)
        self._evaluator = PipelineEvaluator(module, self._carve, comm, num_microbatches=self.num_microbatches,
                                            broadcast=self.broadcast, context=self.precision_plugin.val_step_context)
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_training(trainer)

    def _setup_training(self, trainer: Trainer) -> None:
        module, carve = self.lightning_module, self._carve
        assert module is not None and carve is not None
        if len(self.optimizers) != 1:
            raise ValueError(
                f"`configure_optimizers` returned {len(self.optimizers)} optimizers; `PACIStrategy` steps exactly one "
                f"optimizer per stage. Return a single optimizer (param groups may differ per submodule)."
            )
        owned = [cfg.scheduler for cfg in self.lr_scheduler_configs if cfg.interval == "step"]
        replicas = carve.tied_params if self.stage_index == self.num_stages - 1 else []
        optimizer = StageOptimizer(self.optimizers[0], list(module.parameters()), schedulers=owned,
                                   clip=clip_function(trainer), exclude=replicas)
        program = LightningStageProgram(module, carve, context=self.precision_plugin.train_step_context)
        comm = DistComm(list(range(self.world_size)), groups=self._p2p_groups, device=self.root_device)
        self._runtime = StageRuntime(self.stage_index, self.num_stages, program, comm, optimizer,
                                     loss_scale=loss_scale_for(self.accumulation), tied=carve.tied_params,
                                     skip_nonfinite=self.config.nonfinite == "skip")
        self._driver = StreamDriver(self._runtime, schedule=self.config.schedule,
                                    num_microbatches=self.num_microbatches, accumulation=self.accumulation,
                                    tied=bool(self.plan.tied), max_stream_batches=self.config.max_stream_batches)
        self._relay = LogRelay(self.num_microbatches)
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            # Lightning steps "step"-interval schedulers after each of its optimizer steps; ours step per update
            if not any(scheduler is s for s in owned):
                original(scheduler, metric)

        self._undo_patches = [
            api.patch_method(module, "lr_scheduler_step", lr_scheduler_step, parameters=("scheduler", "metric")),
            # see the module docstring: no per-batch SIGTERM broadcast
            api.patch_method(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", self._local_sigterm_check,
                             parameters=()),
        ]

    def _local_sigterm_check(self) -> None:
        if self._trainer is not None and getattr(self._trainer, "received_sigterm", False):
            raise SIGTERMException()

    # -- training -------------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        driver, relay, trainer = self._driver, self._relay, self._trainer
        assert driver is not None and relay is not None and trainer is not None
        self.runtime.step_label = f"Lightning batch {batch_idx} (global step {trainer.global_step})"
        driver.feed(batch, batch_idx, drain=must_drain(trainer, batch_idx))
        assert self.lightning_module is not None
        relay.emit(self.lightning_module, self.runtime.logs)
        return torch.tensor(relay.last_loss, device=self.root_device)

    def _drain(self) -> None:
        if self._driver is not None:
            self._driver.drain()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss  # the schedule already ran every backward inside training_step

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the stage optimizer steps inside the schedule (OPT); the closure runs training_step

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.config.freeze_gc and not self._froze_gc:
            gc.collect()
            gc.freeze()  # see PACIConfig.freeze_gc: full collections then skip everything alive now
            self._froze_gc = True

    @override
    def on_validation_start(self) -> None:
        self._drain()

    @override
    def on_train_end(self) -> None:
        self._drain()

    # -- evaluation -----------------------------------------------------------------------------------------------
    def _evaluate(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._evaluator is not None
        batch = kwargs.pop("batch", args[0] if args else None)
        return self._evaluator.step(step_name, batch, args[1:] if args else tuple(kwargs.values()))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("predict_step", args, kwargs)

    # -- checkpoints (format: checkpoint.py) ---------------------------------------------------------------------
    @property
    def _checkpoints(self) -> PipelineCheckpoints:
        return PipelineCheckpoints(self.config.checkpoint_layout, self.stage_index, self.num_stages,
                                   self.checkpoint_io)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._drain()
        assert self.lightning_module is not None
        if not api.distributed_is_initialized():
            return cpu_state(self.lightning_module)
        return self._checkpoints.weights(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._drain()
        runtime, module = self._runtime, self.lightning_module
        if runtime is None or runtime.optimizer is None or module is None:
            return super().optimizer_state(optimizer)
        return self._checkpoints.optimizer_state(runtime.optimizer, module, backwards=runtime.microbatch_base,
                                                 steps=runtime.version)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        runtime, module = self._runtime, self.lightning_module
        if runtime is None or runtime.optimizer is None or module is None:
            raise ValueError("Resuming optimizer state needs a fitting PACIStrategy (`trainer.fit(ckpt_path=...)`).")
        num_stages, runtime.microbatch_base, runtime.version = self._checkpoints.load_optimizer_state(
            checkpoint, runtime.optimizer, module)  # the accumulation counter and step count continue
        if num_stages != self.num_stages:
            rank_zero_info(f"lightning_paci: resumed a {num_stages}-stage checkpoint on {self.num_stages} stages "
                           f"(weights and optimizer state repartitioned by parameter name)")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.remove(filepath)

    # -- failures and teardown -------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell every other stage (through the store) which stage failed and why, before Lightning unwinds."""
        self._failed = True
        if self._watchdog is not None:
            self._watchdog.report(self.stage_index, f"{type(exception).__name__}: {exception}")
            self._watchdog.stop(done=False)

    @override
    def teardown(self) -> None:
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        if self._watchdog is not None and not self._failed:
            self._watchdog.stop(done=True)  # before the final gather: a clean exit is not a failure
        if not self._failed:  # after a failure neighbours may be gone: no drain, no gather, no restore
            self._finish()
        self._runtime = self._driver = None
        super().teardown()

    def _finish(self) -> None:
        """Drain, undo the patches, and give every rank's module the complete trained weights again."""
        try:
            self._drain()
        except Exception as err:  # a failing neighbour: do not mask the original error
            log.warning(f"lightning_paci: drain at teardown failed: {err}")
        for undo in reversed(self._undo_patches):
            undo()
        self._undo_patches.clear()
        module = self.lightning_module
        if module is None or self._carve is None:
            return
        full = None
        if api.distributed_is_initialized():
            try:
                gathered: list[Any] = [None] * self.world_size
                dist.all_gather_object(gathered, cpu_state(module))
                full = {k: v for part in gathered for k, v in part.items()}
            except Exception as err:
                log.warning(f"lightning_paci: could not gather the full weights at teardown: {err}")
        self._carve.restore(module, full)
        self._carve = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = (
            ("paci", "popen", "PACI asynchronous pipeline parallelism, one process per stage"),
            ("paci_spawn", "spawn", "PACI, processes started with spawn"),
            ("paci_fork", "fork", "PACI, processes forked (CPU tests, notebooks)"),
        )
        for name, start_method, description in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)


PACIStrategy.register_strategies(StrategyRegistry)
