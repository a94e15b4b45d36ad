"""Virtual stages on the emulated cluster: the flush schedules over loops against the simulator and torch, and the
cost of a drain and refill under paci.

Each device runs ``v`` chunks of ``blocks / v`` sleep-padded blocks (``benchmarks.harness``; the device's work per
micro-batch is the same for every ``v``) through our bare engine -- a ``DeviceRuntime`` of one ``StageRuntime`` per
chunk over gloo, in forked processes, no Trainer -- and the same chunks through torch.distributed.pipelining's
``ScheduleInterleaved1F1B`` (for ``"interleaved"``) or ``ScheduleLoopedBFS`` (for ``"bfs"``), one
``PipelineStage`` per chunk, chunk ``c`` on rank ``c mod P``. Efficiency is the bubble-free limit
``m * blocks * (F + B)`` per mini-batch over the measured time from the start of mini-batch 1 to that of ``K - 1``
(as in ``vs_torch``); the simulator's prediction for the same lists and costs is ``1 - `` its steady bubble,
``(P-1)/(v*m+P-1)`` for both schedules.

``"paci"`` rows measure what loops buy PACI: nothing in the steady state (it has no bubble), a shorter fill and
drain. Each runs ``K`` and ``2K`` mini-batches: the second run's extra time is ``K`` steady mini-batches (its
efficiency is the one shown), so a fill and a drain cost ``2 T(K) - T(2K)``, against the simulator's
``(P-1) * blocks * (F+B) / v``.

``--trainer`` runs ours through ``Trainer(strategy=PACIStrategy(virtual_stages=v))`` (``harness.run_emulated``: the
same blocks, the process's stages carved out of one module) instead of the bare engine; its ``"paci"`` rows compare
``K`` mini-batches in one stream with the same ``K`` drained and refilled after ``K/2`` (``max_stream_batches``), so
the figure is a drain and fill in the middle of training, as validation or a checkpoint causes (the first stream's
fill also pays one-time costs, the first forward's checks among them).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import (
    Benchmark,
    EmulatedModel,
    add_shape_arguments,
    emulated_loader,
    median,
    print_table,
    run_emulated,
    run_seconds,
    steady_seconds,
    torch_step,
)
from lightning_paci import build_schedule, simulate_schedule
from lightning_paci.schedules import layout_communicators, stage_devices, static_drift

__all__ = ["virtual"]

Shape = tuple[str, int, int, int, int, float, float, int]  # name, P, v, m, K, F ms, B ms, blocks per device
WARMUP = 2  # mini-batches of the stream run before the measured one


def _ours(rank: int, shape: Shape, path: str, out: str) -> None:
    from lightning_paci.engine.runtime.microbatch import loss_scale_for, split_microbatches
    from lightning_paci.engine.runtime.runtime import StageRuntime
    from lightning_paci.engine.runtime.virtual_stages import ChunkComm, DeviceRuntime, local_network
    from lightning_paci.engine.transport.point_to_point import DistComm
    from lightning_paci.integration.stage.lightning_program import LightningStageProgram
    from lightning_paci.optim.stage_optimizer import StageOptimizer
    from lightning_paci.partition import carve_stage, plan_partition

    name, p, v, m, k, fwd_ms, bwd_ms, blocks = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=p)
    devices = stage_devices(p, v, "loop")
    num_stages = len(devices)
    groups = {key: dist.new_group(list(members))
              for key, members in layout_communicators("directed", num_stages, 1, devices).items()}
    torch.manual_seed(0)
    model = EmulatedModel(blocks * p, fwd_ms / 1e3, bwd_ms / 1e3)
    plan = plan_partition(model, num_stages, partition="parameters")
    mine = [s for s in range(num_stages) if devices[s] == rank]
    local = local_network(mine, num_stages)
    runtimes = {}
    for s in mine:
        module = copy.deepcopy(model)
        carve = carve_stage(module, plan, s)
        params = list(module.parameters())
        comm = ChunkComm(DistComm(list(devices), groups=groups, stage=s), local[s], frozenset(mine) - {s})
        runtimes[s] = StageRuntime(s, num_stages, LightningStageProgram(module, carve), comm,
                                   StageOptimizer(torch.optim.SGD(params, lr=0.05), params), loss_scale=1.0)
    device = DeviceRuntime(runtimes)
    # a stream of WARMUP mini-batches first: every chunk's first forward and backward and every link's first
    # message cost tens of milliseconds once, which no schedule decides; then the measured stream
    for stream, length in (("warm-up", WARMUP), ("measured", k)):
        lists = build_schedule(name, p, m, m, length, virtual_stages=v)
        for s, runtime in runtimes.items():
            runtime.begin_stream(static_drift(lists.stage_actions(s)).__getitem__, 0, loss_scale_for(m))
            for b, batch in enumerate(emulated_loader(length, batch_size=2 * m)):
                for i, part in enumerate(split_microbatches(batch, m)):
                    runtime.add_microbatch(b * m + i, part, b)
        dist.barrier()
        device.run(lists.actions[rank])
        device.flush()
        if stream == "warm-up":
            for runtime in runtimes.values():
                runtime.end_stream(length * m)
                runtime.records.intervals.clear()
    gathered: list[Any] = [None] * p
    dist.all_gather_object(gathered, [list(iv) for r in runtimes.values() for iv in r.records.intervals])
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _torch(rank: int, shape: Shape, path: str, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleLoopedBFS

    name, p, v, m, k, fwd_ms, bwd_ms, blocks = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=p)
    torch.manual_seed(0)
    model = EmulatedModel(blocks * p, fwd_ms / 1e3, bwd_ms / 1e3)
    per_chunk = blocks // v
    chunks = [rank + i * p for i in range(v)]  # the loop placement
    modules = [nn.Sequential(*list(model.blocks)[c * per_chunk:(c + 1) * per_chunk]) for c in chunks]
    stages = [PipelineStage(module, c, p * v, torch.device("cpu")) for module, c in zip(modules, chunks)]
    schedule_class = {"interleaved": ScheduleInterleaved1F1B, "bfs": ScheduleLoopedBFS}[name]
    schedule = schedule_class(stages, n_microbatches=m, loss_fn=lambda output, target: F.mse_loss(output, target))
    optimizer = torch.optim.SGD([q for module in modules for q in module.parameters()], lr=0.05)
    batches = list(emulated_loader(k, batch_size=2 * m))
    dist.barrier()
    start = time.perf_counter()
    step_starts = []
    for x, y in batches:
        step_starts.append(time.perf_counter())
        torch_step(schedule, optimizer, rank, p, x, y)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps([time.perf_counter() - start, step_starts[-1] - step_starts[1]]))
    dist.destroy_process_group()


def _launch(worker: Any, shape: Shape) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.start_processes(worker, args=(shape, os.path.join(tmp, "rdv"), out), nprocs=shape[1], start_method="fork")
        return json.loads(Path(out).read_text())


def run_ours(shape: Shape) -> tuple[float, float]:
    """Of the measured stream (after the warm-up one): (whole-stream seconds, seconds from mini-batch 1's first
    forward on chunk 0 to mini-batch K-1's)."""
    _, _, _, m, k, *_ = shape
    devices = _launch(_ours, shape)
    base = WARMUP * m  # the records number micro-batches across streams
    starts = {mb - base: start for stage, kind, mb, start, _ in devices[0] if kind == "F" and stage == 0}
    first = min(iv[3] for ivs in devices for iv in ivs)
    last = max(iv[4] for ivs in devices for iv in ivs)
    return last - first, starts[(k - 1) * m] - starts[m]


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, microbatches=(8,), minibatches=6, forward_ms=20, backward_ms=40)
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=[1, 2], help="chunks per device v")
    parser.add_argument("--schedules", nargs="+", default=["interleaved", "bfs", "paci"],
                        help="interleaved, bfs (each with torch's anchor) and paci (fill and drain)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's schedules")
    parser.add_argument("--trainer", action="store_true",
                        help="ours through Trainer(strategy=PACIStrategy(virtual_stages=v)) instead of the bare engine")


