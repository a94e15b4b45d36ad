"""Activation recomputation: a stage's own blocks keep only their inputs between a micro-batch's forward and its
backward, and run their forward again inside the backward.

[Note: recomputation under PACI]
In 1F1B (flushed or not) stage ``s`` holds the activations of up to ``N - s`` micro-batches, so stage 0 holds ``N``
of them. With ``recompute="blocks"`` every block of the stage runs through ``torch.utils.checkpoint``
(non-reentrant, the random state preserved): what a micro-batch keeps until its backward is each block's input
(and what the stage runs outside its blocks: an embedding before the first block, the head and the loss after the
last); the block's own working set exists only while its backward runs, one block at a time. Each backward
costs one more forward of the stage's blocks.

What a backward then computes, by weight version:

* stored activations (the default): the forward ran at version ``v`` (PACI: up to ``ceil((N-1-s)/a)`` local
  updates before the backward's version ``v + d``); the backward differentiates the version-``v`` function at
  version-``v`` activations -- exactly the forward's graph (what DriftMonitor's ``drift`` counts is ``d``);
* recomputed: the backward recomputes each block at the *current* version ``v + d`` from the block's saved input
  (which version ``v`` of the earlier blocks produced), and differentiates that: the gradient of the current
  weights at activations that mix versions. The upstream gradient still comes from the loss of the version-``v``
  forward. Under 1f1b and gpipe ``d = 0``, so recomputation is exact (same weights bit for bit, tested); under
  PACI it is a second, different staleness, measured in benchmarks/RESULTS.md. With the weight prediction
  (optim/weight_prediction.py) the forward ran at the predicted version ``v + d`` and the recomputation at the real one.

The random state of each block's forward is saved with its input and restored for the recomputation, so dropout
draws the same masks (on top of [Note: randomness per micro-batch]); a user's own ``torch.utils.checkpoint`` inside
a block keeps working (checkpoints nest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_paci.engine.runtime.records import ActivationMeter

__all__ = ["RECOMPUTE_MODES", "BlockRecompute", "recomputes"]

RECOMPUTE_MODES = ("off", "blocks")


def recomputes(mode: str, stages: int | None, stage: int) -> bool:
    """Whether ``stage`` recomputes: ``mode="blocks"`` on the first ``stages`` stages (all when None); the first
    stages hold the most micro-batches in flight."""
    return mode == "blocks" and (stages is None or stage < stages)


def _checkpointed(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, padding micro-batches: nothing is kept anyway
            return original(*args, **kwargs)
        ActivationMeter.keep((args, kwargs))  # the block's input stays alive until its backward
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return forward


class BlockRecompute:
    """Run each of ``blocks`` (a stage's own block modules) through ``torch.utils.checkpoint`` by giving the block
    instance its own ``forward``; parameters, names and hooks are untouched (a state dict is the same), and
    :meth:`remove` gives the blocks their class's forward back."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self._blocks = list(blocks)
        for block in self._blocks:
            block.forward = _checkpointed(block.forward)

    def remove(self) -> None:
        for block in self._blocks:
            if "forward" in vars(block):
                del block.forward
        self._blocks = []
