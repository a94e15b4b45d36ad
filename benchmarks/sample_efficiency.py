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
import time
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


class RecipeLM(SleepyLM):
    """``SleepyLM`` with the plain recipes users write: a constant learning rate without warm-up, AdamW or SGD with
    momentum (``recipe="cosine"`` keeps ``time_to_accuracy.py``'s warm-up and cosine decay)."""

    def __init__(self, *, recipe: str, optimizer: str, **kwargs: Any) -> None:
        super().__init__(0.0, 0.0, **kwargs)
        self.recipe, self.optimizer_name = recipe, optimizer

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        if self.optimizer_name == "adamw" and self.recipe == "cosine":
            return super().configure_optimizers()  # time_to_accuracy.py's recipe, unchanged
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)
        if self.recipe == "constant":
            return optimizer
        factor = super().configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]  # warm-up, cosine
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _config(parts: Any) -> tuple[str, str, str]:
    """``schedule[:compensation[:recompute]]`` (as given or as saved) -> (schedule, compensation, recompute)."""
    parts = list(parts)
    return parts[0], parts[1] if len(parts) > 1 else "none", parts[2] if len(parts) > 2 else "off"


def _key(run: dict[str, Any]) -> tuple[str, str, str]:
    return run["schedule"], run.get("compensation", "none"), run.get("recompute", "off")


def _name(config: tuple[str, ...]) -> str:
    schedule, compensation, recompute = _config(config)
    name = schedule if compensation == "none" or schedule != "paci" else f"{schedule}+{compensation}"
    return name if recompute == "off" else f"{name}+recompute"


def train_curve(job: tuple[tuple[str, str, str], int, argparse.Namespace]) -> dict[str, Any]:
    """Validation loss after every ``val_every`` updates of one configuration and seed (one process, one thread)."""
    (schedule, compensation, recompute), seed, args = job
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
    model = RecipeLM(recipe=args.recipe, optimizer=args.optimizer, max_steps=args.max_steps, lr=args.lr,
                     warmup=args.warmup, layers=args.layers, dim=args.dim)
    plan = plan_partition(model, NUM_STAGES, partition="parameters")
    pipeline = ReferencePipeline(model, plan, compensation=compensation, recompute=recompute)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for stage, runtime in enumerate(pipeline.runtimes):
        def keep(version: int, stage: int = stage) -> None:
            if version % args.val_every == 0:
                snapshots.setdefault(version, {}).update(copy_state(pipeline.modules[stage].state_dict()))
        runtime.update_hooks.append(keep)
    start = time.perf_counter()
    pipeline.run(build(schedule, NUM_STAGES, MICROBATCHES, MICROBATCHES, args.max_steps), batches)
    seconds = time.perf_counter() - start
    curve = []
    for version in sorted(snapshots):
        model.load_state_dict(snapshots[version])
        with torch.no_grad():
            loss = sum(float(model._loss(b)) * b.shape[0] for b in val) / len(val.dataset)
        curve.append((version, loss))
    moved = [r.lookahead.peak_extra_bytes if r.lookahead is not None else 0 for r in pipeline.runtimes]
    return {"schedule": schedule, "compensation": compensation, "recompute": recompute, "seed": seed, "curve": curve,
            "seconds": seconds,
            "lookahead_bytes": moved,
            "state_bytes": [sum(t.numel() * t.element_size() for t in _state_tensors(r)) for r in pipeline.runtimes]}


