"""Discrete-event simulation of a schedule: predict bubble, drift and activation memory before launching N processes.

Semantics match the runtime: each stage executes its list in order; a ``SEND`` never blocks; a ``RECV`` waits until
the matching ``SEND`` happened plus ``comm_cost``; ``F``, ``B`` and ``OPT`` take their cost.

The per-stage figures (phases, drift, in-flight depth) are read off the simulated timeline by reports.py, with
the rules the measured timelines of real runs follow.

The command line lives here too (``format_table``, ``main``), next to the engine it prints, so that a new figure
in a report needs one edit; ``python -m lightning_paci.simulate`` (lightning_paci/simulate.py) only runs ``main``::

    python -m lightning_paci.simulate --schedule paci --stages 8 --microbatches 8 --accumulation 8 \\
        [--minibatches K] [--forward-cost F] [--backward-cost B] [--comm-cost C] [--json] [--timeline out.png]
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain as _chain

from lightning_paci.schedules import (
    COMPUTE_KINDS,
    OPT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SEND_T,
    Action,
    B,
    F,
    Interval,
    Schedule,
    build_schedule,
    format_grid,
    message_key,
    static_drift,
)
from lightning_paci.simulation.reports import StageReport, measured_phases, stage_report
from lightning_paci.simulation.timeline import save_timeline_png

__all__ = ["SimulationResult", "StageReport", "format_table", "main", "measured_phases", "simulate_schedule"]

# argparse prints it in --help, which the docs show
_CLI_DESCRIPTION = (
    "``python -m lightning_paci.simulate``: print a schedule's predicted per-stage drift, in-flight depth and bubble."
)


@dataclass
class SimulationResult:
    schedule: Schedule = field(repr=False)
    stages: list[StageReport]
    makespan: float
    throughput: float  # micro-batches per unit time
    _starts: list[list[float]] = field(repr=False)
    _costs: tuple[list[float], list[float], float] = field(repr=False)
    _link: list[list[tuple[float, float]]] = field(default_factory=list, repr=False)

    @property
    def link_intervals(self) -> list[Interval]:
        """Every data-parallel reduction on a device's replicas' link, as ``REDUCE`` intervals (one per bucket,
        or one per update when blocking): the link is its own resource, so these overlap the device's compute where
        the reduction is hidden and precede an ``OPT`` (or, deferred, a ``B``) where it is not. Empty without
        ``reduce_cost``; ``draw_timeline`` gives them a lane under their device's row."""
        return [Interval(s, "REDUCE", None, start, end) for s, jobs in enumerate(self._link) for start, end in jobs]

    @property
    def intervals(self) -> list[Interval]:
        """Every F / B / OPT as an interval (built on demand: millions for large runs)."""
        fwd, bwd, opt = self._costs
        out: list[Interval] = []
        for s, starts in enumerate(self._starts):  # s: the device (its list); costs are per stage (chunk)
            compute = (a for a in self.schedule.actions[s] if a.kind in COMPUTE_KINDS)
            for action, start in zip(compute, starts):
                cost = fwd[action.stage] if action.kind == F else bwd[action.stage] if action.kind == B else opt
                out.append(Interval(s, action.kind, action.microbatch, start, start + cost))
        return out

    @property
    def interval_chunks(self) -> list[int]:
        """For each of ``intervals``, its chunk's place among its device's chunks (0, 1, ..., v-1; all 0 with one
        stage per device), for ``draw_timeline(chunks=...)``."""
        devices = self.schedule.devices
        place = {stage: sum(1 for other in range(stage) if devices[other] == devices[stage])
                 for stage in range(self.schedule.num_stages)}
        return [place[action.stage] for s in range(len(self._starts))
                for action in self.schedule.actions[s] if action.kind in COMPUTE_KINDS]

    def to_json(self) -> dict[str, object]:
        keys = ("stage", "max_drift", "drift_bound", "bubble_fraction", "steady_bubble_fraction", "peak_inflight",
                "mean_drift", "busy", "idle", "startup_idle", "steady_idle", "drain_idle")
        return {
            "schedule": self.schedule.name,
            "num_stages": self.schedule.num_devices,
            "virtual_stages": self.schedule.virtual_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "accumulation": self.schedule.accumulation,
            "num_minibatches": self.schedule.num_minibatches,
            "stages": [{k: asdict(st)[k] for k in keys} for st in self.stages],
            "makespan": self.makespan,
            "throughput": self.throughput,
        }


