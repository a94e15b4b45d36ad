"""The Lightning strategy vs the bare runtime executing the same action lists on the same emulated model.

    cd benchmarks && python strategy_overhead.py [--stages 4] [--microbatches 8] [--minibatches 8] [--json out.json]

Bare: forked gloo processes, each carving the model, wrapping the optimizer and running its whole
``build("paci", N, m, m, K)`` list with StageRuntime + DistComm, no Trainer. Strategy: the same model, data and
schedule through ``Trainer(strategy=PACIStrategy(...))`` (per-batch calls, rounds, log replay, Lightning's loop).
Both times are first-action-to-last-action wall clock over all stages.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_paci.engine.comm import DistComm
from lightning_paci.engine.microbatch import loss_scale_for, split_microbatches
from lightning_paci.engine.runtime import StageRuntime
from lightning_paci.integration.lightning_program import LightningStageProgram
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.partition import carve_stage, plan_partition
from lightning_paci.schedules import build

from emulated import EmulatedModel, emulated_loader, run_emulated, run_seconds


def _bare_worker(rank: int, n: int, m: int, k: int, fwd_ms: float, bwd_ms: float, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    torch.manual_seed(0)
    model = EmulatedModel(2 * n, fwd_ms / 1e3, bwd_ms / 1e3)
    carve = carve_stage(model, plan_partition(model, n, partition="parameters"), rank)
    optimizer = StageOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), list(model.parameters()))
    runtime = StageRuntime(rank, n, LightningStageProgram(model, carve), DistComm(list(range(n))), optimizer,
                           loss_scale=loss_scale_for(m))
    for b, batch in enumerate(emulated_loader(k, batch_size=2 * m)):
        for i, part in enumerate(split_microbatches(batch, m)):
            runtime.add_microbatch(b * m + i, part, b)
    dist.barrier()
    runtime.run(build("paci", n, m, m, k).actions[rank])
    runtime.comm.flush()
    gathered: list = [None] * n
    dist.all_gather_object(gathered, list(runtime.records.intervals))
    if rank == 0:
        with open(out, "w") as fh:
            fh.write(str(run_seconds(gathered)))
    dist.destroy_process_group()


def bare_seconds(n: int, m: int, k: int, fwd_ms: float, bwd_ms: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.start_processes(_bare_worker, args=(n, m, k, fwd_ms, bwd_ms, os.path.join(tmp, "rdv"), out), nprocs=n,
                           start_method="fork")
        with open(out) as fh:
            return float(fh.read())


def strategy_seconds(n: int, m: int, k: int, fwd_ms: float, bwd_ms: float) -> float:
    return run_seconds(run_emulated(num_stages=n, schedule="paci", num_microbatches=m, num_minibatches=k,
                                    forward_ms=fwd_ms, backward_ms=bwd_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    config = (args.stages, args.microbatches, args.minibatches, args.forward_ms, args.backward_ms)
    bare, ours = [], []
    for _ in range(args.repeats):  # alternate, so drifting machine load hits both alike
        bare.append(bare_seconds(*config))
        ours.append(strategy_seconds(*config))
    bare.sort()
    ours.sort()
    b, o = bare[len(bare) // 2], ours[len(ours) // 2]
    print(f"\nN={args.stages} m={args.microbatches} {args.minibatches} batches, block F/B {args.forward_ms:g}/"
          f"{args.backward_ms:g} ms: bare runtime {b:.3f} s, Lightning strategy {o:.3f} s (medians of "
          f"{args.repeats}), overhead {100 * (o / b - 1):+.1f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bare": bare, "strategy": ours, "overhead": o / b - 1}, fh)


if __name__ == "__main__":
    main()
