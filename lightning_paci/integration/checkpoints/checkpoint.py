"""Checkpoints of a pipeline: drained first, consolidated into one ordinary Lightning file, written atomically.

Layout of the optimizer entry (``checkpoint["optimizer_states"][0]``), independent of the partition so that a run
can resume onto a different number of stages::

    {"paci": {"num_stages": N, "backwards": b, "steps": t, "window_start": w,
              "params": {fqn: {"state": {...optimizer tensors...}, "group": {lr, betas, ...}, "grad": g | None},
                         tied_replica_fqn: {"grad": g | None}}}}

``backwards`` (micro-batches every stage has back-propagated) and ``steps`` (local optimizer steps) restore the
accumulation counter, so a resumed run places its optimizer steps where the uninterrupted run would; ``grad`` holds
the gradient accumulated in a window that was still open at the save (also on the last stage's tied-weight
replica), so a resume inside a window is exact.

With ``PACIStrategy(checkpoint_layout="sharded")`` nothing is gathered: the checkpoint path is a directory with
``meta.pt`` (everything but weights and optimizer state, written by rank 0) and one ``stage_NNN.pt`` per stage
(its own weights and name-keyed optimizer state). ``consolidate_checkpoint(directory, file)`` or
``python -m lightning_paci.checkpoint DIRECTORY FILE`` turns it into the single-file form.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch import nn

from lightning_paci.engine.transport.collectives import gather_to_first
from lightning_paci.integration.checkpoints.one_device_optimizer import ONE_DEVICE_KEY, OneDeviceOptimizer
from lightning_paci.integration.lightning_callbacks.batch_outputs import load_callback_state
from lightning_paci.integration.lightning_callbacks.pruning import parameter_names
from lightning_paci.optim.stage_optimizer import StageOptimizer

__all__ = ["PARTITION_KEY", "PipelineCheckpoints", "Resumed", "after_fit_message", "atomic_save",
           "consolidate_checkpoint", "cpu_state", "load_sharded", "load_stage_optimizer_state", "receive_after_fit",
           "recorded_cut", "stage_optimizer_state"]

PARTITION_KEY = "paci_partition"  # {"num_stages": N, "cut": [block indices where stages 1..N-1 start]}


def recorded_cut(checkpoint: Mapping[str, Any], num_stages: int) -> list[int] | None:
    """The split a checkpoint of a ``num_stages``-stage run recorded (``PARTITION_KEY``), or None: none recorded,
    or recorded for another number of stages (a resume on another layout splits anew)."""
    record = checkpoint.get(PARTITION_KEY)
    if not isinstance(record, Mapping) or record.get("num_stages") != num_stages:
        return None
    return [int(i) for i in record["cut"]]


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


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor; a host tensor as it is (a checkpoint is written before training goes on, and
    a copy of every gradient and optimizer tensor would add the stage's size again to the process's peak)."""
    return tensor.detach().cpu()


def stage_optimizer_state(optimizer: StageOptimizer, module: nn.Module,
                          tied_copies: Sequence[nn.Parameter] = (), *, host: bool = True) -> dict[str, Any]:
    """This stage's optimizer state keyed by parameter name (its own parameters only), with the gradients of the
    accumulation window still open (a checkpoint inside a window resumes exactly) -- also those of the tied-weight
    copies (``tied_copies``), which the stage's optimizer never steps (see [Note: tied weights]). ``host``: tensors
    copied to the host (else as held: DTensor shards for a distributed checkpoint)."""
    names = parameter_names(module)  # a pruned weight by its one-device name (pruning.py)
    group_of = {id(alias): group for group in optimizer.optimizer.param_groups for alias in group["params"]}
    place = _host if host else torch.Tensor.detach

    def grad(param: nn.Parameter) -> torch.Tensor | None:
        return None if param.grad is None else place(param.grad)

    out: dict[str, Any] = {}
    for alias, real in optimizer.pairs:
        group = {k: v for k, v in group_of[id(alias)].items() if k != "params"}
        state = {k: (place(v) if isinstance(v, torch.Tensor) else v)
                 for k, v in optimizer.optimizer.state.get(alias, {}).items()}
        out[names[id(real)]] = {"state": state, "group": group, "grad": grad(real)}
    for copy in tied_copies:
        out[names[id(copy)]] = {"grad": grad(copy)}
    return out


