"""Time-to-accuracy on an emulated 8-stage cluster: PACI (a = m = 8) vs 1f1b at m in {8, 16, 32}, global batch fixed.

    cd benchmarks && python time_to_accuracy.py [--seeds 0 1 2] [--max-steps 200] [--val-every 25]
                                                [--json out.json] [--plot ../docs/time-to-accuracy.png]

A small causal transformer (8 blocks, one per stage) trains on the embedded standard-library corpus (byte tokens,
examples/train_gpt.py's corpus) with AdamW, a linear LR warm-up and a cosine decay to 10% (the paper's recipe).

Emulated accelerator: every block's forward takes ``fixed_ms + ms_per_sample * samples`` and its backward twice that
(the real CPU work runs inside that time and the rest is slept, so 8 processes do not compete for 2 cores; the loss
is still computed for real). The fixed part is what makes
small micro-batches inefficient on a real accelerator (kernel launches, weight reads, under-filled matrix units):
the reason the paper's fastest flush schedule used moderate micro-batches rather than the smallest. With
``--fixed-ms 0`` the cost is purely per sample and more micro-batches only shrink the bubble.

Method (the paper's, section 7): the flush schedules run the same SGD for every m (the tests prove 1f1b equals
single-device gradient accumulation), so their throughput is measured for every m over a short run, only the
fastest is trained to the end, and the others' curves are that curve rescaled by their measured throughput.

Validation never runs inside the training: every stage keeps a copy of its weights right after its k-th update
(k = every ``--val-every``), which needs no synchronisation and no drain, and the parent process evaluates each
version on the whole held-out split afterwards. The time of version k is when stage 0, the last to update, got
there. (Validating inside the run would drain the PACI pipeline at every validation, a cost that a real run,
validating every few thousand steps, does not pay, and would charge both schedules the validation time.)
Reported, per seed and as the mean of the seeds:

* the wall clock to train the whole budget (``--max-steps`` mini-batches of 32 sequences);
* the time to reach the target validation loss: by default the *lowest common* loss (the highest final mean loss
  of the trained configurations, which every one of them reaches), linearly interpolated between validations;
  and the speed-up at every loss level the fastest flush run passed at one of its validations;
* the validation loss at equal samples (every validation step) and its relative difference;
* per-stage peak in-flight micro-batches and the activation bytes they keep alive (``MemoryMonitor``'s figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_paci import PACIStrategy

from emulated import BlockClock, BlockEnter, BlockExit, OneThread

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ByteBlocks, stdlib_corpus  # noqa: E402

NUM_STAGES = 8
GLOBAL_BATCH = 32
CONTEXT = 64


class Block(nn.Module):
    """A pre-norm transformer block whose forward takes ``fixed_s + seconds_per_sample * samples`` of emulated
    device time and its backward twice that: the real CPU work runs *inside* that time, as a GPU's host work
    overlaps its kernels, so CPU contention between the 8 stage processes does not change the emulated costs
    (a block whose real work took longer would take its real time)."""

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
    def __init__(self, fixed_s: float, seconds_per_sample: float, *, max_steps: int, lr: float, warmup: int,
                 layers: int = NUM_STAGES, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Embedding(CONTEXT, dim)
        self.blocks = nn.ModuleList(Block(dim, 4, fixed_s, seconds_per_sample) for _ in range(layers))
        self.head = nn.Linear(dim, 256)
        self.max_steps, self.lr, self.warmup = max_steps, lr, warmup

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (micro-batch, T) -> logits (micro-batch, T, 256)
        t = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)

        def factor(update: int) -> float:  # per local update: linear warm-up, cosine to 10% of the peak
            if update < self.warmup:
                return (update + 1) / self.warmup
            progress = min(1.0, (update - self.warmup) / max(1, self.max_steps - self.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def copy_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A carved stage's state dict (only its own tensors), cloned so training can go on."""
    return {k: v.detach().clone() for k, v in state.items()}


