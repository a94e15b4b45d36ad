"""The strategy's ``setup``: this process's stage built around Lightning's own setup, then started.

Lightning's ``Strategy.setup`` (the accelerator, the optimizers from ``configure_optimizers``, the precision) runs
between the two halves: :func:`build_stage` before it -- the Trainer checked, every stage given rank 0's data
order, the plan made, the module carved to this process's stages and its parameters made real, the stage built
over its connections -- so that Lightning's optimizers hold the stage's own parameters; :func:`start_stage` after
it -- the per-batch SIGTERM broadcast replaced, the relayed values prepared, and for fitting the stage optimizer,
the fit loop's patches, clipping and Lightning's per-stage callbacks installed.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_paci.engine.supervision.activity import activity
from lightning_paci.engine.supervision.watchdog import StageWatchdog
from lightning_paci.integration.checkpoints.one_device_optimizer import OneDeviceOptimizer
from lightning_paci.integration.lightning_callbacks.per_stage import callbacks_per_stage
from lightning_paci.integration.setup.stage_build import StageBuilder
from lightning_paci.integration.setup.tensor_parallel import check_tensor_parallel_run, parallelize_stage
from lightning_paci.integration.setup.trainer_checks import check_trainer
from lightning_paci.integration.stage.lightning_program import LightningHooks
from lightning_paci.integration.stage.links import StageLinks
from lightning_paci.integration.stage.local_stage import LocalStage
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.clipping import clipping_by_norm
from lightning_paci.integration.trainer.fit_loop import patch_for_pipeline, same_data_on_every_stage
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy
from lightning_paci.partition.chunks import carve_chunks

__all__ = ["build_stage", "start_stage"]


def build_stage(strategy: PipelineStrategy, trainer: Trainer, builder: StageBuilder,
                stage: LocalStage | None) -> LocalStage:
    """Before Lightning's setup: the checks and the data order on every call, the stage built unless ``stage``
    is already this process's."""
    module = strategy.lightning_module
    assert module is not None
    check_trainer(trainer, module, strategy.num_stages, strategy.config.start_method)
    check_tensor_parallel_run(trainer, strategy.config)
    same_data_on_every_stage(trainer, strategy.broadcast, strategy.data_parallel_size)
    if stage is not None:
        return stage
    plan = builder.plan_stages(trainer, module)  # and logged
    # one device's optimizer layout, read off the whole module before carving
    one_device = OneDeviceOptimizer.of(module) if trainer.state.fn == TrainerFn.FITTING else None
    carve = carve_chunks(module, plan, strategy.topology.stages_on(strategy.stage_index))
    if strategy.config.model_parallel:  # [Note: tensor parallelism in a stage], [Note: a stage built in shards]
        parallelize_stage(module, strategy.process_groups.mesh)
    builder.materialize(module, carve, has_checkpoint=trainer.ckpt_path is not None)
    links = StageLinks.of(strategy.process_groups, strategy.global_rank, strategy.root_device, strategy.stage_devices)
    return LocalStage(module, plan, carve, config=strategy.config, num_microbatches=strategy.num_microbatches,
                      one_device=one_device, links=links, broadcast=strategy.pipeline_broadcast,
                      eval_context=strategy.precision_plugin.val_step_context, index=strategy.stage_index,
                      shows_logs=strategy.is_global_zero)


def start_stage(strategy: PipelineStrategy, trainer: Trainer, stage: LocalStage, builder: StageBuilder,
                watchdog: StageWatchdog | None, optimizers: list[torch.optim.Optimizer]) -> None:
    """After Lightning's setup: what runs the stage for ``trainer``'s current function; every patch is undone at
    teardown (``strategy.undo_at_teardown``)."""
    module = strategy.lightning_module
    assert module is not None
    stop = watchdog.preemption if watchdog is not None else None  # [Note: a preemption's stop]
    strategy.undo_at_teardown([api.sigterm_without_a_collective(trainer, stop.request if stop else None)])
    stage.prepare_relays(strategy, builder.take_sample())  # on the device, in the step's precision
    if trainer.state.fn != TrainerFn.FITTING:
        return
    owned = [cfg.scheduler for cfg in strategy.lr_scheduler_configs if cfg.interval == "step"]
    stage.start_training(optimizers, schedulers=owned, accumulation=strategy.accumulation,
                         hooks=lambda chunk: LightningHooks(module, trainer, chunk),
                         train_context=strategy.precision_plugin.train_step_context)
    strategy.undo_at_teardown(patch_for_pipeline(trainer, module, owned, stop, strategy.config.failure_timeout)
                              + clipping_by_norm(trainer, strategy) + callbacks_per_stage(trainer, strategy))
    activity.source = stage.activity()
