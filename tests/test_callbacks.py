"""DriftMonitor and BubbleMonitor: TensorBoard files read back, figures checked against the simulator and against
brute-force weight copies made in the test."""

from __future__ import annotations

import copy
import math
from collections import deque
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_paci import (
    BubbleMonitor,
    DriftMonitor,
    MemoryMonitor,
    ReferencePipeline,
    build_schedule,
    plan_partition,
    simulate_schedule,
)
from lightning_paci.callbacks.bubble_monitor import bubble_window_metrics
from lightning_paci.callbacks.drift_monitor import drift_window_metrics
from lightning_paci.schedules import drift_bound

from helpers import fit
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


def _scalars(directory: Path, stage: int) -> dict[str, list[float]]:
    events = EventAccumulator(str(directory / f"stage_{stage}"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _run(tmp_path, schedule, accumulation, steps=6, callbacks=None, **kwargs):
    torch.manual_seed(20)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    model = SequentialMLP(depth=4, lr=0.1)
    fit(model, regression_loader(num_batches=steps + 1), devices=4, max_steps=steps, schedule=schedule,
        microbatches=4, accumulation=accumulation, partition="parameters",
        callbacks=callbacks if callbacks is not None else [DriftMonitor(), BubbleMonitor()],
        trainer_kwargs={"logger": logger, "log_every_n_steps": 1, **kwargs})
    return model, tmp_path / "tb" / "version_0"


@pytest.mark.parametrize("schedule,accumulation", [("paci", 1), ("paci", 2), ("paci", 4), ("1f1b", 4)])
def test_every_stage_writes_its_tags_and_drift_equals_the_simulator(tmp_path, schedule, accumulation):
    _, directory = _run(tmp_path, schedule, accumulation)
    predicted = simulate_schedule(build_schedule(schedule, 4, 4, accumulation, 6))
    for s in range(4):
        scalars = _scalars(directory, s)
        for figure in ("drift_max", "drift_mean", "drift_bound", "weight_drift_max", "weight_drift_mean",
                       "bubble_fraction", "steady_bubble_fraction", "compute_fraction", "comm_fraction",
                       "optimizer_fraction"):
            assert f"paci/{figure}/stage_{s}" in scalars, (s, figure, sorted(scalars))
        measured = max(scalars[f"paci/drift_max/stage_{s}"])
        assert measured == predicted.stages[s].max_drift
        if schedule == "paci":
            assert measured == drift_bound(4, s, accumulation)
            assert scalars[f"paci/drift_bound/stage_{s}"][-1] == drift_bound(4, s, accumulation)
        else:
            assert measured == 0 and max(scalars[f"paci/weight_drift_max/stage_{s}"]) == 0.0
    if schedule == "paci":  # the first three stages see updates between forward and backward
        assert all(max(_scalars(directory, s)[f"paci/weight_drift_max/stage_{s}"]) > 0 for s in range(3))


def test_monitors_do_not_change_the_training_result(tmp_path):
    watched, _ = _run(tmp_path / "a", "paci", 2)
    torch.manual_seed(20)
    plain = SequentialMLP(depth=4, lr=0.1)
    fit(plain, regression_loader(num_batches=7), devices=4, max_steps=6, schedule="paci", microbatches=4,
        accumulation=2, partition="parameters")
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(watched.state_dict()[key], value, rtol=0, atol=0)


def test_memory_monitor_shows_paci_holds_what_1f1b_holds(tmp_path):
    peaks = {}
    for schedule in ("paci", "1f1b"):
        _, directory = _run(tmp_path / schedule, schedule, 4, callbacks=[MemoryMonitor()])
        peaks[schedule] = [(_scalars(directory, s)[f"paci/peak_inflight/stage_{s}"][-1],
                            _scalars(directory, s)[f"paci/peak_activation_bytes/stage_{s}"][-1]) for s in range(4)]
    assert peaks["paci"] == peaks["1f1b"]
    assert [inflight for inflight, _ in peaks["paci"]] == [4, 3, 2, 1]
    assert all(nbytes > 0 for _, nbytes in peaks["paci"])


@pytest.mark.parametrize("accumulation", [3, 1])
def test_weight_drift_matches_brute_force_copies(accumulation):
    # the reference executor, with the test stashing a full copy of each stage's weights at every forward;
    # a = 3 = N - 1: at most one update per window, the monitor is exact; a = 1: it is an upper bound. (The drift
    # is the distance between the versions at F and at B; a weight prediction would move the forward's weights.)
    torch.manual_seed(21)
    model = SequentialMLP(depth=4, lr=0.5)
    plan = plan_partition(model, 4, partition="parameters")
    reference = ReferencePipeline(model, plan, compensation="none",
                                  optimizer_factory=lambda m: (torch.optim.AdamW(m.parameters(), lr=0.05), []))
    brute: dict[tuple[int, int], float] = {}
    for runtime, module in zip(reference.runtimes, reference.modules):
        runtime.records.measure(weight_drift=True)
        stash: deque[list[torch.Tensor]] = deque()  # weights at each forward; backwards run in forward order (1F1B)
        program, records = runtime.program, runtime.records

        def forward(*args, forward=program.forward, stash=stash, module=module, **kwargs):
            stash.append([p.detach().clone() for p in module.parameters()])
            return forward(*args, **kwargs)

        def add_backward(record, add=records.add_backward, stash=stash, module=module, stage=runtime.stage):
            # recorded at the end of B, which does not change the weights (the OPTs before it did)
            now = [p.detach() for p in module.parameters()]
            diff = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(now, stash.popleft())))
            brute[(stage, record.microbatch)] = diff / math.sqrt(sum(float(a.pow(2).sum()) for a in now))
            add(record)

        program.forward, records.add_backward = forward, add_backward
    batches = list(regression_loader(num_batches=6))
    reference.run(build_schedule("paci", 4, 4, accumulation, 6), batches)
    checked = 0
    for runtime in reference.runtimes:
        for mb, gap, drift, exact in runtime.records.backwards:
            expected = brute[(runtime.stage, mb)]
            if gap == 0:
                assert drift == 0.0 and expected == 0.0
            elif exact:
                assert drift == pytest.approx(expected, rel=1e-5)
                checked += 1
            else:
                assert gap > 1 and drift >= expected * (1 - 1e-6)
    if accumulation == 3:  # a = N - 1: every window holds at most one update, so every value is exact
        assert checked == sum(1 for r in reference.runtimes for b in r.records.backwards if b.version_gap > 0)
        assert checked > 0
    else:  # a = 1: windows with several updates are bounded from above, and there are some
        assert any(not b.exact for r in reference.runtimes for b in r.records.backwards)


