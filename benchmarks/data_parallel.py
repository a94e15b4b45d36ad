"""Data parallel x pipeline on the emulated cluster: samples/s of P stages x D replicas against P stages x 1.

Every block's forward and backward is padded by a fixed sleep (emulated.py), so the 4 x D stage processes do not
compete for these 2 cores; the replicas' gradient all-reduce before each local step is real (gloo, in the
stage's process). Each replica trains on its own shard at the same per-replica batch, so D replicas should give D
times the samples per second, less what the reduction and the extra processes cost. Throughput is measured in the
steady state (stage 0 of replica 0, mini-batches 1 .. K-1: no fill, no final drain); steady efficiency is the
bubble-free limit over that time, as in vs_torch_pipelining.py.

``--interconnect-ms`` emulates a slow link: every reduction over the replicas waits that long first (as a
transfer would), and ``--local-sgd-steps k`` adds runs that average parameters every k steps instead of gradients
every step (``PACIStrategy(local_sgd_steps=k)``); the final training loss of replica 0 says what that costs.

    python data_parallel.py --stages 4 --replicas 1 2 --json results/data_parallel.json
    python data_parallel.py --replicas 2 --interconnect-ms 150 --local-sgd-steps 4 --minibatches 16
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_paci import PACIStrategy, data_parallel
from lightning_paci.simulation.timeline import Interval

from emulated import EmulatedModel, OneThread, emulated_loader, steady_seconds


class _DumpReplicaIntervals(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        data = [list(iv) for iv in strategy.runtime.records.intervals]
        name = f"stage{strategy.stage_index}_replica{strategy.replica_index}.json"
        (self.directory / name).write_text(json.dumps(data))


def slow_interconnect(milliseconds: float) -> None:
    """Every reduction over the replicas waits ``milliseconds`` first (inherited by the forked stages)."""
    for cls, name in ((data_parallel.GradientAverage, "__call__"), (data_parallel.ParameterAverage, "sync")):
        original = getattr(cls, name)

        def slowed(self, *args, _original=original):  # type: ignore[no-untyped-def]
            time.sleep(milliseconds / 1e3)
            return _original(self, *args)

        setattr(cls, name, slowed)


def run(stages: int, replicas: int, m: int, k: int, fwd: float, bwd: float, per_stage: int,
        microbatch_size: int, local_sgd_steps: int | None = None) -> tuple[list[list[Interval]], float]:
    """Train ``k`` batches per replica; every stage's intervals of replica 0 and the last logged training loss."""
    torch.manual_seed(0)
    model = EmulatedModel(stages * per_stage, fwd / 1e3, bwd / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule="paci", microbatches=m, pipeline_parallel_size=stages, start_method="fork",
                                  timeout=timedelta(seconds=120), partition="parameters",
                                  local_sgd_steps=local_sgd_steps),
            accelerator="cpu", devices=stages * replicas, max_steps=k, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            use_distributed_sampler=True, callbacks=[OneThread(), _DumpReplicaIntervals(Path(tmp))])
        trainer.fit(model, emulated_loader(k * replicas, batch_size=m * microbatch_size))
        return ([[Interval(*iv) for iv in json.loads((Path(tmp) / f"stage{s}_replica0.json").read_text())]
                 for s in range(stages)], float(trainer.callback_metrics["train_loss"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=30.0)
    parser.add_argument("--backward-ms", type=float, default=60.0)
    parser.add_argument("--blocks-per-stage", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--interconnect-ms", type=float, default=0.0, help="wait before every replica reduction")
    parser.add_argument("--local-sgd-steps", type=int, nargs="*", default=[], help="also run LocalSGD with these k")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    n, m, k = args.stages, args.microbatches, args.minibatches
    limit = (k - 2) * m * args.blocks_per_stage * (args.forward_ms + args.backward_ms) / 1e3  # bubble-free steady s
    if args.interconnect_ms:
        slow_interconnect(args.interconnect_ms)
    rows = []
    configs = [(r, None) for r in args.replicas]
    configs += [(r, s) for r in args.replicas if r > 1 for s in args.local_sgd_steps]
    for replicas, local_sgd in configs:
        intervals, loss = run(n, replicas, m, k, args.forward_ms, args.backward_ms, args.blocks_per_stage,
                              args.microbatch_size, local_sgd)
        steady = steady_seconds(intervals, m, k)
        rows.append({"stages": n, "replicas": replicas, "local_sgd_steps": local_sgd, "steady_seconds": steady,
                     "steady_efficiency": limit / steady, "train_loss": loss,
                     "samples_per_second": (k - 2) * m * args.microbatch_size * replicas / steady})
    base = rows[0]["samples_per_second"]
    print(f"\nemulated cluster, paci, {n} stages, m = {m}, {k} mini-batches per replica, block F/B "
          f"{args.forward_ms:g}/{args.backward_ms:g} ms, {args.blocks_per_stage} blocks per stage, "
          f"{m * args.microbatch_size} samples per replica and batch, interconnect +{args.interconnect_ms:g} ms per "
          f"reduction")
    print(f"{'shape':>8} {'reduction':>16} {'steady eff.':>11} {'samples/s':>9} {'vs first':>8} {'train loss':>10}")
    for r in rows:
        how = "-" if r["replicas"] == 1 else (f"LocalSGD k={r['local_sgd_steps']}" if r["local_sgd_steps"]
                                              else "grads every step")
        print(f"{r['stages']:>3} x {r['replicas']:<2} {how:>16} {r['steady_efficiency']:>11.3f} "
              f"{r['samples_per_second']:>9.1f} {r['samples_per_second'] / base:>7.2f}x {r['train_loss']:>10.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
