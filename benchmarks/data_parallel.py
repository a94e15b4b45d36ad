"""What replicas buy: samples per second of P stages x D replicas against P x 1, and what LocalSGD costs in loss.

Time (default), on the emulated cluster (``benchmarks.harness``): every block's forward and backward is padded to
a fixed time, so the P x D stage processes do not compete for the cores; the replicas' gradient all-reduce before
each local step is real (gloo, in the stage's process). Each replica trains on its own shard at the same
per-replica batch, so D replicas should give D times the samples per second, less what the reduction and the extra
processes cost. Throughput is stage 0 of replica 0's steady window (mini-batches 1 .. K-1: no fill, no final
drain); steady efficiency is the bubble-free limit over that time. ``--interconnect-ms`` emulates a slow link: a
stage's whole gradient takes that long on it, each reduction its share by bytes, one after the other, completing in
the background (what waits is the ``wait()`` on it, as on a real network); ``--reduce-bucket-mb`` compares the
blocking average at the step (``none``) with buckets started during the backward (``PACIStrategy(reduce_bucket_mb=)``),
``--deferred`` adds each bucket size with the update made before the next backward (``deferred_update=True``);
``--local-sgd-steps k`` adds runs that average parameters every k steps instead of gradients every step
(``PACIStrategy(local_sgd_steps=k)``).

``--quality``: loss per sample of LocalSGD against gradient averaging, P stages x 2 replicas, in one process (the
processes equal the reference executor with replicas bit for bit, tests/test_data_parallel.py): the
time_to_accuracy benchmark's language model and recipe (AdamW, warm-up and cosine), m = a = ``--microbatches``,
32 samples per replica and update, the replicas on disjoint batches; the held-out loss after the final average.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import timedelta
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import (
    Benchmark,
    EmulatedModel,
    OneThread,
    add_shape_arguments,
    emulated_loader,
    median,
    print_table,
    sleep_until,
    steady_seconds,
)
from benchmarks.time_to_accuracy import SleepyLM, corpus, train_loader, validation_loss
from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition, simulate_schedule
from lightning_paci.schedules import Interval

__all__ = ["data_parallel"]


class _DumpReplicaIntervals(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        name = f"stage{strategy.stage_index}_replica{strategy.replica_index}.json"
        (self.directory / name).write_text(json.dumps([list(iv) for iv in strategy.runtime.records.intervals]))


class _LinkWork:
    """A reduction on the emulated link: done when gloo's is and the link has carried its bytes."""

    def __init__(self, work: Any, done: float) -> None:
        self.work, self.done = work, done

    def wait(self) -> bool:
        self.work.wait()
        sleep_until(self.done)
        return True

    def is_completed(self) -> bool:
        return bool(self.work.is_completed()) and time.perf_counter() >= self.done


def slow_link(seconds_per_byte: float) -> None:
    """Every ``all_reduce`` of this process (inherited by the forked stages) also crosses an emulated link: it
    starts when the link is free and takes ``seconds_per_byte`` per byte of its tensor; the caller is held only by
    a ``wait()`` (a blocking call waits at once)."""
    original = dist.all_reduce
    free_at = [0.0]

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        work = original(tensor, op=op, group=group, async_op=True)
        start = max(time.perf_counter(), free_at[0])
        free_at[0] = start + tensor.numel() * tensor.element_size() * seconds_per_byte
        linked = _LinkWork(work, free_at[0])
        if async_op:
            return linked
        linked.wait()
        return None

    dist.all_reduce = all_reduce  # type: ignore[assignment]


