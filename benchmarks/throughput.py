"""How fast a pipeline runs on the emulated cluster, and where a stage's time per micro-batch goes.

Two benchmarks share the emulated cluster (``benchmarks.harness``: each block's forward and backward padded to a
fixed time, so N stage processes do not compete for the CPU cores) and one definition of efficiency: the
bubble-free limit ``m * blocks * (F + B)`` per mini-batch and stage over the measured time. "Steady" is stage 0's
time from the start of mini-batch 1 to the start of mini-batch K-1 (no pipeline fill, no final drain: the long-run
rate); "whole run" includes both.

* ``vs_torch``: our schedules through the real Trainer against torch.distributed.pipelining's ``ScheduleGPipe`` and
  ``Schedule1F1B`` (one ``step()`` per mini-batch, a flush each time, then the optimizer step, in forked gloo
  processes) on the same blocks and costs.
* ``overhead``: paci and 1f1b through the Trainer; the steady idle fraction of every stage against the simulator's
  prediction for the same lists and costs, and paci's time per micro-batch split into the emulated device time,
  the framework (the rest of F, B and OPT), sends, receives (latency plus real waiting) and the time between
  actions (Lightning's loop, per-batch work, hooks, wake-ups). ``--floor`` adds the bare message loop (the same
  lists with only the emulated kernels and raw messages: this machine's ceiling), ``--bare`` the bare runtime
  running the same lists without the Trainer, ``--torch`` torch's Schedule1F1B, ``--monitors`` DriftMonitor +
  BubbleMonitor: their TensorBoard figures against the simulator and their cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
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
    floor_efficiency,
    median,
    print_table,
    run_emulated,
    run_seconds,
    steady_seconds,
    torch_step,
)
from benchmarks.host_cost import host_table
from lightning_paci import BubbleMonitor, DriftMonitor, TimelineMonitor, build_schedule, simulate_schedule
from lightning_paci.schedules import Interval
from lightning_paci.simulation import measured_phases

__all__ = ["overhead", "run_torch", "vs_torch"]

Stages = list[list[Interval]]


def _torch_worker(rank: int, shape: tuple[str, int, int, int, float, float, int], path: str, out: str,
                  host: bool = False) -> None:
    name, n, m, k, fwd_ms, bwd_ms, per_stage = shape
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from benchmarks import harness

    if host:
        harness.SPIN_S = 0.0  # see benchmarks.host_cost.HostCost

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    torch.manual_seed(0)
    model = EmulatedModel(per_stage * n, fwd_ms / 1e3, bwd_ms / 1e3)
    module = nn.Sequential(*list(model.blocks)[per_stage * rank: per_stage * (rank + 1)])
    stage = PipelineStage(module, rank, n, torch.device("cpu"))
    schedule_class = {"torch_gpipe": ScheduleGPipe, "torch_1f1b": Schedule1F1B}[name]
    schedule = schedule_class(stage, n_microbatches=m, loss_fn=lambda output, target: F.mse_loss(output, target))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    batches = list(emulated_loader(k, batch_size=2 * m))
    spent = {"F": [0.0, 0], "B": [0.0, 0]}  # torch's stage: forward_one_chunk, backward_one_chunk
    for kind, method in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        plain = getattr(stage, method)

        def timed(*args: Any, _plain: Any = plain, _entry: list[Any] = spent[kind], **kwargs: Any) -> Any:
            begin = time.thread_time()
            result = _plain(*args, **kwargs)
            _entry[0] += time.thread_time() - begin
            _entry[1] += 1
            return result

        setattr(stage, method, timed)
    dist.barrier()
    start = time.perf_counter()
    step_starts = []
    steady_cpu = 0.0
    for b, (x, y) in enumerate(batches):
        if b == 1:
            steady_cpu = time.thread_time()
            for entry in spent.values():
                entry[:] = [0.0, 0]
        if b == k - 1:
            steady_cpu = time.thread_time() - steady_cpu
            host_figures = {kind: seconds / max(calls, 1) * 1e6 for kind, (seconds, calls) in spent.items()}
            rest = steady_cpu - sum(v[0] for v in spent.values())
            host_figures["other per micro-batch"] = rest / ((k - 2) * m) * 1e6
            host_figures["total per micro-batch"] = steady_cpu / ((k - 2) * m) * 1e6
        step_starts.append(time.perf_counter())
        torch_step(schedule, optimizer, rank, n, x, y)
    dist.barrier()
    if host:
        Path(f"{out}.{rank}").write_text(json.dumps(host_figures))
    if rank == 0:
        Path(out).write_text(json.dumps([time.perf_counter() - start, step_starts[-1] - step_starts[1]]))
    dist.destroy_process_group()


def run_torch(name: str, n: int, m: int, k: int, fwd_ms: float, bwd_ms: float, per_stage: int) -> tuple[float, float]:
    """torch's ``name`` schedule: (whole-run seconds, seconds from the start of mini-batch 1 to that of K-1)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.start_processes(_torch_worker, args=((name, n, m, k, fwd_ms, bwd_ms, per_stage), os.path.join(tmp, "rdv"),
                                                out), nprocs=n, start_method="fork")
        seconds, steady = json.loads(Path(out).read_text())
        return seconds, steady


