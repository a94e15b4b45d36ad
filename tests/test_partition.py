"""Partitioning unchanged modules (single process: no process group needed).

Timing decisions are tested on a ``FakeClock`` that moves only when a block says so: the measured block costs are
then exactly the configured ones, on any machine and under any load, and no test sleeps.
"""

from __future__ import annotations

import inspect
import logging
import time

import pytest
import torch
from torch import nn
from torch.multiprocessing import ProcessRaisedException

from lightning_paci.partition import (
    BlockCosts,
    carve_stage,
    find_block_container,
    plan_partition,
    profile_block_costs,
    stage_costs,
)

from helpers import fit
from models import HFCausalLM, LoopTransformer, SequentialMLP, no_block_container, regression_loader


class FakeClock:
    """Seconds that pass only through ``advance``: pass it as ``profile_block_costs(..., clock=)``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Tick(torch.autograd.Function):
    """Identity whose forward and backward each advance a FakeClock by ``seconds``: the stand-in for compute."""

    @staticmethod
    def forward(ctx, x, clock, seconds):
        clock.advance(seconds)
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.advance(ctx.seconds)
        return grad, None, None


class TickBlock(nn.Module):
    """Same parameters as its siblings; its forward and its backward each take ``seconds`` on ``clock``."""

    def __init__(self, dim: int, clock: FakeClock, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.clock = clock
        self.seconds = seconds

    def forward(self, x):
        return _Tick.apply(self.linear(x), self.clock, self.seconds)


def expensive_last_block_model(clock: FakeClock) -> nn.Sequential:
    # block costs 1:1:1:1:1:1:1:3 at equal parameter counts: the parameter split (2 blocks per stage) gives the last
    # stage 4 units, the time split at most 3
    return nn.Sequential(*[TickBlock(16, clock, 0.004) for _ in range(7)], TickBlock(16, clock, 0.012))


def _run_step(model: nn.Module):
    x = torch.randn(4, 16)

    def run():
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def _ticking_step(model: nn.Sequential, clock: FakeClock, *, before: float = 0.0, after: float = 0.0,
                  script: list[list[float]] | None = None):
    """One forward+backward per call; ``before`` / ``after`` seconds pass around the blocks each way (an embedding,
    a head and loss), and call ``k`` first sets the blocks' seconds to ``script[k]`` (call 0 is the warm-up). The
    input requires grad so that block 0's backward hooks frame its backward as they do behind an embedding."""
    x = torch.randn(4, 16, requires_grad=True)
    calls = iter(script or [])

    def run():
        for block, seconds in zip(model, next(calls, [])):
            block.seconds = seconds
        out = model(_Tick.apply(x, clock, before))
        _Tick.apply(out, clock, after).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def _ms(blocks: list[float], after: float, before: float = 0.0, repeats: tuple[BlockCosts, ...] = ()) -> BlockCosts:
    return BlockCosts(tuple(b / 1e3 for b in blocks), before / 1e3, after / 1e3, repeats)


def test_container_detection_picks_the_largest_repeated_container():
    assert find_block_container(SequentialMLP())[0] == "net"
    assert find_block_container(LoopTransformer())[0] == "blocks"
    assert find_block_container(HFCausalLM("gpt2"))[0] == "model.transformer.h"
    assert find_block_container(HFCausalLM("llama"))[0] == "model.model.layers"


def test_module_without_container_names_the_module_and_the_fix():
    with pytest.raises(ValueError, match=r"Flat has no repeated-block container.*block_container="):
        find_block_container(no_block_container())


@pytest.mark.distributed
def test_a_run_without_container_is_refused_without_first_saying_it_falls_back_to_parameters(tmp_path):
    # the package's log lines of the forked ranks, in a file (a handler installed before the fork)
    logger, handler = logging.getLogger("lightning_paci"), logging.FileHandler(tmp_path / "log.txt")
    logger.addHandler(handler)
    try:
        with pytest.raises(ProcessRaisedException, match=r"ValueError: Flat has no repeated-block container"):
            fit(no_block_container(), regression_loader(), devices=2, partition="time", max_steps=1)
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert "block timing not possible" not in (tmp_path / "log.txt").read_text()


def test_fewer_blocks_than_stages_names_the_module_and_the_fix():
    with pytest.raises(ValueError, match=r"Cannot split `blocks` \(ModuleList of 4 blocks\) of LoopTransformer into 8 "
                                         r"stages.*at most 4 devices"):
        plan_partition(LoopTransformer(layers=4), 8)


def test_explicit_split_and_its_validation():
    plan = plan_partition(LoopTransformer(layers=6), 3, partition=[1, 4])
    assert plan.boundaries == (0, 1, 4, 6)
    with pytest.raises(ValueError, match="strictly increasing block indices"):
        plan_partition(LoopTransformer(layers=6), 3, partition=[4, 1])


def test_parameter_free_stage_is_rejected():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Tanh(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="own no parameters"):
        plan_partition(model, 3, partition=[1, 2])


def test_carving_keeps_state_dict_keys_and_union_is_the_full_model():
    model = LoopTransformer(layers=4)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_partition(model, 2)
    import copy

    parts = [copy.deepcopy(model) for _ in range(2)]
    for stage, part in enumerate(parts):
        carve_stage(part, plan, stage)
    union = {}
    for part in parts:
        union.update(part.state_dict())
    assert union.keys() == full.keys()
    for key, value in full.items():
        torch.testing.assert_close(union[key], value)


