"""What a stage holds: host memory of a big model per rank, activation bytes with and without recomputation, and
the bytes of every message.

* ``host``: ``VmHWM`` of every stage process for a 268 MB model (16 square ``Linear`` blocks of width ``--width``
  2048) on 4 stages, over the tiny model of the same code (width 64) as the baseline: built in ``configure_model``
  (each stage replays only its own share) or in ``__init__`` (every rank holds the whole model: the control); at fit
  start, during training, and for what follows training (a sharded or consolidated ``save_checkpoint`` and
  teardown, the peak reset when training ends). Global rank 0 is the last stage and writes the consolidated file.
* ``activations``: every stage's peak activation bytes (the exact meter: the tensors a micro-batch keeps from its
  forward to its backward, summed over the micro-batches in flight) with ``recompute="off"`` and ``"blocks"``, paci,
  through the one-process reference executor (the numbers do not depend on timing), on the time_to_accuracy
  benchmark's tiny GPT and on a transformers GPT-2 with tied embedding and head; "block working set" is what one
  block saves for one micro-batch, needed again while a recomputing stage runs that block's backward. ``--time``
  adds steady micro-batches per second on the emulated cluster (2 blocks of 10/20 ms per stage, paci, through the
  Trainer): the recomputation pays the forward again in every backward, (F + B + F) / (F + B) = 1.33 for B = 2F.
* ``optimizer``: the optimizer-state bytes (AdamW) of every rank of the main example's GPT-2 at 2 stages x D
  replicas, with the state whole on every replica and sharded (``dp_shard="optimizer"``), after a few steps.
* ``messages``: the main example's (examples/train_gpt.py's GPT-2) activation and gradient messages per stage and
  their framed size (header: the pickled structure with the tensors taken out, plus the tensors' bytes), counted
  on every rank over a few training steps.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.harness import Benchmark, median, print_table, run_emulated, steady_seconds
from benchmarks.time_to_accuracy import CONTEXT, GLOBAL_BATCH, SleepyLM
from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.replicas.optimizer_shards import optimizer_state_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
from memory_peaks import MB, run_peaks  # noqa: E402
from train_gpt import GPT, ByteBlocks, stdlib_corpus  # noqa: E402

from models import HFCausalLM, token_loader  # noqa: E402

__all__ = ["memory"]


def host(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Peak host memory per rank, MB over the tiny model of the same code."""
    stages = args.stages or 4
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = {later: run_peaks(root / f"tiny-{later}", 64, later=later, devices=stages) for later in (True, False)}
        for name, later, layout in (("configure_model, sharded save", True, "sharded"),
                                    ("configure_model, consolidated save", True, "consolidated"),
                                    ("__init__ (control), sharded save", False, "sharded")):
            peaks = run_peaks(root / name.replace(" ", "_").replace(",", ""), args.width, later=later, layout=layout,
                              devices=stages)
            for rank in range(stages):
                base = tiny[later]
                rows.append({
                    "run": name, "rank": rank, "own_MB": round(peaks.read("start", rank)["own"] / MB),
                    "fit_start_MB": round((peaks.read("start", rank)["peak"] - base.read("start", rank)["peak"]) / MB),
                    "training_MB": round((peaks.read("train", rank)["peak"] - base.read("train", rank)["peak"]) / MB),
                    "save_teardown_MB": round((peaks.read("end", rank)["peak"] - peaks.read("reset", rank)["peak"])
                                              / MB)})
    print_table(f"peak host memory (VmHWM), 16 blocks of width {args.width}, {stages} stages: MB over the tiny model "
                "(save_teardown: added after training)", rows,
                [("run", "s"), ("rank", "d"), ("own_MB", "d"), ("fit_start_MB", "d"), ("training_MB", "d"),
                 ("save_teardown_MB", "d")])
    return rows


def _peaks(model: Any, batches: list[Any], stages: int, m: int, recompute: str) -> list[int]:
    plan = plan_partition(model, stages, partition="parameters")
    reference = ReferencePipeline(model, plan, recompute=recompute)
    for runtime in reference.runtimes:
        runtime.records.measure(activation_bytes=True)
    reference.run(build_schedule("paci", stages, m, m, len(batches), tied=bool(plan.tied)), batches)
    return [runtime.records.peak_activation_bytes for runtime in reference.runtimes]