class Record(Callback):
    """Every stage keeps its weights right after its k-th update for k = every, 2 * every, ... (the runtime's
    ``update_hooks``); rank 0 notes when it got there and the end of every training batch; every stage writes its
    peak in-flight micro-batches and activation bytes.

    Each stage reaches version k on its own, nothing synchronises and the pipeline never drains for it. Stage 0
    updates last (the backward ends there), so its clock says when the whole version-k model exists. The validation
    loss of each version is computed afterwards, in the parent process: validating inside the run would drain the
    PACI pipeline each time and charge both schedules the validation time.
    """

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
                self.versions[version] = (time.perf_counter() - self.start, copy_state(pl_module.state_dict()))

        runtime.update_hooks.append(keep)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_ends.append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime  # type: ignore[attr-defined]
        stage = trainer.strategy.stage_index  # type: ignore[attr-defined]
        for version, (_, weights) in self.versions.items():
            torch.save(weights, self.directory / f"stage{stage}_v{version}.pt")
        optimizer = runtime.optimizer.optimizer
        model_bytes = sum(t.numel() * t.element_size() for t in [p for g in optimizer.param_groups for p in g["params"]]
                          + [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)])
        record = {"peak_inflight": runtime.records.peak_inflight,
                  "model_bytes": model_bytes,  # parameters + optimizer state
                  "lookahead_bytes": runtime.lookahead.peak_extra_bytes if runtime.lookahead is not None else 0,
                  "peak_activation_bytes": runtime.records.peak_activation_bytes,
                  "seconds": time.perf_counter() - self.start, "batch_ends": self.batch_ends,
                  "version_times": {v: t for v, (t, _) in self.versions.items()}}
        (self.directory / f"stage{stage}.json").write_text(json.dumps(record))


def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    data = stdlib_corpus(600_000)
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


def evaluate(directory: Path, versions: list[int], args: argparse.Namespace) -> list[float]:
    """Validation loss of every saved version: the stages' weights merged into one full model, the whole held-out
    split (5% of the corpus) evaluated in this process."""
    val = DataLoader(ByteBlocks(_corpus()[1], CONTEXT), batch_size=GLOBAL_BATCH)
    model = SleepyLM(0.0, 0.0, max_steps=args.max_steps, lr=args.lr, warmup=args.warmup)
    losses = []
    for version in versions:
        weights: dict[str, torch.Tensor] = {}
        for stage in range(NUM_STAGES):
            weights.update(torch.load(directory / f"stage{stage}_v{version}.pt"))
        model.load_state_dict(weights)
        with torch.no_grad():
            total = sum(float(model._loss(b)) * b.shape[0] for b in val)
        losses.append(total / len(val.dataset))
    return losses


def run(schedule: str, m: int, seed: int, max_steps: int, args: argparse.Namespace, *,
        validate: bool = True) -> dict[str, Any]:
    train_data, _ = _corpus()
    train = DataLoader(ByteBlocks(train_data, CONTEXT), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True,
                       generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    model = SleepyLM(args.fixed_ms / 1e3, args.ms_per_sample / 1e3, max_steps=args.max_steps, lr=args.lr,
                     warmup=args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        every = args.val_every if validate else max_steps + 1
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=m, start_method="fork", partition="parameters",  # type: ignore[arg-type]
                                  timeout=timedelta(seconds=300), compensation=args.compensation),
            accelerator="cpu", devices=NUM_STAGES, max_steps=max_steps, limit_val_batches=0,
            num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False,
            callbacks=[OneThread(), Record(Path(tmp), every)],
        )
        trainer.fit(model, train)
        stages = [json.loads((Path(tmp) / f"stage{s}.json").read_text()) for s in range(NUM_STAGES)]
        times = {int(v): t for v, t in stages[0]["version_times"].items()}
        versions = sorted(v for v in times if all(str(v) in st["version_times"] for st in stages))
        curve = [[v, times[v], loss] for v, loss in zip(versions, evaluate(Path(tmp), versions, args))]
    return {"schedule": schedule, "microbatches": m, "seed": seed, "curve": curve,
            "seconds": stages[0]["seconds"], "batch_ends": stages[0]["batch_ends"],
            "peak_inflight": [st["peak_inflight"] for st in stages],
            "peak_activation_bytes": [st["peak_activation_bytes"] for st in stages],
            "model_bytes": [st["model_bytes"] for st in stages],
            "lookahead_bytes": [st["lookahead_bytes"] for st in stages]}


def steps_per_second(result: dict[str, Any], skip: int) -> float:
    """Lightning batches per second on rank 0 after the first ``skip`` (start-up excluded)."""
    ends = result["batch_ends"]
    return (len(ends) - 1 - skip) / (ends[-1] - ends[skip])