def load_stage_optimizer_state(optimizer: StageOptimizer, module: nn.Module, params: Mapping[str, Any],
                               tied_copies: Sequence[nn.Parameter] = ()) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Load name-keyed states into this stage's optimizer, whatever partition wrote them, and return the saved
    open-window gradients as ``(parameter, gradient)`` pairs for the caller to install when training starts
    (Lightning zeroes every gradient after restoring a checkpoint; checkpoints written before gradients were saved
    have none: the window then restarts empty).

    Raises:
        ValueError: a parameter of this stage has no entry (the checkpoint is of another model).
    """
    names = parameter_names(module)  # a pruned weight by its one-device name (pruning.py)
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
        group = group_of[id(alias)]
        group.update({k: v for k, v in entry["group"].items() if k != "params"})
        optimizer.optimizer.state[alias] = {k: _placed(k, v, real, group) for k, v in entry["state"].items()}
    gradients = []
    for param in [real for _, real in optimizer.pairs] + list(tied_copies):
        grad = params.get(names[id(param)], {}).get("grad")
        if grad is not None:
            gradients.append((param, grad.to(device=param.device, dtype=param.dtype)))
    return gradients


def _placed(key: str, value: Any, param: nn.Parameter, group: Mapping[str, Any]) -> Any:
    """A saved optimizer-state value placed as ``torch.optim.Optimizer.load_state_dict`` places it: ``step`` stays
    as saved, except for fused or capturable optimizers, whose kernels read it as float32 on the parameter's device;
    every other tensor goes to the parameter's device (and, for a floating parameter, its dtype)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(dtype=torch.float32, device=param.device) if group.get("fused") or group.get("capturable") \
            else value
    return value.to(dtype=param.dtype, device=param.device) if param.is_floating_point() else value.to(param.device)


# -- per-stage sharded layout ----------------------------------------------------------------------------------
META_FILE = "meta.pt"


def shard_file(stage: int) -> str:
    return f"stage_{stage:03d}.pt"


def load_sharded(directory: str | Path, weights_only: bool | None = None, *, mmap: bool = False) -> dict[str, Any]:
    """Assemble a sharded checkpoint directory into the consolidated form (every stage's weights and optimizer
    state), whatever number of stages wrote it. ``weights_only`` is torch.load's, as Lightning passes it (None:
    torch's default, True): a file from elsewhere cannot run code unless the caller allows it. With ``mmap`` the
    stage files are memory-mapped: a stage that takes only its own tensors reads only those."""
    directory = Path(directory)
    checkpoint = torch.load(directory / META_FILE, map_location="cpu", weights_only=weights_only)
    state_dict: dict[str, Any] = {}
    params: dict[str, Any] = {}
    shards = sorted(directory.glob("stage_*.pt"))
    if len(shards) != checkpoint["paci_num_stages"]:
        raise ValueError(f"{directory} holds {len(shards)} stage files but was written by "
                         f"{checkpoint['paci_num_stages']} stages: the checkpoint is incomplete.")
    for path in shards:
        shard = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
        state_dict.update(shard["state_dict"])
        params.update(shard["optimizer"].get("params", {}))
        counters = {k: v for k, v in shard["optimizer"].items() if k != "params"}
    checkpoint["state_dict"] = state_dict
    layout = counters.pop(ONE_DEVICE_KEY, None)
    entry: dict[str, Any] = {"paci": {**counters, "params": params}}
    if layout is not None:  # torch's form beside it, as a consolidated save writes it: resumable on one device
        entry.update(OneDeviceOptimizer.from_layout(layout).to_torch(params))
    checkpoint["optimizer_states"] = [entry]
    checkpoint.pop("paci_num_stages")
    return checkpoint


