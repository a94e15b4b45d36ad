"""How long building and simulating a large schedule takes (issue: N=64, m=64, 100 mini-batches in under 2 s).

    python benchmarks/simulator_speed.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from lightning_paci.schedules import build
from lightning_paci.simulation import simulate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    rows = []
    for name in ("paci", "1f1b", "gpipe"):
        t0 = time.perf_counter()
        schedule = build(name, 64, 64, 64, 100)
        t1 = time.perf_counter()
        simulate(schedule)
        t2 = time.perf_counter()
        actions = sum(len(a) for a in schedule.actions)
        rows.append({"schedule": name, "actions": actions, "build_s": t1 - t0, "simulate_s": t2 - t1})
    print(f"{'schedule':>8} {'actions':>9} {'build_s':>8} {'simulate_s':>10}   (N=64, m=64, a=64, 100 mini-batches)")
    for row in rows:
        print(f"{row['schedule']:>8} {row['actions']:>9} {row['build_s']:>8.2f} {row['simulate_s']:>10.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
