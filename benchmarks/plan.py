"""``plan="auto"`` against a measured grid over the same space, on the emulated cluster under a memory budget.

The model: 8 (or 16) blocks of ``tanh(linear(x))`` over a sequence, each padded to an uneven emulated cost of a
fixed part per call plus a part per sample (harness.py's emulated cluster, the cost scaled by the micro-batch's
samples), so that both the bubble and the per-call cost shape the best number of micro-batches. For 4 and 8
devices the budget is set below what the default plan (``microbatches = stages``, no recomputation, the parameter
split) is predicted to need, so the naive plan does not fit and the choice is between more micro-batches,
recomputation on the first stages and cuts moving blocks off them.

Per device count: one run with ``plan="auto"`` (its measured costs cached in the run's directory), then the grid:
every micro-batch count the search may pick, recomputation on the first 0, 1, 2, half or all stages, and for each
the parameter split and the search's fastest fitting cut. Every run trains through the Trainer with SGD for
``--minibatches`` batches and is measured: steady samples/s on stage 0's forward starts (batches 1 .. K-2) and each
stage's memory (parameters and gradients, plus the activation bytes the runtime's meter counts). The table gives
the auto run, the best grid run that stays within the budget, and their ratio (auto and the grid's three fastest
fitting runs rerun ``--repeats`` times, alternating, and compared by their medians: a grid's fastest single run is
biased up by its noise); auto's measured memory against the budget and its prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness import Benchmark, BlockClock, BlockEnter, BlockExit, OneThread, print_table
from lightning_paci import PACIStrategy
from lightning_paci.planner import Layout, ModelCosts, Space, search_plans

SEQ, DIM, BATCH = 16, 64, 32
# per block: (fixed ms per call, ms per sample) of the forward; the backward takes twice as long
PATTERN = [(1.0, 0.10), (1.5, 0.10), (3.0, 0.15), (1.0, 0.10), (2.0, 0.25), (1.0, 0.10), (1.5, 0.20), (2.5, 0.10)]


class SizedBlock(nn.Module):
    """``tanh(linear(x))`` padded to ``fixed + per_sample * samples`` of emulated forward time (twice for the
    backward); a recomputation runs the padded forward again."""

    def __init__(self, fixed_s: float, per_sample_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.fixed_s, self.per_sample_s = fixed_s, per_sample_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cost = self.fixed_s + self.per_sample_s * x.shape[0]
        clock = BlockClock(cost, 2 * cost)
        return BlockExit.apply(torch.tanh(self.linear(BlockEnter.apply(x, clock))), clock)


class Uneven(L.LightningModule):
    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        pattern = (PATTERN * (num_blocks // len(PATTERN) + 1))[:num_blocks]
        self.blocks = nn.Sequential(*[SizedBlock(f / 1e3, p / 1e3) for f, p in pattern])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.blocks(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * BATCH, SEQ, DIM, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=BATCH, shuffle=False)


class _Measure(L.Callback):
    """Each stage's forward starts, memory (parameters and gradients, plus metered activations) and options."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for runtime in trainer.strategy.runtimes.values():  # type: ignore[attr-defined]
            runtime.records.measure(activation_bytes=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.on_train_start(trainer, pl_module)  # the plan's check switches the meter off after its window

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        params = sum(p.numel() * p.element_size() for p in pl_module.parameters() if not p.is_meta)
        runtimes = strategy.runtimes.values()
        config = strategy.config
        (self.directory / f"stage{strategy.stage_index}.json").write_text(json.dumps({
            "forwards": [[iv[2], iv[3]] for r in runtimes for iv in r.records.intervals if iv[1] == "F"],
            "memory": 2 * params + sum(r.records.peak_activation_bytes for r in runtimes),
            "microbatches": strategy.num_microbatches, "partition": config.partition, "recompute":
                config.recompute_stages or (strategy.num_stages if config.recompute == "blocks" else 0)}))


def _run(root: Path, stages: int, blocks: int, batches: int, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(start_method="fork", timeout=timedelta(seconds=120), **options),
            accelerator="cpu", devices=stages, max_steps=batches, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            use_distributed_sampler=False, default_root_dir=root, callbacks=[OneThread(), _Measure(Path(tmp))])
        trainer.fit(Uneven(blocks), _loader(batches))
        rows = [json.loads((Path(tmp) / f"stage{s}.json").read_text()) for s in range(stages)]
    m = rows[0]["microbatches"]
    starts = dict(rows[0]["forwards"])
    steady = starts[(batches - 1) * m] - starts[m]
    return {"m": m, "cuts": rows[0]["partition"], "recompute": rows[0]["recompute"],
            "samples_per_s": (batches - 2) * BATCH / steady, "memory": [r["memory"] for r in rows]}


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--minibatches", type=int, default=8, help="batches per run (>= 3)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="final runs of auto and of the grid's three fastest, alternating; medians reported")
    parser.add_argument("--budget-share", type=float, default=0.75,
                        help="the memory budget as a share of the default plan's predicted peak")


