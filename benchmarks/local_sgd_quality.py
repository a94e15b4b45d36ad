"""Loss per sample of LocalSGD against gradient averaging every step, 8 stages x 2 replicas (reference executor).

The loss after k updates does not depend on timing (the processes equal the reference executor with replicas bit
for bit, tests/test_data_parallel.py), so each configuration trains here in one process: sample_efficiency.py's
model and recipe (AdamW, warm-up and cosine), 8 stages, m = a = 8, 32 samples per replica and update, the
replicas on disjoint batches of one shuffled epoch; validation loss of the held-out split at the end (after the
final average: one model). data_parallel.py measures the time side.

    python local_sgd_quality.py --local-sgd-steps 4 16 --json results/local_sgd_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from sample_efficiency import MICROBATCHES, RecipeLM
from time_to_accuracy import CONTEXT, GLOBAL_BATCH, NUM_STAGES
from torch.utils.data import DataLoader

from lightning_paci import ReferencePipeline, build, plan_partition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import ByteBlocks, stdlib_corpus  # noqa: E402


def train(job: tuple[int | None, int, argparse.Namespace]) -> dict[str, Any]:
    local_sgd, seed, args = job
    torch.set_num_threads(1)
    data = stdlib_corpus(args.corpus_bytes)
    split = int(len(data) * 0.95)
    train_loader = DataLoader(ByteBlocks(data[:split], CONTEXT), batch_size=GLOBAL_BATCH, shuffle=True,
                              drop_last=True, generator=torch.Generator().manual_seed(seed))
    batches = [b for _, b in zip(range(2 * args.max_steps), train_loader)]
    per_replica = [batches[0::2], batches[1::2]]  # disjoint shards
    torch.manual_seed(seed)
    model = RecipeLM(recipe="cosine", optimizer="adamw", max_steps=args.max_steps, lr=args.lr, warmup=args.warmup,
                     layers=NUM_STAGES, dim=64)
    plan = plan_partition(model, NUM_STAGES, partition="parameters")
    pipeline = ReferencePipeline(model, plan, replicas=2, local_sgd_steps=local_sgd)
    pipeline.run(build("paci", NUM_STAGES, MICROBATCHES, MICROBATCHES, args.max_steps), per_replica)
    model.load_state_dict(pipeline.state_dict())
    val = DataLoader(ByteBlocks(data[split:], CONTEXT), batch_size=GLOBAL_BATCH)
    with torch.no_grad():
        loss = sum(float(model._loss(b)) * b.shape[0] for b in val) / len(val.dataset)
    return {"local_sgd_steps": local_sgd, "seed": seed, "val_loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local-sgd-steps", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--corpus-bytes", type=int, default=2_500_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    configs: list[int | None] = [None, *args.local_sgd_steps]
    jobs = [(c, seed, args) for seed in args.seeds for c in configs]
    with get_context("fork").Pool(args.workers) as pool:
        runs = pool.map(train, jobs)
    print(f"\n{NUM_STAGES} stages x 2 replicas, paci, m = a = {MICROBATCHES}, {GLOBAL_BATCH} samples per replica and "
          f"update, {args.max_steps} updates (AdamW {args.lr:g}, warm-up {args.warmup}, cosine), seeds {args.seeds}")
    base = sum(r["val_loss"] for r in runs if r["local_sgd_steps"] is None) / len(args.seeds)
    for c in configs:
        mean = sum(r["val_loss"] for r in runs if r["local_sgd_steps"] == c) / len(args.seeds)
        name = "gradients every step" if c is None else f"LocalSGD, parameters every {c} steps"
        print(f"{name:>36}: validation loss {mean:.4f} ({(mean / base - 1) * 100:+.2f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "runs": runs},
                                              indent=1))


if __name__ == "__main__":
    main()
