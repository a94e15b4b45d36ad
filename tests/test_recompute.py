"""Activation recomputation (recompute.py): exact under the flush schedules, the same bits in the processes and the
reference executor, block inputs only between a forward and its backward, and clear errors for bad options."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition

from helpers import fit
from models import SequentialMLP, regression_loader

WIDTH, BATCH, M = 16, 8, 4


class CountingBlock(nn.Module):
    """Linear + tanh + dropout; counts its forwards (a recomputation calls ``forward`` again)."""

    calls = 0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingBlock.calls += 1
        return self.dropout(torch.tanh(self.linear(x)))


class DropoutMLP(SequentialMLP):
    """float64, dropout in every block: recomputation must draw the forward's masks again."""

    def __init__(self) -> None:
        super().__init__(width=WIDTH)
        self.net = nn.Sequential(nn.Linear(8, WIDTH), *[CountingBlock(WIDTH) for _ in range(4)], nn.Linear(WIDTH, 4))
        self.double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x.double(), y.double()), batch_idx)


def _reference(initial, schedule: str, *, recompute: str = "off", stages: int = 3, measure: bool = False,
               recompute_stages: int | None = None) -> ReferencePipeline:
    torch.manual_seed(5)  # the runtimes' random streams start from torch.initial_seed()
    model = copy.deepcopy(initial)
    reference = ReferencePipeline(model, plan_partition(model, stages, partition="parameters"), recompute=recompute,
                                  recompute_stages=recompute_stages)
    for runtime in reference.runtimes:
        runtime.records.measure(activation_bytes=measure)
    batches = list(regression_loader(num_batches=4, batch_size=BATCH))
    reference.run(build_schedule(schedule, stages, M, M, len(batches)), batches)
    return reference


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_recomputation_under_a_flush_schedule_gives_the_same_weights_bit_for_bit(schedule):
    torch.manual_seed(3)
    initial = DropoutMLP()
    CountingBlock.calls = 0
    plain = _reference(initial, schedule)
    calls, CountingBlock.calls = CountingBlock.calls, 0
    recomputed = _reference(initial, schedule, recompute="blocks")
    assert CountingBlock.calls - calls == 4 * 4 * M  # each of 4 blocks once more per micro-batch (4 batches of M)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(recomputed.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert recomputed.runtimes[-1].records.losses == plain.runtimes[-1].records.losses


def test_recomputation_keeps_only_the_block_inputs_between_forward_and_backward():
    torch.manual_seed(3)
    initial = DropoutMLP()
    plain = _reference(initial, "paci", measure=True)
    recomputed = _reference(initial, "paci", recompute="blocks", measure=True)
    blocks = [plan_partition(copy.deepcopy(initial), 3, partition="parameters").blocks(s) for s in range(3)]
    for stage in range(2):  # the last stage's blocks feed the loss right away; stages 0 and 1 hold 3 and 2 in flight
        in_flight = 3 - stage
        inputs = len(blocks[stage]) + 1  # every block's input and the next stage's (the outgoing activation)
        sample_bytes = BATCH // M * WIDTH * 8
        first = BATCH // M * 8 * 8 if stage == 0 else sample_bytes  # stage 0's first block reads the data (8 wide)
        expected = in_flight * (first + (inputs - 1) * sample_bytes)
        assert recomputed.runtimes[stage].records.peak_activation_bytes == expected, stage
        assert plain.runtimes[stage].records.peak_activation_bytes > expected, stage
    assert recomputed.state_dict().keys() == plain.state_dict().keys()


def test_recompute_stages_limits_recomputation_to_the_first_stages():
    torch.manual_seed(3)
    initial = DropoutMLP()
    plain = _reference(initial, "paci", measure=True)
    first_only = _reference(initial, "paci", recompute="blocks", recompute_stages=1, measure=True)
    peaks = [[r.records.peak_activation_bytes for r in run.runtimes] for run in (plain, first_only)]
    assert peaks[1][0] < peaks[0][0] and peaks[1][1:] == peaks[0][1:]


def test_processes_equal_the_reference_executor_bit_for_bit_with_recomputation():
    torch.manual_seed(3)
    model = DropoutMLP()
    initial = copy.deepcopy(model)
    torch.manual_seed(5)
    fit(model, regression_loader(num_batches=4, batch_size=BATCH), devices=3, max_steps=4, microbatches=M,
        partition="parameters", recompute="blocks")
    reference = _reference(initial, "paci", recompute="blocks")
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    # under paci a recomputation runs with newer weights than its forward: a different run than without it
    plain = _reference(initial, "paci")
    assert any(not torch.equal(value, plain.state_dict()[key]) for key, value in reference.state_dict().items())
    assert all("forward" not in vars(block) for block in model.modules())  # the user's module is given back as it was


def test_bad_recompute_options_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"`recompute` must be one of 'off', 'blocks', got 'all'"):
        PACIStrategy(recompute="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`recompute_stages=2` needs `recompute='blocks'`"):
        PACIStrategy(recompute_stages=2)
    with pytest.raises(ValueError, match=r"`recompute_stages` must be"):
        PACIStrategy(recompute="blocks", recompute_stages=0)
    model = DropoutMLP()
    with pytest.raises(ValueError, match=r"`recompute` must be one of 'off', 'blocks', got 'block'"):
        ReferencePipeline(model, plan_partition(model, 2, partition="parameters"), recompute="block")


def test_a_tied_transformers_model_recomputes_in_processes_as_in_the_reference_executor():
    # the embedding and head are tied across the first and last stage; the blocks in between recompute
    from models import HFCausalLM, token_loader

    torch.manual_seed(6)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    initial = copy.deepcopy(model)
    loader = token_loader(num_batches=3, batch_size=4, vocab=64)
    torch.manual_seed(7)
    fit(model, loader, devices=2, max_steps=3, microbatches=2, partition="parameters", recompute="blocks")
    torch.manual_seed(7)
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"), recompute="blocks")
    reference.run(build_schedule("paci", 2, 2, 2, 3, tied=True), list(loader))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
