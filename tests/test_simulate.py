"""The discrete-event simulator and its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_paci.schedules import build_schedule, drift_bound, static_drift
from lightning_paci.simulate import main
from lightning_paci.simulation import simulate_schedule


@pytest.mark.parametrize("num_stages", [2, 4, 8, 16])
@pytest.mark.parametrize("accumulation", [1, 2, 4, 8, 16])
def test_simulated_paci_drift_is_tight_at_the_bound(num_stages, accumulation):
    num_minibatches = max(4, 2 + 4 * accumulation // num_stages)
    result = simulate_schedule(build_schedule("paci", num_stages, num_stages, accumulation, num_minibatches))
    for report in result.stages:
        assert report.max_drift == drift_bound(num_stages, report.stage, accumulation)
        assert report.drift_bound == report.max_drift


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_flush_schedules_show_zero_drift(name):
    result = simulate_schedule(build_schedule(name, 8, 8, 8, 4))
    assert all(report.max_drift == 0 and report.drift_bound == 0 for report in result.stages)


def test_simulated_drift_equals_the_static_drift_of_the_lists():
    schedule = build_schedule("paci", 4, 6, 3, 5)
    result = simulate_schedule(schedule, forward_cost=[1, 3, 1, 2], backward_cost=[2, 1, 4, 2], comm_cost=0.5)
    for report in result.stages:
        assert report.drift == static_drift(schedule.actions[report.stage])


@pytest.mark.parametrize("num_stages,num_microbatches,total", [(4, 4, 4), (8, 8, 4), (8, 4, 4), (4, 2, 5)])
def test_peak_inflight(num_stages, num_microbatches, total):
    paci = simulate_schedule(build_schedule("paci", num_stages, num_microbatches, num_microbatches, total))
    flush = simulate_schedule(build_schedule("1f1b", num_stages, num_microbatches, num_microbatches, total))
    gpipe = simulate_schedule(build_schedule("gpipe", num_stages, num_microbatches, num_microbatches, total))
    for s in range(num_stages):
        assert paci.stages[s].peak_inflight == min(num_stages - s, num_microbatches * total)
        assert flush.stages[s].peak_inflight == min(num_stages - s, num_microbatches)
        assert gpipe.stages[s].peak_inflight == num_microbatches


@pytest.mark.parametrize("num_stages,num_microbatches", [(8, 8), (4, 4), (4, 8), (8, 16)])
def test_steady_bubble_paci_zero_flush_schedules_analytic(num_stages, num_microbatches):
    expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
    paci = simulate_schedule(build_schedule("paci", num_stages, num_microbatches, num_microbatches, 6))
    assert all(report.steady_bubble_fraction == 0.0 for report in paci.stages)
    for name in ("1f1b", "gpipe"):
        result = simulate_schedule(build_schedule(name, num_stages, num_microbatches, num_microbatches, 6))
        for report in result.stages:
            assert report.steady_bubble_fraction == pytest.approx(expected)
            assert report.startup_idle + report.steady_idle + report.drain_idle == pytest.approx(report.idle)


def test_steady_bubble_n8_m8_is_0467():
    result = simulate_schedule(build_schedule("1f1b", 8, 8, 8, 4))
    assert [round(r.steady_bubble_fraction, 3) for r in result.stages] == [0.467] * 8


@pytest.mark.parametrize("num_stages,num_microbatches", [(8, 8), (4, 4), (4, 8), (2, 4), (8, 16)])
def test_makespan_ratio_matches_the_flush_overhead(num_stages, num_microbatches):
    flush = simulate_schedule(build_schedule("1f1b", num_stages, num_microbatches, num_microbatches, 32))
    paci = simulate_schedule(build_schedule("paci", num_stages, num_microbatches, num_microbatches, 32))
    ideal = (num_microbatches + num_stages - 1) / num_microbatches
    assert flush.makespan / paci.makespan == pytest.approx(ideal, rel=0.03)


def test_per_stage_costs_and_comm_cost_lengthen_the_run():
    base = simulate_schedule(build_schedule("paci", 4, 4, 4, 4))
    slow = simulate_schedule(build_schedule("paci", 4, 4, 4, 4), forward_cost=[1, 1, 3, 1], comm_cost=0.5)
    assert slow.makespan > base.makespan
    # the slowest stage sets the pace: it is never idle in steady state
    assert slow.stages[2].steady_bubble_fraction == 0.0


def test_wrong_number_of_per_stage_costs_is_rejected():
    with pytest.raises(ValueError, match="`forward_cost` has 3 per-stage costs but the schedule has 4 stages"):
        simulate_schedule(build_schedule("paci", 4, 4, 4, 2), forward_cost=[1, 1, 1])


def test_cli_json(capsys):
    assert main(["--schedule", "paci", "--stages", "8", "--microbatches", "8", "--accumulation", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["max_drift"] for s in data["stages"]] == [1] * 7 + [0]
    fields = {"stage", "max_drift", "drift_bound", "bubble_fraction", "steady_bubble_fraction", "peak_inflight"}
    assert fields <= set(data["stages"][0])
    assert data["makespan"] > 0 and data["throughput"] > 0


def test_cli_table_and_timeline(tmp_path):
    png = tmp_path / "t.png"
    out = subprocess.run(
        [sys.executable, "-m", "lightning_paci.simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "4",
         "--minibatches", "3", "--timeline", str(png)],
        capture_output=True, text=True, check=True,
    )
    assert "steady_bubble" in out.stdout and "RuntimeWarning" not in out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_input_with_the_argument_name():
    out = subprocess.run([sys.executable, "-m", "lightning_paci.simulate", "--stages", "0", "--microbatches", "4"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "`num_stages` must be >= 1, got 0" in out.stderr


@pytest.mark.parametrize("name", ["paci", "1f1b"])
def test_measured_phases_agree_with_the_simulator_on_its_own_intervals(name):
    from lightning_paci.simulation import measured_phases

    result = simulate_schedule(build_schedule(name, 4, 4, 4, 5), forward_cost=[1, 2, 1, 1], comm_cost=0.25)
    for report in result.stages:
        mine = [iv for iv in result.intervals if iv.stage == report.stage]
        phases = measured_phases(mine, 4, 5, 0.0, result.makespan)
        assert phases["steady_bubble_fraction"] == pytest.approx(report.steady_bubble_fraction)
        assert phases["startup_idle"] == pytest.approx(report.startup_idle)
        assert phases["drain_idle"] == pytest.approx(report.drain_idle)


def test_pure_modules_import_neither_torch_nor_lightning():
    # the simulator, its command line and the schedules must stay usable (and fast to start) without torch:
    # import them under a bare package object so lightning_paci/__init__.py (which loads the strategy) is skipped
    from pathlib import Path

    package_dir = Path(__file__).resolve().parents[1] / "lightning_paci"
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('lightning_paci')\n"
        f"pkg.__path__ = [{str(package_dir)!r}]\n"
        "sys.modules['lightning_paci'] = pkg\n"
        "import lightning_paci.schedules, lightning_paci.simulation, lightning_paci.simulate\n"
        "import lightning_paci.simulation.timeline, lightning_paci.engine.streams.cursor\n"
        "heavy = ('torch', 'lightning', 'pytorch_lightning', 'matplotlib', 'numpy')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_package_run_with_dash_m_that_imports_lightning_paci_gets_the_strategy_registered(tmp_path):
    # `python -m pkg.train`: runpy imports `pkg` (whose __init__ imports lightning_paci) while sys.argv[0] == "-m";
    # only lightning_paci's own tools skip importing the strategy
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import lightning_paci  # noqa: F401\n")
    (tmp_path / "pkg" / "train.py").write_text(
        "from lightning.pytorch.strategies import StrategyRegistry\nprint('paci' in StrategyRegistry)\n")
    out = subprocess.run([sys.executable, "-m", "pkg.train"], capture_output=True, text=True, cwd=tmp_path,
                         check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("buckets,wait", [(0, 3.0), (1, 3.0), (2, 2.0), (4, 1.5)])
def test_the_reduction_on_the_link_delays_each_step_by_what_the_backward_did_not_hide(buckets, wait):
    # a = m = 4, F = 1, B = 2, the whole gradient 3 on the link: blocking (0 buckets) or one bucket at the end of
    # the backward waits 3 per update; with k buckets bucket i leaves at (i + 1) / k of the backward and takes 3 / k,
    # so the step waits 3 / k + 3 (k - 1) / k - 2 (k - 1) / k = 2 (k = 2), 1.5 (k = 4): the steady period per
    # mini-batch is m (F + B) + wait on every stage
    m, k = 4, 6
    result = simulate_schedule(build_schedule("paci", 2, m, m, k), forward_cost=1.0, backward_cost=2.0,
                               reduce_cost=3.0, reduce_buckets=buckets)
    starts = {iv.microbatch: iv.start for iv in result.intervals if iv.stage == 0 and iv.kind == "F"}
    assert starts[(k - 1) * m] - starts[m] == pytest.approx((k - 2) * (m * 3.0 + wait))


def test_a_deferred_update_hides_a_reduction_as_long_as_the_forward_before_the_next_backward():
    # a = m = 4, F = 1, B = 2, the reduction 1: blocking adds it to every update; deferred, the forward that follows
    # each OPT covers it; the drift is then the list's with each update made before the next backward
    m, k = 4, 6
    schedule = build_schedule("paci", 2, m, m, k)
    periods = {}
    for deferred in (False, True):
        result = simulate_schedule(schedule, forward_cost=1.0, backward_cost=2.0, reduce_cost=1.0,
                                   deferred=deferred)
        starts = {iv.microbatch: iv.start for iv in result.intervals if iv.stage == 0 and iv.kind == "F"}
        periods[deferred] = (starts[(k - 1) * m] - starts[m]) / (k - 2)
        if deferred:
            for report in result.stages:
                assert report.drift == static_drift(schedule.actions[report.stage], deferred=True)
            assert [r.max_drift for r in result.stages] == [1, 1]  # the last stage: 0 -> 1
    assert periods == {False: pytest.approx(m * 3.0 + 1.0), True: pytest.approx(m * 3.0)}


@pytest.mark.parametrize("buckets", [0, 1, 2, 4])
def test_the_link_is_a_lane_of_reductions_each_step_waits_for(buckets):
    # the paci case above: every update's reduction is on the stage's link as one job (blocking) or k jobs of 3 / k,
    # one after the other, bucket i not before (i + 1) / k of the closing backward; the OPT follows the last job
    m, k = 4, 6
    result = simulate_schedule(build_schedule("paci", 2, m, m, k), forward_cost=1.0, backward_cost=2.0,
                               reduce_cost=3.0, reduce_buckets=buckets)
    jobs_per_update = max(buckets, 1)
    for stage in range(2):
        links = [iv for iv in result.link_intervals if iv.stage == stage]
        work = [iv for iv in result.intervals if iv.stage == stage]
        updates = [index for index, iv in enumerate(work) if iv.kind == "OPT"]
        assert len(updates) == k  # one update per mini-batch (a = m)
        assert {iv.kind for iv in links} == {"REDUCE"} and len(links) == jobs_per_update * k
        assert all(iv.end - iv.start == pytest.approx(3.0 / jobs_per_update) for iv in links)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(links, links[1:]))  # one link: one job at a time
        for number, index in enumerate(updates):
            closing = work[index - 1]  # the backward that closes the window
            assert closing.kind == "B"
            jobs = links[number * jobs_per_update:(number + 1) * jobs_per_update]
            for i, job in enumerate(jobs):
                released = closing.end if buckets == 0 else closing.start + 2.0 * (i + 1) / buckets
                assert job.start >= released - 1e-9
            assert work[index].start == pytest.approx(max(closing.end, jobs[-1].end))


@pytest.mark.parametrize("buckets,wait", [(0, 3.0), (1, 3.0), (2, 1.5), (4, 0.75)])
def test_under_layered_a_bucket_leaves_as_the_layer_major_pass_finishes_its_blocks(buckets, wait):
    # "layered", m = a = 4, B = 2: a stage's backward is one pass of 8 over the mini-batch; bucket i leaves after
    # (i + 1) / k of the pass and takes 3 / k (shorter than the 8 / k between two buckets), so only the last
    # bucket is exposed: 3 / k (k >= 1), and the whole 3 when blocking; the closing backward alone (gpipe: 2)
    # would hide less
    result = simulate_schedule(build_schedule("layered", 2, 4, 4, 3), forward_cost=1.0, backward_cost=2.0,
                               reduce_cost=3.0, reduce_buckets=buckets)
    for stage in range(2):
        work = [iv for iv in result.intervals if iv.stage == stage]
        waits = [iv.start - work[index - 1].end for index, iv in enumerate(work) if iv.kind == "OPT"]
        assert waits == pytest.approx([wait] * 3)
    gpipe = simulate_schedule(build_schedule("gpipe", 2, 4, 4, 3), forward_cost=1.0, backward_cost=2.0,
                              reduce_cost=3.0, reduce_buckets=buckets)
    gpipe_work = [iv for iv in gpipe.intervals if iv.stage == 0]
    gpipe_waits = [iv.start - gpipe_work[i - 1].end for i, iv in enumerate(gpipe_work) if iv.kind == "OPT"]
    assert min(gpipe_waits) >= wait - 1e-9 and (buckets < 2 or min(gpipe_waits) > wait)


def test_the_command_line_draws_the_link_under_each_stage(tmp_path):
    path = tmp_path / "link.png"
    assert main(["--stages", "2", "--microbatches", "4", "--minibatches", "3", "--reduce-cost", "3",
                 "--reduce-buckets", "2", "--timeline", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
