"""Issue 13's remaining items: an unchanged module trains as on one device, or is refused at setup.

Each test is written as an ordinary single-device module would be, and compares the pipelined run with
``Trainer(devices=1)`` or the one-process reference executor.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_paci import ReferencePipeline, build, plan_partition

from helpers import fit
from models import SequentialMLP, regression_loader


class _BatchNormMLP(SequentialMLP):
    """BatchNorm inside the blocks: running statistics are buffers a profiling step would advance."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def test_balanced_profiling_leaves_buffers_and_rng_as_they_were():
    torch.manual_seed(21)
    model = _BatchNormMLP()
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=3)
    # "balanced" runs a profiling step on rank 0 before carving; 1f1b's result does not depend on the split
    fit(model, loader, devices=2, max_steps=3, schedule="1f1b", microbatches=2, partition="balanced")
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"))
    reference.run(build("1f1b", 2, 2, 2, 3), list(loader))
    expected = reference.state_dict()
    assert expected["net.1.num_batches_tracked"] == 6  # 3 batches x 2 micro-batches, none from profiling
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")
