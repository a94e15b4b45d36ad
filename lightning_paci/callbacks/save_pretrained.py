"""``SavePretrained``: write what PACI trained as a transformers directory, each stage writing its own shard.

Every stage writes ``model-<s+1>-of-<N>.safetensors`` with its own tensors (the names less ``prefix``, the attribute
that holds the transformers model), after the run's last drain; rank 0 then writes ``model.safetensors.index.json``
(which file holds which key) and the model's ``config.json``, so ``from_pretrained(directory)`` reads the trained
weights. Nothing is gathered but the shards' names and sizes (over the host group: [Note: host groups on a bound
world]): each stage's tensors go from its own memory to its own file. A tied weight is written
once, by its owner (stage 0); the last stage's replica is left out, as transformers leaves out ``lm_head.weight``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist

__all__ = ["SavePretrained"]


class SavePretrained(L.Callback):
    """At the end of ``fit``, export the trained model to ``directory`` as sharded safetensors plus an index.

    Args:
        directory: where to write (created).
        prefix: the LightningModule attribute path of the transformers model, with its dot (default ``"model."``);
            keys outside it are not written.
    """

    def __init__(self, directory: str | Path, prefix: str = "model.") -> None:
        self.directory = Path(directory)
        self.prefix = prefix

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Refuse a ``prefix`` the module has no submodule for at the start, on every rank, not after training."""
        path = self.prefix.rstrip(".")
        if not path:
            return
        try:
            pl_module.get_submodule(path)
        except AttributeError:
            children = [name for name, _ in pl_module.named_children()]
            raise ValueError(
                f"`SavePretrained(prefix={self.prefix!r})`: {type(pl_module).__name__} has no submodule {path!r} "
                f"(its children: {children}). Pass the attribute that holds the transformers model with its dot "
                f"(`SavePretrained(directory, prefix='net.')` for `self.net`), or `prefix=''` for the whole "
                f"module.") from None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from safetensors.torch import save_file

        strategy = trainer.strategy
        stage, num_stages = getattr(strategy, "stage_index", 0), getattr(strategy, "num_stages", 1)
        pipeline = getattr(strategy, "stage", None)  # a PACIStrategy's stage of the pipeline
        if pipeline is not None:
            pipeline.drain()  # the last updates are in
        tied_copies = {id(p) for p in (pipeline.tied_copies if pipeline is not None else [])}
        first = getattr(strategy, "replica_index", 0) == 0
        name = f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"
        tensors = {key[len(self.prefix):]: value.detach().cpu().contiguous()
                   for key, value in pl_module.state_dict(keep_vars=True).items()
                   if key.startswith(self.prefix) and id(value) not in tied_copies and not value.is_meta}
        self.directory.mkdir(parents=True, exist_ok=True)
        if first:
            save_file(tensors, str(self.directory / name), metadata={"format": "pt"})
        shard = {"file": name, "keys": sorted(tensors), "bytes": sum(t.numel() * t.element_size()
                                                                       for t in tensors.values())} if first else None
        shards = _gather(strategy, shard)  # names and sizes only
        if trainer.is_global_zero:
            listed = [s for s in shards if s is not None]
            index = {"metadata": {"total_size": sum(s["bytes"] for s in listed)},
                     "weight_map": {key: s["file"] for s in listed for key in s["keys"]}}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            model = pl_module.get_submodule(self.prefix.rstrip(".")) if self.prefix else pl_module
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(self.directory)
        strategy.barrier()


def _gather(strategy: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``: a PACIStrategy gathers objects over its host group (gloo), never over NCCL, whose
    object collectives read device memory back; another strategy over its world."""
    if hasattr(strategy, "all_gather_object"):
        return list(strategy.all_gather_object(obj))
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
