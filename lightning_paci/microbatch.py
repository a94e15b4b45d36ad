"""Micro-batches: splitting a Lightning batch, measuring a micro-batch, merging step outputs, the loss scale.

Every stage splits the same batch the same way (``torch.tensor_split``), so micro-batch ``i`` holds the same samples
on every stage; the helpers are pure functions of the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_paci.comm import flatten, unflatten

__all__ = ["loss_scale_for", "merge_microbatch_outputs", "microbatch_size", "split_microbatches"]


def loss_scale_for(accumulation: int) -> float:
    """The last stage back-propagates ``loss / a``: every stage then accumulates the mean over its a micro-batches."""
    return 1.0 / accumulation


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of a (nested) batch along dim 0 into ``m`` parts; the first ``B mod m`` parts get one
    extra sample (``torch.tensor_split``). Non-tensor leaves are shared by all parts."""
    skeleton, tensors = flatten(batch)
    if not tensors:
        raise ValueError("The batch holds no tensor to split into micro-batches.")
    size = tensors[0].shape[0] if tensors[0].dim() else 0
    if size < num_microbatches:
        raise ValueError(
            f"A batch of {size} samples cannot be split into `microbatches={num_microbatches}` micro-batches: every "
            f"micro-batch needs at least one sample. Use a batch size >= {num_microbatches} (also for the last, "
            f"smaller batch: set `drop_last=True` in the DataLoader) or fewer micro-batches."
        )
    parts = [torch.tensor_split(t, num_microbatches, dim=0) if t.dim() and t.shape[0] == size
             else [t] * num_microbatches
             for t in tensors]
    return [unflatten(skeleton, [p[i] for p in parts]) for i in range(num_microbatches)]


def microbatch_size(batch: Any) -> int:
    """Samples in a (micro-)batch: dim 0 of its first tensor (1 for a batch without a batched tensor)."""
    tensors = flatten(batch)[1]
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1


def merge_microbatch_outputs(results: list[Any]) -> Any:
    """Concatenate the micro-batches' step outputs along dim 0 (tensors, possibly nested); anything else is returned
    as the list of per-micro-batch outputs."""
    if len(results) == 1:
        return results[0]
    skeletons = [flatten(r) for r in results]
    first_skeleton, first_tensors = skeletons[0]
    if first_tensors and all(len(t) == len(first_tensors) for _, t in skeletons) and all(
        t.dim() > 0 for t in first_tensors
    ):
        try:
            return unflatten(first_skeleton, [torch.cat(parts, dim=0) for parts in zip(*(t for _, t in skeletons))])
        except RuntimeError:
            pass
    return results
