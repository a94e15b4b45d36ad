"""Per-stage figures read off a stage's timeline, simulated or measured: busy and idle time by phase (start-up,
steady state, drain), drift and in-flight depth.

Phases (per stage ``s``; ``K`` mini-batches of ``m`` micro-batches):

* start-up ends at the later of the stage's first backward (with virtual stages: the last of its chunks' first
  backwards) and its first forward of mini-batch 1,
* drain starts at the earlier of the end of its last forward and its first forward of mini-batch ``K - 1``,
* steady state is in between. For flush schedules it is ``K - 2`` whole mini-batch periods, so its idle fraction is
  exactly ``(N - 1) / (m + N - 1)`` with balanced costs. It needs ``K >= 3``; with fewer mini-batches the steady
  figures fall back to the whole run.

The simulator (simulator.py) and the measured timelines of real runs (``measured_phases``) share these rules, so a
prediction and a measurement are comparable figure by figure.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_paci.schedules import COMPUTE_KINDS, OPT, B, F, Interval, Schedule

__all__ = ["StageReport", "measured_phases", "stage_report"]


@dataclass
class StageReport:
    stage: int
    busy: float
    idle: float
    bubble_fraction: float
    startup_idle: float
    steady_idle: float
    drain_idle: float
    steady_bubble_fraction: float
    peak_inflight: int
    max_drift: int
    mean_drift: float
    drift_bound: int
    drift: dict[int, int] = field(repr=False)  # micro-batch -> version gap (optimizer steps between its F and B)


def _busy_within(starts: list[float], ends: list[float], lo: float, hi: float) -> float:
    """Busy time inside [lo, hi]; a stage's intervals are sequential, so bisect to the window."""
    total = 0.0
    for i in range(max(0, bisect.bisect_left(ends, lo)), bisect.bisect_right(starts, hi)):
        total += max(0.0, min(ends[i], hi) - max(starts[i], lo))
    return total


def _phases(starts: list[float], ends: list[float], t0: float, t_end: float, num_minibatches: int,
            first_backward: float | None, last_forward_end: float | None, first_forward_mb1: float | None,
            first_forward_last_mb: float | None) -> tuple[float, float, float, float]:
    """(start-up idle, steady idle, drain idle, steady idle fraction) of one stage over ``[t0, t_end]``; see the
    module docstring for the phase boundaries. Shared by the simulator and measured timelines."""
    busy = _busy_within(starts, ends, t0, t_end)
    idle = (t_end - t0) - busy
    lo = hi = t0
    if num_minibatches >= 3 and first_backward is not None and last_forward_end is not None and \
            first_forward_mb1 is not None and first_forward_last_mb is not None:
        lo = max(first_backward, first_forward_mb1)
        hi = min(last_forward_end, first_forward_last_mb)
    if hi <= lo:
        return 0.0, idle, 0.0, idle / (t_end - t0) if t_end > t0 else 0.0
    startup_idle = (lo - t0) - _busy_within(starts, ends, t0, lo)
    steady_idle = (hi - lo) - _busy_within(starts, ends, lo, hi)
    return startup_idle, steady_idle, idle - startup_idle - steady_idle, steady_idle / (hi - lo)


def measured_phases(intervals: Sequence[Interval], num_microbatches: int, num_minibatches: int,
                    t0: float, t_end: float) -> dict[str, float]:
    """Phase split of one stage's *measured* intervals (F / B / OPT; waits are idle), same rules as the simulator.
    Micro-batch ``j`` belongs to mini-batch ``j // num_microbatches``."""
    compute = sorted((iv for iv in intervals if iv.kind in COMPUTE_KINDS), key=lambda iv: iv.start)
    starts = [iv.start for iv in compute]
    ends = [iv.end for iv in compute]
    forwards = {iv.microbatch: iv for iv in compute if iv.kind == F}
    backwards = [iv for iv in compute if iv.kind == B]
    last_f = max(forwards.values(), key=lambda iv: iv.end, default=None)
    mb1 = forwards.get(num_microbatches)
    last_mb = forwards.get((num_minibatches - 1) * num_microbatches)
    startup, steady, drain, fraction = _phases(
        starts, ends, t0, t_end, num_minibatches, backwards[0].start if backwards else None,
        last_f.end if last_f else None, mb1.start if mb1 else None, last_mb.start if last_mb else None)
    busy = _busy_within(starts, ends, t0, t_end)
    return {"busy": busy, "idle": (t_end - t0) - busy, "startup_idle": startup, "steady_idle": steady,
            "drain_idle": drain, "steady_bubble_fraction": fraction}


