"""StageRuntime on its own: one handler per action kind, named failures, non-finite losses, and the records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_paci.engine.runtime.reference import run_lists
from lightning_paci.engine.runtime.runtime import ForwardOutput, StageRuntime
from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.errors import StageFailure
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.schedules import Action, build_schedule, static_drift


class LinearStage:
    """The StageProgram protocol with one Linear layer; the last stage returns the mean square as its loss."""

    def __init__(self, stage: int, last: bool, *, poison: int | None = None) -> None:
        torch.manual_seed(stage)
        self.module = nn.Linear(3, 3).double()
        self.last = last
        self.poison = poison  # the step argument (batch index) whose loss is NaN
        self.calls = 0

    def forward(self, data, *step_args, received):
        self.calls += 1
        out = self.module(data if received is None else received)
        if not self.last:
            return ForwardOutput(outgoing=out)
        loss = out.pow(2).mean()
        return ForwardOutput(loss=loss * float("nan") if step_args[0] == self.poison else loss)


def _pipeline(num_stages: int, *, skip_nonfinite: bool = False, poison: int | None = None) -> list[StageRuntime]:
    comms = LocalComm.network(num_stages)
    runtimes = []
    for s in range(num_stages):
        program = LinearStage(s, s == num_stages - 1, poison=poison)
        params = list(program.module.parameters())
        optimizer = StageOptimizer(torch.optim.SGD(params, lr=0.1), params)
        runtimes.append(StageRuntime(s, num_stages, program, comms[s], optimizer, loss_scale=0.25,
                                     skip_nonfinite=skip_nonfinite))
    return runtimes


def _feed(runtimes: list[StageRuntime], num_minibatches: int, m: int) -> None:
    for k in range(num_minibatches):
        batch = torch.randn(m, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        for runtime in runtimes:
            for i in range(m):
                runtime.add_microbatch(k * m + i, batch[i:i + 1], k)


def test_every_action_kind_runs_through_its_handler_and_is_recorded():
    runtimes = _pipeline(3)
    schedule = build_schedule("paci", 3, 4, 2, 3)
    _feed(runtimes, 3, 4)
    run_lists(runtimes, schedule.actions)
    for s, runtime in enumerate(runtimes):
        kinds = {iv.kind for iv in runtime.records.intervals}
        expected = {"F", "B", "OPT"} | ({"WAIT_F", "SEND"} if s > 0 else set())
        expected |= {"WAIT_B", "SEND"} if s < 2 else set()
        expected |= {"WAIT_B", "SEND"} if s < 2 else set()
        assert kinds == expected
        assert runtime.version == 6  # 12 backwards, a step every 2
        assert dict(runtime.records.version_gaps) == static_drift(schedule.actions[s])  # the list's own gaps
        assert runtime.records.peak_inflight == 3 - s and not runtime.held and not runtime.inbox
    assert sorted(runtimes[-1].records.losses) == list(range(12))


def test_a_failed_receive_names_the_peer_the_action_and_the_step():
    runtimes = _pipeline(2)
    runtimes[1].step_label = "Lightning batch 7 (global step 7)"
    with pytest.raises(StageFailure, match=r"^stage 1: receiving from stage 0 failed at 1RECV_F0 \(Lightning batch 7 "
                                           r"\(global step 7\)\): stage 1: nothing to receive from stage 0"):
        runtimes[1].execute(Action.from_str("1RECV_F0"))


def test_an_optimizer_step_on_a_stage_without_optimizer_is_an_internal_error():
    runtime = StageRuntime(0, 1, LinearStage(0, True), LocalComm.network(1)[0], None, loss_scale=1.0)
    with pytest.raises(AssertionError, match="stage 0: OPT scheduled on a stage without an optimizer"):
        runtime.execute(Action.from_str("0OPT"))


def test_a_nonfinite_loss_fails_naming_the_stage_and_the_microbatch():
    runtimes = _pipeline(2, poison=1)
    _feed(runtimes, 2, 2)
    runtimes[1].step_label = "Lightning batch 1"
    with pytest.raises(StageFailure, match=r"stage 1: the loss of micro-batch 2 is nan at Lightning batch 1\. Pass "
                                           r"`PACIStrategy\(nonfinite='skip'\)`"):
        run_lists(runtimes, build_schedule("1f1b", 2, 2, 2, 2).actions)


def test_losses_kept_on_the_device_train_exactly_as_losses_read_at_once():
    # [Note: no host sync per micro-batch], run on the CPU: the device form changes no number, only when it is read
    runs = []
    for keep in (None, True):
        runtimes = _pipeline(3)
        for runtime in runtimes:
            runtime.device_losses = keep
        _feed(runtimes, 3, 4)
        run_lists(runtimes, build_schedule("paci", 3, 4, 4, 3).actions)
        runs.append(runtimes)
    for host, device in zip(*runs):
        for a, b in zip(host.program.module.parameters(), device.program.module.parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert sorted(device.records.losses) == sorted(host.records.losses) == list(range(12))
        for key, value in host.records.losses.items():  # stage 0 and 1: the loss travelled upstream as a tensor
            assert isinstance(value, float) and isinstance(device.records.losses[key], torch.Tensor)
            assert float(device.records.losses[key]) == value
    assert runs[1][-1].unchecked_losses == []  # checked at the last update


def test_a_nonfinite_loss_kept_on_the_device_fails_before_the_update_that_would_use_it():
    runtimes = _pipeline(2, poison=1)
    for runtime in runtimes:
        runtime.device_losses = True
    _feed(runtimes, 2, 2)
    runtimes[1].step_label = "Lightning batch 1"
    with pytest.raises(StageFailure, match=r"stage 1: the loss of micro-batch 2 is nan at Lightning batch 1\. Pass "
                                           r"`PACIStrategy\(nonfinite='skip'\)`"):
        run_lists(runtimes, build_schedule("1f1b", 2, 2, 2, 2).actions)
    assert runtimes[1].version == 1  # the first window's update only: none used the NaN loss


def test_a_skipped_microbatch_sends_zero_gradients_and_no_loss():
    runtimes = _pipeline(2, skip_nonfinite=True, poison=1)
    _feed(runtimes, 2, 2)
    grads: list[torch.Tensor] = []
    first = runtimes[0]
    original = first.records.add_backward

    def record(backward):  # stage 0's weight gradient after each backward (accumulated within the window)
        grad = first.program.module.weight.grad
        grads.append(None if grad is None else grad.clone())
        original(backward)

    first.records.add_backward = record
    run_lists(runtimes, build_schedule("1f1b", 2, 2, 2, 2).actions)
    assert sorted(runtimes[1].records.losses) == [0, 1]  # micro-batches 2 and 3 (batch 1) were dropped
    # batch 0 accumulated gradients; batch 1's window starts from cleared gradients and its backwards add nothing
    assert grads[0] is not None and torch.count_nonzero(grads[1]) > 0
    assert grads[2] is None and grads[3] is None
    assert all(torch.isfinite(p).all() for r in runtimes for p in r.program.module.parameters())


def test_each_forward_draws_from_its_own_stream_and_leaves_the_main_one_alone():
    from lightning_paci.engine.runtime.microbatch import microbatch_rng

    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    with microbatch_rng(3, 0, 5):
        stage0 = torch.rand(64)
    with microbatch_rng(3, 1, 5):
        stage1 = torch.rand(64)
    with microbatch_rng(3, 0, 5):
        again = torch.rand(64)
    with microbatch_rng(3, 0, 6):
        next_microbatch = torch.rand(64)
    assert torch.equal(stage0, again)  # the same stage and micro-batch: the same draws, whenever it runs
    assert not torch.equal(stage0, stage1) and not torch.equal(stage0, next_microbatch)
    assert torch.equal(torch.random.get_rng_state(), before)
