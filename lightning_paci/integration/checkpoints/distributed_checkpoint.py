"""Checkpoints of stages that apply their own parallelism: one ``torch.distributed.checkpoint`` directory.

[Note: distributed checkpoints]
With ``PACIStrategy(tensor_parallel_size=...)`` a stage's parameters and optimizer state are DTensor shards
([Note: tensor parallelism in a stage]); no rank holds a stage whole, so nothing is gathered. A checkpoint is a
directory written by every rank together through ``torch.distributed.checkpoint`` (DCP) over the host group (its
collectives move Python objects: plans and metadata, never tensors):

    DIRECTORY/.metadata, DIRECTORY/__<rank>_0.distcp      DCP: {"model": {name: weight},
                                                                "optim": {name: {"state": {...}, "group": {...},
                                                                                 "grad": g | None}}}
    DIRECTORY/meta.pt                                      rank 0: everything else (loops, callbacks, schedulers,
                                                           the accumulation counters, the layout that wrote it)

Every key is the parameter's one-device name, and DCP records each shard with its offset in the whole tensor: a
rank asks for its own stage's names with the shapes and placements it has now, and DCP reads the slices it needs,
so the checkpoint resumes on another number of stages, replicas or tensor-parallel ranks. The same layout resumes
bit for bit (the same bytes land in the same shards). A replicated value (a shard alike on several ranks, the
``step`` counter, a param group's hyperparameters) is written once. The optimizer state is read into tensors made
like the parameter they belong to (``zeros_like``: the same mesh and placements), the state's keys and dtypes taken
from the checkpoint's metadata: a state tensor not shaped like its parameter (a factored second moment) is refused
by name. DCP reads non-tensor values with ``torch.load(weights_only=False)``: load only checkpoints you trust, as
with ``ModelParallelStrategy``.

A window's gradients under FSDP2 are held unsharded inside FSDP2 until the window's last backward reduce-scatters
them ([Note: tensor parallelism in a stage]): a save inside an open window of a sharded stage is refused (the
strategy saves at Lightning batches; with ``accumulation`` a multiple of the micro-batches a window never spans
one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_paci.integration.checkpoints.checkpoint import META_FILE, atomic_save, stage_optimizer_state
from lightning_paci.integration.lightning_callbacks.pruning import parameter_names
from lightning_paci.optim.stage_optimizer import StageOptimizer

__all__ = ["DISTRIBUTED_KEY", "is_distributed_checkpoint", "load_meta", "load_optimizer_params", "load_weights",
           "own_state", "save_distributed", "sharded_optimizer_state"]

DISTRIBUTED_KEY = "paci_distributed"  # in a loaded checkpoint: the DCP directory its tensors are read from
_METADATA = ".metadata"


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a DCP directory (its ``.metadata`` is written last: a partial save has none)."""
    return (Path(path) / _METADATA).is_file()


