"""Checkpoints of a pipeline: drained first, consolidated into one ordinary Lightning file, written atomically.

Layout of the optimizer entry (``checkpoint["optimizer_states"][0]``), independent of the partition so that a run
can resume onto a different number of stages::

    {"paci": {"num_stages": N, "backwards": b, "steps": t,
              "params": {fqn: {"state": {...optimizer tensors...}, "group": {lr, betas, ...}}}}}

``backwards`` (micro-batches every stage has back-propagated) and ``steps`` (local optimizer steps) restore the
accumulation counter, so a resumed run places its optimizer steps where the uninterrupted run would.

With ``PACIStrategy(checkpoint_layout="sharded")`` nothing is gathered: the checkpoint path is a directory with
``meta.pt`` (everything but weights and optimizer state, written by rank 0) and one ``stage_NNN.pt`` per stage
(its own weights and name-keyed optimizer state). ``consolidate_checkpoint(directory, file)`` or
``python -m lightning_paci.checkpoint DIRECTORY FILE`` turns it into the single-file form.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_paci.runtime import StageOptimizer

__all__ = ["atomic_save", "consolidate_checkpoint", "load_sharded", "load_stage_optimizer_state", "save_shard",
           "stage_optimizer_state"]


def atomic_save(checkpoint: dict[str, Any], path: str | Path) -> None:
    """Write to a temporary file beside ``path``, flush it to disk, then rename it over ``path``: a crash or a kill
    at any moment leaves either the previous file or the new one, never a truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def stage_optimizer_state(optimizer: StageOptimizer, module: nn.Module) -> dict[str, Any]:
    """This stage's optimizer state keyed by parameter name (its own parameters only)."""
    names = {id(p): n for n, p in module.named_parameters()}
    group_of = {id(alias): group for group in optimizer.optimizer.param_groups for alias in group["params"]}
    out: dict[str, Any] = {}
    for alias, real in optimizer.pairs:
        group = {k: v for k, v in group_of[id(alias)].items() if k != "params"}
        state = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in optimizer.optimizer.state.get(alias, {}).items()}
        out[names[id(real)]] = {"state": state, "group": group}
    return out


def load_stage_optimizer_state(optimizer: StageOptimizer, module: nn.Module, params: Mapping[str, Any]) -> None:
    """Load name-keyed states into this stage's optimizer, whatever partition wrote them.

    Raises:
        ValueError: a parameter of this stage has no entry (the checkpoint is of another model).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    missing = [names[id(real)] for _, real in optimizer.pairs if names[id(real)] not in params]
    if missing:
        raise ValueError(
            f"The checkpoint's optimizer state has no entry for {missing[:3]}{'...' if len(missing) > 3 else ''}: it "
            f"was written for another model (or another set of trainable parameters), so it cannot be mapped onto "
            f"this stage. Resume with the same model, or load only the weights (`Model.load_from_checkpoint`)."
        )
    group_of = {id(alias): group for group in optimizer.optimizer.param_groups for alias in group["params"]}
    for alias, real in optimizer.pairs:
        entry = params[names[id(real)]]
        optimizer.optimizer.state[alias] = {
            k: (v.to(real.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in entry["state"].items()
        }
        group_of[id(alias)].update({k: v for k, v in entry["group"].items() if k != "params"})


# -- per-stage sharded layout ----------------------------------------------------------------------------------
META_FILE = "meta.pt"


def shard_file(stage: int) -> str:
    return f"stage_{stage:03d}.pt"


def save_shard(directory: str | Path, stage: int, state_dict: dict[str, Any], optimizer: dict[str, Any]) -> None:
    atomic_save({"state_dict": state_dict, "optimizer": optimizer}, Path(directory) / shard_file(stage))


def load_sharded(directory: str | Path) -> dict[str, Any]:
    """Assemble a sharded checkpoint directory into the consolidated form (every stage's weights and optimizer
    state), whatever number of stages wrote it."""
    directory = Path(directory)
    checkpoint = torch.load(directory / META_FILE, map_location="cpu", weights_only=False)
    state_dict: dict[str, Any] = {}
    params: dict[str, Any] = {}
    shards = sorted(directory.glob("stage_*.pt"))
    if len(shards) != checkpoint["paci_num_stages"]:
        raise ValueError(f"{directory} holds {len(shards)} stage files but was written by "
                         f"{checkpoint['paci_num_stages']} stages: the checkpoint is incomplete.")
    for path in shards:
        shard = torch.load(path, map_location="cpu", weights_only=False)
        state_dict.update(shard["state_dict"])
        params.update(shard["optimizer"].get("params", {}))
        counters = {k: v for k, v in shard["optimizer"].items() if k != "params"}
    checkpoint["state_dict"] = state_dict
    checkpoint["optimizer_states"] = [{"paci": {**counters, "params": params}}]
    checkpoint.pop("paci_num_stages")
    return checkpoint


def consolidate_checkpoint(directory: str | Path, output: str | Path) -> Path:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file (loadable by the unchanged
    module's ``load_from_checkpoint`` and by ``fit(ckpt_path=...)``)."""
    atomic_save(load_sharded(directory), output)
    return Path(output)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_paci.checkpoint",
                                     description="Consolidate a sharded lightning_paci checkpoint into one file.")
    parser.add_argument("directory", help="the sharded checkpoint directory (meta.pt + stage_NNN.pt)")
    parser.add_argument("output", help="the consolidated .ckpt file to write")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.directory, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
