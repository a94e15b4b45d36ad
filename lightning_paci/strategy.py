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
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_paci.config import PACIConfig
from lightning_paci.engine.comm import DistComm
from lightning_paci.engine.communicators import transport_device
from lightning_paci.engine.data_parallel import join_replicas
from lightning_paci.engine.runtime import StageRuntime
from lightning_paci.engine.supervision import activity, mark_setup_error, runtime_activity
from lightning_paci.integration import lightning_api as api
from lightning_paci.integration.lightning_program import LightningHooks
from lightning_paci.integration.optimizer_layout import OptimizerLayout
from lightning_paci.integration.pipeline_stage import PipelineStage
from lightning_paci.integration.stage_build import StageBuilder, StageBuilding
from lightning_paci.integration.strategy_checkpoints import CheckpointingProcesses
from lightning_paci.integration.trainer_glue import (
    check_trainer,
    ends_epoch,
    must_drain,
    patch_for_pipeline,
    same_data_on_every_stage,
    seed_workers_alike,
)
from lightning_paci.optim.stage_optimizer import optimizer_and_step_schedulers
from lightning_paci.partition import PartitionPlan, PartitionSpec, carve_stage

__all__ = ["PACIStrategy", "optimizer_and_step_schedulers"]

log = logging.getLogger(__name__)


_REGISTERED = (  # Trainer(strategy=...) names: one class, different process start methods (as ddp / ddp_fork)
    ("paci", "popen", "PACI asynchronous pipeline parallelism, one process per stage"),
    ("paci_spawn", "spawn", "PACI, processes started with spawn"),
    ("paci_fork", "fork", "PACI, processes forked (CPU tests, notebooks)"),
)


