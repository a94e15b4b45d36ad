"""Device clocks for the monitors (engine/runtime/device_clock.py, [Note: device clocks]): on CUDA, F, B and OPT are
timed by events kept pending and read once per logging window; the time accounts and intervals are then the device's.

CUDA events exist only on a GPU; here ``HostEvent`` stands in for them with the host clock (what a CPU device's
events would say). What is tested is the clock's bookkeeping in the real runtime and records: nothing is read per
action, one wait per read, the bound, the accounts and intervals it produces, the idle time derived from them.
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.runtime.device_clock import DeviceClock
from lightning_paci.schedules import static_drift

from models import SequentialMLP, regression_loader


class HostEvent:
    """An event with ``torch.cuda.Event``'s methods, stamped with the host clock when recorded."""

    waits = 0

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        HostEvent.waits += 1

    def elapsed_time(self, other: HostEvent) -> float:
        assert self.at is not None and other.at is not None, "elapsed_time of an event never recorded"
        return (other.at - self.at) * 1e3  # milliseconds, as CUDA's


def _pipeline(bound: int) -> tuple[ReferencePipeline, list[DeviceClock]]:
    L.seed_everything(0, verbose=False)
    model = SequentialMLP(depth=4)
    reference = ReferencePipeline(model, plan_partition(model, num_stages=2, partition="parameters"),
                                  compensation="none")
    clocks = []
    for runtime in reference.runtimes:
        runtime.records.device_clock = DeviceClock(runtime.clock, bound=bound, event=HostEvent)
        clocks.append(runtime.records.device_clock)
    return reference, clocks


def test_device_timed_actions_are_read_once_per_window_into_the_accounts_and_intervals():
    reference, clocks = _pipeline(bound=4096)
    batches = list(regression_loader(num_batches=3))
    reference.run(build_schedule("paci", 2, 4, 4, num_minibatches=3), batches)
    HostEvent.waits = 0
    assert all(len(clock.pending) == 3 * (4 + 4 + 1) for clock in clocks)  # every F, B and OPT: nothing read yet
    assert all(not [iv for iv in r.records._intervals if iv.kind in ("F", "B", "OPT")] for r in reference.runtimes)
    for runtime, clock in zip(reference.runtimes, clocks):
        snapshot = runtime.records.time_snapshot()  # a monitor's read: one wait for all
        assert clock.reads == 1 and not clock.pending
        kinds = [iv.kind for iv in runtime.records.intervals]
        assert kinds.count("F") == kinds.count("B") == 12 and kinds.count("OPT") == 3
        spans = [iv for iv in runtime.records.intervals if iv.kind in ("F", "B", "OPT")]
        assert all(iv.end >= iv.start for iv in spans)
        compute = sum(iv.end - iv.start for iv in spans if iv.kind != "OPT")
        accounts = {k: sum(phase[k] for phase in snapshot.values()) for k in ("wall", "compute", "wait", "comm",
                                                                               "optimizer")}
        assert accounts["compute"] == pytest.approx(compute)
        for phase in snapshot.values():  # idle: the wall clock less what the device and the message posting took
            busy = phase["compute"] + phase["optimizer"] + phase["comm"]
            assert phase["wait"] == pytest.approx(max(0.0, phase["wall"] - busy))
    assert HostEvent.waits == 2
    assert all(runtime.records.time_snapshot() and clock.reads == 1 for runtime, clock in zip(reference.runtimes,
                                                                                              clocks))


def test_pending_events_are_bounded_without_a_reader():
    reference, clocks = _pipeline(bound=5)
    reference.run(build_schedule("paci", 2, 4, 4, num_minibatches=3), list(regression_loader(num_batches=3)))
    for clock in clocks:
        assert len(clock.pending) < 5 and clock.reads == 27 // 5  # 27 timed actions: read every 5th


class _AdamMLP(SequentialMLP):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


@pytest.mark.parametrize("share", [0.0, 1e9])
def test_the_prediction_is_switched_off_once_where_it_costs_more_than_its_share(share):
    """[Note: the prediction's budget]: the first compensated forward's move and way back are timed, compared at
    the next update with the stage's mean F+B, and the prediction stays on only within ``share`` of it."""
    from lightning_paci.optim.prediction_cost import PredictionTiming

    L.seed_everything(0, verbose=False)
    model = _AdamMLP(depth=4)
    reference = ReferencePipeline(model, plan_partition(model, num_stages=2, partition="parameters"),
                                  compensation="predict")
    prediction = reference.runtimes[0].prediction
    prediction.timer = PredictionTiming(share, event=HostEvent)
    schedule = build_schedule("paci", 2, 4, 4, num_minibatches=4)
    crossing = sum(1 for k in static_drift(schedule.actions[0]).values() if k > 0)  # stage 0's forwards run ahead
    if share == 0.0:
        with pytest.warns(UserWarning, match=r"stage 0: the weight prediction costs [\d.]+ ms per compensated forward, "
                                             r"\d+% of the stage's forward\+backward .* compensation is off on this "
                                             r"stage after optimizer step 2\."):
            reference.run(schedule, list(regression_loader(num_batches=4)))
        # the first crossing forward with optimizer state is timed; off after the next update
        assert reference.runtimes[0].prediction is None and 1 <= prediction.moves < crossing
    else:
        reference.run(schedule, list(regression_loader(num_batches=4)))
        assert reference.runtimes[0].prediction is prediction and prediction.moves == crossing
    assert prediction.timer.decided and len(prediction.timer.events) == 4
