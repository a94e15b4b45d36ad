"""lightning_paci through the real Trainer vs torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on the
same emulated model and costs.

    cd benchmarks && python vs_torch_pipelining.py [--stages 4 8] [--microbatches 4 8 16] [--minibatches 8]
                                                   [--forward-ms 30] [--backward-ms 60] [--blocks-per-stage 2]
                                                   [--schedules paci torch_1f1b ...] [--json out.json]

Each stage owns ``--blocks-per-stage`` sleep-padded blocks (forward / backward sleeps per block), so N processes do
not compete for the 2 cores. Two efficiencies against the bubble-free limit m * (F + B) per mini-batch and stage:

* steady: stage 0's time from the start of mini-batch 1 to the start of mini-batch K-1 (K-2 mini-batches, no
  pipeline fill or final drain) -- the long-run rate;
* whole run: all K mini-batches, fill and drain included.

torch's schedules run one ``step()`` per mini-batch (a flush each time), then the optimizer step, in forked gloo
processes; ours run through the real Lightning Trainer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from emulated import EmulatedModel, emulated_loader, run_emulated, run_seconds, steady_seconds


def _torch_worker(rank: int, args: tuple, path: str, out: str) -> None:
    name, n, m, k, fwd_ms, bwd_ms, per_stage = args
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    torch.manual_seed(0)
    model = EmulatedModel(per_stage * n, fwd_ms / 1e3, bwd_ms / 1e3)
    module = nn.Sequential(*list(model.blocks)[per_stage * rank: per_stage * (rank + 1)])
    stage = PipelineStage(module, rank, n, torch.device("cpu"))
    schedule_class = {"torch_gpipe": ScheduleGPipe, "torch_1f1b": Schedule1F1B}[name]
    schedule = schedule_class(stage, n_microbatches=m, loss_fn=lambda out, target: F.mse_loss(out, target))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    batches = list(emulated_loader(k, batch_size=2 * m))
    dist.barrier()
    start = time.perf_counter()
    step_starts = []
    for x, y in batches:
        step_starts.append(time.perf_counter())
        if rank == 0:
            schedule.step(x)
        elif rank == n - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"seconds": time.perf_counter() - start, "steady": step_starts[-1] - step_starts[1]}, fh)
    dist.destroy_process_group()


def run_torch(name: str, n: int, m: int, k: int, fwd_ms: float, bwd_ms: float, per_stage: int) -> tuple[float, float]:
    """(whole-run seconds, seconds from the start of mini-batch 1 to the start of mini-batch K-1)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.start_processes(_torch_worker,
                           args=((name, n, m, k, fwd_ms, bwd_ms, per_stage), os.path.join(tmp, "rdv"), out),
                           nprocs=n, start_method="fork")
        with open(out) as fh:
            data = json.load(fh)
        return data["seconds"], data["steady"]


def run_ours(schedule: str, n: int, m: int, k: int, fwd_ms: float, bwd_ms: float,
             per_stage: int) -> tuple[float, float]:
    stages = run_emulated(num_stages=n, schedule=schedule, num_microbatches=m, num_minibatches=k,
                          forward_ms=fwd_ms, backward_ms=bwd_ms, blocks_per_stage=per_stage)
    return run_seconds(stages), steady_seconds(stages, m, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--minibatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=30.0)
    parser.add_argument("--backward-ms", type=float, default=60.0)
    parser.add_argument("--blocks-per-stage", type=int, default=2, help="3 gives GPT-2 Medium's 24 blocks at N=8")
    parser.add_argument("--schedules", nargs="+", default=["paci", "1f1b", "gpipe", "torch_gpipe", "torch_1f1b"])
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    k, fwd, bwd, per_stage = args.minibatches, args.forward_ms, args.backward_ms, args.blocks_per_stage
    rows = []
    for n in args.stages:
        for m in args.microbatches:
            limit = k * m * per_stage * (fwd + bwd) / 1e3  # bubble-free seconds per stage
            for name in args.schedules:
                if name == "torch_1f1b" and m < n:
                    rows.append({"stages": n, "microbatches": m, "schedule": name, "seconds": None,
                                 "note": "torch requires n_microbatches >= num_stages"})
                    continue
                seconds, steady = (run_torch if name.startswith("torch") else run_ours)(name, n, m, k, fwd, bwd,
                                                                                       per_stage)
                rows.append({"stages": n, "microbatches": m, "schedule": name, "seconds": seconds,
                             "efficiency": limit / seconds, "throughput": k * m / seconds,
                             "steady_efficiency": limit * (k - 2) / k / steady,
                             "steady_throughput": (k - 2) * m / steady})
    print(f"\nemulated cluster, {k} mini-batches, block F/B {fwd:g}/{bwd:g} ms, {per_stage} blocks per stage")
    print(f"{'N':>3} {'m':>3} {'schedule':>12} {'steady eff.':>11} {'steady mb/s':>11} {'paci speed-up':>13} "
          f"{'whole-run eff.':>14} {'seconds':>8}")
    for r in rows:
        if r["seconds"] is None:
            print(f"{r['stages']:>3} {r['microbatches']:>3} {r['schedule']:>12}   n/a ({r['note']})")
            continue
        paci = next((x for x in rows if x["stages"] == r["stages"] and x["microbatches"] == r["microbatches"]
                     and x["schedule"] == "paci"), r)
        print(f"{r['stages']:>3} {r['microbatches']:>3} {r['schedule']:>12} {r['steady_efficiency']:>11.3f} "
              f"{r['steady_throughput']:>11.2f} {paci['steady_throughput'] / r['steady_throughput']:>13.2f} "
              f"{r['efficiency']:>14.3f} {r['seconds']:>8.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
