"""Does PACI reach a given loss sooner than 1F1B with a flush? Its steps are faster; its drift may cost updates.

A small causal transformer (one block per stage) trains on the embedded standard-library corpus (byte tokens,
examples/train_gpt.py's corpus), global batch 32, AdamW with a linear warm-up and a cosine decay to 10% (the
paper's recipe).

Default (time): N emulated stages through the real Trainer; every block's forward takes ``--fixed-ms +
--ms-per-sample * samples`` and its backward twice that (the real work runs inside that time). The fixed part is
what makes small micro-batches inefficient on an accelerator, why the fastest flush schedule uses moderate
micro-batches. As in the paper (section 7), the flush throughput is measured for every ``--flush-microbatches``
over ``--rate-steps`` steps, only the fastest is trained to the end, and the others' curves are its curve rescaled
(1f1b computes one device's SGD whatever m). Validation never runs inside the training: every stage keeps its
weights after its k-th update (no drain), the parent evaluates every version on the held-out 5% afterwards; version
k's time is when stage 0, the last to update, got there. Printed: the wall clock for the budget, the time to the
lowest common loss (or ``--target``), the loss at equal samples, per-stage peak in-flight micro-batches and
activation bytes, and the weight prediction's extra memory.

``--reference`` (loss per update): the loss after k updates does not depend on timing (the processes compute what
the one-process reference executor computes, bit for bit, tested), so a run far longer than the emulated cluster
affords is computed in one process for ``--configs schedule:compensation[:recompute]``; with ``--rates JSON`` (a
``time_to_accuracy --json`` file) the curves are put on that run's measured time axis.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.harness import (
    Benchmark,
    BlockClock,
    BlockEnter,
    BlockExit,
    OneThread,
    plot_curves,
    print_table,
    time_to,
)
from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ByteBlocks, stdlib_corpus  # noqa: E402

__all__ = ["CONTEXT", "GLOBAL_BATCH", "SleepyLM", "corpus", "time_to_accuracy", "train_loader", "validation_loss"]

GLOBAL_BATCH, CONTEXT = 32, 64


class Block(nn.Module):
    """A pre-norm transformer block whose forward takes ``fixed_s + seconds_per_sample * samples`` of emulated
    device time and its backward twice that; with both 0 it is a plain block."""

    def __init__(self, dim: int, heads: int, fixed_s: float, seconds_per_sample: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.fixed_s, self.seconds_per_sample = fixed_s, seconds_per_sample

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: (micro-batch, T, dim)
        forward_s = self.fixed_s + self.seconds_per_sample * x.shape[0]
        clock = BlockClock(forward_s, 2 * forward_s)
        x = BlockEnter.apply(x, clock)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return BlockExit.apply(x, clock)


class SleepyLM(L.LightningModule):
    """The benchmark's language model; ``recipe="cosine"``: linear warm-up, cosine to 10% of the peak per local
    update; ``"constant"``: the learning rate from the first update. ``optimizer="sgd"``: momentum 0.9."""

    def __init__(self, fixed_s: float = 0.0, seconds_per_sample: float = 0.0, *, max_steps: int, lr: float,
                 warmup: int, layers: int = 8, dim: int = 64, recipe: str = "cosine", optimizer: str = "adamw") -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, dim), nn.Embedding(CONTEXT, dim)
        self.blocks = nn.ModuleList(Block(dim, 4, fixed_s, seconds_per_sample) for _ in range(layers))
        self.head = nn.Linear(dim, 256)
        self.max_steps, self.lr, self.warmup = max_steps, lr, warmup
        self.recipe, self.optimizer_name = recipe, optimizer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (micro-batch, T) -> logits (micro-batch, T, 256)
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def _factor(self, update: int) -> float:
        if update < self.warmup:
            return (update + 1) / self.warmup
        progress = min(1.0, (update - self.warmup) / max(1, self.max_steps - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)
        if self.recipe == "constant":
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def corpus(num_bytes: int) -> tuple[bytes, bytes]:
    """The embedded corpus: the training 95% and the held-out 5%."""
    data = stdlib_corpus(num_bytes)
    return data[: int(len(data) * 0.95)], data[int(len(data) * 0.95):]


def validation_loss(model: SleepyLM, held_out: bytes) -> float:
    """Mean loss per sequence over the whole held-out split."""
    val = DataLoader(ByteBlocks(held_out, CONTEXT), batch_size=GLOBAL_BATCH)
    with torch.no_grad():
        return sum(float(model._loss(b)) * b.shape[0] for b in val) / len(val.dataset)  # type: ignore[arg-type]


def _state_bytes(runtime: Any) -> int:
    """A stage's parameters and optimizer state, in bytes."""
    optimizer = runtime.optimizer.optimizer
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


