"""A loss that couples the samples of a batch, found at setup: the one case the pipeline's exactness cannot cover.

[Note: a loss that couples a batch's samples]
The pipeline computes a batch's loss as the weighted mean of its micro-batches' losses (``split_weighted``: each
part's weight its share of the samples), which is one device's loss when the loss is a mean over independent
samples -- every causal LM, classifier or encoder-decoder. A loss over the batch as a whole is not: a contrastive
loss with in-batch negatives (CLIP, SigLIP, SimCLR, retrieval models: each micro-batch sees B/m negatives, not B),
a loss normalized by a batch-wide count, a batch-level regularizer, a mixture-of-experts balance over the batch's
tokens. Such a model trains another objective under every schedule, and nothing in its messages shows it. So at
setup of ``fit`` global rank 0, which holds the whole model (not where it is built on the meta device), runs the
user's step once on the first batch whole and once on each of its micro-batches -- without gradients, in eval
mode (dropout's masks would differ between the two), the RNG, the buffers and ``self.log`` left as they were --
and compares the whole batch's loss with the micro-batches' weighted mean. Where they differ by more than
``TOLERANCE`` relative (float32 rounding of a different summation order is ~1e-6) one warning names the coupling,
both figures and the choices. BatchNorm's batch statistics, the other batch-coupled case, are named by their own
warning (trainer_checks.batch_norm_warning) and are in eval mode here. The cost: one forward of the first batch
and one of each micro-batch on rank 0, once per ``fit``; a step that cannot run there (out of memory) is skipped
with a line. With ``whole_batch_loss`` the same run checks that option instead (``check_whole_batch_loss``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_paci.engine.runtime.microbatch import split_weighted
from lightning_paci.integration.stage.lightning_program import extract_loss
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.integration.stage.setup_probe import without_side_effects

__all__ = ["TOLERANCE", "batch_coupling", "check_whole_batch_loss", "coupling_warning", "whole_batch_method"]

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # relative difference between the whole batch's loss and the micro-batches' weighted mean


@contextlib.contextmanager
def _steps_at_setup(module: LightningModule, context: Callable[[], Any],
                    cuda_devices: list[int]) -> Iterator[Callable[[Any], torch.Tensor]]:
    """The user's ``training_step`` as a function of the data, run as the setup runs it here: without gradients,
    in eval mode (dropout's masks would differ between runs), the RNG, the buffers, ``self.log`` and the mode left
    as they were."""
    def step(data: Any) -> torch.Tensor:
        with recording_logs(module, [], 1, "training_step"), context():
            return extract_loss(module.training_step(data, 0), "training_step")

    was_training = module.training
    with without_side_effects(module, cuda_devices=cuda_devices), torch.no_grad():
        module.eval()
        try:
            yield step
        finally:
            module.train(was_training)


def batch_coupling(module: LightningModule, batch: Any, num_microbatches: int, *, context: Callable[[], Any],
                   cuda_devices: list[int]) -> tuple[float, float]:
    """``(the whole batch's loss, its micro-batches' weighted mean)`` of the user's ``training_step`` on ``batch``
    ([Note: a loss that couples a batch's samples])."""
    parts = split_weighted(batch, num_microbatches)
    with _steps_at_setup(module, context, cuda_devices) as step:
        whole = float(step(batch).double())
        mean = sum(weight * float(step(part).double()) for part, weight in parts if weight) / num_microbatches
    return whole, mean


def coupling_warning(module: LightningModule, batch: Any, num_microbatches: int, *, context: Callable[[], Any],
                     cuda_devices: list[int]) -> str | None:
    """The warning for a loss that couples the samples of ``batch`` (None where it is a mean over them, or where
    the step cannot run on the whole batch here)."""
    if num_microbatches < 2:
        return None
    try:
        whole, mean = batch_coupling(module, batch, num_microbatches, context=context, cuda_devices=cuda_devices)
    except Exception as err:  # out of memory, a step that needs gradients, ...: said, and training goes on
        log.warning(f"lightning_paci: the step could not run on the first batch whole at setup ({type(err).__name__}: "
                    f"{err}); whether its loss couples the batch's samples is not checked")
        return None
    difference = abs(whole - mean) / max(abs(whole), abs(mean), 1e-12)
    if difference <= TOLERANCE:
        return None
    return (f"lightning_paci: the loss of `training_step` couples the samples of a batch: on the first batch the "
            f"whole batch's loss is {whole:.6g}, the mean of its {num_microbatches} micro-batches' losses (weighted "
            f"by samples, as the pipeline computes it) {mean:.6g}, {difference:.1%} apart. Each micro-batch computes "
            f"the loss over its own samples (in-batch negatives, a batch-wide normalization, a batch-level "
            f"regularizer), so the pipeline trains another objective than one device under every schedule. Where "
            f"the step computes that loss by calling one method of the module on per-sample tensors, "
            f"`PACIStrategy(whole_batch_loss='<method>')` computes it once over the whole batch, as one device; "
            f"else use fewer micro-batches (`PACIStrategy(microbatches=...)`), or a loss that is a mean over "
            f"samples, if the difference matters.")


def whole_batch_method(module: LightningModule, method: str) -> Callable[..., Any]:
    """The module's ``whole_batch_loss`` method, or a ``ValueError`` naming the option (every rank, at setup)."""
    found = getattr(module, method, None)
    if not callable(found):
        raise ValueError(f"`PACIStrategy(whole_batch_loss={method!r})`: {type(module).__name__} has no method "
                         f"{method!r}. Name the method `training_step` calls to compute the loss over the batch.")
    return found


def check_whole_batch_loss(module: LightningModule, method: str, batch: Any, *, context: Callable[[], Any],
                           cuda_devices: list[int]) -> None:
    """Refuse a ``whole_batch_loss`` the step does not compute its loss with: the step must call ``method`` once
    and return its result (the last stage runs the step only up to that call, [Note: the whole-batch loss] in
    engine/runtime/whole_batch.py). Run on the first batch whole, as ``batch_coupling`` runs it."""
    found = whole_batch_method(module, method)
    results: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        results.append(found(*args, **kwargs))
        return results[-1]

    with _steps_at_setup(module, context, cuda_devices) as step:
        module.__dict__[method] = counted
        try:
            loss = step(batch)
        finally:
            module.__dict__.pop(method, None)
    fix = (f"The last stage runs each micro-batch's step up to that call and computes the loss once per batch, so "
           f"the step must call `self.{method}(...)` once and return its result.")
    if len(results) != 1:
        raise ValueError(f"`PACIStrategy(whole_batch_loss={method!r})`: `training_step` called `self.{method}` "
                         f"{len(results)} times on the first batch. {fix}")
    if loss is not extract_loss(results[0], method):
        raise ValueError(f"`PACIStrategy(whole_batch_loss={method!r})`: `training_step` returned a loss other than "
                         f"the result of `self.{method}(...)` (computed after the call?). {fix}")