def _per_stage(name: str, value: float | Sequence[float], num_stages: int, virtual_stages: int = 1) -> list[float]:
    """Cost per stage; one number is a device's whole share, so each of its ``virtual_stages`` chunks costs a
    ``1 / v`` part; a sequence gives every stage (chunk) its own."""
    if isinstance(value, (int, float)):
        values = [float(value) / virtual_stages] * num_stages
    else:
        values = [float(v) for v in value]
        if len(values) != num_stages:
            raise ValueError(f"`{name}` has {len(values)} per-stage costs but the schedule has {num_stages} stages; "
                             f"give one cost for all stages or exactly {num_stages}.")
    if any(v < 0 for v in values):
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
    return values


def simulate_schedule(
    schedule: Schedule,
    *,
    forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 2.0,
    comm_cost: float = 0.0,
    optimizer_cost: float = 0.0,
    reduce_cost: float = 0.0,
    reduce_buckets: int = 0,
    deferred: bool = False,
) -> SimulationResult:
    """Run the schedule's lists on a virtual clock. Costs may be per stage (unbalanced partitions). With virtual
    stages ([Note: virtual stages]) a single cost is one device's whole share, each chunk runs ``1 / v`` of it, and
    the reports are per device (drift: the largest of its chunks').

    ``reduce_cost``: the time a stage's whole gradient takes on its replicas' link, each ``OPT`` waits for its
    reduction. With ``reduce_buckets = 0`` the reduction starts at the ``OPT`` (the blocking average); with ``k``
    buckets ([Note: overlapped reduction]) the backward before the ``OPT`` releases bucket ``i`` after ``(i + 1) / k``
    of its cost, and the link carries the buckets one after the other, ``reduce_cost / k`` each. Under
    ``"layered"`` ([Note: layered backward]) that backward is the whole run of the window's last mini-batch's ``B``
    (a block's gradient is final once the layer-major pass has left it for every micro-batch), so bucket ``i``
    leaves after ``(i + 1) / k`` of the run. With ``deferred`` ([Note: deferred update]) the ``OPT`` does not wait:
    the stage's next ``B``, ``OPT`` or tied-weight message does, and the drift is counted with each update there.
    Each reduction's time on the link is kept (``SimulationResult.link_intervals``)."""
    n = schedule.num_devices
    num_stages, v = schedule.num_stages, schedule.virtual_stages
    fwd = _per_stage("forward_cost", forward_cost, num_stages, v)
    bwd = _per_stage("backward_cost", backward_cost, num_stages, v)
    if comm_cost < 0 or optimizer_cost < 0:
        raise ValueError(f"`comm_cost` and `optimizer_cost` must be >= 0, got {comm_cost} and {optimizer_cost}.")
    if reduce_cost < 0 or reduce_buckets < 0:
        raise ValueError(f"`reduce_cost` and `reduce_buckets` must be >= 0, got {reduce_cost} and {reduce_buckets}.")
    lists = schedule.actions
    last_backward = [0.0] * n  # when each stage's latest backward started (its reduction's buckets follow it)
    # "layered": the start of the stage's current run of consecutive B (its layer-major pass); -1 outside a run
    layered, run_start = schedule.name == "layered", [-1.0] * n
    link: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # each device's reductions (start, end)
    deferred_until = [-1.0] * n  # deferred: when the reduction of the update not yet made completes (-1: none pending)
    clock = [0.0] * n
    # Hot loop: one persistent iterator per stage (a blocked RECV is kept in `pending`), and only the start time
    # of each compute action is recorded; kinds and costs are re-read from the list afterwards.
    iterators = [iter(stage_actions) for stage_actions in lists]
    pending: list[Action | None] = [None] * n
    starts: list[list[float]] = [[] for _ in range(n)]
    # message key: (microbatch * stages + destination stage) * 2 + direction (0 = activation, 1 = gradient)
    arrival: dict[object, float] = {}
    waiting: dict[object, int] = {}
    ready = deque(range(n))
    # local names: LOAD_FAST instead of LOAD_GLOBAL in the loop below (about 20% faster)
    k_f, k_b, k_opt, k_send_f, k_send_b, k_recv_f, k_recv_b = F, B, OPT, SEND_F, SEND_B, RECV_F, RECV_B
    # a message or compute action always carries its micro-batch (only OPT's is None): the `type: ignore`s below
    # say so without a check per simulated action
    while ready:
        s = ready.popleft()
        now = clock[s]
        record = starts[s].append
        blocked = None
        head = pending[s]
        stream = iter(()) if head is None else iter((head,))
        for action in _chain(stream, iterators[s]):
            kind = action[1]
            if kind is k_f:
                record(now)
                now += fwd[action[0]]
                run_start[s] = -1.0
            elif kind is k_b:
                if deferred_until[s] >= 0:
                    now, deferred_until[s] = max(now, deferred_until[s]), -1.0
                record(now)
                last_backward[s] = now
                if run_start[s] < 0:
                    run_start[s] = now
                now += bwd[action[0]]
            elif kind is k_send_f:
                key = (action[2] * num_stages + action[0] + 1) * 2  # type: ignore[operator]
                arrival[key] = now + comm_cost
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif kind is k_send_b:
                key = (action[2] * num_stages + action[0] - 1) * 2 + 1  # type: ignore[operator]
                arrival[key] = now + comm_cost
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif kind is k_opt:
                if deferred_until[s] >= 0:
                    now, deferred_until[s] = max(now, deferred_until[s]), -1.0
                if reduce_cost:
                    # the backward whose end makes the gradient final: the closing B, or the layered pass
                    start, cost = (run_start[s], now - run_start[s]) if layered else (last_backward[s], bwd[action[0]])
                    done = _reduced(now, start, cost, reduce_cost / v, reduce_buckets, link[s])
                    if deferred:
                        deferred_until[s] = done
                    else:
                        now = done
                run_start[s] = -1.0
                record(now)
                now += optimizer_cost
            elif kind is k_recv_f or kind is k_recv_b:
                key = (action[2] * num_stages + action[0]) * 2 + (kind is k_recv_b)  # type: ignore[operator]
                t = arrival.get(key)
                if t is None:
                    waiting[key] = s
                    blocked = action
                    break
                if t > now:  # noqa: PLR1730 -- hot loop: a comparison is cheaper than a max() call
                    now = t
            else:  # tied-weight messages between the first and last stage: rare, keyed as in the validator
                if deferred_until[s] >= 0:
                    now, deferred_until[s] = max(now, deferred_until[s]), -1.0
                tkey = message_key(action, num_stages)
                if kind is SEND_T:
                    arrival[tkey] = now + comm_cost
                    if tkey in waiting:
                        ready.append(waiting.pop(tkey))
                else:
                    t = arrival.get(tkey)
                    if t is None:
                        waiting[tkey] = s
                        blocked = action
                        break
                    if t > now:  # noqa: PLR1730 -- as above
                        now = t
        pending[s] = blocked
        clock[s] = now
    stuck = [s for s in range(n) if pending[s] is not None]
    if stuck:  # cannot happen for built schedules; hand-written lists should go through validate_schedule() first
        step = lists[stuck[0]].index(pending[stuck[0]])
        grid = format_grid(lists, error_stage=stuck[0], error_step=step)
        raise ValueError("Schedule deadlocks in simulation:\n" + grid)

    makespan = max(clock) if n else 0.0
    reports = [stage_report(schedule, s, starts[s], fwd, bwd, optimizer_cost, makespan) for s in range(n)]
    if deferred:  # the updates are made later than their OPT: the gaps of the list read that way, per chunk
        for report in reports:
            report.drift = {}
            for stage in (s for s in range(num_stages) if schedule.devices[s] == report.stage):
                for mb, gap in static_drift(schedule.stage_actions(stage), deferred=True).items():
                    report.drift[mb] = max(gap, report.drift.get(mb, 0))
            report.max_drift = max(report.drift.values(), default=0)
            report.mean_drift = sum(report.drift.values()) / len(report.drift) if report.drift else 0.0
            report.drift_bound = report.max_drift
    return SimulationResult(schedule=schedule, stages=reports, makespan=makespan,
                            throughput=schedule.total_microbatches / makespan if makespan else 0.0,
                            _starts=starts, _costs=(fwd, bwd, optimizer_cost), _link=link)