def _through_trainer(shape: Shape, drain_every: int = 256) -> tuple[float, float]:
    """``run_ours``'s two figures through the Trainer (no warm-up stream: mini-batch 0 fills the pipeline); the
    pipeline also drains every ``drain_every`` batches (``max_stream_batches``)."""
    name, p, v, m, k, fwd, bwd, blocks = shape
    stages = run_emulated(num_stages=p, schedule=name, num_microbatches=m, num_minibatches=k,
                          blocks_per_stage=blocks, forward_ms=fwd, backward_ms=bwd, virtual_stages=v,
                          max_stream_batches=drain_every)
    return run_seconds(stages), steady_seconds(stages, m, k)


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    k, fwd, bwd, blocks = args.minibatches, args.forward_ms, args.backward_ms, args.blocks_per_stage
    ours = _through_trainer if args.trainer else run_ours
    rows: list[dict[str, Any]] = []
    for p in args.stages:
        for m in args.microbatches:
            limit = m * blocks * (fwd + bwd) / 1e3  # seconds of device work per mini-batch
            for name in args.schedules:
                for v in args.virtual_stages:
                    shape: Shape = (name, p, v, m, k, fwd, bwd, blocks)
                    simulated = simulate_schedule(build_schedule(name, p, m, m, k, virtual_stages=v),
                                                  forward_cost=blocks * fwd / 1e3, backward_cost=blocks * bwd / 1e3)
                    predicted = 1 - simulated.stages[0].steady_bubble_fraction
                    row: dict[str, Any] = {"N": p, "m": m, "v": v, "schedule": name, "simulated": predicted}
                    if name == "paci" and args.trainer:
                        # K mini-batches in one stream, and the same K with a drain and a fill after K/2: the
                        # difference is one drain and fill in the middle of training (the first stream's fill pays
                        # one-time costs -- the first forward's checks, allocations -- that a later one does not)
                        pairs = [(ours(shape), _through_trainer(shape, k // 2)[0]) for _ in range(args.repeats)]
                        row["simulated"] = 1.0
                        row["ours"] = limit * (k - 2) / median([steady for (_, steady), _ in pairs])
                        drained, whole = median([b for _, b in pairs]), median([a for (a, _), _ in pairs])
                        row["fill_drain_ms"] = (drained - whole) * 1e3
                        row["simulated_fill_drain_ms"] = (simulated.makespan - k * limit) * 1e3
                    elif name == "paci":
                        # a run of K and one of 2K mini-batches: the second's extra time is K steady mini-batches,
                        # so a fill and a drain cost 2 T(K) - T(2K) (whatever the first mini-batches' order)
                        twice: Shape = (name, p, v, m, 2 * k, fwd, bwd, blocks)
                        pairs = [(ours(shape)[0], ours(twice)[0]) for _ in range(args.repeats)]
                        once, double = median([a for a, _ in pairs]), median([b for _, b in pairs])
                        row["simulated"] = 1.0
                        row["ours"] = k * limit / (double - once)
                        row["fill_drain_ms"] = (2 * once - double) * 1e3
                        row["simulated_fill_drain_ms"] = (simulated.makespan - k * limit) * 1e3
                    else:
                        runs = [ours(shape) for _ in range(args.repeats)]
                        row["ours"] = limit * (k - 2) / median([s for _, s in runs])
                        if not args.no_torch:
                            anchor = [_launch(_torch, shape) for _ in range(args.repeats)]
                            row["torch"] = limit * (k - 2) / median([s for _, s in anchor])
                            row["torch_vs_simulated"] = row["torch"] / predicted
                    row["ours_vs_simulated"] = row["ours"] / row["simulated"]
                    rows.append(row)
    where = " through the Trainer" if args.trainer else ""
    print_table(f"emulated cluster{where}, {k} mini-batches, block F/B {fwd:g}/{bwd:g} ms, {blocks} blocks per device "
                f"(v chunks of {blocks}/v), steady efficiency, median of {args.repeats}", rows,
                [("N", "d"), ("m", "d"), ("v", "d"), ("schedule", "s"), ("simulated", ".3f"), ("ours", ".3f"),
                 ("ours_vs_simulated", ".3f"), ("torch", ".3f"), ("torch_vs_simulated", ".3f"),
                 ("fill_drain_ms", ".0f"), ("simulated_fill_drain_ms", ".0f")])
    return rows


virtual = Benchmark(_arguments, _run, __doc__ or "")
