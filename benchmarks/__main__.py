"""``python -m benchmarks <name> [options]``: one entry point over every benchmark.

The list below is the whole catalogue; a benchmark's module is imported only when it runs, so ``--help`` answers
at once (importing torch and Lightning takes seconds).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module, one line for --help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "vs_torch": ("benchmarks.throughput",
                 "paci/1f1b/gpipe through the Trainer vs torch.distributed.pipelining's schedules: steady efficiency"),
    "overhead": ("benchmarks.throughput",
                 "per-micro-batch host cost and steady bubble on the emulated cluster (bare runtime, monitors)"),
    "time_to_accuracy": ("benchmarks.time_to_accuracy",
                         "PACI vs the fastest 1F1B-flush: time to a validation loss, and loss per update"),
    "data_parallel": ("benchmarks.data_parallel",
                      "stages x replicas: samples/s vs one replica, LocalSGD on a slow link and its loss"),
    "virtual": ("benchmarks.virtual",
                "virtual stages: interleaved/bfs over loops vs the simulator and torch; paci's fill and drain"),
    "memory": ("benchmarks.memory",
               "peak host memory of a big model per rank, activation bytes with recomputation, message bytes"),
    "compile": ("benchmarks.compile_speed",
                "compile=\"blocks\" against eager: a stage's GPT-2 blocks, forward and backward per micro-batch"),
    "compensation": ("benchmarks.compensation",
                     "six transformers models: final loss of one device and PACI with compensation none/predict/auto"),
    "prediction": ("benchmarks.prediction_cost",
                   "the weight prediction's bytes per parameter (counted) and its share of a GPU stage's F+B"),
    "plan": ("benchmarks.plan",
             "plan=\"auto\" under a memory budget against the best run of a measured grid (emulated cluster)"),
}


def _usage() -> str:
    width = max(len(name) for name in BENCHMARKS)
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in BENCHMARKS.items()]
    return ("usage: python -m benchmarks <name> [options]    (python -m benchmarks <name> --help: its options)\n\n"
            "benchmarks:\n" + "\n".join(lines))


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], list(argv[1:])
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    from benchmarks.harness import main as run

    run(name, getattr(importlib.import_module(BENCHMARKS[name][0]), name), rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