class PACIStrategy(StageBuilding, CheckpointingProcesses):
    """Pipeline-parallel training with PACI's asynchronous, flush-free 1F1B schedule (one process per stage).

    The pipeline options are documented on :class:`~lightning_paci.config.PACIConfig`, which checks them here; the
    rest (``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``)
    are Lightning's usual strategy arguments.

    Raises:
        ValueError: at construction for bad options, at setup for modules or Trainer settings that cannot run.

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
        compensation: Literal["auto", "lookahead", "none"] = "auto",
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_size: int | Literal["auto"] = "auto",
        local_sgd_steps: int | None = None,
        recompute: Literal["off", "blocks"] = "off",
        recompute_stages: int | None = None,
        model_init: Literal["stage", "full"] = "stage",
        weights: str | os.PathLike[str] | None = None,
    ) -> None:
        config = PACIConfig(
            schedule=schedule, microbatches=microbatches, accumulation=accumulation, partition=partition,
            block_container=block_container, process_group_backend=process_group_backend, timeout=timeout,
            failure_timeout=failure_timeout, nonfinite=nonfinite, checkpoint_layout=checkpoint_layout,
            max_stream_batches=max_stream_batches, freeze_gc=freeze_gc, start_method=start_method,
            compensation=compensation, pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size, local_sgd_steps=local_sgd_steps, recompute=recompute,
            recompute_stages=recompute_stages, model_init=model_init, weights=weights)
        super().__init__(config, accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._failed = self._froze_gc = False
        self._trainer: Trainer | None = None
        self._stage: PipelineStage | None = None
        self._undo_patches: list[Callable[[], None]] = []
        self._builder = StageBuilder(self)

    @property
    def num_microbatches(self) -> int:
        return self.config.microbatches or self.num_stages

    @property
    def accumulation(self) -> int:
        """Local backwards per optimizer step, Trainer's ``accumulate_grad_batches`` included."""
        factor = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
        return (self.config.accumulation or self.num_microbatches) * factor

    @property
    def _closes_windows(self) -> bool:
        """Whether an epoch's end steps an open window, as Lightning does: when windows are whole Lightning batches
        (``accumulate_grad_batches``); a window of ``accumulation`` micro-batches that is not a multiple of the
        batch's is PACI's own and carries on across epochs."""
        return self.accumulation % self.num_microbatches == 0

    @property
    def runtime(self) -> StageRuntime:
        if self._stage is None or self._stage.runtime is None:
            raise RuntimeError("PACIStrategy.runtime is only available after `trainer.fit` has set up the stage.")
        return self._stage.runtime

    @property
    def plan(self) -> PartitionPlan:
        if self._stage is None:
            raise RuntimeError("PACIStrategy.plan is only available after setup.")
        return self._stage.plan

    # -- setup ----------------------------------------------------------------------------------------------------
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
        check_trainer(trainer, module, self.num_stages)
        same_data_on_every_stage(trainer, self.broadcast, self.data_parallel_size)
        if self._stage is None:
            plan = self._plan_stages(trainer, module)  # and logged
            layout = OptimizerLayout.of(module) if trainer.state.fn == TrainerFn.FITTING else None
            carve = carve_stage(module, plan, self.stage_index)
            self._builder.materialize(module, carve, has_checkpoint=trainer.ckpt_path is not None)
            self._stage = PipelineStage(
                module, plan, carve, config=self.config, layout=layout, num_microbatches=self.num_microbatches,
                broadcast=self._pipeline_broadcast,
                comm=lambda: DistComm([self.rank_of(s) for s in range(self.num_stages)], groups=self._p2p_groups,
                                      replica=self.replica_index, deliver=self.root_device,
                                      device=transport_device(self._process_group_backend, self.root_device),
                                      headers=self.host_group),
                eval_context=self.precision_plugin.val_step_context)
        super().setup(trainer)
        self._stage.prepare_relays(self, self._builder.take_sample())  # on the device, in the step's precision
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_training(trainer, module, self._stage)

    def _setup_training(self, trainer: Trainer, module: LightningModule, stage: PipelineStage) -> None:
        owned = [cfg.scheduler for cfg in self.lr_scheduler_configs if cfg.interval == "step"]
        stage.start_training(self.optimizers, schedulers=owned, accumulation=self.accumulation,
                             hooks=LightningHooks(module, trainer, stage.index),
                             train_context=self.precision_plugin.train_step_context)
        if self.data_parallel_size > 1:
            join_replicas(stage.runtime, stage.driver, self.dp_group, self.data_parallel_size,
                          self.replica_index, local_sgd_steps=self.config.local_sgd_steps,
                          last_stage=stage.index == self.num_stages - 1,
                          names={id(p): name for name, p in module.named_parameters()})
        self._undo_patches += patch_for_pipeline(trainer, module, owned)
        watched = (lambda s: s) if self.data_parallel_size == 1 else self.rank_of  # [Note: judging progress]
        activity.source = runtime_activity(stage.runtime, watched)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return seed_workers_alike(dataloader, self.replica_index)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        trainer, stage = self._trainer, self._stage
        assert trainer is not None and stage is not None
        loss, minibatch = stage.train(batch, batch_idx,
                                      label=f"Lightning batch {batch_idx} (global step {trainer.global_step})",
                                      drain=must_drain(trainer, batch_idx), accumulation=self.accumulation,
                                      close_window=self._closes_windows and ends_epoch(trainer, batch_idx))
        # what `on_train_batch_end(outputs)` gets: the loss of mini-batch `paci_minibatch` (see PipelineStage.train)
        return {"loss": torch.as_tensor(loss, device=self.root_device), "paci_minibatch": minibatch}

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
            gc.collect()
            gc.freeze()  # see PACIConfig.freeze_gc: full collections then skip everything alive now
            self._froze_gc = True

    @override
    def on_validation_start(self) -> None:
        self._drain()

    @override
    def on_train_end(self) -> None:
        self._drain()

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

    # -- failures and teardown -------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell every other stage (through the store) which stage failed and why, before Lightning unwinds."""
        self._failed = True
        if self._watchdog is not None:
            self._watchdog.report(self.watch_id, f"{type(exception).__name__}: {exception}")
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
        activity.source, self._stage = None, None  # the runtime goes with the stage
        super().teardown()

    def _finish(self) -> None:
        """Drain, undo the patches, and give every rank's module the complete trained weights again."""
        try:
            self._drain()
        except (RuntimeError, ConnectionError) as err:  # a failing neighbour: do not mask the original error
            log.warning(f"lightning_paci: drain at teardown failed: {err}")
        for undo in reversed(self._undo_patches):
            undo()
        self._undo_patches.clear()
        stage = self._stage
        if stage is None:
            return
        self._keep_after_fit(stage)
        if self._builder.built is not None:  # no full gather: other stages' parameters stay on the meta device
            stage.restore_full_model(gather=False, materialize=False)
            return
        stage.restore_full_model(gather=api.distributed_is_initialized(), replicas=self.data_parallel_size,
                                 group=self.host_group)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method, description in _REGISTERED:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)


PACIStrategy.register_strategies(StrategyRegistry)
