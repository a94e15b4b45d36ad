"""Partitioning unchanged modules (single process: no process group needed)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_paci.partition import carve_stage, find_block_container, plan_partition, profile_block_costs

from models import HFCausalLM, LoopTransformer, SequentialMLP, no_block_container


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepyBlock(nn.Module):
    """Same parameters as its siblings, a chosen forward/backward time."""

    def __init__(self, dim: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.seconds = seconds

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.seconds)


def expensive_last_block_model() -> nn.Module:
    # block costs 1:1:1:1:1:1:1:3 at equal parameter counts: the parameter split (2 blocks per stage) gives the last
    # stage 4 units, the time split at most 3
    return nn.Sequential(*[SleepyBlock(16, 0.004) for _ in range(7)], SleepyBlock(16, 0.012))


def _run_step(model: nn.Module):
    x = torch.randn(4, 16)

    def run():
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def test_container_detection_picks_the_largest_repeated_container():
    assert find_block_container(SequentialMLP())[0] == "net"
    assert find_block_container(LoopTransformer())[0] == "blocks"
    assert find_block_container(HFCausalLM("gpt2"))[0] == "model.transformer.h"
    assert find_block_container(HFCausalLM("llama"))[0] == "model.model.layers"


def test_module_without_container_names_the_module_and_the_fix():
    with pytest.raises(ValueError, match=r"Flat has no repeated-block container.*block_container="):
        find_block_container(no_block_container())


def test_fewer_blocks_than_stages_names_the_module_and_the_fix():
    with pytest.raises(ValueError, match=r"Cannot split `blocks` \(ModuleList of 4 blocks\) of LoopTransformer into 8 stages.*at most 4 devices"):
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
    for key in full:
        torch.testing.assert_close(union[key], full[key])


def test_time_balanced_split_gives_the_expensive_last_block_its_own_stage():
    model = expensive_last_block_model()
    measured = profile_block_costs(model, None, _run_step(model))
    assert measured.blocks[-1] > 2 * max(measured.blocks[:-1])
    by_params = plan_partition(model, 4, partition="parameters")
    plan = plan_partition(model, 4, measured=measured)
    assert by_params.boundaries == (0, 2, 4, 6, 8)
    assert plan.boundaries[-2] == 7  # the slow block alone on the last stage
    from lightning_paci.partition import stage_costs

    times = stage_costs(list(plan.boundaries), measured)
    assert max(times) < 0.8 * max(stage_costs(list(by_params.boundaries), measured))
    # the log line shows the measured per-stage times before and after balancing
    assert "by parameters [" in plan.describe() and "-> using time" in plan.describe()


def test_homogeneous_blocks_keep_the_parameter_split_despite_timing_noise():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    for _ in range(3):
        measured = profile_block_costs(model, None, _run_step(model))
        assert plan_partition(model, 4, measured=measured).boundaries == (0, 2, 4, 6, 8)