def test_profile_reads_the_injected_clock_and_keeps_the_median_repetition():
    assert inspect.signature(profile_block_costs).parameters["clock"].default is time.perf_counter
    clock = FakeClock()
    model = nn.Sequential(*[TickBlock(16, clock, 0.0) for _ in range(3)])
    # seconds each way per block; call 0 is the warm-up and is dropped; by total the median of 1x, 3x, 2x is 2x
    base = [0.001, 0.002, 0.004]
    script = [[100 * s for s in base], base, [3 * s for s in base], [2 * s for s in base]]
    measured = profile_block_costs(model, None, _ticking_step(model, clock, before=0.0005, after=0.003, script=script),
                                   clock=clock)
    assert [r.blocks for r in measured.repeats] == [
        pytest.approx(tuple(2 * k * s for s in base), abs=1e-12) for k in (1, 3, 2)]
    assert measured.blocks == pytest.approx((0.004, 0.008, 0.016), abs=1e-12)  # forward + backward, 2x
    assert measured.before == pytest.approx(0.001, abs=1e-12)
    assert measured.after == pytest.approx(0.006, abs=1e-12)
    assert all(r.before == measured.before and r.after == measured.after for r in measured.repeats)


# 4 equal blocks on 2 stages: by parameters (0, 2, 4); with 10 ms blocks and a head of A ms the time split is
# (0, 3, 4), slowest stage 20 + A ms by parameters and 10 + A ms by time: 10% faster exactly at A = 80
@pytest.mark.parametrize(("head_ms", "expected", "note"), [
    (79.0, (0, 3, 4), "by parameters [20.0, 99.0], by time [30.0, 89.0]; the time split's slowest stage faster by "
                      "10% and 1 ms in 1 of 1 repetitions -> using time (time only when in all)"),  # 10.1% faster
    (81.0, (0, 2, 4), "by parameters [20.0, 101.0], by time [30.0, 91.0]; the time split's slowest stage faster by "
                      "10% and 1 ms in 0 of 1 repetitions -> using parameters (time only when in all)"),  # 9.9%
])
def test_time_split_needs_ten_percent_of_the_slowest_stage(head_ms, expected, note):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    plan = plan_partition(model, 2, partition="balanced", measured=_ms([10.0] * 4, head_ms))
    assert plan.boundaries == expected
    assert plan.note == f"measured F+B ms per stage (median repetition): {note}"


@pytest.mark.parametrize(("block_ms", "expected"), [
    (0.5, (0, 2, 4)),  # slowest stage 2.0 -> 1.5 ms: 25% faster but only 0.5 ms
    (2.0, (0, 3, 4)),  # slowest stage 8.0 -> 6.0 ms: 25% faster and 2 ms
])
def test_time_split_needs_a_millisecond_of_the_slowest_stage(block_ms, expected):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    plan = plan_partition(model, 2, partition="balanced", measured=_ms([block_ms] * 4, 2 * block_ms))
    assert plan.boundaries == expected


@pytest.mark.parametrize(("heads_ms", "expected"), [
    ((79.0, 60.0, 70.0), (0, 3, 4)),
    ((79.0, 81.0, 70.0), (0, 2, 4)),  # the second repetition gains 9.9% only
])
def test_time_split_must_win_in_every_repetition(heads_ms, expected):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    median = _ms([10.0] * 4, heads_ms[0], repeats=tuple(_ms([10.0] * 4, h) for h in heads_ms))
    assert plan_partition(model, 2, partition="time", measured=median).boundaries == expected
    assert plan_partition(model, 2, partition="parameters", measured=median).boundaries == (0, 2, 4)


def test_time_balanced_split_gives_the_expensive_last_block_its_own_stage():
    clock = FakeClock()
    model = expensive_last_block_model(clock)
    measured = profile_block_costs(model, None, _ticking_step(model, clock), clock=clock)
    assert measured.blocks[-1] > 2 * max(measured.blocks[:-1])
    by_params = plan_partition(model, 4, partition="parameters")
    plan = plan_partition(model, 4, partition="time", measured=measured)
    assert by_params.boundaries == (0, 2, 4, 6, 8)
    assert plan.boundaries[-2] == 7  # the slow block alone on the last stage
    assert plan.boundaries == (0, 3, 6, 7, 8)  # stages filled from the front up to 5% over the optimum (24 ms)

    times = stage_costs(list(plan.boundaries), measured)
    assert max(times) < 0.8 * max(stage_costs(list(by_params.boundaries), measured))
    # the log line shows the measured per-stage times before and after balancing
    assert "by parameters [" in plan.describe() and "-> using time" in plan.describe()
    assert "by parameters [16.0, 16.0, 16.0, 32.0], by time [24.0, 24.0, 8.0, 24.0];" in plan.note
    assert plan.note.endswith("-> using time (time only when in all)")


def test_profiled_split_keeps_parameters_when_one_repetition_disagrees():
    clock = FakeClock()
    model = expensive_last_block_model(clock)
    slow_last, uniform = [0.004] * 7 + [0.012], [0.004] * 8
    # the median repetition (by total time) has the slow last block; the uniform one does not gain from the time split
    script = [slow_last, slow_last, uniform, slow_last]
    measured = profile_block_costs(model, None, _ticking_step(model, clock, script=script), clock=clock)
    assert measured.blocks == pytest.approx((0.008,) * 7 + (0.024,), abs=1e-12)
    plan = plan_partition(model, 4, partition="time", measured=measured)
    assert plan.boundaries == (0, 2, 4, 6, 8)
    # the line shows why: the time split wins in the repetitions with the slow block, not in the uniform one
    assert plan.note.endswith("in 2 of 3 repetitions -> using parameters (time only when in all)")


def test_homogeneous_blocks_keep_the_parameter_split_despite_timing_noise():
    # on the real clock: wall-clock noise on microsecond blocks must not flip the split
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    for _ in range(3):
        measured = profile_block_costs(model, None, _run_step(model))
        assert plan_partition(model, 4, partition="time", measured=measured).boundaries == (0, 2, 4, 6, 8)