def stage_report(schedule: Schedule, s: int, starts: list[float], f_cost: Sequence[float], b_cost: Sequence[float],
                 optimizer_cost: float, makespan: float) -> StageReport:
    """One pass over device ``s``'s compute actions (costs per stage): busy time, drift, in-flight depth and the
    phase boundaries. With virtual stages each chunk counts its own versions; a micro-batch's drift is the largest
    over the device's chunks, ``peak_inflight`` counts every chunk's micro-batches and ``drift_bound`` is the largest
    chunk's bound."""
    m, k_total = schedule.num_microbatches, schedule.num_minibatches
    steady_first, steady_last = m, (k_total - 1) * m  # first forwards of mini-batches 1 and K-1
    held = peak = 0
    versions: dict[int, int] = {}
    chunk_held: dict[int, int] = {}
    chunk_peak: dict[int, int] = {}
    stepped_while_held: set[int] = set()
    at_forward: dict[tuple[int, int], int] = {}
    drift: dict[int, int] = {}
    last_f_end = t_first = t_last = None
    first_backward: dict[int, float] = {}  # chunk -> its first backward here: the start-up lasts until the last one
    busy = 0.0
    ends: list[float] = []
    compute = (a for a in schedule.actions[s] if a[1] is F or a[1] is B or a[1] is OPT)
    for (stage, kind, mb), start in zip(compute, starts):
        if kind is F:
            cost = f_cost[stage]
            busy += cost
            ends.append(start + cost)
            at_forward[(stage, mb)] = versions.get(stage, 0)  # type: ignore[index]
            held += 1
            if held > peak:  # noqa: PLR1730 -- once per simulated action: no max() call
                peak = held
            count = chunk_held[stage] = chunk_held.get(stage, 0) + 1
            if count > chunk_peak.get(stage, 0):
                chunk_peak[stage] = count
            last_f_end = start + cost
            if mb == steady_first and t_first is None:
                t_first = start
            elif mb == steady_last and t_last is None:
                t_last = start
        elif kind is B:
            cost = b_cost[stage]
            busy += cost
            ends.append(start + cost)
            gap = versions.get(stage, 0) - at_forward.pop((stage, mb))  # type: ignore[arg-type]
            drift[mb] = max(gap, drift.get(mb, 0))  # type: ignore[index, arg-type]
            held -= 1
            chunk_held[stage] -= 1
            if stage not in first_backward:
                first_backward[stage] = start
        else:
            busy += optimizer_cost
            ends.append(start + optimizer_cost)
            versions[stage] = versions.get(stage, 0) + 1
            if chunk_held.get(stage, 0) > 0:
                stepped_while_held.add(stage)
    idle = makespan - busy
    first_b = max(first_backward.values()) if first_backward else None
    startup_idle, steady_idle, drain_idle, steady_fraction = _phases(
        starts, ends, 0.0, makespan, k_total, first_b, last_f_end, t_first, t_last)
    values = drift.values()
    # the IR-derived bound (see schedules.derived_drift_bound) of each chunk, computed in this same pass
    bound = max((math.ceil((chunk_peak[c] - 1) / schedule.accumulation) for c in stepped_while_held), default=0)
    return StageReport(
        stage=s, busy=busy, idle=idle, bubble_fraction=idle / makespan if makespan else 0.0,
        startup_idle=startup_idle, steady_idle=steady_idle, drain_idle=drain_idle,
        steady_bubble_fraction=steady_fraction, peak_inflight=peak,
        max_drift=max(values, default=0), mean_drift=sum(values) / len(values) if values else 0.0,
        drift_bound=bound, drift=drift,
    )
