"""What every benchmark shares: the command line, the medians, the table, the JSON record, and the emulated cluster.

The emulated cluster exists because this project is measured on 2 shared CPU cores: each block's forward and
backward are padded to a fixed time by a sleep, so N stage processes do not compete for the cores while the loss is
still computed for real, and the schedules' speeds can be compared as ratios inside one run. ``run_emulated``
trains through the real Lightning Trainer and returns every stage's measured intervals.

A benchmark is a ``Benchmark``: its options (``arguments``) and a ``run`` that prints its table and returns what
``--json PATH`` writes, together with the command line, the date and the commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from lightning_paci.schedules import Interval

__all__ = ["Benchmark", "EmulatedModel", "OneThread", "add_shape_arguments", "emulated_loader", "floor_efficiency",
           "main", "median", "plot_curves", "print_table", "run_emulated", "run_seconds", "sleep_until",
           "steady_seconds", "time_to", "torch_step"]

ROOT = Path(__file__).resolve().parents[1]
SPIN_S = 0.0003  # the last stretch of an emulated kernel is spun, not slept (see sleep_until)


@dataclass(frozen=True)
class Benchmark:
    """One named benchmark: ``arguments`` adds its options, ``run`` prints its table and returns its JSON record;
    ``description`` is its ``--help`` text (what it measures, and how)."""

    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Any]
    description: str


def main(name: str, benchmark: Benchmark, argv: Sequence[str]) -> None:
    """Parse ``argv`` for ``benchmark``, run it quietly, and write ``--json`` with the command, date and commit."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=benchmark.description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.arguments(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures and the command here")
    args = parser.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    result = benchmark.run(args)
    if args.json is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        record = {"command": " ".join(["python -m benchmarks", name, *argv]),
                  "date": datetime.date.today().isoformat(), "commit": commit.stdout.strip() or None,
                  "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "result": result}
        args.json.write_text(json.dumps(record, indent=1))


def add_shape_arguments(parser: argparse.ArgumentParser, *, stages: Sequence[int] = (4, 8),
                        microbatches: Sequence[int] = (8,), minibatches: int = 10, forward_ms: float = 10.0,
                        backward_ms: float = 20.0, blocks_per_stage: int = 2, repeats: int = 1) -> None:
    """The emulated run's shape: ``--stages --microbatches --minibatches --forward-ms --backward-ms
    --blocks-per-stage``, and ``--repeats`` (each figure is the median of that many alternating runs)."""
    parser.add_argument("--stages", type=int, nargs="+", default=list(stages), help="pipeline stages N")
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(microbatches),
                        help="micro-batches m per mini-batch")
    parser.add_argument("--minibatches", type=int, default=minibatches, help="mini-batches K per run (>= 3)")
    parser.add_argument("--forward-ms", type=float, default=forward_ms, help="emulated forward time per block")
    parser.add_argument("--backward-ms", type=float, default=backward_ms, help="emulated backward time per block")
    parser.add_argument("--blocks-per-stage", type=int, default=blocks_per_stage)
    parser.add_argument("--repeats", type=int, default=repeats, help="runs per figure; the median is reported")


def median(values: Sequence[float]) -> float:
    """The median of the repeats (the middle run, or the mean of the two middle ones)."""
    return float(statistics.median(values))


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    """``rows`` as a plain-text table: ``columns`` are (key, format spec); ``None`` prints as n/a."""
    cells = [[key for key, _ in columns]]
    for row in rows:
        cells.append(["n/a" if row.get(key) is None else format(row[key], spec) for key, spec in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def time_to(curve: Sequence[tuple[int, float, float]], target: float) -> float:
    """First time the loss reaches ``target`` on ``curve`` (updates, seconds, loss), linearly interpolated between
    its points; inf if never."""
    previous = None
    for point in curve:
        if point[2] <= target:
            if previous is None or previous[2] <= target:
                return point[1]
            return previous[1] + (point[1] - previous[1]) * (previous[2] - target) / (previous[2] - point[2])
        previous = point
    return math.inf


def plot_curves(curves: dict[str, list[tuple[float, float]]], xlabel: str, path: Path, target: float | None) -> None:
    """Loss curves (x, loss) by name, to a PNG; dashed where the name says "rescaled"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot([x for x, _ in curve], [y for _, y in curve], marker="o", markersize=3,
                linestyle="--" if "rescaled" in name else "-", label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (mean of the seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the emulated cluster --------------------------------------------------------------------------------------


def sleep_until(deadline: float) -> None:
    """Hold the host until ``deadline`` (``time.perf_counter`` seconds), as waiting on an accelerator kernel would.

    A deadline rather than a duration: the block's real work (and Python's) runs *inside* its emulated time, as a
    GPU's host work overlaps its kernels. The last ``SPIN_S`` are spun: ``time.sleep`` wakes 0.10-0.20 ms late on
    these shared cores, which a device does not; with 10/20 ms blocks two late wake-ups per micro-batch and stage
    would be ~1% of a stage's time, counted as the framework's overhead.
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
    work included."""

    def __init__(self, dim: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock = BlockClock(self.forward_s, self.backward_s)
        return BlockExit.apply(torch.tanh(self.linear(BlockEnter.apply(x, clock))), clock)


class EmulatedModel(L.LightningModule):
    """A plain regression model: ``self.blocks`` is an ``nn.Sequential`` of sleep-padded blocks, SGD."""

    def __init__(self, num_blocks: int, forward_s: float, backward_s: float, dim: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[SleepBlock(dim, forward_s, backward_s) for _ in range(num_blocks)])
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.blocks(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def emulated_loader(num_batches: int, batch_size: int, dim: int = 32, seed: int = 0) -> DataLoader:
    """``num_batches`` fixed batches of ``(x, tanh(flip(x)))``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_batches * batch_size, dim, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=batch_size, shuffle=False)