def _reduced(now: float, backward_start: float, backward_cost: float, cost: float, buckets: int,
             jobs: list[tuple[float, float]]) -> float:
    """When an ``OPT`` reached at ``now`` may run: after its gradient's reduction (see ``simulate_schedule``);
    each job's (start, end) on the link is appended to ``jobs``."""
    if not buckets:
        jobs.append((now, now + cost))
        return now + cost
    done = backward_start
    for i in range(buckets):
        start = max(done, backward_start + backward_cost * (i + 1) / buckets)
        done = start + cost / buckets
        jobs.append((start, done))
    return max(now, done)


# --------------------------------------------------------------------------------------------------------------
# Command line: python -m lightning_paci.simulate
# --------------------------------------------------------------------------------------------------------------


def format_table(result: SimulationResult) -> str:
    """The per-stage report as the fixed-width table the command line prints (docs/tuning.md quotes it)."""
    sch = result.schedule
    head = (f"schedule={sch.name} stages={sch.num_devices} microbatches={sch.num_microbatches} "
            f"accumulation={sch.accumulation} minibatches={sch.num_minibatches}")
    if sch.virtual_stages > 1:  # one row per device; drift and its bound: the largest of the device's chunks
        head += f" virtual_stages={sch.virtual_stages} placement={_placement_name(sch)}"
    cols = f"{'stage':>5} {'max_drift':>9} {'bound':>5} {'mean_drift':>10} {'peak_inflight':>13} " \
           f"{'bubble':>7} {'steady_bubble':>13} {'startup_idle':>12} {'steady_idle':>11} {'drain_idle':>10}"
    rows = [head, cols]
    for st in result.stages:
        rows.append(f"{st.stage:>5} {st.max_drift:>9} {st.drift_bound:>5} {st.mean_drift:>10.3f} "
                    f"{st.peak_inflight:>13} {st.bubble_fraction:>7.3f} {st.steady_bubble_fraction:>13.3f} "
                    f"{st.startup_idle:>12.1f} {st.steady_idle:>11.1f} {st.drain_idle:>10.1f}")
    rows.append(f"makespan={result.makespan:.1f} throughput={result.throughput:.4f} micro-batches/unit")
    return "\n".join(rows)


