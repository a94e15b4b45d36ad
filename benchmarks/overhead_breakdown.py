"""Where a stage's time per micro-batch goes, through the Trainer on the emulated cluster.

Each stage is one block whose forward and backward take ``--forward-ms`` / ``--backward-ms`` of emulated device time
(emulated.py: the block's real work runs inside it). From every stage's recorded intervals in the steady window
(mini-batches 1 .. K-1 of stage 0's clock: no fill, no final drain) the stage's wall time per micro-batch splits into:

* device: the emulated forward + backward time (what a bubble-free, overhead-free stage would spend);
* framework: the rest of the F and B actions (our forward/backward code, the user's step around the blocks, hooks)
  and OPT;
* send: ``SEND_*`` actions (framing, posting the message);
* receive: ``RECV_*`` actions (taking a message: its latency plus any real waiting for a neighbour);
* between actions: time outside the actions (Lightning's loop and our per-batch work, a backward's hooks run after
  its send, posting receives, the host's wake-ups).

Each configuration runs ``--repeats`` times (the table shows the run with the median efficiency: single runs vary
by ~0.01 on the shared cores), next to the bare message loop of the same shape (message_floor.py: the machine's
ceiling) and torch.distributed.pipelining's Schedule1F1B on the same blocks (``--torch``):

    cd benchmarks && python overhead_breakdown.py --stages 4 8 --torch --json results/overhead_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import warnings
from pathlib import Path

from lightning_paci.simulation.timeline import Interval

from emulated import add_shape_arguments, run_emulated, steady_seconds
from message_floor import floor_efficiency


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


def torch_1f1b_efficiency(n: int, m: int, k: int, fwd: float, bwd: float) -> float:
    """Steady efficiency of torch's Schedule1F1B (one block per stage, flush per mini-batch)."""
    from vs_torch_pipelining import run_torch

    _, steady = run_torch("torch_1f1b", n, m, k, fwd, bwd, 1)
    return (k - 2) * m * (fwd + bwd) / 1e3 / steady


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="also run torch's Schedule1F1B (the ratio's baseline)")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    m, k, fwd, bwd = args.microbatches, args.minibatches, args.forward_ms, args.backward_ms
    results = []
    for n in args.stages:
        runs = []
        for _ in range(args.repeats):
            stages = run_emulated(num_stages=n, schedule="paci", num_microbatches=m, num_minibatches=k,
                                  blocks_per_stage=1, forward_ms=fwd, backward_ms=bwd)
            efficiency = (k - 2) * m * (fwd + bwd) / 1e3 / steady_seconds(stages, m, k)
            runs.append((efficiency, breakdown(stages, m, k, fwd, bwd)))
        runs.sort(key=lambda r: r[0])
        efficiency, rows = runs[len(runs) // 2]
        floor = floor_efficiency(n, m, k, fwd, bwd)
        baseline = torch_1f1b_efficiency(n, m, k, fwd, bwd) if args.torch else None
        results.append({"stages": n, "efficiency": efficiency, "efficiencies": [r[0] for r in runs],
                        "floor": floor, "torch_1f1b": baseline, "rows": rows})
        print(f"\nN = {n}, paci, m = {m}, {k} batches, one block per stage, F/B {fwd:g}/{bwd:g} ms; ms per micro-batch "
              f"and stage in the steady window (median of {args.repeats} runs)")
        print(f"{'stage':>5} {'device':>7} {'framework':>9} {'send':>6} {'receive':>7} {'between':>7} {'wall':>7}")
        for s, r in enumerate(rows):
            print(f"{s:>5} {r['device']:>7.2f} {r['framework']:>9.2f} {r['send']:>6.2f} {r['receive']:>7.2f} "
                  f"{r['between']:>7.2f} {r['wall']:>7.2f}")
        line = (f"steady efficiency {efficiency:.3f} (runs {', '.join(f'{e:.3f}' for e, _ in runs)}; median "
                f"{statistics.median(e for e, _ in runs):.3f}); bare message loop {floor:.3f}")
        if baseline is not None:
            line += f"; torch Schedule1F1B {baseline:.3f}, paci speed-up {efficiency / baseline:.2f}x"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