class _Record(Callback):
    """Every stage keeps its weights right after its k-th update (k = every, 2 * every, ...) with the time, and
    writes them with its peak in-flight micro-batches and activation bytes; nothing synchronises for it."""

    def __init__(self, directory: Path, every: int) -> None:
        self.directory, self.every = directory, every

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime  # type: ignore[attr-defined]
        runtime.records.measure(activation_bytes=True)
        self.start = time.perf_counter()
        self.batch_ends: list[float] = []
        self.versions: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}

        def keep(version: int) -> None:
            if version % self.every == 0:
                weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
                self.versions[version] = (time.perf_counter() - self.start, weights)

        runtime.update_hooks.append(keep)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_ends.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime, stage = trainer.strategy.runtime, trainer.strategy.stage_index  # type: ignore[attr-defined]
        for version, (_, weights) in self.versions.items():
            torch.save(weights, self.directory / f"stage{stage}_v{version}.pt")
        prediction = runtime.prediction.peak_extra_bytes if runtime.prediction is not None else 0
        record = {"peak_inflight": runtime.records.peak_inflight, "model_bytes": _state_bytes(runtime),
                  "prediction_bytes": prediction, "peak_activation_bytes": runtime.records.peak_activation_bytes,
                  "seconds": time.perf_counter() - self.start, "batch_ends": self.batch_ends,
                  "version_times": {v: t for v, (t, _) in self.versions.items()}}
        (self.directory / f"stage{stage}.json").write_text(json.dumps(record))


def _model(args: argparse.Namespace, emulated: bool = False) -> SleepyLM:
    return SleepyLM(args.fixed_ms / 1e3 if emulated else 0.0, args.ms_per_sample / 1e3 if emulated else 0.0,
                    max_steps=args.max_steps, lr=args.lr, warmup=args.warmup, layers=args.layers or args.stages,
                    dim=args.dim, recipe=args.recipe, optimizer=args.optimizer)


def train_loader(corpus_bytes: int, seed: int) -> DataLoader:
    """The training split in global batches, shuffled by ``seed``."""
    return DataLoader(ByteBlocks(corpus(corpus_bytes)[0], CONTEXT), batch_size=GLOBAL_BATCH, shuffle=True,
                      drop_last=True, generator=torch.Generator().manual_seed(seed))


def run_trainer(schedule: str, m: int, seed: int, steps: int, args: argparse.Namespace, validate: bool) -> dict:
    """One emulated run through the Trainer: its validation curve (if ``validate``), batch times and memory."""
    torch.manual_seed(seed)
    model = _model(args, emulated=True)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=m, start_method="fork",  # type: ignore[arg-type]
                                  partition="parameters", timeout=timedelta(seconds=300),
                                  compensation=args.compensation),
            accelerator="cpu", devices=args.stages, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False,
            callbacks=[OneThread(), _Record(Path(tmp), args.val_every if validate else steps + 1)])
        trainer.fit(model, train_loader(args.corpus_bytes, seed))
        stages = [json.loads((Path(tmp) / f"stage{s}.json").read_text()) for s in range(args.stages)]
        times = {int(v): t for v, t in stages[0]["version_times"].items()}
        curve = []
        for version in sorted(v for v in times if all(str(v) in st["version_times"] for st in stages)):
            evaluated = _model(args)
            evaluated.load_state_dict({k: v for s in range(args.stages)
                                       for k, v in torch.load(Path(tmp) / f"stage{s}_v{version}.pt").items()})
            curve.append((version, times[version], validation_loss(evaluated, corpus(args.corpus_bytes)[1])))
    return {"schedule": schedule, "microbatches": m, "seed": seed, "curve": curve, "seconds": stages[0]["seconds"],
            "batch_ends": stages[0]["batch_ends"], **{key: [st[key] for st in stages] for key in (
                "peak_inflight", "peak_activation_bytes", "model_bytes", "prediction_bytes")}}