def test_without_tensorboard_logger_monitors_write_to_the_default_directory(tmp_path):
    # (the warning that says so is raised in the forked rank 0, where pytest cannot catch it)
    torch.manual_seed(22)
    fit(SequentialMLP(), regression_loader(), devices=2, max_steps=3, callbacks=[DriftMonitor(), BubbleMonitor()],
        trainer_kwargs={"default_root_dir": str(tmp_path), "log_every_n_steps": 1})
    for s in range(2):
        assert f"paci/drift_max/stage_{s}" in _scalars(tmp_path / "paci_monitors", s)


def test_window_figures_are_pure_functions():
    records = [(0, 1, 0.02, True), (1, 0, 0.0, True), (2, 2, 0.05, False)]
    assert drift_window_metrics(records, 2) == {
        "drift_max": 2.0, "drift_mean": 1.0, "drift_bound": 2.0, "weight_drift_max": 0.05,
        "weight_drift_mean": pytest.approx(0.07 / 3), "weight_drift_exact": 0.0,
    }
    zero = {p: {"wall": 0.0, "compute": 0.0, "wait": 0.0, "comm": 0.0, "optimizer": 0.0}
            for p in ("startup", "steady", "drain", "outside")}
    later = copy.deepcopy(zero)
    later["steady"].update(wall=10.0, compute=8.0, wait=1.0, comm=0.5, optimizer=0.25)
    later["startup"].update(wall=2.0, wait=1.5, compute=0.5)
    later["outside"].update(wall=100.0)  # validation time is not pipeline time
    figures = bubble_window_metrics(zero, later)
    assert figures["bubble_fraction"] == pytest.approx(2.5 / 12) and figures["steady_bubble_fraction"] == 0.1
    assert figures["startup_idle_seconds"] == 1.5 and figures["drain_idle_seconds"] == 0.0


def test_monitor_arguments_are_checked():
    with pytest.raises(ValueError, match="`logging_interval` must be >= 1"):
        DriftMonitor(logging_interval=0)
    with pytest.raises(ValueError, match="`logging_interval` must be >= 1"):
        BubbleMonitor(logging_interval=0)


def test_timeline_monitor_writes_a_gantt_image_and_a_chrome_trace(tmp_path):
    import json

    from lightning_paci import TimelineMonitor

    _, directory = _run(tmp_path, "paci", 4, callbacks=[TimelineMonitor(every_n_steps=3, last_microbatches=8)])
    trace = json.loads((directory / "timeline" / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {0, 1, 2, 3}  # every stage's row
    assert {"F", "B", "OPT"} <= {e["cat"] for e in events}
    assert all(e["dur"] >= 0 for e in events)
    assert (directory / "timeline" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    # drawn by global rank 0, which runs the last stage, under that stage's directory
    accumulator = EventAccumulator(str(directory / "stage_3"), size_guidance={"images": 10})
    accumulator.Reload()
    assert "paci/timeline" in accumulator.Tags()["images"]


def test_drift_monitor_shows_the_tied_replica_lag_and_its_bound_on_the_last_stage(tmp_path):
    from lightning_paci.schedules import static_tied_lags

    from models import HFCausalLM, token_loader

    torch.manual_seed(23)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(HFCausalLM("gpt2", layers=4, tied=True), token_loader(num_batches=7, batch_size=4, vocab=64, seq=12),
        devices=4, max_steps=6, schedule="paci", microbatches=2, accumulation=1, partition="parameters",
        callbacks=[DriftMonitor(weight_drift=False)], trainer_kwargs={"logger": logger, "log_every_n_steps": 2})
    last = _scalars(tmp_path / "tb" / "version_0", 3)
    bound = max(static_tied_lags(build_schedule("paci", 4, 2, 1, 6, tied=True).actions[3]).values())
    assert bound == 4 and set(last["paci/tied_lag_bound/stage_3"]) == {4.0}
    assert max(last["paci/tied_lag_max/stage_3"]) == 4.0  # reached in the steady state
    assert "paci/tied_lag_bound/stage_0" not in _scalars(tmp_path / "tb" / "version_0", 0)
