"""Steady-state bubble and throughput of "paci" vs "1f1b" through the real Trainer on an emulated N-device cluster.

    python benchmarks/emulated_bubble.py [--stages 4 8] [--microbatches 8] [--minibatches 10] [--json out.json]

Each block's forward / backward sleeps (default 30 / 60 ms, 2 blocks per stage: F=60 ms, B=120 ms per stage), so the
predicted steady-state idle fraction is 0 for paci and (N-1)/(m+N-1) for 1f1b. Measured phases use the same rules as
the simulator (lightning_paci.simulate.measured_phases) on the runtime's recorded intervals.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings

from lightning_paci.schedules import build
from lightning_paci.simulation import measured_phases, simulate

from emulated import run_emulated, run_seconds


def measure(num_stages: int, schedule: str, m: int, k: int, forward_ms: float, backward_ms: float) -> dict:
    stages = run_emulated(num_stages=num_stages, schedule=schedule, num_microbatches=m, num_minibatches=k,
                          forward_ms=forward_ms, backward_ms=backward_ms)
    t0 = min(iv.start for ivs in stages for iv in ivs)
    t1 = t0 + run_seconds(stages)
    phases = [measured_phases(ivs, m, k, t0, t1) for ivs in stages]
    predicted = simulate(build(schedule, num_stages, m, m, k), forward_cost=2 * forward_ms,
                         backward_cost=2 * backward_ms)
    return {
        "stages": num_stages, "schedule": schedule, "microbatches": m, "minibatches": k,
        "steady_bubble": [p["steady_bubble_fraction"] for p in phases],
        "predicted_steady_bubble": [r.steady_bubble_fraction for r in predicted.stages],
        "seconds": t1 - t0, "throughput": m * k / (t1 - t0),
        "predicted_seconds": predicted.makespan / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=10)
    parser.add_argument("--forward-ms", type=float, default=30.0)
    parser.add_argument("--backward-ms", type=float, default=60.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = []
    for n in args.stages:
        for schedule in ("paci", "1f1b"):
            rows.append(measure(n, schedule, args.microbatches, args.minibatches, args.forward_ms, args.backward_ms))
    print(f"\n{'N':>3} {'schedule':>8} {'steady idle max':>15} {'mean':>6} {'predicted':>9} {'(N-1)/(m+N-1)':>13} "
          f"{'seconds':>8} {'mb/s':>6} {'paci/1f1b':>9} {'predicted':>9}")
    by = {(r["stages"], r["schedule"]): r for r in rows}
    for r in rows:
        n, m = r["stages"], r["microbatches"]
        ratio = by[(n, "paci")]["throughput"] / by[(n, "1f1b")]["throughput"]
        predicted = by[(n, "1f1b")]["predicted_seconds"] / by[(n, "paci")]["predicted_seconds"]
        paci_row = r["schedule"] == "paci"
        print(f"{n:>3} {r['schedule']:>8} {max(r['steady_bubble']):>15.3f} {sum(r['steady_bubble']) / n:>6.3f} "
              f"{max(r['predicted_steady_bubble']):>9.3f} {(n - 1) / (m + n - 1):>13.3f} {r['seconds']:>8.2f} "
              f"{r['throughput']:>6.1f} {ratio if paci_row else float('nan'):>9.2f} "
              f"{predicted if paci_row else float('nan'):>9.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
