"""``python -m lightning_paci.simulate``: print a schedule's predicted per-stage drift, in-flight depth and bubble.

    python -m lightning_paci.simulate --schedule paci --stages 8 --microbatches 8 --accumulation 8 \\
        [--minibatches K] [--forward-cost F] [--backward-cost B] [--comm-cost C] [--json] [--timeline out.png]

The engine is :mod:`lightning_paci.simulation`; this module is only the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_paci.schedules import build
from lightning_paci.simulation import SimulationResult, simulate
from lightning_paci.timeline import save_timeline_png

__all__ = ["format_table", "main"]


def format_table(result: SimulationResult) -> str:
    sch = result.schedule
    head = (f"schedule={sch.name} stages={sch.num_stages} microbatches={sch.num_microbatches} "
            f"accumulation={sch.accumulation} minibatches={sch.num_minibatches}")
    cols = f"{'stage':>5} {'max_drift':>9} {'bound':>5} {'mean_drift':>10} {'peak_inflight':>13} " \
           f"{'bubble':>7} {'steady_bubble':>13} {'startup_idle':>12} {'steady_idle':>11} {'drain_idle':>10}"
    rows = [head, cols]
    for st in result.stages:
        rows.append(f"{st.stage:>5} {st.max_drift:>9} {st.drift_bound:>5} {st.mean_drift:>10.3f} {st.peak_inflight:>13} "
                    f"{st.bubble_fraction:>7.3f} {st.steady_bubble_fraction:>13.3f} {st.startup_idle:>12.1f} "
                    f"{st.steady_idle:>11.1f} {st.drain_idle:>10.1f}")
    rows.append(f"makespan={result.makespan:.1f} throughput={result.throughput:.4f} micro-batches/unit")
    return "\n".join(rows)


def _costs(text: str) -> float | list[float]:
    values = [float(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_paci.simulate", description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", default="paci", help="paci, 1f1b or gpipe (default paci)")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages N")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m per mini-batch")
    parser.add_argument("--accumulation", type=int, default=None, help="local backwards a per optimizer step (default m)")
    parser.add_argument("--minibatches", type=int, default=4, help="mini-batches K in the run (default 4)")
    parser.add_argument("--forward-cost", type=_costs, default=1.0, help="F cost, or comma-separated per stage")
    parser.add_argument("--backward-cost", type=_costs, default=2.0, help="B cost, or comma-separated per stage")
    parser.add_argument("--comm-cost", type=float, default=0.0, help="cost of one message")
    parser.add_argument("--optimizer-cost", type=float, default=0.0, help="cost of one optimizer step")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--timeline", metavar="PNG", help="draw a Gantt chart of the run to this PNG file")
    args = parser.parse_args(argv)
    try:
        schedule = build(args.schedule, args.stages, args.microbatches,
                         args.accumulation if args.accumulation is not None else args.microbatches, args.minibatches)
        result = simulate(schedule, forward_cost=args.forward_cost, backward_cost=args.backward_cost,
                          comm_cost=args.comm_cost, optimizer_cost=args.optimizer_cost)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    if args.timeline:
        save_timeline_png(result.intervals, schedule.num_stages, args.timeline, time_unit="simulated time",
                          title=f"{schedule.name}: N={schedule.num_stages}, m={schedule.num_microbatches}, "
                                f"a={schedule.accumulation}, {schedule.num_minibatches} mini-batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
