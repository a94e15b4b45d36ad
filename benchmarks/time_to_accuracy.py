"""Time-to-accuracy on an emulated 8-stage cluster: PACI (a = m = 8) vs 1f1b at m in {8, 16, 32}, global batch fixed.

    cd benchmarks && python time_to_accuracy.py [--seeds 0 1 2] [--max-steps 120] [--target 2.6] [--json out.json]
                                                [--plot ../docs/time-to-accuracy.png]

A small causal transformer (8 blocks, one per stage) trains on the embedded standard-library corpus (byte tokens,
examples/train_gpt.py's corpus). Every block's forward sleeps ``ms_per_sample`` per sample of its micro-batch and
its backward twice that, so smaller micro-batches are cheaper, as on an accelerator, while 8 processes share 2
cores. The global batch (32 sequences) is the same for every configuration; validation loss is measured every
``--val-every`` steps. Reported: wall clock to reach ``--target`` validation loss, the validation loss at equal
samples (the last common step), and per-stage peak in-flight micro-batches.
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
from emulated import OneThread
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ByteBlocks, stdlib_corpus  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        ctx.seconds = 2 * seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, seconds_per_sample: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.seconds_per_sample = seconds_per_sample

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return _Sleep.apply(x, self.seconds_per_sample * x.shape[0])


class SleepyLM(L.LightningModule):
    def __init__(self, seconds_per_sample: float, layers: int = 8, dim: int = 64, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, 4, seconds_per_sample) for _ in range(layers))
        self.head = nn.Linear(dim, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
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
        return torch.optim.AdamW(self.parameters(), lr=2e-3, betas=(0.9, 0.95))


class Record(Callback):
    """Rank 0 appends (step, seconds since training started, val_loss) after every validation."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and "val_loss" in trainer.callback_metrics and trainer.global_step > 0:
            with self.path.open("a") as fh:
                fh.write(json.dumps([trainer.global_step, time.perf_counter() - self.start,
                                     float(trainer.callback_metrics["val_loss"])]) + "\n")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = trainer.strategy.runtime.peak_inflight  # type: ignore[attr-defined]
        with self.path.with_name(f"peak{trainer.strategy.stage_index}.json").open("w") as fh:  # type: ignore[attr-defined]
            json.dump(peak, fh)


def run(schedule: str, m: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    data = stdlib_corpus(600_000)
    split = int(len(data) * 0.95)
    train = DataLoader(ByteBlocks(data[:split], 64), batch_size=32, shuffle=True, drop_last=True,
                       generator=torch.Generator().manual_seed(seed))
    val = DataLoader(ByteBlocks(data[split:], 64), batch_size=32, drop_last=True)
    torch.manual_seed(seed)
    model = SleepyLM(args.ms_per_sample / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "curve.jsonl"
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=m, start_method="fork", partition="parameters",  # type: ignore[arg-type]
                                  timeout=timedelta(seconds=300)),
            accelerator="cpu", devices=8, max_steps=args.max_steps, val_check_interval=args.val_every,
            check_val_every_n_epoch=None, limit_val_batches=4, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, callbacks=[OneThread(), Record(path)],
        )
        trainer.fit(model, train, val)
        curve = [json.loads(line) for line in path.read_text().splitlines()]
        peaks = [json.loads((Path(tmp) / f"peak{s}.json").read_text()) for s in range(8)]
    return {"schedule": schedule, "microbatches": m, "seed": seed, "curve": curve, "peak_inflight": peaks}


def time_to(curve: list[list[float]], target: float) -> float:
    return next((t for _, t, loss in curve if loss <= target), math.inf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=2.6, help="validation loss to reach")
    parser.add_argument("--ms-per-sample", type=float, default=2.5, help="forward sleep per sample and block")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    configs = [("paci", 8), ("1f1b", 8), ("1f1b", 16), ("1f1b", 32)]
    results = [run(schedule, m, seed, args) for seed in args.seeds for schedule, m in configs]
    print(f"\n8 emulated stages, global batch 32, target val loss {args.target}, seeds {args.seeds}")
    print(f"{'config':>12} {'time to target (s), per seed':>32} {'mean':>7} {'val loss at equal samples':>26} "
          f"{'peak in-flight per stage':>26}")
    summary = {}
    for schedule, m in configs:
        mine = [r for r in results if r["schedule"] == schedule and r["microbatches"] == m]
        times = [time_to(r["curve"], args.target) for r in mine]
        final = [r["curve"][-1][2] for r in mine]
        name = f"{schedule} m={m}"
        summary[name] = {"times": times, "mean_time": sum(times) / len(times), "mean_final_loss": sum(final) / len(final),
                         "peak_inflight": mine[0]["peak_inflight"]}
        print(f"{name:>12} {', '.join(f'{t:.1f}' for t in times):>32} {summary[name]['mean_time']:>7.1f} "
              f"{summary[name]['mean_final_loss']:>26.4f} {str(mine[0]['peak_inflight']):>26}")
    fastest = min((v["mean_time"], k) for k, v in summary.items() if k.startswith("1f1b"))
    print(f"PACI speed-up to the target vs the fastest 1f1b ({fastest[1]}): "
          f"{fastest[0] / summary['paci m=8']['mean_time']:.2f}x; validation loss at equal samples: paci "
          f"{summary['paci m=8']['mean_final_loss']:.4f} vs {summary['1f1b m=8']['mean_final_loss']:.4f} (1f1b m=8)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "summary": summary}, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for schedule, m in configs:
            for i, r in enumerate(r for r in results if r["schedule"] == schedule and r["microbatches"] == m):
                ax.plot([p[1] for p in r["curve"]], [p[2] for p in r["curve"]], alpha=0.8,
                        color={"paci": "C0", 8: "C1", 16: "C2", 32: "C3"}[schedule if schedule == "paci" else m],
                        label=f"{schedule} m={m}" if i == 0 else None)
        ax.axhline(args.target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("wall clock (s)")
        ax.set_ylabel("validation loss")
        ax.set_title("8 emulated stages, global batch 32")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