class OneThread(Callback):
    """One intra-op thread per stage process: an idle stage must not lend its core to its neighbour's matrix work,
    or the flush schedules' bubbles get partly filled and the comparison measures thread scheduling instead."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


class _DumpIntervals(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy: Any = trainer.strategy
        process = strategy.stage_index  # with virtual stages the process's stages' intervals, in its row
        data = [[process, *iv[1:]] for runtime in strategy.runtimes.values() for iv in runtime.records.intervals]
        (self.directory / f"stage{process}.json").write_text(json.dumps(data))


def run_emulated(*, num_stages: int, schedule: str, num_microbatches: int, num_minibatches: int,
                 blocks_per_stage: int = 2, forward_ms: float = 10.0, backward_ms: float = 20.0,
                 callbacks: list[Callback] | None = None, logger: Any = False,
                 recompute: str = "off", virtual_stages: int = 1, placement: str = "loop",
                 max_stream_batches: int = 256) -> list[list[Interval]]:
    """Train ``num_minibatches`` batches through ``Trainer(strategy=PACIStrategy(...))`` (forked ranks, 2 samples
    per micro-batch) and return each stage's measured intervals (with ``virtual_stages``: each process's, its
    stages' together, over ``blocks_per_stage`` blocks per process)."""
    torch.manual_seed(0)
    model = EmulatedModel(num_stages * blocks_per_stage, forward_ms / 1e3, backward_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=PACIStrategy(schedule=schedule, microbatches=num_microbatches,  # type: ignore[arg-type]
                                  start_method="fork", timeout=timedelta(seconds=120),
                                  recompute=recompute, virtual_stages=virtual_stages,  # type: ignore[arg-type]
                                  placement=placement, max_stream_batches=max_stream_batches),  # type: ignore[arg-type]
            accelerator="cpu", devices=num_stages, max_steps=num_minibatches, logger=logger, log_every_n_steps=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
            callbacks=[OneThread(), _DumpIntervals(Path(tmp)), *(callbacks or [])],
        )
        trainer.fit(model, emulated_loader(num_minibatches, batch_size=num_microbatches * 2))
        return [[Interval(*iv) for iv in json.loads((Path(tmp) / f"stage{s}.json").read_text())]
                for s in range(num_stages)]


def torch_step(schedule: Any, optimizer: torch.optim.Optimizer, rank: int, world: int, x: torch.Tensor,
               y: torch.Tensor) -> None:
    """One mini-batch through a torch.distributed.pipelining schedule on this rank -- the first rank feeds the
    inputs, the last the targets, a lone rank both -- then the optimizer's step."""
    if rank == 0:
        schedule.step(x, target=y) if world == 1 else schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad()


def run_seconds(stages: Sequence[Sequence[Interval]]) -> float:
    """Wall clock of a run: first action to last action over all stages."""
    return max(iv.end for ivs in stages for iv in ivs) - min(iv.start for ivs in stages for iv in ivs)


def steady_seconds(stages: Sequence[Sequence[Interval]], num_microbatches: int, num_minibatches: int) -> float:
    """Stage 0's time from the start of mini-batch 1 to the start of mini-batch K-1 (K-2 mini-batches, no pipeline
    fill and no final drain): the long-run rate of a run."""
    if num_minibatches < 3:
        sys.exit(f"--minibatches ({num_minibatches}) must be at least 3: the steady window is mini-batches 1..K-2")
    forward_start = {iv.microbatch: iv.start for iv in stages[0] if iv.kind == "F"}
    return forward_start[(num_minibatches - 1) * num_microbatches] - forward_start[num_microbatches]