class Resumed(NamedTuple):
    """What a checkpoint's optimizer entry restores besides the optimizer state."""

    num_stages: int  # the stages that wrote it
    backwards: int  # micro-batches back-propagated on every stage (the accumulation counter)
    steps: int  # local optimizer steps
    gradients: list[tuple[nn.Parameter, torch.Tensor]]  # the open window's gradients, to install at train start
    window_start: int = 0  # backwards before the open window's count began (a window closed at an epoch's end)


def cpu_state(module: nn.Module, exclude: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The module's state on the CPU, without ``exclude`` (a stage's foreign buffers: another stage's copy counts)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if k not in exclude}


class PipelineCheckpoints:
    """What the strategy's checkpoint hooks do, in the one module that owns the format.

    Args:
        layout: ``"consolidated"`` (one file, gathered on rank 0) or ``"sharded"`` (a directory, no gather).
        stage, num_stages: this process's stage and the pipeline's length.
        checkpoint_io: the Trainer's ``CheckpointIO``. The default ``TorchCheckpointIO`` is replaced by an atomic
            write (temporary file, fsync, rename); any other is used as given, with the ``storage_options``.
        rank: this process's global rank; rank 0 (where states are gathered) writes the file, or the directory's
            ``meta.pt``.
        first_replica: this process is its stage's first data-parallel replica, which writes the stage's shard
            (the replicas hold the same weights and optimizer state: one copy per stage).
    """

    def __init__(self, layout: str, stage: int, num_stages: int, checkpoint_io: CheckpointIO, *,
                 rank: int = 0, first_replica: bool = True, replicas: int = 1, group: Any = None,
                 host_copies: bool = True) -> None:
        self.layout, self.stage, self.num_stages = layout, stage, num_stages
        self.host_copies = host_copies  # False: optimizer tensors as held ([Note: distributed checkpoints])
        self.checkpoint_io = checkpoint_io
        self.writes = rank == 0
        self.writes_shard = first_replica
        self.replicas = replicas
        self.group = group  # where the consolidated layout gathers: the host group under NCCL

    def _writer(self, storage_options: Any | None) -> Callable[[dict[str, Any], Path], None]:
        io = self.checkpoint_io
        if type(io) is not TorchCheckpointIO:
            return lambda obj, path: io.save_checkpoint(obj, path, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options={storage_options!r})` is not supported with the "
                f"default `TorchCheckpointIO`: pass a custom `CheckpointIO` to `PACIStrategy(checkpoint_io=...)` that "
                f"defines how to use `storage_options`."
            )
        return atomic_save

    def weights(self, module: nn.Module, exclude: Collection[str] = ()) -> dict[str, Any]:
        """The checkpoint's ``state_dict``: the whole model on rank 0 (consolidated), the stage's own (sharded);
        ``exclude``: this stage's foreign buffers."""
        local = cpu_state(module, exclude)
        if self.layout == "sharded":
            return local
        return gather_to_first(local, self.replicas, self.group) or {}

    def optimizer_state(self, optimizer: StageOptimizer, module: nn.Module, *, backwards: int, steps: int,
                        tied_copies: Sequence[nn.Parameter] = (), window_start: int = 0,
                        merge: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Every stage's optimizer state keyed by parameter name, with the accumulation counters (module docstring);
        ``merge``: makes the stage's whole state from this replica's share ([Note: optimizer shards])."""
        counters = {"num_stages": self.num_stages, "backwards": backwards, "steps": steps,
                    "window_start": window_start}
        local = stage_optimizer_state(optimizer, module, tied_copies, host=self.host_copies)
        if merge is not None:
            local = merge(local)
        if self.layout == "sharded":
            return {"paci": {**counters, "params": local}}
        params = gather_to_first(local, self.replicas, self.group)
        return {"paci": {**counters, "params": params}} if params is not None else {}

    def save(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        write = self._writer(storage_options)
        if self.layout == "consolidated":
            if self.writes:
                write(checkpoint, Path(filepath))
            return
        # sharded: every stage's first replica writes the stage's file; rank 0 adds everything else
        states = checkpoint.get("optimizer_states") or [{}]
        shard = {"state_dict": checkpoint["state_dict"], "optimizer": states[0].get("paci", {})}
        if self.writes_shard:
            write(shard, Path(filepath) / shard_file(self.stage))
        if self.writes:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta["paci_num_stages"] = self.num_stages
            write(meta, Path(filepath) / META_FILE)

    def load(self, path: str | Path, weights_only: bool | None = None, *, mmap: bool = False) -> dict[str, Any]:
        """Read a checkpoint (``mmap``: memory-mapped, for a stage that takes only its own tensors) with every tensor
        on the host, whatever device it was saved from: each stage then places its own part (its parameters' device,
        the optimizer state beside them), where Lightning's default would put a GPU-saved file whole on the GPU it
        names, on every rank (and fail where that GPU does not exist)."""
        if Path(path).is_dir():
            return load_sharded(path, weights_only, mmap=mmap)
        if mmap and isinstance(self.checkpoint_io, TorchCheckpointIO) and Path(path).is_file():
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        return self.checkpoint_io.load_checkpoint(path, map_location="cpu", weights_only=weights_only)

    def load_optimizer_state(self, checkpoint: Mapping[str, Any], optimizer: StageOptimizer, module: nn.Module,
                             tied_copies: Sequence[nn.Parameter] = ()) -> Resumed:
        """Load the stage's optimizer state; return the saved counters and open-window gradients."""
        states = checkpoint["optimizer_states"]
        if not states or "paci" not in states[0]:
            raise ValueError(
                "This checkpoint has no pipeline optimizer state (it was not written by PACIStrategy). Load its "
                "weights with `Model.load_from_checkpoint(path)` and start a new run instead of `ckpt_path=`."
            )
        saved = states[0]["paci"]
        gradients = load_stage_optimizer_state(optimizer, module, saved["params"], tied_copies)
        return Resumed(int(saved["num_stages"]), int(saved["backwards"]), int(saved["steps"]), gradients,
                       int(saved.get("window_start", 0)))

    def remove(self, filepath: str | Path) -> None:
        if self.writes:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def after_fit_message(trainer: Any, states: dict[str, list[Any]] | None) -> dict[str, Any]:
    """What rank 0 of a fork/spawn run hands to the main process, for a ``trainer.save_checkpoint`` there after
    ``fit``: the optimizer and scheduler ``states`` gathered at teardown, the fit loop's progress (epoch, step) and
    the callbacks' states (the main process never ran a stage or a loop)."""
    return {"states": states, "fit_loop": trainer.fit_loop.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks}}


def receive_after_fit(trainer: Any, sent: Mapping[str, Any]) -> dict[str, list[Any]] | None:
    """In the main process: take rank 0's :func:`after_fit_message` into ``trainer``; return the states."""
    trainer.fit_loop.load_state_dict(sent["fit_loop"])
    for callback in trainer.callbacks:
        if sent["callbacks"].get(callback.state_key):
            load_callback_state(callback, sent["callbacks"][callback.state_key])
    states: dict[str, list[Any]] | None = sent["states"]
    return states


def consolidate_checkpoint(directory: str | Path, output: str | Path) -> Path:
    """Turn a sharded checkpoint directory into one ordinary Lightning checkpoint file (loadable by the unchanged
    module's ``load_from_checkpoint`` and by ``fit(ckpt_path=...)``)."""
    atomic_save(load_sharded(directory), output)
    return Path(output)