def _plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for devices in args.devices:
        blocks = 2 * devices
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            _run(root, devices, blocks, 3, plan="auto")  # measures the costs once (cached for the runs below)
            (cache,) = (root / "paci_plan").glob("costs-*.json")
            costs = ModelCosts.from_json(json.loads(cache.read_text()))
            space = Space(schedule="paci", batch_size=BATCH, layouts=(Layout(devices),))
            every = search_plans(costs, space)
            uniform = tuple(range(0, blocks + 1, blocks // devices))
            naive = next(p for p in every if p.microbatches == devices and p.recompute_stages == 0)
            budget = args.budget_share * naive.peak_memory
            auto = _run(root, devices, blocks, args.minibatches, plan="auto", memory_budget=budget)
            naive_run = _run(root, devices, blocks, args.minibatches, partition=list(uniform[1:-1]))
            grid = []
            ks = sorted({0, 1, 2, devices // 2, devices})
            for m in sorted({p.microbatches for p in every}):
                for k in ks:
                    fitted = search_plans(costs, Space(schedule="paci", batch_size=BATCH, layouts=(Layout(devices),),
                                                       microbatches=m, recompute_stages=k, memory_budget=budget))
                    for cut in {uniform[1:-1], fitted[0].bounds[1:-1]}:
                        options: dict[str, Any] = {"microbatches": m, "partition": list(cut)}
                        if k:
                            options.update(recompute="blocks", recompute_stages=k if k < devices else None)
                        run = _run(root, devices, blocks, args.minibatches, **options)
                        run["fits"] = max(run["memory"]) <= budget
                        run["options"] = options
                        grid.append(run)
                        print(f"  {devices} devices: m={m} k={k} cuts={list(cut)}: {run['samples_per_s']:.1f} "
                              f"samples/s, peak {max(run['memory']) / 1024:.0f} KiB{'' if run['fits'] else ' (over)'}",
                              flush=True)
            # the grid's three fastest fitting runs and auto again, alternating, ``--repeats`` times: medians
            top = sorted((r for r in grid if r["fits"]), key=lambda r: -r["samples_per_s"])[:3]
            finals: dict[int, list[float]] = {i: [] for i in range(len(top) + 1)}
            for _ in range(args.repeats):
                finals[0].append(_run(root, devices, blocks, args.minibatches, plan="auto",
                                      memory_budget=budget)["samples_per_s"])
                for i, r in enumerate(top, 1):
                    finals[i].append(_run(root, devices, blocks, args.minibatches, **r["options"])["samples_per_s"])
        medians = {i: statistics.median(v) for i, v in finals.items()}
        best_i = max(range(1, len(top) + 1), key=lambda i: medians[i])
        best = top[best_i - 1]
        chosen = search_plans(costs, replace(space, memory_budget=budget))[0]
        out.append({"devices": devices, "blocks": blocks, "budget_kib": budget / 1024,
                    "naive_peak_kib": max(naive_run["memory"]) / 1024,
                    "auto": f"m={auto['m']} cuts={auto['cuts']} k={auto['recompute']}",
                    "auto_samples_per_s": medians[0], "auto_peak_kib": max(auto["memory"]) / 1024,
                    "auto_predicted_peak_kib": chosen.peak_memory / 1024,
                    "auto_predicted_samples_per_s": chosen.samples_per_s,
                    "best": f"m={best['m']} cuts={best['cuts']} k={best['recompute']}",
                    "best_samples_per_s": medians[best_i], "grid_runs": len(grid),
                    "auto_vs_best": medians[0] / medians[best_i],
                    "within_budget": max(auto["memory"]) <= budget})
    print_table("plan='auto' against the best measured grid run within the budget (emulated cluster, paci, SGD)",
                out, [("devices", "d"), ("budget_kib", ".0f"), ("naive_peak_kib", ".0f"), ("auto", "s"),
                      ("auto_samples_per_s", ".1f"), ("auto_predicted_samples_per_s", ".1f"), ("auto_peak_kib", ".0f"),
                      ("auto_predicted_peak_kib", ".0f"), ("best", "s"),
                      ("best_samples_per_s", ".1f"), ("auto_vs_best", ".3f"), ("grid_runs", "d"),
                      ("within_budget", "")])
    return out


plan = Benchmark(_plan_arguments, _plan, __doc__ or "")
