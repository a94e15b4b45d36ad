"""Lightning's own callbacks under a pipeline: what ``on_train_batch_end`` hands them as the batch's outputs, and
the settings a stage cannot run, refused at setup naming the callback, the rule and the fix.

Why the outputs need care: a stage before the last has not seen batch ``k``'s loss when its Lightning call ``k``
ends (the loss comes back with the gradients, calls later under ``"paci"``), so it hands ``on_train_batch_end``
the newest loss it has, and ``0.0`` before the first. A callback that compares consecutive losses on every rank
(``SpikeDetection``: a running mean per rank, the decision any-reduced over the ranks) then sees a jump from the
placeholder ``0.0`` to the first real loss and stops a run that one device finishes cleanly. Such a callback
already synchronises every rank on every batch (a barrier and an all-reduce of its decision), so the last stage's
loss of batch ``k`` is broadcast to the other stages of its replica in that call: every rank then hands the
callback the loss one device would, at the same batch, and the decision is one device's. Without such a callback
no rank waits for another per batch, and the stages before the last keep the newest loss they have, labelled
with its mini-batch (``paci_minibatch``).

Which run per stage: a callback that keeps its own copy of the module (``EMAWeightAveraging``,
weight_averaging.py; ``StochasticWeightAveraging``, stochastic_weight_averaging.py), adds parameter groups to the
optimizer (fine-tuning schedules, finetuning.py) or prunes the module's layers (``ModelPruning``, pruning.py) meets a
stage's carved module, whose other stages' parameters are placeholders on the meta device, and each is made to work
on the stage's own parameters at setup; the settings a stage cannot run as one device does are refused here.
The batch statistics ``StochasticWeightAveraging`` recomputes in an extra epoch (a model with batch normalization)
and a model built in ``configure_model`` (the averaging callbacks copy the whole module in their ``setup``) are
refused too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import (
    ModelPruning,
    SpikeDetection,
    StochasticWeightAveraging,
    WeightAveraging,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_paci.integration.lightning_callbacks.pruning import check_pruning

__all__ = ["batch_outputs", "check_callbacks", "load_callback_state", "needs_every_stage_loss"]


def check_callbacks(trainer: Trainer, module: LightningModule) -> None:
    """Refuse, at setup, a Lightning callback (or its setting) a stage cannot run: ``ValueError`` naming it, the rule
    and the fix."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set in Trainer.__init__
        averages = isinstance(callback, (WeightAveraging, StochasticWeightAveraging))
        if averages and is_overridden("configure_model", module):
            raise ValueError(
                f"`{type(callback).__name__}` with a model built in `configure_model` is not supported by "
                f"`PACIStrategy`: Lightning's callback builds the whole model in its own `setup` (the stages build "
                f"only their own parts) and its averaged copy would not line up with a stage's. Build the model in "
                f"`__init__`, or remove the callback.")
        if isinstance(callback, StochasticWeightAveraging) and callback.pl_module_contains_batch_norm(module):
            raise ValueError(
                "`StochasticWeightAveraging` with batch normalization is not supported by `PACIStrategy`: the "
                "callback recomputes the batch statistics in an extra epoch without backwards or updates, which a "
                "pipeline's schedule does not run. Use GroupNorm or LayerNorm, recompute the statistics after "
                "`fit`, or use `EMAWeightAveraging`.")
        if isinstance(callback, ModelPruning):
            check_pruning(callback, module)


def needs_every_stage_loss(trainer: Trainer) -> bool:
    """Whether a callback compares every rank's batch loss per batch (``SpikeDetection``), so that every stage must
    hand it the batch's own loss rather than the newest one it has."""
    return any(isinstance(c, SpikeDetection) for c in trainer.callbacks)  # type: ignore[attr-defined]


_LOSS_DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16}  # else float32 (also under bf16 autocast)


def batch_outputs(loss: float | torch.Tensor, minibatch: int, *, precision: str, device: torch.device,
                  every_stage: bool, holds_last: bool, from_last: Callable[[Any], Any]) -> dict[str, Any]:
    """What ``on_train_batch_end(outputs)`` gets: ``{"loss": ..., "paci_minibatch": j}``, the mean loss of the
    run's mini-batch ``j``, a tensor of the dtype one device's loss has under ``precision`` (the stages' records
    carry it as a Python float, which holds a float64 loss exactly). With ``every_stage`` the last stage's loss of
    this batch is sent to the other stages (``from_last``: a broadcast from the last stage, called on every stage
    of the replica), so ``j`` is the batch just fed on every rank."""
    if every_stage:
        loss, minibatch = from_last((float(loss), minibatch) if holds_last else None)
    dtype = _LOSS_DTYPES.get(precision, torch.float32)
    if isinstance(loss, torch.Tensor):
        return {"loss": loss.detach().to(device), "paci_minibatch": minibatch}
    return {"loss": torch.tensor(float(loss), dtype=dtype, device=device), "paci_minibatch": minibatch}


def load_callback_state(callback: Any, state: dict[str, Any]) -> None:
    """``callback.load_state_dict(state)``, for the states rank 0 of a fork/spawn run hands to the main process
    after ``fit``. Lightning's ``SpikeDetection.load_state_dict`` reads ``self.running``, an attribute it never sets
    (its running mean is ``running_mean``), so every loaded state would fail with an ``AttributeError`` after a run
    that finished cleanly; the name is given to it here first."""
    if isinstance(callback, SpikeDetection) and not hasattr(callback, "running"):
        callback.running = callback.running_mean  # type: ignore[attr-defined]  # the name its loader reads
    callback.load_state_dict(dict(state))