_FLOOR_BYTES = 16384  # one message of the size our first framed buffer has (FIRST_BYTES)


def _floor_stage(rank: int, shape: tuple[int, int, int, float, float], path: str, out: str) -> None:
    import torch.distributed as dist

    from lightning_paci import build_schedule
    from lightning_paci.schedules import RECV_B, RECV_F, SEND_B, SEND_F, B
    from lightning_paci.schedules import F as FORWARD

    n, m, k, forward_s, backward_s = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    # one group per neighbour pair and direction (the "directed" layout), created in the same order on every rank
    links = {(kind, s): dist.new_group([s, s + 1]) for s in range(n - 1) for kind in ("F", "B")}
    actions = build_schedule("paci", n, m, m, k).actions[rank]
    peer_of = {SEND_F: rank + 1, SEND_B: rank - 1, RECV_F: rank - 1, RECV_B: rank + 1}
    link_of = {SEND_F: ("F", rank), SEND_B: ("B", rank - 1), RECV_F: ("F", rank - 1), RECV_B: ("B", rank)}
    left = {kind: sum(a.kind is kind for a in actions) for kind in (RECV_F, RECV_B)}
    posted: dict[Any, Any] = {}

    def post(kind: Any) -> None:  # each receive posted as soon as the previous one of its link completed
        group = links[link_of[kind]]
        buffer = torch.empty(_FLOOR_BYTES, dtype=torch.uint8)
        posted[kind] = (group.recv([buffer], dist.get_group_rank(group, peer_of[kind]), 0), buffer)

    message = torch.zeros(_FLOOR_BYTES, dtype=torch.uint8)
    sends = []
    starts: dict[int, float] = {}
    host = 0.0  # thread CPU seconds of the message actions (posting, waiting, sending) in the steady window
    for kind, count in left.items():
        if count:
            post(kind)
    dist.barrier()
    for action in actions:
        kind = action.kind
        if kind is FORWARD:
            starts[action.microbatch] = time.perf_counter()
            sleep_until(starts[action.microbatch] + forward_s)
        elif kind is B:
            sleep_until(time.perf_counter() + backward_s)
        elif kind in peer_of:  # a message (OPT does nothing here)
            begin = time.thread_time()
            if kind is SEND_F or kind is SEND_B:
                group = links[link_of[kind]]
                sends.append(group.send([message], dist.get_group_rank(group, peer_of[kind]), 0))
            elif kind is RECV_F or kind is RECV_B:
                posted.pop(kind)[0].wait()
                left[kind] -= 1
                if left[kind]:
                    post(kind)
            if m <= action.microbatch < (k - 1) * m:
                host += time.thread_time() - begin
    for work in sends:
        work.wait()
    Path(f"{out}.host{rank}").write_text(json.dumps(host / ((k - 2) * m) * 1e6))
    if rank == 0:
        Path(out).write_text(json.dumps(starts[(k - 1) * m] - starts[m]))
    dist.barrier()
    dist.destroy_process_group()


def floor_efficiency(num_stages: int, num_microbatches: int, num_minibatches: int, forward_ms: float,
                     backward_ms: float, host_us: list[float] | None = None) -> float:
    """The ceiling of this machine for a flush-free 1F1B on the emulated cluster: every stage's ``"paci"`` list
    executed with nothing but the emulated kernels and one raw 16 KiB gloo message per send (directed groups,
    receives posted ahead) -- no framing, no model, no Lightning. Steady efficiency as ``steady_seconds`` measures
    it; whatever a real runtime adds comes on top of this. ``host_us``, if given, gets each stage's thread CPU
    microseconds per micro-batch in its message actions (the loop's only host work outside the kernels)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "steady")
        shape = (num_stages, num_microbatches, num_minibatches, forward_ms / 1e3, backward_ms / 1e3)
        mp.start_processes(_floor_stage, args=(shape, str(Path(tmp) / "rdv"), out), nprocs=num_stages,
                           start_method="fork")
        steady = json.loads(Path(out).read_text())
        if host_us is not None:
            host_us.extend(json.loads(Path(f"{out}.host{rank}").read_text()) for rank in range(num_stages))
    return (num_minibatches - 2) * num_microbatches * (forward_ms + backward_ms) / 1e3 / steady