def run(stages: int, replicas: int, m: int, args: argparse.Namespace, local_sgd_steps: int | None,
        bucket_mb: float | None = 25.0, deferred: bool = False) -> tuple[list[list[Interval]], float]:
    """Train ``--minibatches`` batches per replica: every stage's intervals of replica 0, the last training loss."""
    k = args.minibatches
    torch.manual_seed(0)
    model = EmulatedModel(stages * args.blocks_per_stage, args.forward_ms / 1e3, args.backward_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=args.schedule, microbatches=m, pipeline_parallel_size=stages,
                                  start_method="fork",
                                  timeout=timedelta(seconds=120), partition="parameters",
                                  local_sgd_steps=local_sgd_steps, reduce_bucket_mb=bucket_mb,
                                  deferred_update=deferred),
            accelerator="cpu", devices=stages * replicas, max_steps=k, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            use_distributed_sampler=True, callbacks=[OneThread(), _DumpReplicaIntervals(Path(tmp))])
        trainer.fit(model, emulated_loader(k * replicas, batch_size=m * args.microbatch_size))
        return ([[Interval(*iv) for iv in json.loads((Path(tmp) / f"stage{s}_replica0.json").read_text())]
                 for s in range(stages)], float(trainer.callback_metrics["train_loss"]))


def _time(args: argparse.Namespace) -> list[dict[str, Any]]:
    k, per_stage = args.minibatches, args.blocks_per_stage
    stage_bytes = per_stage * (32 * 32 + 32 + 2) * 4  # one stage's gradient (and flags): blocks x Linear(32, 32)
    if args.interconnect_ms:
        slow_link(args.interconnect_ms / 1e3 / stage_bytes)
    buckets = [None if b == "none" else float(b) for b in args.reduce_bucket_mb]
    rows: list[dict[str, Any]] = []
    for n in args.stages:
        for m in args.microbatches:
            limit = (k - 2) * m * per_stage * (args.forward_ms + args.backward_ms) / 1e3  # bubble-free steady s
            # (replicas, LocalSGD steps, bucket MiB, deferred update)
            configs: list[tuple[int, int | None, float | None, bool]] = \
                [(1, None, None, False)] if 1 in args.replicas else []
            configs += [(r, None, b, False) for r in args.replicas if r > 1 for b in buckets]
            configs += [(r, None, b, True) for r in args.replicas if r > 1 and args.deferred for b in buckets
                        if b is not None and args.schedule == "paci"]
            configs += [(r, s, None, False) for r in args.replicas if r > 1 for s in args.local_sgd_steps]
            first = len(rows)
            for replicas, local_sgd, bucket_mb, deferred in configs:
                runs = [run(n, replicas, m, args, local_sgd, bucket_mb, deferred) for _ in range(args.repeats)]
                steady = median([steady_seconds(intervals, m, k) for intervals, _ in runs])
                grads = "grads, blocking" if bucket_mb is None else f"grads, {bucket_mb:g} MiB buckets"
                grads += ", deferred" if deferred else ""
                predicted = None
                if local_sgd is None:  # the simulator's link: the same lists, the blocks' costs, the reduction
                    count = 0 if bucket_mb is None else max(1, min(per_stage, -(-stage_bytes // int(bucket_mb * 2**20
                                                                                                       or 1))))
                    simulated = simulate_schedule(
                        build_schedule(args.schedule, n, m, m, k), forward_cost=per_stage * args.forward_ms,
                        backward_cost=per_stage * args.backward_ms,
                        reduce_cost=args.interconnect_ms if replicas > 1 else 0.0, reduce_buckets=count,
                        deferred=deferred)
                    stage0 = [iv for iv in simulated.intervals if iv.stage == 0]
                    predicted = limit * 1e3 / steady_seconds([stage0], m, k)
                rows.append({"shape": f"{n} x {replicas}", "m": m, "local_sgd_steps": local_sgd,
                             "reduce_bucket_mb": bucket_mb, "deferred": deferred, "predicted_efficiency": predicted,
                             "reduction": "-" if replicas == 1 else (f"LocalSGD k={local_sgd}" if local_sgd
                                                                     else grads),
                             "steady_efficiency": limit / steady, "train_loss": runs[-1][1],
                             "samples_per_s": (k - 2) * m * args.microbatch_size * replicas / steady})
            for row in rows[first:]:
                row["vs_first"] = row["samples_per_s"] / rows[first]["samples_per_s"]
    print_table(f"emulated cluster, {args.schedule}, {k} mini-batches per replica, block F/B {args.forward_ms:g}/"
                f"{args.backward_ms:g} ms, {per_stage} blocks per stage, {args.microbatch_size} samples per "
                f"micro-batch, link {args.interconnect_ms:g} ms per stage gradient, median of {args.repeats}",
                rows, [("shape", "s"), ("m", "d"), ("reduction", "s"), ("steady_efficiency", ".3f"),
                       ("predicted_efficiency", ".3f"),
                       ("samples_per_s", ".1f"), ("vs_first", ".2f"), ("train_loss", ".4f")])
    return rows


