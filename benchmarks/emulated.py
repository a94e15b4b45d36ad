"""An emulated accelerator cluster on a 2-core machine: each block's forward and backward are padded by a fixed
sleep, so N stage processes do not compete for the CPU while the loss is still computed for real.

Shared by the benchmarks; ``run_emulated`` trains through the real Lightning Trainer and returns every stage's
measured intervals.
"""

from __future__ import annotations

import argparse
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
from lightning_paci.simulation.timeline import Interval

SPIN_S = 0.0003  # the last stretch of an emulated kernel is spun, not slept (see sleep_until)


def sleep_until(deadline: float) -> None:
    """Hold the host until ``deadline`` (``time.perf_counter`` seconds), as waiting on an accelerator kernel would.

    A deadline rather than a duration: the block's real work (and Python's) runs *inside* its emulated time, as a
    GPU's host work overlaps its kernels. The last ``SPIN_S`` are spun: ``time.sleep`` wakes 0.10-0.20 ms late on
    these shared cores (measured 2026-12-01), which a device does not (its kernel ends on time, and CUDA's default
    host wait spins when there are fewer processes than cores); with 10/20 ms blocks two late wake-ups per
    micro-batch and stage were ~1% of a stage's time, counted as our overhead.
    """
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class BlockClock:
    """One block call's emulated device times (seconds on ``time.perf_counter``)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.start = time.perf_counter()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.backward_start = 0.0
        self.input_grad = False  # whether the block's input needs a gradient (BlockEnter's backward runs)


class BlockEnter(torch.autograd.Function):
    """A block's input. Backward: return once the block's emulated backward time has passed since it began, so the
    block's real backward work (its other autograd nodes) runs inside that time, like its forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: BlockClock) -> torch.Tensor:
        ctx.clock = clock
        clock.input_grad = x.requires_grad
        return x.view_as(x)  # no copy: the block's activations stay what they would be without emulation

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        sleep_until(ctx.clock.backward_start + ctx.clock.backward_s)
        return grad, None


class BlockExit(torch.autograd.Function):
    """A block's output. Forward: return once the emulated forward time has passed since the block began;
    backward (the block's first node): note when the block's backward begins. A block whose input needs no gradient
    (the first stage's, without an embedding) has no ``BlockEnter`` backward: its time is slept here."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, clock: BlockClock) -> torch.Tensor:
        ctx.clock = clock
        out = y.clone()
        sleep_until(clock.start + clock.forward_s)
        # an empty saved tensor (0 bytes): a recomputation (non-reentrant torch.utils.checkpoint stops as soon as
        # every saved tensor is back) then runs through the emulated forward time, as a real block's last kernel
        ctx.save_for_backward(y.new_empty(0))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.saved_tensors  # noqa: B018  (unpacking it is what runs a recomputation, see forward)
        ctx.clock.backward_start = time.perf_counter()
        if not ctx.clock.input_grad:
            sleep_until(ctx.clock.backward_start + ctx.clock.backward_s)
        return grad, None


class SleepBlock(nn.Module):
    """``tanh(linear(x))`` taking ``forward_s`` of emulated device time and its backward ``backward_s``, its real
    work included (the first version slept ``backward_s`` and then ran the block's real backward after it)."""

    def __init__(self, dim: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock = BlockClock(self.forward_s, self.backward_s)
        return BlockExit.apply(torch.tanh(self.linear(BlockEnter.apply(x, clock))), clock)


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
                 microbatch_size: int = 2, input_scale: bool = False, recompute: str = "off") -> list[list[Interval]]:
    """Train ``num_minibatches`` batches through ``Trainer(strategy=PACIStrategy(...))`` (forked ranks) and return
    each stage's measured intervals."""
    torch.manual_seed(0)
    model = EmulatedModel(num_stages * blocks_per_stage, forward_ms / 1e3, backward_ms / 1e3, dim=dim,
                          input_scale=input_scale)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=num_microbatches, start_method="fork",  # type: ignore[arg-type]
                                  timeout=timedelta(seconds=120), recompute=recompute),  # type: ignore[arg-type]
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


def add_shape_arguments(parser: argparse.ArgumentParser, *, forward_ms: float = 10.0,
                        backward_ms: float = 20.0) -> None:
    """``--stages --microbatches --minibatches --forward-ms --backward-ms``: the emulated run's shape."""
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=10)
    parser.add_argument("--forward-ms", type=float, default=forward_ms)
    parser.add_argument("--backward-ms", type=float, default=backward_ms)


def steady_seconds(stages: list[list[Interval]], num_microbatches: int, num_minibatches: int) -> float:
    """Stage 0's time from the start of mini-batch 1 to the start of mini-batch K-1 (K-2 mini-batches, no pipeline
    fill and no final drain): the long-run rate of a run."""
    forward_start = {iv.microbatch: iv.start for iv in stages[0] if iv.kind == "F"}
    return forward_start[(num_minibatches - 1) * num_microbatches] - forward_start[num_microbatches]
