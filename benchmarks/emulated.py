"""An emulated accelerator cluster on a 2-core machine: each block's forward and backward are padded by a fixed
sleep, so N stage processes do not compete for the CPU while the loss is still computed for real.

Shared by the benchmarks; ``run_emulated`` trains through the real Lightning Trainer and returns every stage's
measured intervals.
"""

from __future__ import annotations

import json
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_paci import PACIStrategy
from lightning_paci.timeline import Interval


def sleep_until(deadline: float) -> None:
    """Hold the host until ``deadline`` (``time.perf_counter`` seconds), as waiting on an accelerator kernel would.

    A deadline rather than a duration: the block's real work (and Python's) runs *inside* its emulated time, as a
    GPU's host work overlaps its kernels. (Spinning the last 0.3 ms to remove time.sleep's ~0.17 ms late wake-up
    was measured too: 0.971/0.972 vs 0.972/0.969 steady efficiency, no difference, so it is not done.)
    """
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class _Sleep(torch.autograd.Function):
    """The block's output; forward returns at ``start + forward_s`` (its real work runs inside that time), backward
    takes ``backward_s`` from when it begins."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, start: float, forward_s: float, backward_s: float) -> torch.Tensor:
        sleep_until(start + forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        sleep_until(time.perf_counter() + ctx.backward_s)
        return grad, None, None, None


class SleepBlock(nn.Module):
    def __init__(self, dim: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        return _Sleep.apply(torch.tanh(self.linear(x)), start, self.forward_s, self.backward_s)


class _Scale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class EmulatedModel(L.LightningModule):
    """A plain regression model: ``self.blocks`` is an ``nn.Sequential`` of sleep-padded blocks."""

    def __init__(self, num_blocks: int, forward_s: float, backward_s: float, dim: int = 32, lr: float = 0.05,
                 input_scale: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[SleepBlock(dim, forward_s, backward_s) for _ in range(num_blocks)])
        self.lr = lr
        # like an embedding in front of the first block: its input then needs a gradient, so the first stage's
        # backward does the same matrix work as the others' (without it, stage 0 skips one product per backward)
        self.input_scale = _Scale(dim) if input_scale else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.input_scale is not None:
            x = self.input_scale(x)
        loss = F.mse_loss(self.blocks(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def emulated_loader(num_batches: int, batch_size: int, dim: int = 32, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_batches * batch_size, dim, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=batch_size, shuffle=False)


class OneThread(Callback):
    """One intra-op thread per stage process: an idle stage must not lend its core to its neighbour's matrix work,
    or the flush schedules' bubbles get partly filled and the comparison measures thread scheduling instead."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


class DumpIntervals(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime
        data = [list(iv) for iv in runtime.records.intervals]
        (self.directory / f"stage{trainer.strategy.stage_index}.json").write_text(json.dumps(data))


def run_emulated(*, num_stages: int, schedule: str, num_microbatches: int, num_minibatches: int,
                 blocks_per_stage: int = 2, forward_ms: float = 10.0, backward_ms: float = 20.0,
                 callbacks: list[Callback] | None = None, logger: Any = False, dim: int = 32,
                 microbatch_size: int = 2, input_scale: bool = False) -> list[list[Interval]]:
    """Train ``num_minibatches`` batches through ``Trainer(strategy=PACIStrategy(...))`` (forked ranks) and return
    each stage's measured intervals."""
    torch.manual_seed(0)
    model = EmulatedModel(num_stages * blocks_per_stage, forward_ms / 1e3, backward_ms / 1e3, dim=dim,
                          input_scale=input_scale)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=num_microbatches, start_method="fork",  # type: ignore[arg-type]
                                  timeout=timedelta(seconds=120)),
            accelerator="cpu", devices=num_stages, max_steps=num_minibatches, logger=logger, log_every_n_steps=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
            callbacks=[OneThread(), DumpIntervals(Path(tmp)), *(callbacks or [])],
        )
        trainer.fit(model, emulated_loader(num_minibatches, batch_size=num_microbatches * microbatch_size, dim=dim))
        return [[Interval(*iv) for iv in json.loads((Path(tmp) / f"stage{s}.json").read_text())]
                for s in range(num_stages)]


def run_seconds(stages: list[list[Interval]]) -> float:
    """Wall clock of a run: first action to last action over all stages."""
    return max(iv.end for ivs in stages for iv in ivs) - min(iv.start for ivs in stages for iv in ivs)


def steady_seconds(stages: list[list[Interval]], num_microbatches: int, num_minibatches: int) -> float:
    """Stage 0's time from the start of mini-batch 1 to the start of mini-batch K-1 (K-2 mini-batches, no pipeline
    fill and no final drain): the long-run rate of a run."""
    forward_start = {iv.microbatch: iv.start for iv in stages[0] if iv.kind == "F"}
    return forward_start[(num_minibatches - 1) * num_microbatches] - forward_start[num_microbatches]