def steps_per_second(ends: list[float], skip: int, drop_last: int = 0) -> float:
    """Batches per second between batch end ``skip`` and the ``drop_last``-th from the end (start-up excluded)."""
    last = len(ends) - 1 - drop_last
    return (last - skip) / (ends[last] - ends[skip])


def mean_curve(runs: list[dict[str, Any]], scale: float = 1.0) -> list[tuple[int, float, float]]:
    """(updates, mean seconds times ``scale``, mean validation loss) over the seeds: a curve for ``time_to``."""
    return [(points[0][0], scale * sum(p[1] for p in points) / len(points), sum(p[2] for p in points) / len(points))
            for points in zip(*(r["curve"] for r in runs))]


def _time_run(args: argparse.Namespace) -> dict[str, Any]:
    flush_ms = args.flush_microbatches
    rate_runs = {m: run_trainer("1f1b", m, args.seeds[0], args.rate_steps, args, False) for m in flush_ms}
    rates = {m: steps_per_second(rate_runs[m]["batch_ends"], skip=2) for m in flush_ms}
    fastest = max(flush_ms, key=lambda m: rates[m])
    paci = [run_trainer("paci", args.microbatches, seed, args.max_steps, args, True) for seed in args.seeds]
    flush = [run_trainer("1f1b", fastest, seed, args.max_steps, args, True) for seed in args.seeds]
    curves = {f"paci m={args.microbatches}": mean_curve(paci)}
    curves.update({f"1f1b m={m}": mean_curve(flush, rates[fastest] / rates[m]) for m in flush_ms})
    target = args.target if args.target is not None else max(c[-1][2] for c in curves.values())
    rows = []
    for name, curve in curves.items():
        m = int(name.split("=")[1])
        trained = name.startswith("paci") or m == fastest
        runs = paci if name.startswith("paci") else flush
        memory = runs[0] if trained else rate_runs[m]
        rows.append({"config": name + ("" if trained else " (rescaled)"), "trained": trained,
                     "wall_clock_s": (1.0 if name.startswith("paci") else rates[fastest] / rates[m])
                     * sum(r["seconds"] for r in runs) / len(runs),
                     "time_to_target_s": time_to(curve, target), "final_val_loss": curve[-1][2],
                     "peak_inflight": str(memory["peak_inflight"]),
                     "peak_activation_bytes": memory["peak_activation_bytes"],
                     "activation_KiB": " ".join(f"{b / 1024:.0f}" for b in memory["peak_activation_bytes"])})
    print("1f1b throughput (steps/s): " + ", ".join(f"m={m} {rates[m]:.3f}" for m in flush_ms) + f" -> m={fastest}")
    print_table(f"{args.stages} emulated stages, global batch {GLOBAL_BATCH}, {args.max_steps} steps, seeds "
                f"{args.seeds}, paci compensation={args.compensation!r}, block forward {args.fixed_ms} ms + "
                f"{args.ms_per_sample} ms/sample, backward 2x; target validation loss {target:.4f}", rows,
                [("config", "s"), ("wall_clock_s", ".1f"), ("time_to_target_s", ".1f"), ("final_val_loss", ".4f"),
                 ("peak_inflight", "s"), ("activation_KiB", "s")])
    paci_curve, flush_curve = curves[f"paci m={args.microbatches}"], curves[f"1f1b m={fastest}"]
    best = min(r["time_to_target_s"] for r in rows[1:])
    print(f"budget: {rows[1 + flush_ms.index(fastest)]['wall_clock_s'] / rows[0]['wall_clock_s']:.2f}x; "
          f"to the target: {best / rows[0]['time_to_target_s']:.2f}x sooner than the fastest 1f1b")
    equal = [(s, p, f, (p - f) / f) for (s, _, p), (_, _, f) in zip(paci_curve, flush_curve)]
    print("val loss at equal samples, paci vs 1f1b: " + "; ".join(f"step {s}: {p:.4f} vs {f:.4f} ({100 * d:+.2f}%)"
                                                                   for s, p, f, d in equal))
    base = [a + b for a, b in zip(paci[0]["model_bytes"], paci[0]["peak_activation_bytes"])]
    print("weight prediction's extra memory per stage, KiB (share of parameters + optimizer state + activations): "
          + " ".join(f"{e / 1024:.1f} ({100 * e / b:.2f}%)" for e, b in zip(paci[0]["prediction_bytes"], base)))
    if args.plot:
        plot_curves({name: [(t, loss) for _, t, loss in c] for name, c in curves.items()}, "wall clock (s)", args.plot,
              target)
    return {"rates": rates, "target": target, "rows": rows, "equal_samples": equal,
            "runs": paci + flush + list(rate_runs.values())}


