"""What activation recomputation saves and costs, on 8 stages with m = 8.

    cd benchmarks && python recompute_memory.py [--time] [--json results/recompute_memory.json]

Memory: every stage's peak activation bytes (the exact meter: ``StageRecords.measure(activation_bytes=True)``, the
tensors a micro-batch keeps from its forward to its backward, summed over the micro-batches in flight) with
``recompute="off"`` and ``"blocks"``, through the one-process reference executor (the numbers do not depend on
timing), on ``time_to_accuracy.py``'s tiny GPT (8 blocks of width 64, context 64, global batch 32) and on a
transformers GPT-2 with tied embedding and head (8 blocks of width 32). "Block working set" is what one block
saves for one micro-batch: the memory a recomputing stage needs for the one block whose backward runs.

``--time``: steady micro-batches per second on the emulated cluster (emulated.py; 2 blocks of 10/20 ms per stage,
N = 4 and 8, paci, m = 8, through the Trainer, two alternating runs each): the recomputation's forward is paid
again in every backward, (F + B + F) / (F + B) = 1.33 for B = 2F.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from time_to_accuracy import CONTEXT, GLOBAL_BATCH, SleepyLM

from lightning_paci import ReferencePipeline, build, plan_partition
from lightning_paci.engine.records import ActivationMeter

from emulated import run_emulated, steady_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import HFCausalLM, token_loader  # noqa: E402

STAGES = MICROBATCHES = 8


def _models() -> dict[str, tuple[Any, list[Any]]]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (3 * GLOBAL_BATCH, CONTEXT + 1))
    tiny = SleepyLM(0.0, 0.0, max_steps=100, lr=1e-3, warmup=10)
    gpt2 = HFCausalLM("gpt2", layers=8, tied=True, vocab=64)
    return {"tiny GPT (time_to_accuracy.py)": (tiny, list(tokens.split(GLOBAL_BATCH))),
            "transformers GPT-2, tied": (gpt2, list(token_loader(num_batches=3, batch_size=16, seq=33, vocab=64)))}


def _peaks(model: Any, batches: list[Any], recompute: str) -> list[int]:
    plan = plan_partition(model, STAGES, partition="parameters")
    reference = ReferencePipeline(model, plan, recompute=recompute)
    for runtime in reference.runtimes:
        runtime.records.measure(activation_bytes=True)
    reference.run(build("paci", STAGES, MICROBATCHES, MICROBATCHES, len(batches), tied=bool(plan.tied)), batches)
    return [runtime.records.peak_activation_bytes for runtime in reference.runtimes]


def _block_working_set(model: Any, batch: Any) -> int:
    """Bytes block 0 saves for one micro-batch (its input caught by a pre-hook on a one-device forward)."""
    plan = plan_partition(model, STAGES, partition="parameters")
    block = model.get_submodule(plan.container)[0]
    caught: list[tuple[Any, Any]] = []
    handle = block.register_forward_pre_hook(lambda _m, args, kwargs: caught.append((args, kwargs)),
                                             with_kwargs=True)
    microbatch = [t[: len(t) // MICROBATCHES] for t in batch] if isinstance(batch, list) else \
        batch[: len(batch) // MICROBATCHES]
    with torch.no_grad():
        model.training_step(microbatch, 0)
    handle.remove()
    args, kwargs = caught[0]
    meter = ActivationMeter(model.parameters())
    with meter:
        out = block(*args, **kwargs)
    return meter.total([], None) if out is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    results: dict[str, Any] = {}
    for name, (model, batches) in _models().items():
        peaks = {mode: _peaks(model, batches, mode) for mode in ("off", "blocks")}
        working = _block_working_set(model, batches[0])
        results[name] = {"peaks": peaks, "block_working_set": working}
        print(f"\n{name}: peak activation KiB per stage, N = {STAGES}, m = {MICROBATCHES}, paci (block working set "
              f"{working / 1024:.1f} KiB)")
        print(f"{'stage':>5} {'off':>10} {'blocks':>10} {'ratio':>7}")
        for s, (off, on) in enumerate(zip(peaks["off"], peaks["blocks"])):
            print(f"{s:>5} {off / 1024:>10.1f} {on / 1024:>10.1f} {on / off:>7.3f}")
    if args.time:
        for n in (4, 8):
            rates: dict[str, list[float]] = {"off": [], "blocks": []}
            for _ in range(2):
                for mode in rates:
                    stages = run_emulated(num_stages=n, schedule="paci", num_microbatches=8, num_minibatches=10,
                                          blocks_per_stage=2, forward_ms=10, backward_ms=20, recompute=mode)
                    rates[mode].append(8 * 8 / steady_seconds(stages, 8, 10))
            ratio = sum(rates["off"]) / sum(rates["blocks"])
            results[f"time N={n}"] = {"micro_batches_per_s": rates, "slowdown": ratio}
            print(f"N = {n}: micro-batches/s off {rates['off']}, blocks {rates['blocks']}: {ratio:.2f}x the time")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
