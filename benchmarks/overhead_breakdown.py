"""Where a stage's time per micro-batch goes, through the Trainer on the emulated cluster (issue 16's measure).

Each stage is one block whose forward and backward are padded to ``--forward-ms`` / ``--backward-ms`` (the
emulated device time, emulated.py). From every stage's recorded intervals in the steady window (mini-batches 1 ..
K-1 of stage 0's clock: no fill, no final drain) the stage's wall time per micro-batch splits into:

* device: the emulated forward + backward time (what a bubble-free, overhead-free stage would spend);
* framework: the rest of the F and B actions (our forward/backward code, hooks, the look-ahead) and OPT;
* send: ``SEND_*`` actions (framing, ``isend``);
* receive: ``RECV_*`` actions (a message's latency plus any real waiting for a neighbour);
* between actions: time outside the runtime (Lightning's loop, the driver, log replay, the host's wake-ups).

    cd benchmarks && python overhead_breakdown.py --stages 4 8 --json results/overhead_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path

from lightning_paci.timeline import Interval

from emulated import run_emulated


def breakdown(stages: list[list[Interval]], m: int, k: int, fwd: float, bwd: float) -> list[dict[str, float]]:
    """Per stage, milliseconds per micro-batch in the steady window."""
    starts = {iv.microbatch: iv.start for iv in stages[0] if iv.kind == "F"}
    lo, hi = starts[m], starts[(k - 1) * m]
    count = (k - 2) * m
    rows = []
    for ivs in stages:
        inside = [iv for iv in ivs if lo <= iv.start < hi]
        total = {"F": 0.0, "B": 0.0, "OPT": 0.0, "SEND": 0.0, "WAIT": 0.0}
        for iv in inside:
            key = "WAIT" if iv.kind.startswith("WAIT") else iv.kind
            total[key] = total.get(key, 0.0) + (iv.end - iv.start)
        covered = sum(total.values())
        device = count * (fwd + bwd) / 1e3
        rows.append({
            "device": device / count * 1e3,
            "framework": (total["F"] + total["B"] + total["OPT"] - device) / count * 1e3,
            "send": total["SEND"] / count * 1e3,
            "receive": total["WAIT"] / count * 1e3,
            "between": (hi - lo - covered) / count * 1e3,
            "wall": (hi - lo) / count * 1e3,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=10)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    m, k, fwd, bwd = args.microbatches, args.minibatches, args.forward_ms, args.backward_ms
    results = []
    for n in args.stages:
        stages = run_emulated(num_stages=n, schedule="paci", num_microbatches=m, num_minibatches=k,
                              blocks_per_stage=1, forward_ms=fwd, backward_ms=bwd)
        rows = breakdown(stages, m, k, fwd, bwd)
        results.append({"stages": n, "rows": rows})
        print(f"\nN = {n}, paci, m = {m}, {k} batches, one block per stage, F/B {fwd:g}/{bwd:g} ms; ms per micro-batch "
              f"and stage in the steady window")
        print(f"{'stage':>5} {'device':>7} {'framework':>9} {'send':>6} {'receive':>7} {'between':>7} {'wall':>7} "
              f"{'efficiency':>10}")
        for s, r in enumerate(rows):
            print(f"{s:>5} {r['device']:>7.2f} {r['framework']:>9.2f} {r['send']:>6.2f} {r['receive']:>7.2f} "
                  f"{r['between']:>7.2f} {r['wall']:>7.2f} {r['device'] / r['wall']:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
