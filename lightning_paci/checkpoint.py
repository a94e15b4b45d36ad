"""Checkpoints of a pipeline: drained first, consolidated into one ordinary Lightning file, written atomically.

Layout of the optimizer entry (``checkpoint["optimizer_states"][0]``), independent of the partition so that a run
can resume onto a different number of stages::

    {"paci": {"num_stages": N, "backwards": b, "steps": t,
              "params": {fqn: {"state": {...optimizer tensors...}, "group": {lr, betas, ...}}}}}

``backwards`` (micro-batches every stage has back-propagated) and ``steps`` (local optimizer steps) restore the
accumulation counter, so a resumed run places its optimizer steps where the uninterrupted run would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_paci.runtime import StageOptimizer

__all__ = ["atomic_save", "load_stage_optimizer_state", "stage_optimizer_state"]


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