def _state_tensors(runtime: Any) -> list[torch.Tensor]:
    """A stage's parameters and optimizer state tensors."""
    optimizer = runtime.optimizer.optimizer
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    return tensors + [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def updates_to(curve: list[tuple[int, float]], target: float) -> float:
    """First update count at which the loss reaches ``target``, linearly interpolated between validations."""
    return time_to([(step, float(step), loss) for step, loss in curve], target)


# the settings a reused run must share (older files predate the last four: they had the defaults)
_SAME = {"max_steps": None, "val_every": None, "lr": None, "warmup": None, "corpus_bytes": None,
         "recipe": "cosine", "optimizer": "adamw", "layers": NUM_STAGES, "dim": 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=["paci:none", "paci:auto", "1f1b:none"],
                        help="schedule:compensation[:recompute] (recompute: off or blocks); 1f1b:none is the baseline")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20, help="warm-up updates (recipe cosine)")
    parser.add_argument("--recipe", choices=("cosine", "constant"), default="cosine",
                        help="cosine: warm-up then cosine to 10%%; constant: the lr from the first update")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: momentum 0.9")
    parser.add_argument("--layers", type=int, default=NUM_STAGES, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--corpus-bytes", type=int, default=2_500_000)
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (one thread each)")
    parser.add_argument("--rates", metavar="JSON", help="a time_to_accuracy.py --json file with measured step rates")
    parser.add_argument("--reuse", metavar="JSON", help="take runs of an earlier --json with the same settings "
                        "instead of training them again (the curves are deterministic)")
    parser.add_argument("--json")
    parser.add_argument("--plot", metavar="PNG", help="loss vs updates (and vs time with --rates) of every config")
    parser.add_argument("--report", metavar="JSON", help="print the runs saved by an earlier --json (no training)")
    args = parser.parse_args()
    configs = [_config(c.split(":")) for c in args.configs]
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        for key, value in saved["args"].items():
            if key not in ("report", "json", "rates", "plot"):
                setattr(args, key, value)
        runs = saved["runs"]
        configs = [_config(c) for c in saved.get("configs", [["paci", "none"], ["1f1b", "none"]])]
    else:
        reusable: list[dict[str, Any]] = []
        if args.reuse:
            saved = json.loads(Path(args.reuse).read_text())
            if all(saved["args"].get(k, default) == getattr(args, k) for k, default in _SAME.items()):
                reusable = saved["runs"]
        have = {(*_key(r), r["seed"]): r for r in reusable}
        jobs = [(c, seed, args) for seed in args.seeds for c in configs if (*c, seed) not in have]
        with get_context("fork").Pool(args.workers) as pool:
            runs = pool.map(train_curve, jobs)
        runs += [have[(*c, seed)] for seed in args.seeds for c in configs if (*c, seed) in have]
    report(args, configs, runs)


def report(args: argparse.Namespace, configs: list[tuple[str, ...]], runs: list[dict[str, Any]]) -> None:
    """Mean validation curves of every configuration against 1f1b, and the summary figures of each."""
    mean = {}
    for config in configs:
        curves = [r["curve"] for r in runs if _key(r) == tuple(config) and r["seed"] in args.seeds]
        mean[_name(config)] = [(points[0][0], sum(p[1] for p in points) / len(points)) for points in zip(*curves)]
    base = mean.pop("1f1b")
    others = list(mean)
    print(f"\n{NUM_STAGES} stages, m = a = {MICROBATCHES}, global batch {GLOBAL_BATCH}, {args.max_steps} updates, "
          f"{args.layers} blocks of width {args.dim}, {args.optimizer} lr {args.lr} ({args.recipe}"
          f"{f', warm-up {args.warmup}, cosine to 10%' if args.recipe == 'cosine' else ''}), seeds {args.seeds}; "
          f"mean validation loss, and its difference to 1f1b")
    print(f"{'updates':>8} {'1f1b':>8} " + " ".join(f"{name:>24}" for name in others))
    for i, (step, f) in enumerate(base):
        print(f"{step:>8} {f:>8.4f} " + " ".join(
            f"{mean[n][i][1]:>14.4f} ({100 * (mean[n][i][1] - f) / f:>+6.2f}%)" for n in others))
    summary: dict[str, Any] = {}
    for name in others:
        curve = mean[name]
        final = (curve[-1][1] - base[-1][1]) / base[-1][1]
        worst = max((p - f) / f for (_, p), (_, f) in zip(curve, base))
        # the updates this configuration needs for a loss, relative to 1f1b's: its own final loss, which 1f1b
        # reaches after fewer updates (or the updates it needs for 1f1b's final loss, if it gets there first)
        ratio = curve[-1][0] / updates_to(base, curve[-1][1])
        if curve[-1][1] < base[-1][1]:
            ratio = updates_to(curve, base[-1][1]) / base[-1][0]
        summary[name] = {"final_relative": final, "worst_relative": worst, "updates_ratio": ratio}
        print(f"{name}: final {100 * final:+.2f}% vs 1f1b, worst {100 * worst:+.2f}%; needs {ratio:.3f}x the "
              f"updates of 1f1b for the same loss (1f1b reached {name}'s final loss after "
              f"{updates_to(base, curve[-1][1]):.0f} updates)")
        # (files from before the chunked look-ahead hold only the kept elements, as "lookahead_kept_bytes")
        extra = [max(x.get("lookahead_bytes", x.get("lookahead_kept_bytes", [0]))) for x in runs]
        if name.startswith("paci+") and max(extra):
            states = max(max(x.get("state_bytes", [1])) for x in runs)
            print(f"  look-ahead: at most {max(extra)} bytes beyond the model (largest stage's parameters + optimizer "
                  f"state: {states} bytes)")
    paci_rate = flush_rate = 0.0
    if args.rates:
        saved = json.loads(Path(args.rates).read_text())
        paci_runs = [r for r in saved["runs"] if r["schedule"] == "paci"]
        # PACI's steady rate: batches 3 .. K-1 (the fill before, the final drain in the last batch left out)
        paci_rate = sum(len(r["batch_ends"]) - 4 for r in paci_runs) / sum(
            r["batch_ends"][-2] - r["batch_ends"][2] for r in paci_runs)
        flush_rate = max(saved["rates"].values())
        for name in others:
            speedup = paci_rate / flush_rate / summary[name]["updates_ratio"]
            summary[name]["time_to_same_loss_speedup"] = speedup
            print(f"measured steps/s (time_to_accuracy.py): paci {paci_rate:.3f}, fastest 1f1b {flush_rate:.3f} "
                  f"({paci_rate / flush_rate:.2f}x); {name} reaches its final loss {speedup:.2f}x sooner than 1f1b")
    if args.plot:
        _plot(args, base, mean, rates=(paci_rate, flush_rate) if args.rates else None)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                               "configs": configs, "summary": summary, "runs": runs}, indent=1))