def _reference_curve(job: tuple[tuple[str, str, str], int, argparse.Namespace]) -> dict[str, Any]:
    """Validation loss after every ``val_every`` updates of one configuration and seed (one process, one thread)."""
    (schedule, compensation, recompute), seed, args = job
    torch.set_num_threads(1)
    loader = train_loader(args.corpus_bytes, seed)
    if len(loader) < args.max_steps:
        sys.exit(f"--corpus-bytes {args.corpus_bytes} gives {len(loader)} batches < --max-steps {args.max_steps}")
    torch.manual_seed(seed)
    model = _model(args)
    pipeline = ReferencePipeline(model, plan_partition(model, args.stages, partition="parameters"),
                                 compensation=compensation, recompute=recompute)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for stage, runtime in enumerate(pipeline.runtimes):
        def keep(version: int, stage: int = stage) -> None:
            if version % args.val_every == 0:
                snapshots.setdefault(version, {}).update(
                    {k: v.detach().clone() for k, v in pipeline.modules[stage].state_dict().items()})
        runtime.update_hooks.append(keep)
    pipeline.run(build_schedule(schedule, args.stages, args.microbatches, args.microbatches, args.max_steps),
                 [b for _, b in zip(range(args.max_steps), loader)])
    curve = []
    for version in sorted(snapshots):
        model.load_state_dict(snapshots[version])
        curve.append((version, float(version), validation_loss(model, corpus(args.corpus_bytes)[1])))
    return {"config": f"{schedule}:{compensation}:{recompute}", "seed": seed, "curve": curve,
            "prediction_bytes": [r.prediction.peak_extra_bytes if r.prediction is not None else 0
                                for r in pipeline.runtimes]}


def _reference_run(args: argparse.Namespace) -> dict[str, Any]:
    configs = [tuple(c.split(":") + ["none", "off"][c.count(":"):]) for c in args.configs]
    names = [":".join(c) for c in configs]
    jobs = [(c, seed, args) for seed in args.seeds for c in configs]
    with get_context("fork").Pool(args.workers) as pool:
        runs = pool.map(_reference_curve, jobs)
    mean = {name: mean_curve([r for r in runs if r["config"] == name]) for name in names}
    base_name = next((n for n in names if n.startswith("1f1b")), names[-1])
    base = mean[base_name]
    rows, summary = [], {}
    for i, (step, _, loss) in enumerate(base):
        row: dict[str, Any] = {"updates": step, base_name: loss}
        for name in (n for n in names if n != base_name):
            row[name] = f"{mean[name][i][2]:.4f} ({100 * (mean[name][i][2] - loss) / loss:+.2f}%)"
        rows.append(row)
    print_table(f"{args.stages} stages, m = a = {args.microbatches}, global batch {GLOBAL_BATCH}, {args.max_steps} "
                f"updates, {args.layers or args.stages} blocks of width {args.dim}, {args.optimizer} lr {args.lr} "
                f"({args.recipe}), seeds {args.seeds}: mean validation loss and its difference to {base_name}", rows,
                [("updates", "d"), (base_name, ".4f"), *[(n, "s") for n in names if n != base_name]])
    paci_rate = flush_rate = 0.0
    if args.rates:
        saved = json.loads(Path(args.rates).read_text())
        saved = saved.get("result", saved)
        paci_runs = [r for r in saved["runs"] if r["schedule"] == "paci"]
        paci_rate = sum(steps_per_second(r["batch_ends"], 2, 1) for r in paci_runs) / len(paci_runs)
        flush_rate = max(saved["rates"].values())
    for name in (n for n in names if n != base_name):
        curve = mean[name]
        ratio = curve[-1][0] / time_to(base, curve[-1][2])  # updates for the same loss, relative to the baseline
        if curve[-1][2] < base[-1][2]:
            ratio = time_to(curve, base[-1][2]) / base[-1][0]
        summary[name] = {"final_relative": (curve[-1][2] - base[-1][2]) / base[-1][2], "updates_ratio": ratio,
                         "worst_relative": max((p[2] - f[2]) / f[2] for p, f in zip(curve, base)),
                         "prediction_bytes": max(max(r["prediction_bytes"]) for r in runs if r["config"] == name)}
        line = (f"{name}: final {100 * summary[name]['final_relative']:+.2f}%, worst "
                f"{100 * summary[name]['worst_relative']:+.2f}%, {ratio:.3f}x the updates for the same loss")
        if args.rates:
            summary[name]["time_to_same_loss_speedup"] = paci_rate / flush_rate / ratio
            line += (f"; on the measured steps/s ({paci_rate:.3f} vs {flush_rate:.3f}): "
                     f"{paci_rate / flush_rate / ratio:.2f}x sooner")
        print(line)
    if args.plot:
        plot_curves({n: [(u, loss) for u, _, loss in c] for n, c in mean.items()}, "updates", args.plot, None)
    return {"summary": summary, "runs": runs}


