"""Measured block times, and the rule that lets them override the parameter split.

Parameter counts are a proxy for time that fails on blocks of equal size and unequal cost (an attention block at a
long sequence, a block with a custom kernel). The strategy therefore times each block's forward and backward on one
sample micro-batch of the unchanged module (``profile_block_costs``) and hands the result to ``plan_partition``,
which takes the time-balanced split only when it clearly wins (``prefer_time_split``): timings are noisy, and a
partition that flips between runs would change which blocks drift by how much under "paci".
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_paci.partition.blocks import CallTrace, balanced_boundaries, find_block_containers

__all__ = [
    "TIME_BALANCE_MIN_GAIN",
    "TIME_BALANCE_MIN_SECONDS",
    "BlockCosts",
    "canonical_time_split",
    "prefer_time_split",
    "profile_block_costs",
    "stage_costs",
    "time_split_wins",
]


@dataclass(frozen=True)
class BlockCosts:
    """Measured forward+backward seconds of each block, and of what runs before (embedding) and after (head, loss).
    ``repeats`` keeps every measured repetition (the fields above are the median one)."""

    blocks: tuple[float, ...]
    before: float
    after: float
    repeats: tuple[BlockCosts, ...] = ()


def profile_block_costs(module: nn.Module, container: str | Sequence[str] | None, run_step: Callable[[], None],
                        *, repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
                        trace: CallTrace | None = None) -> BlockCosts:
    """Time each block's forward and backward while ``run_step`` runs one full forward+backward of the unchanged
    module (on a sample micro-batch); the median over ``repeats`` runs after one warm-up.

    ``clock`` returns seconds; it is read in the block hooks and around ``run_step``, nowhere else. The wall clock
    is the point in production; a clock that advances by known amounts makes the measured costs -- and so the
    partition decided from them -- exact, which is how the tests pin the decision rule down without sleeping.
    ``trace`` finds the containers as ``plan_partition`` does (the blocks of all of them, in the step's order); time
    spent between two containers' blocks counts in ``after``.
    """
    blocks = [block for _, c in find_block_containers(module, container, trace) for block in c]
    n = len(blocks)
    marks: dict[str, float] = {}
    handles = []

    def mark(key: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            marks[key] = clock()
        return hook

    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(mark(f"f{i}")))
        handles.append(block.register_forward_hook(mark(f"F{i}")))
        handles.append(block.register_full_backward_pre_hook(mark(f"b{i}")))
        handles.append(block.register_full_backward_hook(mark(f"B{i}")))
    samples: list[tuple[list[float], float, float]] = []
    try:
        for attempt in range(repeats + 1):
            marks.clear()
            with warnings.catch_warnings():  # block 0's input needs no gradient under a frozen embedding (adapters):
                # its backward hook then fires before its backward runs, whose time counts in `before` -- on stage 0
                # like block 0 itself
                warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
                start = clock()
                run_step()
                end = clock()
            if not all(f"{k}{i}" in marks for k in "fFbB" for i in range(n)):
                raise RuntimeError("not every block ran a forward and a backward in the sample step")
            costs = [(marks[f"F{i}"] - marks[f"f{i}"]) + (marks[f"B{i}"] - marks[f"b{i}"]) for i in range(n)]
            # before: up to block 0's forward, and after block 0's backward; after: the rest
            before = (marks["f0"] - start) + (end - marks["B0"])
            after = (end - start) - before - sum(costs)
            if attempt:
                samples.append((costs, before, max(after, 0.0)))
    finally:
        for handle in handles:
            handle.remove()
    each = tuple(BlockCosts(tuple(c), b, a) for c, b, a in samples)
    mid = sorted(range(len(each)), key=lambda k: sum(each[k].blocks))[len(each) // 2]
    return BlockCosts(each[mid].blocks, each[mid].before, each[mid].after, repeats=each)


def stage_costs(bounds: Sequence[int], costs: BlockCosts) -> list[float]:
    """Per-stage cost of a split: its blocks, plus the outside parts on the first and last stage."""
    out = [sum(costs.blocks[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]
    out[0] += costs.before
    out[-1] += costs.after
    return out


# The measured-time split replaces the parameter-count split only when it is clearly better -- in every measured
# repetition, by at least 10% and 1 ms of the slowest stage's time -- so that timing noise cannot flip the partition
# between runs (the partition decides which blocks drift by how much under "paci").
TIME_BALANCE_MIN_GAIN = 0.10
TIME_BALANCE_MIN_SECONDS = 1e-3


def canonical_time_split(sample: BlockCosts, num_stages: int, tolerance: float = 0.05) -> list[int]:
    """A time-balanced split that small timing noise does not move: the optimal slowest-stage time ``M`` from the
    exact programme, then stages filled greedily from the front up to ``M * (1 + tolerance)``."""
    optimal = balanced_boundaries(list(sample.blocks), sample.before, sample.after, num_stages)
    limit = max(stage_costs(optimal, sample)) * (1 + tolerance)
    n = len(sample.blocks)
    bounds, i = [0], 0
    for stage in range(num_stages - 1):
        cost = sample.before if stage == 0 else 0.0
        j = i
        while j < n - (num_stages - 1 - stage) and (j == i or cost + sample.blocks[j] <= limit):
            cost += sample.blocks[j]
            j += 1
        bounds.append(j)
        i = j
    bounds.append(n)
    return bounds if max(stage_costs(bounds, sample)) <= limit else optimal


def time_split_wins(slow_params: float, slow_time: float) -> bool:
    """Whether, in one repetition, the time split's slowest stage (``slow_time`` seconds) is clearly faster than the
    parameter split's (``slow_params``): by ``TIME_BALANCE_MIN_GAIN`` of it and by ``TIME_BALANCE_MIN_SECONDS``."""
    return not (slow_time > (1 - TIME_BALANCE_MIN_GAIN) * slow_params
                or slow_params - slow_time < TIME_BALANCE_MIN_SECONDS)


def prefer_time_split(by_params: list[int], measured: BlockCosts, num_stages: int) -> tuple[list[int], str]:
    """The split to use and a note for the setup log line: the time split of the median repetition if it wins
    (``time_split_wins``) in *every* repetition, else ``by_params``. The note gives both splits' per-stage times
    in the median repetition."""
    timed = canonical_time_split(measured, num_stages)
    samples = measured.repeats or (measured,)
    won = sum(time_split_wins(max(stage_costs(by_params, sample)), max(stage_costs(timed, sample)))
              for sample in samples)
    wins = won == len(samples)
    by_param_ms = [round(1e3 * c, 1) for c in stage_costs(by_params, measured)]
    by_time_ms = [round(1e3 * c, 1) for c in stage_costs(timed, measured)]
    gain = f"{TIME_BALANCE_MIN_GAIN:.0%} and {1e3 * TIME_BALANCE_MIN_SECONDS:g} ms"
    note = (f"measured F+B ms per stage (median repetition): by parameters {by_param_ms}, by time {by_time_ms}; "
            f"the time split's slowest stage faster by {gain} in {won} of {len(samples)} repetitions -> using "
            f"{'time' if wins else 'parameters'} (time only when in all)")
    return (timed if wins else by_params), note
