"""Micro-batches: splitting a Lightning batch, measuring a micro-batch, merging step outputs, the loss scale, and
each forward's random stream.

Every stage splits the same batch the same way (``torch.tensor_split``), so micro-batch ``i`` holds the same samples
on every stage; the helpers are pure functions of the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lightning_paci.engine.transport.messages import flatten, unflatten

__all__ = ["loss_scale_for", "merge_microbatch_outputs", "microbatch_rng", "microbatch_size", "split_microbatches",
           "split_weighted"]


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


def split_weighted(batch: Any, num_microbatches: int) -> list[tuple[Any, float]]:
    """Exactly ``m`` micro-batches of a Lightning batch of ``B`` samples, each with the weight of its loss, so that
    the weighted micro-batch means are the mean over the whole batch, as one device computes it:

    * ``B >= m``: ``torch.tensor_split`` parts of ``b_j`` samples, weight ``b_j * m / B`` (exactly 1.0 when the
      parts are equal, the usual case);
    * ``B < m`` (a short last batch): ``B`` one-sample parts of weight ``m / B``, then ``m - B`` *padding* parts
      of weight 0 (copies of the last sample, so that every stage still runs the action lists every stage agreed
      on): the runtime runs them without gradient and drops them (see ``StageRuntime``).
    """
    size = microbatch_size(batch)
    if size >= num_microbatches:
        parts = split_microbatches(batch, num_microbatches)
        if size % num_microbatches == 0:
            return [(p, 1.0) for p in parts]
        # tensor_split's sizes: the first B mod m parts hold one sample more
        base, extra = divmod(size, num_microbatches)
        return [(p, (base + (j < extra)) * num_microbatches / size) for j, p in enumerate(parts)]
    parts = split_microbatches(batch, size)
    weight = num_microbatches / size
    return [(p, weight) for p in parts] + [(parts[-1], 0.0)] * (num_microbatches - size)


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


@contextlib.contextmanager
def microbatch_rng(seed: int, stage: int, microbatch: int, replica: int = 0) -> Iterator[None]:
    """[Note: randomness per micro-batch]
    Every forward runs with the CPU (and CUDA) generators seeded from ``(seed, stage, micro-batch index in the run)``
    and the CPU generator restored afterwards. Dropout masks and any other draw of a forward are then independent
    across stages (every rank starts from the same RNG state: drawing in lock step, stage 1's block 2 used stage 0's
    block 0 masks), the same whatever the timing, equal in the one-process reference executor and the processes,
    and the main RNG stream (samplers, augmentation) does not depend on how many forwards a stage ran.
    Data-parallel replicas (``replica`` > 0) mix their index in: their samples get their own masks, as the samples
    of one device's larger batch would.
    """
    mixed = (((seed * 1_000_003) ^ (stage + 1)) * 1_000_033 + microbatch) % (2**63 - 1)
    if replica:
        mixed = (mixed * 1_000_037 + replica) % (2**63 - 1)
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
    # the generators themselves, not torch.manual_seed (150 us: it visits every backend) or fork_rng: ~3 us
    states = [g.get_state() for g in generators]
    for g in generators:
        g.manual_seed(mixed)
    try:
        yield
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)
