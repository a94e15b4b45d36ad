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
with a line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_paci.engine.runtime.microbatch import split_weighted
from lightning_paci.integration.stage.lightning_program import extract_loss
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.integration.stage.setup_probe import without_side_effects

__all__ = ["TOLERANCE", "batch_coupling", "coupling_warning"]

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # relative difference between the whole batch's loss and the micro-batches' weighted mean


def batch_coupling(module: LightningModule, batch: Any, num_microbatches: int, *, context: Callable[[], Any],
                   cuda_devices: list[int]) -> tuple[float, float]:
    """``(the whole batch's loss, its micro-batches' weighted mean)`` of the user's ``training_step`` on ``batch``
    ([Note: a loss that couples a batch's samples])."""
    def loss(data: Any) -> float:
        with recording_logs(module, [], 1, "training_step"), context():
            return float(extract_loss(module.training_step(data, 0), "training_step").detach().double())

    parts = split_weighted(batch, num_microbatches)
    was_training = module.training
    with without_side_effects(module, cuda_devices=cuda_devices), torch.no_grad():
        module.eval()
        try:
            whole = loss(batch)
            mean = sum(weight * loss(part) for part, weight in parts if weight) / num_microbatches
        finally:
            module.train(was_training)
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
            f"regularizer), so the pipeline trains another objective than one device under every schedule. Use "
            f"fewer micro-batches (`PACIStrategy(microbatches=...)`), or a loss that is a mean over samples, if the "
            f"difference matters.")