def _plot(args: argparse.Namespace, base: list[tuple[int, float]], mean: dict[str, list[tuple[int, float]]],
          rates: tuple[float, float] | None) -> None:
    """Mean validation loss against updates, and against time at the measured steps/s (every paci variant at
    PACI's rate: the look-ahead runs inside the emulated block times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if rates else 1, figsize=(12 if rates else 6.5, 4), squeeze=False)
    curves = {"1f1b": base, **mean}
    for name, curve in curves.items():
        axes[0][0].plot([u for u, _ in curve], [x for _, x in curve], marker="o", markersize=2, label=name)
        if rates:
            rate = rates[1] if name == "1f1b" else rates[0]
            axes[0][1].plot([u / rate for u, _ in curve], [x for _, x in curve], marker="o", markersize=2, label=name)
    axes[0][0].set_xlabel("updates")
    if rates:
        axes[0][1].set_xlabel("seconds at the measured steps/s (8 emulated stages)")
    for ax in axes[0]:
        ax.set_ylabel(f"validation loss (mean of {len(args.seeds)} seeds)")
        ax.set_ylim(min(x for c in curves.values() for _, x in c) - 0.05, base[1][1] + 0.2)
        ax.legend()
    fig.suptitle(f"{args.layers} blocks x {args.dim}, {args.optimizer} lr {args.lr} ({args.recipe}), "
                 f"8 stages, m = a = 8")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