def _placement_name(schedule: Schedule) -> str:
    return "loop" if schedule.devices[schedule.num_devices] == 0 else "v"


def _costs(text: str) -> float | list[float]:
    values = [float(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def main(argv: Sequence[str] | None = None) -> int:
    """Build, simulate and print one schedule; argument errors exit with argparse's usage message."""
    parser = argparse.ArgumentParser(prog="python -m lightning_paci.simulate", description=_CLI_DESCRIPTION)
    parser.add_argument("--schedule", default="paci",
                        help="paci, 1f1b, gpipe, layered, or over virtual stages interleaved and bfs (default paci)")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages N (devices, with virtual stages)")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks v per device (default 1)")
    parser.add_argument("--placement", default="loop", help="loop or v: where each chunk sits (default loop)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m per mini-batch")
    parser.add_argument("--accumulation", type=int, default=None,
                        help="local backwards a per optimizer step (default m)")
    parser.add_argument("--minibatches", type=int, default=4, help="mini-batches K in the run (default 4)")
    parser.add_argument("--forward-cost", type=_costs, default=1.0, help="F cost, or comma-separated per stage")
    parser.add_argument("--backward-cost", type=_costs, default=2.0, help="B cost, or comma-separated per stage")
    parser.add_argument("--comm-cost", type=float, default=0.0, help="cost of one message")
    parser.add_argument("--optimizer-cost", type=float, default=0.0, help="cost of one optimizer step")
    parser.add_argument("--reduce-cost", type=float, default=0.0,
                        help="data parallel: a stage's whole gradient on its replicas' link, waited for by each OPT")
    parser.add_argument("--reduce-buckets", type=int, default=0,
                        help="buckets released during the backward before each OPT (0: the reduction starts there)")
    parser.add_argument("--deferred", action="store_true",
                        help="each update made before the stage's next backward (PACIStrategy(deferred_update=True))")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--timeline", metavar="PNG", help="draw a Gantt chart of the run to this PNG file")
    args = parser.parse_args(argv)
    try:
        schedule = build_schedule(args.schedule, args.stages, args.microbatches,
                         args.accumulation if args.accumulation is not None else args.microbatches, args.minibatches,
                         virtual_stages=args.virtual_stages, placement=args.placement)
        result = simulate_schedule(schedule, forward_cost=args.forward_cost, backward_cost=args.backward_cost,
                          comm_cost=args.comm_cost, optimizer_cost=args.optimizer_cost,
                          reduce_cost=args.reduce_cost, reduce_buckets=args.reduce_buckets, deferred=args.deferred)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    if args.timeline:
        chunks = result.interval_chunks if schedule.virtual_stages > 1 else None
        links = result.link_intervals  # the replicas' link in a lane under each stage (with --reduce-cost)
        if chunks is not None:
            chunks = chunks + [0] * len(links)
        save_timeline_png(result.intervals + links, schedule.num_devices, args.timeline, time_unit="simulated time",
                          chunks=chunks,
                          title=f"{schedule.name}: N={schedule.num_devices}"
                                + (f" x {schedule.virtual_stages} chunks" if chunks else "")
                                + f", m={schedule.num_microbatches}, a={schedule.accumulation}, "
                                  f"{schedule.num_minibatches} mini-batches")
    return 0
