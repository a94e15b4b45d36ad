"""Peak host memory per rank (``VmHWM``) with a 268 MB model on 4 stages. Built in ``configure_model``, each rank's
peak up to fit start is its own stage plus one block and a small constant over the tiny model of the same code,
and what follows training -- a sharded ``save_checkpoint`` and teardown -- adds no more than a block and the
constant (the peak is reset when training ends). Built in ``__init__`` (the control) every rank holds more than the
whole model at fit start, and its teardown's gather adds more than the other stages' share."""

from __future__ import annotations

import pytest
from memory_peaks import MB, run_peaks

from models import WideMLP

pytestmark = [pytest.mark.timeout(240), pytest.mark.heavy]

def test_each_rank_holds_only_its_stage_from_fit_start_to_the_end_of_the_process(tmp_path) -> None:
    full = WideMLP(2048)  # built later: nothing allocated here
    block = (2048 * 2048 + 2048) * 4
    total = full.depth * block
    assert total > 250 * MB
    # the baselines first: a forked rank counts what the test process holds, and a big model may outlive its run
    tiny = run_peaks(tmp_path / "tiny", 64, later=True)
    staged = run_peaks(tmp_path / "staged", 2048, later=True)
    control = run_peaks(tmp_path / "control", 2048, later=False)  # built in __init__: every rank holds the whole model
    figures = []
    for rank in range(4):
        own = staged.read("start", rank)["own"]
        assert own == total // 4  # uniform: 4 of the 16 blocks
        start = staged.read("start", rank)["peak"] - tiny.read("start", rank)["peak"]
        after = staged.read("end", rank)["peak"] - staged.read("reset", rank)["peak"]
        training = staged.read("train", rank)["peak"] - tiny.read("train", rank)["peak"]
        control_start = control.read("start", rank)["peak"] - tiny.read("start", rank)["peak"]
        control_after = control.read("end", rank)["peak"] - control.read("reset", rank)["peak"]
        figures.append(f"rank {rank}: fit start +{start / MB:.0f} MB, training +{training / MB:.0f} MB, "
                       f"save and teardown +{after / MB:.0f} MB; control {control_start / MB:.0f} MB at start, "
                       f"+{control_after / MB:.0f} MB at teardown")
        assert start <= own + block + 64 * MB, f"rank {rank}: {start / MB:.0f} MB at fit start, own {own / MB} MB"
        assert after <= block + 64 * MB, f"rank {rank}: the save and teardown added {after / MB:.0f} MB"
        # the whole model (within the baseline's noise of a few MB) against a quarter of it
        assert control_start > 0.95 * total, f"control rank {rank}: {control_start / MB:.0f} MB at fit start"
        assert control_after > total - own - block, f"control rank {rank}: teardown added {control_after / MB} MB"
    print("; ".join(figures))
