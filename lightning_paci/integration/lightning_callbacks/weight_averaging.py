"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging`` and subclasses) on each stage: the averaged
copy holds the stage's own parameters and is updated at the stage's own updates.

Why: Lightning builds the callback's ``AveragedModel`` in ``setup``, from the whole module, before the strategy
carves it; its updates then zip the whole model's parameters with a stage's (a shape mismatch inside torch), and it
updates once per Lightning batch, when under ``"paci"`` a stage's updates happen calls later. Here, after carving,
each callback's copy is rebuilt from the carved module (taking the values the whole copy holds by name, so a copy
resumed from a checkpoint keeps them) and updated by the runtime's update hook after each update ``v`` where the
callback's ``should_update(step_idx=v - 1)`` says so -- one device's rule, at the stage's ``v``-th update. Its swap
for validation and its copy into the module at the end of ``fit`` work on the carved module as they are (the
pipeline has drained by then), and the end of ``fit`` gathers the averaged stages into the whole model. A checkpoint
holds the averaged weights of every stage, gathered to rank 0 as the model's are, under ``state_dict`` and the
current ones under ``current_model_state``, Lightning's own format, so it resumes here and on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import WeightAveraging
from torch.optim.swa_utils import AveragedModel

from lightning_paci.engine.transport.collectives import gather_to_first
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["weight_averaging_per_stage"]


def _stage_average(callback: WeightAveraging, module: torch.nn.Module) -> AveragedModel:
    """The callback's copy rebuilt from the carved ``module``, with the values its whole copy holds by name."""
    device = getattr(callback, "_device", None)
    if device is not None and torch.device(device) != next(module.parameters()).device:
        raise ValueError(
            f"`{type(callback).__name__}(device={device!r})` is not supported by `PACIStrategy`: each stage keeps "
            f"its averaged copy on its own device. Remove the `device` argument.")
    average = AveragedModel(model=module, use_buffers=callback._use_buffers, **callback._kwargs)
    whole = callback._average_model
    if whole is not None:
        values = whole.module.state_dict()
        own = average.module.state_dict()
        average.module.load_state_dict({k: values[k] for k in own if k in values}, strict=False)
        average.n_averaged.copy_(whole.n_averaged)
    return average


def weight_averaging_per_stage(trainer: Trainer, strategy: PipelineStrategy) -> list[Callable[[], None]]:
    """At setup, for fitting: every ``WeightAveraging`` callback averages this stage's own parameters at its
    updates; returns the undos for teardown."""
    undos: list[Callable[[], None]] = []
    callbacks = [c for c in trainer.callbacks if isinstance(c, WeightAveraging)]  # type: ignore[attr-defined]
    if not callbacks:
        return undos
    if strategy.config.virtual_stages > 1 or strategy.config.checkpoint_layout != "consolidated":
        raise ValueError(
            f"`{type(callbacks[0]).__name__}` under `PACIStrategy` needs one stage per process and consolidated "
            f"checkpoints: remove `virtual_stages` and `checkpoint_layout='sharded'`, or the callback.")
    module, runtime = strategy.lightning_module, strategy.runtime
    assert module is not None
    for callback in callbacks:
        average = _stage_average(callback, module)
        callback._average_model = average
        runtime.on_update(_Update(callback, average, module))
        undos += [api.patch_method(callback, "on_train_batch_end", _no_update,  # the update hook does it
                                   parameters=("trainer", "pl_module", "outputs", "batch", "batch_idx")),
                  api.patch_method(callback, "on_save_checkpoint", _Save(average, strategy),
                                   parameters=("trainer", "pl_module", "checkpoint")),
                  partial(_forget, callback)]
    return undos


class _Update:
    """The runtime's hook after update ``version`` of this stage: one device's rule for its ``version``-th step."""

    def __init__(self, callback: WeightAveraging, average: AveragedModel, module: torch.nn.Module) -> None:
        self.callback, self.average, self.module = callback, average, module

    def __call__(self, version: int) -> None:
        callback = self.callback
        if callback._average_model is not self.average:  # fit ended (undone) or the copy was replaced
            return
        if version > callback._latest_update_step and callback.should_update(step_idx=version - 1):
            self.average.update_parameters(self.module)
            callback._latest_update_step = version


class _Save:
    """``on_save_checkpoint`` on every rank: the stages' averaged weights gathered to rank 0, in Lightning's format
    (``state_dict`` the average, ``current_model_state`` the trained weights, ``averaging_state`` the count)."""

    def __init__(self, average: AveragedModel, strategy: PipelineStrategy) -> None:
        self.average, self.strategy = average, strategy

    def __call__(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        local = {k: v.detach().cpu() for k, v in self.average.module.state_dict().items()}
        merged = gather_to_first(local, self.strategy.data_parallel_size, self.strategy.process_groups.host)
        if merged is not None:  # rank 0, which writes the file
            checkpoint["current_model_state"] = checkpoint["state_dict"]
            checkpoint["state_dict"] = merged
            checkpoint["averaging_state"] = {"n_averaged": self.average.n_averaged.detach().cpu()}


def _no_update(*args: Any, **kwargs: Any) -> None:
    """Lightning's per-batch update, replaced by the stage's update hook."""


def _forget(callback: WeightAveraging) -> None:
    callback._average_model = None  # the hooks of this fit's runtime stay inert