def _block_working_set(model: Any, batch: Any, stages: int, m: int) -> int:
    """Bytes block 0 saves for one micro-batch (its input caught by a pre-hook on a one-device forward)."""
    from lightning_paci.engine.runtime.records import ActivationMeter

    block = model.get_submodule(plan_partition(model, stages, partition="parameters").container)[0]
    caught: list[tuple[Any, Any]] = []
    handle = block.register_forward_pre_hook(lambda _m, a, kw: caught.append((a, kw)), with_kwargs=True)
    microbatch = [t[: len(t) // m] for t in batch] if isinstance(batch, list) else batch[: len(batch) // m]
    with torch.no_grad():
        model.training_step(microbatch, 0)
    handle.remove()
    meter = ActivationMeter(model.parameters())
    with meter:
        out = block(*caught[0][0], **caught[0][1])
    return meter.total([], None) if out is not None else 0


def activations(args: argparse.Namespace) -> dict[str, Any]:
    """Peak activation bytes per stage, recompute off and on; with ``--time``, the recomputation's time."""
    stages, m = args.stages or 8, args.microbatches
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (3 * GLOBAL_BATCH, CONTEXT + 1))
    models = {"tiny GPT": (SleepyLM(max_steps=100, lr=1e-3, warmup=10, layers=8), list(tokens.split(GLOBAL_BATCH))),
              "transformers GPT-2, tied": (HFCausalLM("gpt2", layers=8, tied=True, vocab=64),
                                           list(token_loader(num_batches=3, batch_size=16, seq=33, vocab=64)))}
    results: dict[str, Any] = {}
    for name, (model, batches) in models.items():
        peaks = {mode: _peaks(model, batches, stages, m, mode) for mode in ("off", "blocks")}
        working = _block_working_set(model, batches[0], stages, m)
        results[name] = {"peaks": peaks, "block_working_set": working}
        rows = [{"stage": s, "off_KiB": off / 1024, "blocks_KiB": on / 1024, "ratio": on / off}
                for s, (off, on) in enumerate(zip(peaks["off"], peaks["blocks"]))]
        print_table(f"{name}: peak activation KiB per stage, N = {stages}, m = {m}, paci (block working set "
                    f"{working / 1024:.1f} KiB)", rows,
                    [("stage", "d"), ("off_KiB", ".1f"), ("blocks_KiB", ".1f"), ("ratio", ".3f")])
    if args.time:
        for n in args.time_stages:
            rates: dict[str, list[float]] = {"off": [], "blocks": []}
            for _ in range(args.repeats):
                for mode in rates:
                    intervals = run_emulated(num_stages=n, schedule="paci", num_microbatches=m, num_minibatches=10,
                                             blocks_per_stage=2, forward_ms=10, backward_ms=20, recompute=mode)
                    rates[mode].append(8 * m / steady_seconds(intervals, m, 10))
            slowdown = median(rates["off"]) / median(rates["blocks"])
            results[f"time N={n}"] = {"microbatches_per_s": rates, "slowdown": slowdown}
            print(f"N = {n}: micro-batches/s off {rates['off']}, blocks {rates['blocks']}: {slowdown:.2f}x the time")
    return results


def _framed(payload: Any) -> int:
    from lightning_paci.engine.transport.messages import flatten

    skeleton, tensors = flatten(payload)
    return 16 + len(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)) + sum(
        t.numel() * t.element_size() for t in tensors)