def _quality_run(job: tuple[int | None, int, argparse.Namespace]) -> dict[str, Any]:
    local_sgd, seed, args = job
    torch.set_num_threads(1)
    batches = [b for _, b in zip(range(2 * args.max_steps), train_loader(args.corpus_bytes, seed))]
    n, m = args.stages[0], args.microbatches[0]
    torch.manual_seed(seed)
    model = SleepyLM(max_steps=args.max_steps, lr=args.lr, warmup=args.warmup, layers=n)
    pipeline = ReferencePipeline(model, plan_partition(model, n, partition="parameters"), replicas=2,
                                 local_sgd_steps=local_sgd)
    pipeline.run(build_schedule("paci", n, m, m, args.max_steps), [batches[0::2], batches[1::2]])  # disjoint shards
    model.load_state_dict(pipeline.state_dict())
    loss = validation_loss(model, corpus(args.corpus_bytes)[1])
    return {"local_sgd_steps": local_sgd, "seed": seed, "val_loss": loss}


def _quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    configs: list[int | None] = [None, *args.local_sgd_steps]
    with get_context("fork").Pool(args.workers) as pool:
        runs = pool.map(_quality_run, [(c, seed, args) for seed in args.seeds for c in configs])
    losses = {c: sum(r["val_loss"] for r in runs if r["local_sgd_steps"] == c) / len(args.seeds) for c in configs}
    rows = [{"reduction": "gradients every step" if c is None else f"LocalSGD, parameters every {c} steps",
             "val_loss": loss, "vs_gradients": f"{100 * (loss / losses[None] - 1):+.2f}%"}
            for c, loss in losses.items()]
    print_table(f"{args.stages[0]} stages x 2 replicas, paci, m = a = {args.microbatches[0]}, 32 samples "
                f"per replica and update, {args.max_steps} updates (AdamW {args.lr:g}, warm-up {args.warmup}, cosine), "
                f"seeds {args.seeds}: validation loss after the final average", rows,
                [("reduction", "s"), ("val_loss", ".4f"), ("vs_gradients", "s")])
    return runs


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, stages=(4,), minibatches=8, forward_ms=30, backward_ms=60)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--microbatch-size", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--interconnect-ms", type=float, default=0.0,
                        help="emulated link: ms for one stage's whole gradient (each reduction its share by bytes)")
    parser.add_argument("--reduce-bucket-mb", nargs="+", default=["25"],
                        help="PACIStrategy(reduce_bucket_mb=) of the gradient runs: MiB, or none (blocking)")
    parser.add_argument("--schedule", default="paci",
                        help="the time runs' schedule: paci (default), or a flush schedule (1f1b, gpipe, layered); "
                             "efficiency is against the bubble-free limit either way")
    parser.add_argument("--deferred", action="store_true",
                        help="also run each bucket size with PACIStrategy(deferred_update=True)")
    parser.add_argument("--local-sgd-steps", type=int, nargs="*", default=[], help="also run LocalSGD with these k")
    parser.add_argument("--quality", action="store_true", help="loss per sample instead of time (one process)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="--quality")
    parser.add_argument("--max-steps", type=int, default=200, help="--quality: updates")
    parser.add_argument("--lr", type=float, default=1e-3, help="--quality")
    parser.add_argument("--warmup", type=int, default=20, help="--quality: warm-up updates")
    parser.add_argument("--corpus-bytes", type=int, default=2_500_000, help="--quality")
    parser.add_argument("--workers", type=int, default=2, help="--quality: runs in parallel")


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    return _quality(args) if args.quality else _time(args)


data_parallel = Benchmark(_arguments, _run, __doc__ or "")
