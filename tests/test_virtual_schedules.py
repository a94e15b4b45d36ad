"""Schedules over virtual stages ([Note: virtual stages]): placement, validity under the NCCL model, the flush
bubble (P-1)/(v*m+P-1), per-chunk drift bounds and activation peaks, each read off the lists or the simulator."""

from __future__ import annotations

import itertools

import pytest

from lightning_paci.schedules import (
    OPT,
    RECV_T,
    SEND_T,
    B,
    F,
    activation_peaks,
    build_schedule,
    check_deadlock_free,
    chunk_drift_bounds,
    stage_devices,
    static_drift,
    validate_schedule,
)
from lightning_paci.simulation.simulator import simulate_schedule


def test_loop_and_v_placements():
    assert stage_devices(4, 2, "loop") == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_devices(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_devices(3, 3, "v") == (0, 1, 2, 2, 1, 0, 0, 1, 2)
    with pytest.raises(ValueError, match="`placement` must be one of 'loop', 'v', got 'ring'"):
        stage_devices(4, 2, "ring")


@pytest.mark.parametrize(("alias", "plain"), [("interleaved", "1f1b"), ("bfs", "gpipe")])
def test_with_one_chunk_per_device_the_virtual_schedules_are_1f1b_and_gpipe(alias, plain):
    for n, m in itertools.product((1, 2, 4), (1, 3, 8)):
        assert build_schedule(alias, n, m, m, 3, tied=n > 1).actions == build_schedule(plain, n, m, m, 3,
                                                                                       tied=n > 1).actions


def test_every_chunk_is_named_and_each_device_holds_its_own():
    schedule = build_schedule("interleaved", 4, 4, 4, 1, virtual_stages=2)
    assert schedule.num_stages == 8 and schedule.num_devices == 4 and schedule.virtual_stages == 2
    assert schedule.stage_text(0, compute_only=True) == (
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4B0 4B1 4B2 4B3 4OPT 0B0 0B1 0B2 0B3 0OPT")
    # Megatron's warm-up on the last device: (v - 1) * P forward units, then one forward and one backward
    assert schedule.stage_text(3, compute_only=True) == (
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 7OPT 3B0 3B1 3B2 3B3 3OPT")
    for stage in range(8):
        assert {a.stage for a in schedule.stage_actions(stage)} == {stage}


def test_every_virtual_schedule_is_valid_and_deadlock_free_under_nccl_rules():
    """Loops add the wrap-around link and two chunks per link pair; V placements send both ways between neighbours.
    Every list set, with one and two replicas, under the directed layout, communicators connected at setup and
    receives posted ahead per link."""
    checked = 0
    for name, placement, p, v, groups, a in itertools.product(("interleaved", "bfs", "paci"), ("loop", "v"),
                                                               (2, 3, 4), (2, 3), (1, 2), (1, 3)):
        m = groups * p
        schedule = build_schedule(name, p, m, a * m if name != "paci" else a, 3, virtual_stages=v,
                                  placement=placement, tied=placement == "v" and v % 2 == 0)
        validate_schedule(schedule)
        check_deadlock_free(schedule, replicas=1 + checked % 2, connect="warm")
        checked += 1
    assert checked == 3 * 2 * 3 * 2 * 2 * 2


@pytest.mark.parametrize("name", ["interleaved", "bfs"])
@pytest.mark.parametrize(("p", "v"), [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2)])
def test_the_simulated_flush_bubble_is_p_minus_1_over_v_m_plus_p_minus_1(name, p, v):
    m = 2 * p
    schedule = build_schedule(name, p, m, m, 4, virtual_stages=v)
    result = simulate_schedule(schedule, forward_cost=1.0, backward_cost=2.0)
    for report in result.stages:
        assert report.steady_bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)
        assert report.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


def test_paci_over_chunks_pays_a_fill_and_a_drain_v_times_shorter():
    p, m, k = 4, 4, 8
    ideal = k * m * 3.0
    for v in (1, 2, 4):
        result = simulate_schedule(build_schedule("paci", p, m, m, k, virtual_stages=v), backward_cost=2.0)
        assert result.makespan - ideal == pytest.approx((p - 1) * 3.0 / v)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_paci_over_chunks_has_no_steady_bubble(placement):
    # the steady window starts after the last of a device's chunks' first backwards (the grouped warm-up)
    for p in (4, 8):
        result = simulate_schedule(build_schedule("paci", p, p, p, 12, virtual_stages=2, placement=placement))
        assert [report.steady_bubble_fraction for report in result.stages] == [0.0] * p


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_each_chunks_drift_stays_within_its_bound_and_the_simulator_reads_the_same(placement):
    p, m = 4, 4
    for a in (1, 2, 4):
        schedule = build_schedule("paci", p, m, a, 6, virtual_stages=2, placement=placement)
        bounds = chunk_drift_bounds(schedule)
        result = simulate_schedule(schedule)
        for report in result.stages:
            chunks = [s for s in range(schedule.num_stages) if schedule.devices[s] == report.stage]
            assert report.max_drift == max(bounds[s] for s in chunks)
            assert report.drift_bound >= report.max_drift  # the peak-based bound, never below
        deferred = chunk_drift_bounds(schedule, deferred=True)  # each update made at the chunk's next backward
        for report in simulate_schedule(schedule, deferred=True, reduce_cost=1.0).stages:
            chunks = [s for s in range(schedule.num_stages) if schedule.devices[s] == report.stage]
            assert report.max_drift == max(deferred[s] for s in chunks)
    for name in ("interleaved", "bfs"):  # flush schedules at a = m: every update with nothing in flight
        assert set(chunk_drift_bounds(build_schedule(name, p, m, m, 3, virtual_stages=2))) == {0}


def test_the_drift_bound_of_chunk_0_under_paci_loops_at_8_devices():
    """The figure the docs quote: at P = a = m = 8, chunk 0 holds 2P micro-batches (its groups of P forwards run a
    loop ahead of their backwards), so its bound is 2 against 1 with one chunk per device."""
    one = chunk_drift_bounds(build_schedule("paci", 8, 8, 8, 6))
    two = chunk_drift_bounds(build_schedule("paci", 8, 8, 8, 6, virtual_stages=2))
    assert one[0] == 1 and two[0] == 2
    assert max(two) == 2
    assert max(static_drift(build_schedule("paci", 8, 8, 8, 6, virtual_stages=2).stage_actions(0)).values()) == 2


def test_activation_peaks_per_device():
    p = 8
    one = activation_peaks(build_schedule("paci", p, p, p, 6))
    two = activation_peaks(build_schedule("paci", p, p, p, 6, virtual_stages=2))
    assert one[0] == p
    assert two[0] == pytest.approx(p * (1 + (p - 1) / (p * 2)))  # Megatron's order: 1.44x at P = 8, v = 2
    # bfs holds every micro-batch of the mini-batch on every chunk: m device shares; interleaved at most m
    assert set(activation_peaks(build_schedule("bfs", 4, 8, 8, 2, virtual_stages=2))) == {8.0}
    assert max(activation_peaks(build_schedule("interleaved", 4, 8, 8, 2, virtual_stages=2))) <= 8.0


def test_each_chunk_steps_after_its_own_window():
    schedule = build_schedule("paci", 2, 2, 2, 2, virtual_stages=2)
    for stage in range(4):
        kinds = [a.kind for a in schedule.stage_actions(stage) if a.kind in (F, B, OPT)]
        assert kinds.count(OPT) == 2 and kinds.count(B) == 4


def test_tied_weights_under_the_v_placement_need_no_exchange():
    schedule = build_schedule("paci", 4, 4, 4, 3, virtual_stages=2, placement="v", tied=True)
    assert schedule.devices[0] == schedule.devices[-1] == 0
    assert not [a for actions in schedule.actions for a in actions if a.kind in (SEND_T, RECV_T)]
    with pytest.raises(ValueError, match="tied weights with `virtual_stages=2` need the first and the last chunk on "
                                         "one device: use placement='v'"):
        build_schedule("paci", 4, 4, 4, 3, virtual_stages=2, placement="loop", tied=True)


def test_refusals_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"`schedule='1f1b'` runs one stage per device, got `virtual_stages=2`: "
                                         r"use schedule='interleaved'"):
        build_schedule("1f1b", 4, 4, 4, 1, virtual_stages=2)
    with pytest.raises(ValueError, match=r"`microbatches` \(6\) must be a multiple of the devices \(4\). "
                                         r"Use microbatches=8"):
        build_schedule("interleaved", 4, 6, 6, 1, virtual_stages=2)
    build_schedule("bfs", 4, 6, 6, 1, virtual_stages=2)  # breadth-first takes any m
    with pytest.raises(ValueError, match="`virtual_stages` must be >= 1, got 0"):
        build_schedule("paci", 4, 4, 4, 1, virtual_stages=0)


def test_the_timeline_shows_devices_and_shades_their_later_chunks(tmp_path):
    from lightning_paci.simulation.timeline import draw_timeline

    result = simulate_schedule(build_schedule("interleaved", 4, 4, 4, 2, virtual_stages=2))
    chunks = result.interval_chunks
    intervals = result.intervals
    assert len(chunks) == len(intervals)
    # device 0 holds chunks 0 and 4: its first forwards are chunk 0's (place 0), then chunk 4's (place 1)
    first = [(iv.microbatch, place) for iv, place in zip(intervals, chunks) if iv.stage == 0 and iv.kind == "F"]
    assert first[:8] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    figure = draw_timeline(intervals, 4, chunks=chunks)
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == [f"device {d}" for d in range(4)]
