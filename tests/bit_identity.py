"""Fixed-seed losses and weights of paci, 1f1b and gpipe, for checking that a refactor changed nothing.

    python tests/bit_identity.py write before.pt     # on the old commit
    python tests/bit_identity.py write after.pt      # on the new commit
    python tests/bit_identity.py compare before.pt after.pt

Each schedule runs twice: through the one-process reference executor and as a 4-process Trainer run (forked ranks,
gloo), on an MLP, a hand-written loop transformer and a tied transformers GPT-2; the losses of every micro-batch,
the values logged to rank 0 and the final weights are stored; then the MLP once per engine feature
(``FEATURES``: data parallel with buckets, optimizer shards, virtual stages, recomputation, the
layered backward), and the loop transformer under each compensation. ``compare`` demands bit equality (``torch.equal``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from lightning_paci import ReferencePipeline, build_schedule, plan_partition  # noqa: E402

from helpers import DumpLastStageLosses, RecordLosses, fit  # noqa: E402
from models import HFCausalLM, LoopTransformer, SequentialMLP, regression_loader, token_loader  # noqa: E402

STAGES, MICROBATCHES, ACCUMULATION, STEPS = 4, 4, 2, 6


def _models() -> dict[str, tuple[Any, Any]]:
    return {
        "mlp": (lambda: SequentialMLP(width=16, depth=8), lambda: regression_loader(num_batches=STEPS, batch_size=8)),
        "loop": (lambda: LoopTransformer(layers=4), lambda: token_loader(num_batches=STEPS, batch_size=8)),
        "gpt2_tied": (lambda: HFCausalLM("gpt2", layers=4, tied=True),
                      lambda: token_loader(num_batches=STEPS, batch_size=8, vocab=64)),
    }


# the engine's parts beyond one process per stage, each through the Trainer on the MLP
FEATURES: dict[str, dict[str, Any]] = {
    "data_parallel": dict(schedule="paci", pipeline_parallel_size=2, data_parallel_size=2, reduce_bucket_mb=1e-4),
    "optimizer_shards": dict(schedule="paci", pipeline_parallel_size=2, data_parallel_size=2, dp_shard="optimizer",
                             deferred_update=True),
    "virtual_loop": dict(schedule="interleaved", pipeline_parallel_size=2, virtual_stages=2, placement="loop"),
    "virtual_v": dict(schedule="paci", pipeline_parallel_size=2, virtual_stages=2, placement="v"),
    "recompute": dict(schedule="paci", recompute="blocks"),
    "layered": dict(schedule="layered", accumulation=MICROBATCHES),
}


def _reference(make: Any, loader: Any, schedule: str) -> dict[str, Any]:
    L.seed_everything(0)
    model = make()
    plan = plan_partition(model, num_stages=STAGES, partition="parameters")
    reference = ReferencePipeline(model, plan)
    batches = list(loader)
    reference.run(build_schedule(schedule, STAGES, MICROBATCHES, ACCUMULATION, num_minibatches=len(batches),
                        tied=bool(plan.tied)), batches)
    losses = reference.runtimes[-1].records.losses
    return {"losses": torch.tensor([losses[k] for k in sorted(losses)], dtype=torch.float64),
            "weights": {k: v.detach().clone() for k, v in reference.state_dict().items()}}


def _distributed(make: Any, loader: Any, schedule: str, **features: Any) -> dict[str, Any]:
    L.seed_everything(0)
    model = make()
    with tempfile.TemporaryDirectory() as tmp:
        dumped, logged = DumpLastStageLosses(Path(tmp) / "losses"), RecordLosses(Path(tmp))
        settings: dict[str, Any] = dict(schedule=schedule, microbatches=MICROBATCHES, accumulation=ACCUMULATION,
                                        partition="parameters", max_stream_batches=4)
        settings.update(features)
        fit(model, loader, devices=STAGES, max_steps=STEPS, callbacks=[dumped, logged], **settings)
        losses = dumped.values()
        return {"losses": torch.tensor([losses[k] for k in sorted(losses)], dtype=torch.float64),
                "logged": torch.tensor(logged.values(), dtype=torch.float64),
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def collect() -> dict[str, Any]:
    out: dict[str, Any] = {}
    make, loader = _models()["mlp"]
    for feature, settings in FEATURES.items():
        out[f"mlp/{feature}/trainer"] = _distributed(make, loader(), **settings)
        print(f"mlp/{feature}: done", flush=True)
    for compensation in ("predict", "none"):  # AdamW: a state to predict from
        make, loader = _models()["loop"]
        out[f"loop/compensation_{compensation}/trainer"] = _distributed(make, loader(), "paci",
                                                                        compensation=compensation)
    for name, (make, loader) in _models().items():
        for schedule in ("paci", "1f1b", "gpipe"):
            out[f"{name}/{schedule}/reference"] = _reference(make, loader(), schedule)
            out[f"{name}/{schedule}/trainer"] = _distributed(make, loader(), schedule)
            print(f"{name}/{schedule}: done", flush=True)
    return out


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}/{key}").items()}
    return {prefix: tree}


def compare(before: dict[str, Any], after: dict[str, Any]) -> int:
    a, b = _flatten(before), _flatten(after)
    if a.keys() != b.keys():
        print(f"different entries: {sorted(a.keys() ^ b.keys())[:10]}")
        return 1
    bad = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    print(f"{len(a)} tensors compared ({sum(t.numel() for t in a.values())} values), {len(bad)} differ")
    for k in bad[:20]:
        print("  differs:", k)
    return int(bool(bad))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["write"] and len(sys.argv) == 3:
        torch.save(collect(), sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(torch.load(sys.argv[2]), torch.load(sys.argv[3])))
    else:
        sys.exit(__doc__)