def mean_curve(runs: list[dict[str, Any]], scale: float = 1.0) -> list[tuple[int, float, float]]:
    """(step, mean seconds, mean val loss) over seeds, times multiplied by ``scale``."""
    out = []
    for points in zip(*(r["curve"] for r in runs)):
        assert len({p[0] for p in points}) == 1, "seeds validated at different steps"
        out.append((points[0][0], scale * sum(p[1] for p in points) / len(points),
                    sum(p[2] for p in points) / len(points)))
    return out


def time_to(curve: list[tuple[int, float, float]], target: float) -> float:
    """First time the validation loss reaches ``target``, linearly interpolated between validations."""
    previous = None
    for step, seconds, loss in curve:
        if loss <= target:
            if previous is None or previous[2] <= target:
                return seconds
            _, t0, l0 = previous
            return t0 + (seconds - t0) * (l0 - target) / (l0 - loss)
        previous = (step, seconds, loss)
    return math.inf


def _speedup(flush_seconds: float, paci_seconds: float) -> float:
    """flush time / PACI time; 0.0 when PACI never reached the level, inf when only PACI did."""
    if math.isinf(paci_seconds):
        return 0.0
    return flush_seconds / paci_seconds


def _ratio(x: float) -> str:
    return "PACI did not reach it" if x == 0.0 else ("1f1b did not reach it" if math.isinf(x) else f"{x:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--val-every", type=int, default=25, help="validate every this many updates")
    parser.add_argument("--rate-steps", type=int, default=12, help="steps of each flush throughput run")
    parser.add_argument("--target", type=float, help="validation loss to reach (default: the lowest common)")
    parser.add_argument("--fixed-ms", type=float, default=20.0, help="forward sleep per block and micro-batch")
    parser.add_argument("--ms-per-sample", type=float, default=2.5, help="forward sleep per block and sample")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=15, help="warm-up updates")
    parser.add_argument("--compensation", choices=("auto", "lookahead", "none"), default="auto",
                        help="PACIStrategy(compensation=...) of the paci runs (flush schedules have no drift)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--report", metavar="JSON", help="print and plot the runs saved by an earlier --json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    flush_ms = (8, 16, 32)

    if args.report:
        saved = json.loads(Path(args.report).read_text())
        for key in ("seeds", "max_steps", "fixed_ms", "ms_per_sample"):
            setattr(args, key, saved["args"][key])
        args.compensation = saved["args"].get("compensation", "none")  # files before the option: none
        runs = saved["runs"]
        rate_runs = {r["microbatches"]: r for r in runs if not r["curve"]}
        paci = [r for r in runs if r["schedule"] == "paci"]
        flush = [r for r in runs if r["schedule"] == "1f1b" and r["curve"]]
    else:
        # 1. throughput of every flush configuration (no validation), the fastest is trained to the end
        rate_runs = {m: run("1f1b", m, args.seeds[0], args.rate_steps, args, validate=False) for m in flush_ms}
    rates = {m: steps_per_second(rate_runs[m], skip=2) for m in flush_ms}
    fastest = max(flush_ms, key=lambda m: rates[m])
    print("1f1b throughput (steps/s): " + ", ".join(f"m={m} {rates[m]:.3f}" for m in flush_ms) + f" -> m={fastest}")
    if not args.report:  # 2. full runs: paci and the fastest flush, every seed
        paci = [run("paci", 8, seed, args.max_steps, args) for seed in args.seeds]
        flush = [run("1f1b", fastest, seed, args.max_steps, args) for seed in args.seeds]
    curves = {"paci m=8": mean_curve(paci)}
    for m in flush_ms:  # the flush curves: the fastest measured, the others rescaled by throughput
        curves[f"1f1b m={m}"] = mean_curve(flush, rates[fastest] / rates[m])
    target = args.target if args.target is not None else max(c[-1][2] for c in curves.values())
    times = {name: time_to(c, target) for name, c in curves.items()}
    best_flush = min((times[f"1f1b m={m}"], m) for m in flush_ms)
    per_seed = [_speedup(time_to(mean_curve([f]), target), time_to(mean_curve([p]), target))
                for p, f in zip(paci, flush)]

    print(f"\n{NUM_STAGES} emulated stages, global batch {GLOBAL_BATCH}, {args.max_steps} steps, seeds {args.seeds}, "
          f"paci compensation={args.compensation!r}, "
          f"block forward {args.fixed_ms} ms + {args.ms_per_sample} ms/sample, backward 2x")
    print(f"{'config':>10} {'wall clock (s)':>15} {'time to target (s)':>19} {'final val loss':>15} "
          f"{'peak in-flight per stage':>26} {'peak activation KiB per stage':>40}")
    rows = []
    for name, curve in curves.items():
        runs = paci if name.startswith("paci") else flush
        trained = name.startswith("paci") or name == f"1f1b m={fastest}"
        scale = 1.0 if name.startswith("paci") else rates[fastest] / rates[int(name.split("=")[1])]
        wall = scale * sum(r["seconds"] for r in runs) / len(runs)
        memory = runs[0] if trained else rate_runs[int(name.split("=")[1])]
        row = {"config": name, "wall_clock_s": wall, "time_to_target_s": times[name], "final_val_loss": curve[-1][2],
               "trained": trained, "peak_inflight": memory["peak_inflight"],
               "peak_activation_bytes": memory["peak_activation_bytes"]}
        rows.append(row)
        kib = " ".join(f"{b / 1024:.0f}" for b in memory["peak_activation_bytes"])
        print(f"{name:>10} {wall:>15.1f} {times[name]:>19.1f} {curve[-1][2]:>15.4f} "
              f"{str(memory['peak_inflight']):>26} {kib:>40}" + ("" if trained else "  (time rescaled)"))
    if "lookahead_bytes" in paci[0]:  # the look-ahead's memory against the stage's parameters, state, activations
        base = [a + b for a, b in zip(paci[0]["model_bytes"], paci[0]["peak_activation_bytes"])]
        extra = paci[0]["lookahead_bytes"]
        print("per-stage peak memory, parameters + optimizer state + activations (KiB): "
              + " ".join(f"{b / 1024:.0f}" for b in base) + "; look-ahead's extra: "
              + " ".join(f"{e / 1024:.1f} ({100 * e / b:.2f}%)" for e, b in zip(extra, base)))
    speedup = _speedup(best_flush[0], times["paci m=8"])
    equal = [(step, p, f, (p - f) / f)
             for (step, _, p), (_, _, f) in zip(curves["paci m=8"], curves[f"1f1b m={fastest}"])]
    print(f"wall clock for the {args.max_steps}-step budget: paci {rows[0]['wall_clock_s']:.1f} s, "
          f"fastest 1f1b {rows[1 + flush_ms.index(fastest)]['wall_clock_s']:.1f} s: "
          f"{rows[1 + flush_ms.index(fastest)]['wall_clock_s'] / rows[0]['wall_clock_s']:.2f}x")
    print(f"target val loss {target:.4f}; PACI reaches it {_ratio(speedup)} sooner than the fastest 1f1b "
          f"(m={best_flush[1]}) "
          f"(per seed, own curves: {', '.join(_ratio(x) for x in per_seed)})")
    ladder = []  # every quality level the fastest flush passed at a validation: how much sooner PACI got there
    for step, seconds, loss in curves[f"1f1b m={fastest}"]:
        ladder.append((step, loss, _speedup(seconds, time_to(curves["paci m=8"], loss))))
    print("speed-up at the loss the fastest 1f1b had at each validation: " +
          "; ".join(f"step {s} ({loss:.3f}): {_ratio(x)}" for s, loss, x in ladder))
    print("val loss at equal samples, paci vs 1f1b (mean of seeds): " +
          "; ".join(f"step {s}: {p:.4f} vs {f:.4f} ({100 * d:+.2f}%)" for s, p, f, d in equal))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rates": rates, "target": target, "speedup": speedup,
                                               "per_seed_speedup": per_seed, "rows": rows, "equal_samples": equal,
                                               "ladder": ladder,
                                               "runs": paci + flush + list(rate_runs.values())}, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        colors = {"paci m=8": "C0", "1f1b m=8": "C1", "1f1b m=16": "C2", "1f1b m=32": "C3"}
        for name, curve in curves.items():
            trained = name.startswith("paci") or name == f"1f1b m={fastest}"
            ax.plot([p[1] for p in curve], [p[2] for p in curve], marker="o", markersize=3, color=colors[name],
                    linestyle="-" if trained else "--", label=name + ("" if trained else " (rescaled)"))
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("wall clock (s)")
        ax.set_ylabel(f"validation loss (mean of {len(args.seeds)} seeds)")
        ax.set_title(f"{NUM_STAGES} emulated stages, global batch {GLOBAL_BATCH}: time to accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
