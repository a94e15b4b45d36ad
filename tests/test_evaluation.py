"""Evaluation as a forward-only action list: valid for every pipeline length, run through the same runtime."""

from __future__ import annotations

import pytest

from lightning_paci.integration.stage.evaluation import forward_only_actions
from lightning_paci.schedules import validate_schedule


@pytest.mark.parametrize("num_stages", [1, 2, 3, 8])
@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_forward_only_lists_are_valid_and_forward_in_order(num_stages, num_microbatches):
    lists = [forward_only_actions(s, num_stages, num_microbatches) for s in range(num_stages)]
    validate_schedule(lists)
    for s, actions in enumerate(lists):
        assert [a.microbatch for a in actions if a.kind == "F"] == list(range(num_microbatches))
        assert all(a.kind != "B" and a.kind != "OPT" for a in actions)
    if num_stages >= 3 and num_microbatches == 4:  # a middle stage: receive, forward, send, one micro-batch at a time
        assert " ".join(map(str, lists[1][:6])) == "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1"
