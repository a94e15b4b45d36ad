"""Real compute, no emulation: 2 stages on the 2 cores, paci vs 1f1b throughput for m = 4.

    cd benchmarks && python real_compute_n2.py [--microbatches 4] [--minibatches 12] [--repeats 5] [--dim 1024]
        [--json out.json]

Each stage owns 2 blocks of ``Linear(dim, dim)`` on micro-batches of 256 rows (no sleeps: the time is matrix work,
one thread per process, one core each), after an elementwise input scale (an embedding's stand-in: the first block's
input then needs a gradient, so both stages do the same matrix work per backward; without it stage 0 skips one
product and the stages are unequal, which the (m+1)/m prediction does not assume). The steady rate (stage 0,
mini-batches 1..K-2, as in vs_torch_pipelining.py) is compared with the bubble-free prediction (m + N - 1) / m for
N = 2. Real compute on 2 shared cores is noisy: runs alternate and the medians are compared.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings

from emulated import run_emulated, steady_seconds


def steady_rate(schedule: str, m: int, k: int, dim: int) -> float:
    stages = run_emulated(num_stages=2, schedule=schedule, num_microbatches=m, num_minibatches=k, forward_ms=0.0,
                          backward_ms=0.0, dim=dim, microbatch_size=256, input_scale=True)
    return (k - 2) * m / steady_seconds(stages, m, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs; medians are reported")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    m, k = args.microbatches, args.minibatches
    runs: dict[str, list[float]] = {"paci": [], "1f1b": []}
    for _ in range(args.repeats):  # alternate, so drifting load on the shared cores hits both alike
        for schedule in runs:
            runs[schedule].append(steady_rate(schedule, m, k, args.dim))
    paci, flush = (sorted(v)[len(v) // 2] for v in runs.values())
    ideal = (m + 1) / m
    print("per run, micro-batches/s: " + "; ".join(f"{name} " + ", ".join(f"{v:.2f}" for v in values)
                                                  for name, values in runs.items()))
    print(f"\nN=2, m={m}, real compute (dim {args.dim}): paci {paci:.2f} mb/s, 1f1b {flush:.2f} mb/s, "
          f"ratio {paci / flush:.3f} vs (m+1)/m = {ideal:.3f} ({100 * (paci / flush / ideal - 1):+.1f}%)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": runs, "paci": paci, "1f1b": flush, "ratio": paci / flush, "ideal": ideal}, fh)


if __name__ == "__main__":
    main()