def torch_host_costs(n: int, m: int, k: int, fwd_ms: float, bwd_ms: float, per_stage: int) -> list[dict[str, float]]:
    """Per stage, microseconds of host time per call of torch's ``Schedule1F1B`` stage: F (``forward_one_chunk``),
    B (``backward_one_chunk``), and the rest of its step per micro-batch (messages, the schedule, the optimizer)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.start_processes(_torch_worker, args=(("torch_1f1b", n, m, k, fwd_ms, bwd_ms, per_stage),
                                                os.path.join(tmp, "rdv"), out, True), nprocs=n, start_method="fork")
        return [json.loads(Path(f"{out}.{s}").read_text()) for s in range(n)]


def _vs_torch_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, microbatches=(4, 8, 16), minibatches=8, forward_ms=30, backward_ms=60)
    parser.add_argument("--schedules", nargs="+", default=["paci", "1f1b", "gpipe", "torch_gpipe", "torch_1f1b"],
                        help="ours: paci 1f1b gpipe; torch's: torch_gpipe torch_1f1b")


def _vs_torch(args: argparse.Namespace) -> list[dict[str, Any]]:
    k, fwd, bwd, per_stage = args.minibatches, args.forward_ms, args.backward_ms, args.blocks_per_stage
    rows: list[dict[str, Any]] = []
    for n in args.stages:
        for m in args.microbatches:
            limit = k * m * per_stage * (fwd + bwd) / 1e3  # bubble-free seconds per stage
            for name in args.schedules:
                row: dict[str, Any] = {"N": n, "m": m, "schedule": name}
                rows.append(row)
                if name == "torch_1f1b" and m < n:
                    continue  # torch requires n_microbatches >= num_stages
                runs = []
                for _ in range(args.repeats):
                    if name.startswith("torch"):
                        runs.append(run_torch(name, n, m, k, fwd, bwd, per_stage))
                    else:
                        stages = run_emulated(num_stages=n, schedule=name, num_microbatches=m, num_minibatches=k,
                                              forward_ms=fwd, backward_ms=bwd, blocks_per_stage=per_stage)
                        runs.append((run_seconds(stages), steady_seconds(stages, m, k)))
                steady = median([s for _, s in runs])
                row.update({"steady_efficiency": limit * (k - 2) / k / steady,
                            "steady_efficiencies": [limit * (k - 2) / k / s for _, s in runs],
                            "steady_mb_per_s": (k - 2) * m / steady,
                            "whole_run_efficiency": limit / median([w for w, _ in runs])})
    for row in rows:
        paci = next((r for r in rows if r["N"] == row["N"] and r["m"] == row["m"] and r["schedule"] == "paci"), {})
        if row.get("steady_mb_per_s") and paci.get("steady_mb_per_s"):
            row["paci_speedup"] = paci["steady_mb_per_s"] / row["steady_mb_per_s"]
    # the note only where a row is left empty for it
    skipped = any(r["schedule"] == "torch_1f1b" and r["m"] < r["N"] for r in rows)
    note = " (n/a: torch's Schedule1F1B needs m >= N)" if skipped else ""
    print_table(f"emulated cluster, {k} mini-batches, block F/B {fwd:g}/{bwd:g} ms, {per_stage} blocks per stage, "
                f"median of {args.repeats} run(s){note}", rows,
                [("N", "d"), ("m", "d"), ("schedule", "s"), ("steady_efficiency", ".3f"), ("steady_mb_per_s", ".2f"),
                 ("paci_speedup", ".2f"), ("whole_run_efficiency", ".3f")])
    return rows


vs_torch = Benchmark(_vs_torch_arguments, _vs_torch, __doc__ or "")


def breakdown(stages: Stages, m: int, k: int, device_ms: float) -> list[dict[str, float]]:
    """Per stage, milliseconds per micro-batch in the steady window, split by what the stage was doing."""
    starts = {iv.microbatch: iv.start for iv in stages[0] if iv.kind == "F"}
    lo, hi = starts[m], starts[(k - 1) * m]
    count = (k - 2) * m
    rows = []
    for ivs in stages:
        total = {"F": 0.0, "B": 0.0, "OPT": 0.0, "SEND": 0.0, "WAIT": 0.0}
        for iv in ivs:
            if lo <= iv.start < hi:
                key = "WAIT" if iv.kind.startswith("WAIT") else iv.kind
                total[key] = total.get(key, 0.0) + (iv.end - iv.start)
        framework = total["F"] + total["B"] + total["OPT"] - count * device_ms / 1e3
        rows.append({"framework": framework / count * 1e3, "send": total["SEND"] / count * 1e3,
                     "receive": total["WAIT"] / count * 1e3,
                     "between": (hi - lo - sum(total.values())) / count * 1e3, "wall": (hi - lo) / count * 1e3})
    return rows


def _bare_worker(rank: int, shape: tuple[int, int, int, float, float, int], path: str, out: str) -> None:
    from lightning_paci.engine.runtime.microbatch import loss_scale_for, split_microbatches
    from lightning_paci.engine.runtime.runtime import StageRuntime
    from lightning_paci.engine.transport.point_to_point import DistComm
    from lightning_paci.integration.stage.lightning_program import LightningStageProgram
    from lightning_paci.optim.stage_optimizer import StageOptimizer
    from lightning_paci.partition import carve_stage, plan_partition

    n, m, k, fwd_ms, bwd_ms, per_stage = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    torch.manual_seed(0)
    model = EmulatedModel(per_stage * n, fwd_ms / 1e3, bwd_ms / 1e3)
    carve = carve_stage(model, plan_partition(model, n, partition="parameters"), rank)
    optimizer = StageOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), list(model.parameters()))
    runtime = StageRuntime(rank, n, LightningStageProgram(model, carve), DistComm(list(range(n))), optimizer,
                           loss_scale=loss_scale_for(m))
    for b, batch in enumerate(emulated_loader(k, batch_size=2 * m)):
        for i, part in enumerate(split_microbatches(batch, m)):
            runtime.add_microbatch(b * m + i, part, b)
    dist.barrier()
    runtime.run(build_schedule("paci", n, m, m, k).actions[rank])
    runtime.comm.flush()
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, [list(iv) for iv in runtime.records.intervals])
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_bare(n: int, m: int, k: int, fwd_ms: float, bwd_ms: float, per_stage: int) -> Stages:
    """The same paci lists run by the bare runtime (StageRuntime + DistComm in forked processes, no Trainer)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "intervals")
        mp.start_processes(_bare_worker, args=((n, m, k, fwd_ms, bwd_ms, per_stage), os.path.join(tmp, "rdv"), out),
                           nprocs=n, start_method="fork")
        return [[Interval(*iv) for iv in ivs] for ivs in json.loads(Path(out).read_text())]