def _is_meta(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return tensor.is_meta or (isinstance(tensor, DTensor) and tensor.to_local().is_meta)


def own_state(module: nn.Module, exclude: Sequence[str] | set[str] = ()) -> dict[str, torch.Tensor]:
    """The stage's own weights as they are held (DTensor shards, on their device): what DCP writes. Blocks of other
    stages (on the meta device) and ``exclude`` (foreign buffers) are left out."""
    return {k: v.detach() for k, v in module.state_dict().items() if k not in exclude and not _is_meta(v)}


def sharded_optimizer_state(optimizer: StageOptimizer, module: nn.Module,
                            tied_copies: Sequence[nn.Parameter] = ()) -> dict[str, Any]:
    """The stage's name-keyed optimizer state (checkpoint.stage_optimizer_state), its tensors left as they are held
    (DTensor shards, on their device: DCP copies each to the host as it writes it)."""
    return stage_optimizer_state(optimizer, module, tied_copies, host=False)


def save_distributed(checkpoint: dict[str, Any], directory: str | Path, *, group: Any, writes_meta: bool,
                     layout: Mapping[str, int]) -> None:
    """Every rank writes its shards of ``checkpoint`` (``state_dict`` and the optimizer entry's ``params``) to the
    DCP ``directory`` (a collective over ``group``); rank 0 (``writes_meta``) then writes the rest as ``meta.pt``,
    with the counters and the ``layout`` (stages, replicas, tensor-parallel ranks) that wrote it."""
    import torch.distributed.checkpoint as dcp

    states = checkpoint.get("optimizer_states") or [{}]
    entry = dict(states[0].get("paci", {}))
    tensors = {"model": checkpoint.get("state_dict", {}), "optim": entry.pop("params", {})}
    dcp.save(tensors, checkpoint_id=Path(directory), process_group=group)
    if writes_meta:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["optimizer_states"] = [{"paci": {**entry, "distributed": True}}] if entry else []
        meta["paci_layout"] = dict(layout)
        atomic_save(meta, Path(directory) / META_FILE)


def load_meta(directory: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """A DCP checkpoint's ``meta.pt``, marked with the directory its tensors are read from (``DISTRIBUTED_KEY``)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise ValueError(f"{directory} holds a torch.distributed.checkpoint but no {META_FILE}: its save did not "
                         f"complete. Resume from an earlier checkpoint.")
    checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=weights_only)
    checkpoint[DISTRIBUTED_KEY] = str(directory)
    return checkpoint


def _metadata(directory: str | Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(directory)).read_metadata().state_dict_metadata


def _missing(wanted: Sequence[str], saved: Mapping[str, Any], what: str, directory: str | Path) -> None:
    missing = [k for k in wanted if k not in saved]
    if missing:
        raise ValueError(
            f"The checkpoint {directory} has no {what} for {missing[:3]}{'...' if len(missing) > 3 else ''}: it was "
            f"written for another model (or another set of trainable parameters), so it cannot be mapped onto this "
            f"stage. Resume with the same model.")


def load_weights(module: nn.Module, directory: str | Path, *, group: Any,
                 exclude: Sequence[str] | set[str] = ()) -> None:
    """Read the stage's own weights from the DCP ``directory`` into the module's tensors, in place (each rank the
    slices its shards cover); a collective over ``group``."""
    import torch.distributed.checkpoint as dcp

    own = own_state(module, exclude)
    _missing([f"model.{k}" for k in own], _metadata(directory), "weights", directory)
    dcp.load({"model": own}, checkpoint_id=Path(directory), process_group=group)


def _templates(saved: Mapping[str, Any], name: str, param: nn.Parameter, directory: str | Path) -> dict[str, Any]:
    """What DCP reads ``name``'s optimizer entry into: for each saved key a tensor made like ``param`` (its shape)
    or a scalar (``step``), with the saved dtype; None for a non-tensor value (a hyperparameter)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry: dict[str, Any] = {"state": {}, "group": {}, "grad": None}
    prefix = f"optim.{name}."
    for key, meta in saved.items():
        if not key.startswith(prefix):
            continue
        path = key[len(prefix):].split(".")
        if len(path) not in (1, 2) or path[0] not in entry or (len(path) == 1) != (path[0] == "grad"):
            continue  # another parameter's, whose name extends this one's
        if not isinstance(meta, TensorStorageMetadata):
            value: Any = None
        elif tuple(meta.size) == tuple(param.shape):
            value = torch.zeros_like(param.detach(), dtype=meta.properties.dtype)
        elif len(meta.size) == 0:
            value = torch.zeros((), dtype=meta.properties.dtype)
        else:
            raise ValueError(
                f"The checkpoint {directory} holds `{key}` of shape {tuple(meta.size)} for a parameter of shape "
                f"{tuple(param.shape)}: an optimizer state not shaped like its parameter is not resharded in this "
                f"release. Use an optimizer whose state is elementwise (SGD, Adam, AdamW, ...), or resume on the "
                f"layout that wrote it.")
        if path[0] == "grad":
            entry["grad"] = value
        else:
            entry[path[0]][path[1]] = value
    return entry


def load_optimizer_params(optimizer: StageOptimizer, module: nn.Module, directory: str | Path, *, group: Any,
                          tied_copies: Sequence[nn.Parameter] = ()) -> dict[str, Any]:
    """The stage's name-keyed optimizer entries read from the DCP ``directory`` (the ``params`` of the checkpoint's
    optimizer entry, for checkpoint.load_stage_optimizer_state); a collective over ``group``."""
    import torch.distributed.checkpoint as dcp

    names = parameter_names(module)
    saved = _metadata(directory)
    own = [(names[id(real)], real) for _, real in optimizer.pairs]
    _missing([f"optim.{n}.group.lr" for n, _ in own], saved, "optimizer state", directory)
    params = {name: _templates(saved, name, param, directory) for name, param in own}
    for copy in tied_copies:
        params[names[id(copy)]] = {"grad": _templates(saved, names[id(copy)], copy, directory)["grad"]}
    dcp.load({"optim": params}, checkpoint_id=Path(directory), process_group=group)
    return params