QUICK = {"stages": 2, "microbatches": 2, "flush_microbatches": [2, 4], "seeds": [0], "max_steps": 6, "val_every": 3,
         "rate_steps": 4, "fixed_ms": 1.0, "ms_per_sample": 0.1, "warmup": 2, "corpus_bytes": 100_000}


def _arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--reference", action="store_true", help="loss per update in one process (no timing; long runs)")
    add("--quick", action="store_true", help="a tiny run that only proves the command works: " + str(QUICK))
    add("--stages", type=int, default=8)
    add("--microbatches", type=int, default=8, help="paci's m = a (and the reference runs')")
    add("--flush-microbatches", type=int, nargs="+", default=[8, 16, 32], help="1f1b's m whose throughput is measured")
    add("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add("--max-steps", type=int, help="updates (default 200; --reference 1000); the cosine's length")
    add("--val-every", type=int, help="validate every this many updates (default 25; --reference 50)")
    add("--warmup", type=int, help="warm-up updates (default 15; --reference 20)")
    add("--lr", type=float, default=1e-3)
    add("--recipe", choices=("cosine", "constant"), default="cosine", help="constant: no warm-up, no decay")
    add("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: momentum 0.9")
    add("--layers", type=int, help="transformer blocks (default: one per stage)")
    add("--dim", type=int, default=64, help="model width")
    add("--corpus-bytes", type=int, help="default 600000; --reference 2500000")
    add("--compensation", choices=("auto", "predict", "none"), default="auto", help="the time runs' paci")
    add("--rate-steps", type=int, default=12, help="steps of each flush throughput run")
    add("--target", type=float, help="validation loss to reach (default: the lowest common)")
    add("--fixed-ms", type=float, default=20.0, help="forward time per block and micro-batch")
    add("--ms-per-sample", type=float, default=2.5, help="forward time per block and sample")
    add("--configs", nargs="+", default=["paci:none", "paci:auto", "1f1b:none"],
        help="--reference: schedule:compensation[:recompute] (recompute: off or blocks); 1f1b is the baseline")
    add("--workers", type=int, default=2, help="--reference: runs in parallel (one thread each)")
    add("--rates", type=Path, metavar="JSON", help="--reference: a time run's --json, for the time axis")
    add("--plot", type=Path, metavar="PNG", help="the validation loss curves")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    defaults = {"max_steps": (200, 1000), "val_every": (25, 50), "warmup": (15, 20), "corpus_bytes": (6e5, 2.5e6)}
    for key, pair in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, int(pair[args.reference]))
    vars(args).update(QUICK if args.quick else {})
    return _reference_run(args) if args.reference else _time_run(args)


time_to_accuracy = Benchmark(_arguments, _run, __doc__ or "")
