"""What the look-ahead costs per update: the one-process reference executor with and without it, alternating.

    cd benchmarks && python lookahead_cost.py [--updates 20] [--repeats 3]

Every stage of ``time_to_accuracy.py``'s 8-stage model (real compute, no emulated sleeps, one thread) runs the same
PACI lists with ``compensation="none"`` and ``"lookahead"``, alternating, after a few updates so that the
optimizer has state. Printed: seconds per update of each, their ratio, and how often the stages moved (the
first ``N-1-s`` micro-batches of every window on stage ``s``). On an accelerator the same elementwise work is a
few kernels per chunk; on these CPU cores it competes with the model's own compute.
"""

from __future__ import annotations

import argparse
import time

import torch
from time_to_accuracy import CONTEXT, GLOBAL_BATCH, NUM_STAGES, SleepyLM

from lightning_paci import ReferencePipeline, build, plan_partition


def seconds_per_update(compensation: str, updates: int, seed: int) -> tuple[float, int]:
    torch.manual_seed(seed)
    model = SleepyLM(0.0, 0.0, max_steps=10_000, lr=1e-3, warmup=1)
    pipeline = ReferencePipeline(model, plan_partition(model, NUM_STAGES, partition="parameters"),
                                 compensation=compensation)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, 256, (GLOBAL_BATCH, CONTEXT + 1), generator=gen) for _ in range(2 + updates)]
    pipeline.run(build("paci", NUM_STAGES, 8, 8, 2), batches[:2])  # optimizer state exists from here on
    start = time.perf_counter()
    pipeline.run(build("paci", NUM_STAGES, 8, 8, updates), batches[2:])
    moves = sum(r.lookahead.moves for r in pipeline.runtimes if r.lookahead is not None)
    return (time.perf_counter() - start) / updates, moves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"none": [], "lookahead": []}
    for repeat in range(args.repeats):
        for compensation in ("none", "lookahead"):
            seconds, moves = seconds_per_update(compensation, args.updates, repeat)
            times[compensation].append(seconds)
            print(f"{compensation:>9}: {seconds * 1e3:7.1f} ms per update ({moves} forwards moved)")
    none, ahead = min(times["none"]), min(times["lookahead"])
    print(f"best of {args.repeats}: none {none * 1e3:.1f} ms, lookahead {ahead * 1e3:.1f} ms per update "
          f"(all 8 stages in one process): {100 * (ahead / none - 1):+.1f}%")


if __name__ == "__main__":
    main()
