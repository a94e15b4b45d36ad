"""Sample efficiency of PACI vs 1F1B-flush over a long run, with the one-process reference executor.

    cd benchmarks && python sample_efficiency.py [--seeds 0 1 2] [--max-steps 1000] [--val-every 50]
                                                 [--rates results/time_to_accuracy.json] [--json out.json]
    python sample_efficiency.py --report results/sample_efficiency.json [--rates results/time_to_accuracy.json]

The validation loss after k updates does not depend on timing: the multi-process runtime computes exactly what the
one-process reference executor computes for the same action lists (the tests check it, and
``time_to_accuracy.py``'s version snapshots equal the reference executor's bit for bit). So the loss-per-update
curve of a run far longer than an emulated 8-process run can afford on this machine is computed here, in one
process, for ``time_to_accuracy.py``'s model, data, optimizer and LR schedule (``--max-steps`` sets the cosine
length). PACI runs as one stream (no drain anywhere); 1f1b drains after every mini-batch by construction.

Printed: the mean validation loss of both at every ``--val-every`` updates and their relative difference, and
how many updates 1f1b needed to reach PACI's loss at each validation (PACI's extra updates = its sample-efficiency
cost). With ``--rates JSON`` (a ``time_to_accuracy.py --json`` file) the curves are also put on a time axis with
the seconds per update measured there -- the paper's own method for every configuration it did not train to the
end -- and the time-to-target speed-up is reported for PACI's final loss.
"""

from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from time_to_accuracy import CONTEXT, GLOBAL_BATCH, NUM_STAGES, SleepyLM, copy_state, time_to
from torch.utils.data import DataLoader

from lightning_paci import ReferencePipeline, build, plan_partition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ByteBlocks, stdlib_corpus  # noqa: E402

MICROBATCHES = 8


def train_curve(job: tuple[str, int, argparse.Namespace]) -> dict[str, Any]:
    """Validation loss after every ``val_every`` updates of one schedule and seed (one process, one thread)."""
    schedule, seed, args = job
    torch.set_num_threads(1)
    data = stdlib_corpus(args.corpus_bytes)
    split = int(len(data) * 0.95)
    train = DataLoader(ByteBlocks(data[:split], CONTEXT), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True,
                       generator=torch.Generator().manual_seed(seed))
    if len(train) < args.max_steps:
        raise SystemExit(f"--corpus-bytes {args.corpus_bytes} gives {len(train)} batches "
                         f"< --max-steps {args.max_steps}")
    batches = [b for _, b in zip(range(args.max_steps), train)]
    val = DataLoader(ByteBlocks(data[split:], CONTEXT), batch_size=GLOBAL_BATCH)
    torch.manual_seed(seed)
    model = SleepyLM(0.0, 0.0, max_steps=args.max_steps, lr=args.lr, warmup=args.warmup)
    pipeline = ReferencePipeline(model, plan_partition(model, NUM_STAGES, partition="parameters"))
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for stage, runtime in enumerate(pipeline.runtimes):
        def keep(version: int, stage: int = stage) -> None:
            if version % args.val_every == 0:
                snapshots.setdefault(version, {}).update(copy_state(pipeline.modules[stage].state_dict()))
        runtime.update_hooks.append(keep)
    pipeline.run(build(schedule, NUM_STAGES, MICROBATCHES, MICROBATCHES, args.max_steps), batches)
    curve = []
    for version in sorted(snapshots):
        model.load_state_dict(snapshots[version])
        with torch.no_grad():
            loss = sum(float(model._loss(b)) * b.shape[0] for b in val) / len(val.dataset)
        curve.append((version, loss))
    return {"schedule": schedule, "seed": seed, "curve": curve}


def updates_to(curve: list[tuple[int, float]], target: float) -> float:
    """First update count at which the loss reaches ``target``, linearly interpolated between validations."""
    return time_to([(step, float(step), loss) for step, loss in curve], target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20, help="warm-up updates")
    parser.add_argument("--corpus-bytes", type=int, default=2_500_000)
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (one thread each)")
    parser.add_argument("--rates", metavar="JSON", help="a time_to_accuracy.py --json file with measured step rates")
    parser.add_argument("--json")
    parser.add_argument("--report", metavar="JSON", help="print the runs saved by an earlier --json (no training)")
    args = parser.parse_args()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        for key in ("seeds", "max_steps", "val_every", "lr", "warmup", "corpus_bytes"):
            setattr(args, key, saved["args"][key])
        runs = saved["runs"]
    else:
        jobs = [(schedule, seed, args) for seed in args.seeds for schedule in ("paci", "1f1b")]
        with get_context("fork").Pool(args.workers) as pool:
            runs = pool.map(train_curve, jobs)
    mean = {}
    for schedule in ("paci", "1f1b"):
        curves = [r["curve"] for r in runs if r["schedule"] == schedule]
        mean[schedule] = [(points[0][0], sum(p[1] for p in points) / len(points)) for points in zip(*curves)]

    print(f"\n{NUM_STAGES} stages, m = a = {MICROBATCHES}, global batch {GLOBAL_BATCH}, {args.max_steps} updates, "
          f"AdamW lr {args.lr} (warm-up {args.warmup}, cosine to 10%), seeds {args.seeds}; mean validation loss")
    print(f"{'updates':>8} {'paci':>8} {'1f1b':>8} {'diff':>8} {'1f1b updates to paci loss':>26} {'paci extra':>11}")
    rows = []
    for (step, p), (_, f) in zip(mean["paci"], mean["1f1b"]):
        needed = updates_to(mean["1f1b"], p)
        rows.append({"updates": step, "paci": p, "1f1b": f, "relative": (p - f) / f, "flush_updates_to_paci": needed})
        print(f"{step:>8} {p:>8.4f} {f:>8.4f} {100 * (p - f) / f:>+7.2f}% {needed:>26.0f} {step / needed - 1:>+10.1%}")
    final_extra = rows[-1]["updates"] / rows[-1]["flush_updates_to_paci"]
    summary: dict[str, Any] = {"final_relative": rows[-1]["relative"], "updates_ratio_at_final": final_extra}
    print(f"final: paci {rows[-1]['paci']:.4f} vs 1f1b {rows[-1]['1f1b']:.4f} ({100 * rows[-1]['relative']:+.2f}%); "
          f"1f1b reached PACI's final loss after {rows[-1]['flush_updates_to_paci']:.0f} updates "
          f"(PACI needs {final_extra:.3f}x the updates)")
    if args.rates:
        saved = json.loads(Path(args.rates).read_text())
        paci_runs = [r for r in saved["runs"] if r["schedule"] == "paci"]
        # PACI's steady rate: batches 3 .. K-1 (the fill before, the final drain in the last batch left out)
        paci_rate = sum(len(r["batch_ends"]) - 4 for r in paci_runs) / sum(
            r["batch_ends"][-2] - r["batch_ends"][2] for r in paci_runs)
        flush_rate = max(saved["rates"].values())
        speedup = paci_rate / flush_rate / final_extra
        summary.update({"paci_steps_per_s": paci_rate, "fastest_flush_steps_per_s": flush_rate,
                        "time_to_paci_final_speedup": speedup})
        print(f"measured steps/s (time_to_accuracy.py): paci {paci_rate:.3f}, fastest 1f1b {flush_rate:.3f} "
              f"({paci_rate / flush_rate:.2f}x); time to PACI's final loss: {speedup:.2f}x sooner with PACI")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows,
                                               "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