class _Count(L.Callback):
    """Wraps this rank's training transport to add up each direction's messages and framed bytes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sent: dict[str, list[int]] = {"activation": [0, 0], "gradient": [0, 0]}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        comm, stage = strategy.runtime.comm, strategy.stage_index
        send = comm.send

        def counted(payload: Any, to: int, channel: int = 0) -> None:
            if channel == 0:
                entry = self.sent["activation" if to > stage else "gradient"]
                entry[0], entry[1] = entry[0] + 1, entry[1] + _framed(payload)
            send(payload, to, channel)

        comm.send = counted

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"stage": trainer.strategy.stage_index, **self.sent}  # type: ignore[attr-defined]
        (self.directory / f"sent{dist.get_rank()}.json").write_text(json.dumps(record))


def messages(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Messages and framed bytes per stage and direction of examples/train_gpt.py's model (its defaults)."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(ByteBlocks(stdlib_corpus(400_000), 128), batch_size=16, drop_last=True)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(strategy=PACIStrategy(start_method="fork", microbatches=4), accelerator="cpu",
                            devices=args.stages or 4, max_steps=args.steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[_Count(Path(tmp))])
        trainer.fit(GPT(), loader)
        records = sorted((json.loads(p.read_text()) for p in Path(tmp).glob("sent*.json")), key=lambda r: r["stage"])
    rows = [{"stage": r["stage"], "activation_messages": r["activation"][0],
             "activation_bytes_each": r["activation"][1] // max(1, r["activation"][0]),
             "gradient_messages": r["gradient"][0], "gradient_bytes_each": r["gradient"][1] // max(1, r["gradient"][0])}
            for r in records]
    print_table(f"examples/train_gpt.py's GPT-2, {args.stages or 4} stages, m = 4, batch 16 x 128 tokens, "
                f"{args.steps} steps: framed bytes per message", rows,
                [("stage", "d"), ("activation_messages", "d"), ("activation_bytes_each", "d"),
                 ("gradient_messages", "d"), ("gradient_bytes_each", "d")])
    return rows


class _StateBytes(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        record = {"stage": strategy.stage_index, "replica": strategy.replica_index,
                  "bytes": optimizer_state_bytes(strategy.runtime.optimizer.optimizer)}
        (self.directory / f"state{dist.get_rank()}.json").write_text(json.dumps(record))


def optimizer(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Optimizer-state bytes per rank of examples/train_gpt.py's model, 2 stages x D replicas, whole or sharded."""
    rows = []
    for replicas in args.replicas:
        for dp_shard in ("none", "optimizer"):
            torch.manual_seed(0)
            loader = torch.utils.data.DataLoader(ByteBlocks(stdlib_corpus(400_000), 128), batch_size=8,
                                                 drop_last=True)
            with tempfile.TemporaryDirectory() as tmp:
                trainer = L.Trainer(
                    strategy=PACIStrategy(start_method="fork", microbatches=2, pipeline_parallel_size=2,
                                          dp_shard=dp_shard, compensation="none"),
                    accelerator="cpu", devices=2 * replicas, max_steps=args.steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, use_distributed_sampler=True, callbacks=[_StateBytes(Path(tmp))])
                trainer.fit(GPT(), loader)
                records = [json.loads(p.read_text()) for p in Path(tmp).glob("state*.json")]
            for stage in range(2):
                per_rank = [r["bytes"] for r in records if r["stage"] == stage]
                rows.append({"replicas": replicas, "dp_shard": dp_shard, "stage": stage, "max_bytes": max(per_rank),
                             "min_bytes": min(per_rank), "sum_bytes": sum(per_rank)})
    for row in rows:
        whole = next(r for r in rows if r["replicas"] == row["replicas"] and r["stage"] == row["stage"]
                     and r["dp_shard"] == "none")
        row["max_vs_whole"] = row["max_bytes"] / whole["max_bytes"]
    print_table(f"examples/train_gpt.py's GPT-2 (AdamW), 2 stages x D replicas, {args.steps} steps: optimizer-state "
                f"bytes per rank", rows, [("replicas", "d"), ("dp_shard", "s"), ("stage", "d"), ("max_bytes", "d"),
                                          ("min_bytes", "d"), ("sum_bytes", "d"), ("max_vs_whole", ".3f")])
    return rows


MEASURES = {"host": host, "activations": activations, "optimizer": optimizer, "messages": messages}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measure", nargs="+", choices=list(MEASURES), default=list(MEASURES))
    parser.add_argument("--stages", type=int, help="pipeline stages (default: 4; activations: 8)")
    parser.add_argument("--width", type=int, default=2048, help="host: the big model's block width")
    parser.add_argument("--microbatches", type=int, default=8, help="activations: m")
    parser.add_argument("--time", action="store_true", help="activations: also the recomputation's time")
    parser.add_argument("--time-stages", type=int, nargs="+", default=[4, 8], help="--time: emulated stages")
    parser.add_argument("--repeats", type=int, default=2, help="--time: alternating runs; the median is reported")
    parser.add_argument("--steps", type=int, default=2, help="messages, optimizer: training steps")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="optimizer: data-parallel replicas")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    return {name: MEASURES[name](args) for name in args.measure}


memory = Benchmark(_arguments, _run, __doc__ or "")