def _monitored(tmp: Path, interval: int, timeline: bool, **shape: Any) -> Stages:
    logger = L.pytorch.loggers.TensorBoardLogger(tmp, name="tb", version=0)
    callbacks: list[L.Callback] = [DriftMonitor(logging_interval=interval), BubbleMonitor(logging_interval=interval)]
    if timeline:
        callbacks.append(TimelineMonitor(every_n_steps=shape["num_minibatches"],
                                         last_microbatches=2 * shape["num_microbatches"]))
    return run_emulated(callbacks=callbacks, logger=logger, **shape)


def _read_bubbles(tmp: Path, n: int) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for s in range(n):
        events = EventAccumulator(str(tmp / "tb" / "version_0" / f"stage_{s}"))
        events.Reload()
        values.append(events.Scalars(f"paci/steady_bubble_fraction/stage_{s}")[-1].value)
    return values


def _overhead_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser, blocks_per_stage=1, repeats=3)
    parser.add_argument("--bare", action="store_true", help="also run the same lists without the Trainer")
    parser.add_argument("--torch", action="store_true", help="also run torch's Schedule1F1B on the same blocks")
    parser.add_argument("--floor", action="store_true",
                        help="also run the bare message loop: the same paci lists with only the emulated kernels "
                             "and one raw gloo message per send (this machine's ceiling)")
    parser.add_argument("--monitors", action="store_true",
                        help="also train with DriftMonitor + BubbleMonitor: their figures and their cost")
    parser.add_argument("--timeline-png", type=Path, help="with --monitors: save paci's measured timeline here")
    parser.add_argument("--host", action="store_true",
                        help="also measure the host time per action kind (CPU time, sleeps and waits excluded), "
                             "ours and, with --torch, torch's stage")


