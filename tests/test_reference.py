"""The one-process reference executor: flush schedules equal single-device gradient accumulation; bad lists fail
with the validator's grid."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.runtime.reference import run_lists
from lightning_paci.schedules import ScheduleError, stage_lists_from_text

from models import SequentialMLP, reference_accumulation, regression_loader


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_flush_schedule_equals_single_device_gradient_accumulation(schedule):
    torch.manual_seed(40)
    model = SequentialMLP(depth=6).double()
    single = copy.deepcopy(model)
    batches = [[t.double() for t in batch] for batch in regression_loader(num_batches=3)]
    reference = ReferencePipeline(model, plan_partition(model, 3, partition="parameters"))
    reference.run(build_schedule(schedule, 3, 4, 4, 3), batches)
    reference_accumulation(single, batches, num_microbatches=4, num_steps=3)
    expected = single.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-12, atol=1e-12, msg=lambda m: f"{key}: {m}")


def test_a_list_that_cannot_finish_fails_with_the_grid():
    lists = stage_lists_from_text(["0RECV_B0", "1RECV_F0"])  # both stages wait for each other
    torch.manual_seed(41)
    model = SequentialMLP(depth=4)
    reference = ReferencePipeline(model, plan_partition(model, 2, partition="parameters"))
    with pytest.raises(ScheduleError, match=r"(?s)Stage 0, step 0: .*<-- ERROR HERE"):
        run_lists(reference.runtimes, lists)