def _overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    k, fwd, bwd, per_stage = args.minibatches, args.forward_ms, args.backward_ms, args.blocks_per_stage
    device_ms = per_stage * (fwd + bwd)
    results = []
    for n in args.stages:
        for m in args.microbatches:
            shape = dict(num_stages=n, num_microbatches=m, num_minibatches=k, blocks_per_stage=per_stage,
                         forward_ms=fwd, backward_ms=bwd)
            names = ["paci", "1f1b"] + ["bare"] * args.bare + ["paci+monitors"] * args.monitors
            runs: dict[str, list[Stages]] = {name: [] for name in names}
            floors: list[float] = []
            floor_host: list[float] = []  # the bare loop's message actions, us per micro-batch, every stage and run
            for _ in range(args.repeats):  # alternating, so drifting machine load hits every configuration alike
                if args.floor:
                    floors.append(floor_efficiency(n, m, k, per_stage * fwd, per_stage * bwd, host_us=floor_host))
                for name in names:
                    if name == "bare":
                        runs[name].append(run_bare(n, m, k, fwd, bwd, per_stage))
                    elif name == "paci+monitors":
                        with tempfile.TemporaryDirectory() as tmp:
                            runs[name].append(_monitored(Path(tmp), 1, False, schedule="paci", **shape))
                    else:
                        runs[name].append(run_emulated(schedule=name, **shape))
            rows: list[dict[str, Any]] = []
            for name, stage_runs in runs.items():
                schedule = "1f1b" if name == "1f1b" else "paci"
                efficiencies = [(k - 2) * m * device_ms / 1e3 / steady_seconds(s, m, k) for s in stage_runs]
                middle = stage_runs[sorted(range(len(stage_runs)), key=efficiencies.__getitem__)[len(stage_runs) // 2]]
                t0 = min(iv.start for ivs in middle for iv in ivs)
                idle = [measured_phases(ivs, m, k, t0, t0 + run_seconds(middle))["steady_bubble_fraction"]
                        for ivs in middle]
                predicted = simulate_schedule(build_schedule(schedule, n, m, m, k), forward_cost=per_stage * fwd,
                                     backward_cost=per_stage * bwd).stages
                parts = breakdown(middle, m, k, device_ms)
                row = {"N": n, "m": m, "run": name, "steady_efficiency": median(efficiencies),
                       "efficiencies": efficiencies, "run_s": median([run_seconds(s) for s in stage_runs]),
                       "steady_idle_max": max(idle), "predicted_idle_max": max(r.steady_bubble_fraction
                                                                               for r in predicted),
                       "idle": idle, "stages": parts}
                for key in ("framework", "send", "receive", "between"):
                    row[key] = f"{min(p[key] for p in parts):.2f}-{max(p[key] for p in parts):.2f}"
                row["lost_ms"] = max(p["wall"] for p in parts) - device_ms
                rows.append(row)
            if args.floor:
                rows.append({"N": n, "m": m, "run": "floor", "steady_efficiency": median(floors),
                             "efficiencies": floors, "host_us": median(floor_host)})
            if args.torch:
                _, steady = run_torch("torch_1f1b", n, m, k, fwd, bwd, per_stage)
                rows.append({"N": n, "m": m, "run": "torch_1f1b", "steady_efficiency": (k - 2) * m * device_ms / 1e3
                             / steady})
            for row in rows:
                row["paci_speedup"] = rows[0]["steady_efficiency"] / row["steady_efficiency"]
                if "run_s" in row:
                    row["vs_paci_time"] = row["run_s"] / rows[0]["run_s"]
            print_table(f"N = {n}, m = {m}, {k} batches, {per_stage} block(s) per stage of F/B {fwd:g}/{bwd:g} ms; "
                        f"median of {args.repeats} run(s); ms per micro-batch and stage in the steady window "
                        f"(range over the stages; device time {device_ms:g} ms)", rows,
                        [("run", "s"), ("steady_efficiency", ".3f"), ("paci_speedup", ".2f"),
                         ("steady_idle_max", ".3f"), ("predicted_idle_max", ".3f"), ("framework", "s"), ("send", "s"),
                         ("receive", "s"), ("between", "s"), ("lost_ms", ".2f"), ("run_s", ".2f"),
                         ("vs_paci_time", ".3f")])
            result: dict[str, Any] = {"N": n, "m": m, "rows": rows}
            if args.host:
                result["host_us"] = host_table(args, n, m, torch_host_costs if args.torch else None,
                                               floor_us=median(floor_host) if floor_host else None)
            if args.monitors:
                result["bubble_monitor"] = _bubble_monitor(args, shape)
            results.append(result)
    return results


def _bubble_monitor(args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    """BubbleMonitor's steady bubble per stage (one logging window over the run, read back from TensorBoard)."""
    out: dict[str, Any] = {}
    n, m, k = shape["num_stages"], shape["num_microbatches"], shape["num_minibatches"]
    for schedule in ("paci", "1f1b"):
        tmp = Path(tempfile.mkdtemp())
        timeline = args.timeline_png is not None and schedule == "paci"
        _monitored(tmp, k, timeline, schedule=schedule, **shape)
        measured = _read_bubbles(tmp, n)
        predicted = [r.steady_bubble_fraction for r in simulate_schedule(
            build_schedule(schedule, n, m, m, k), forward_cost=shape["blocks_per_stage"] * shape["forward_ms"],
            backward_cost=shape["blocks_per_stage"] * shape["backward_ms"]).stages]
        if timeline:
            shutil.copy(tmp / "tb" / "version_0" / "timeline" / "timeline.png", args.timeline_png)
        shutil.rmtree(tmp, ignore_errors=True)
        out[schedule] = {"measured": measured, "predicted": predicted}
        print(f"BubbleMonitor {schedule:>5}: " + " ".join(f"{v:.3f}" for v in measured) + "; simulator: "
              + " ".join(f"{v:.3f}" for v in predicted))
    return out


overhead = Benchmark(_overhead_arguments, _overhead, __doc__ or "")
