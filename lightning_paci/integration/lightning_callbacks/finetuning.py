"""Lightning's fine-tuning callbacks (``BaseFinetuning`` and its subclasses, ``BackboneFinetuning``) on each stage:
a module frozen at the start and unfrozen later, its parameters a new param group of the stage that owns them.

Why they need care: ``freeze_before_training`` runs in the callback's ``setup``, on the whole module before the
strategy carves it, and needs nothing. ``unfreeze_and_add_param_group`` at an epoch's start (the pipeline has
drained at the epoch's end, fit_loop.py) does not work on a stage as it is: the stage's optimizer holds aliases of
its parameters ([Note: alias optimizer]), so Lightning's check "already in the optimizer" never matches and a
parameter added as it is would be stepped in place, outside the aliases; the modules of other stages are
placeholders without parameters, so a stage owning none of the unfrozen module would add no group, and code that
reads ``param_groups[-1]`` (``BackboneFinetuning``'s learning-rate schedule) would read another group there. And
the callback records each group by ``pl_module.named_parameters()``, which holds neither the aliases nor the
other stages' names.

So the decision is taken by the whole model's parameter names, the same on every stage: the unfrozen modules'
parameters (a placeholder's read off the meta copy it keeps of the real module), less those one device's optimizer
holds (the optimizer layout read at setup, one_device_optimizer.py); when any are left, every stage adds the group,
with its own of them joining through aliases (``StageOptimizer.add_param_group``) -- an empty group on the other
stages. The layout gains the group, so a consolidated checkpoint still holds one device's optimizer, and the
callback's ``internal_optimizer_metadata`` is one device's (every group's names), which resumes here and on one
device. The weight prediction, where it runs (``"paci"``), moves the new group's parameters from the next
forward on (it follows the stage optimizer's pairs), by the group's own hyper-parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.clipping import FLUSH_SCHEDULES, clips_by_norm
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy
from lightning_paci.partition.placeholder import Placeholder

__all__ = ["finetune_per_stage"]

def finetune_per_stage(trainer: Trainer, strategy: PipelineStrategy) -> list[Callable[[], None]]:
    """At setup, for fitting: every ``BaseFinetuning`` callback adds its groups to this stage's optimizer by the
    whole model's names; returns the undos for teardown.

    Raises:
        ValueError: virtual stages, replicas, clipping by norm under ``"paci"`` (each keeps the stage's parameters
            from the start of training), or an optimizer layout the strategy could not read.
    """
    callbacks = [c for c in trainer.callbacks if isinstance(c, BaseFinetuning)]  # type: ignore[attr-defined]
    if not callbacks:
        return []
    name = type(callbacks[0]).__name__
    config = strategy.config
    if config.virtual_stages > 1 or strategy.data_parallel_size > 1 or (
            clips_by_norm(trainer) and config.schedule not in FLUSH_SCHEDULES):
        raise ValueError(
            f"`{name}` under `PACIStrategy` needs one stage per process, no data-parallel replicas and, under "
            f"`schedule={config.schedule!r}`, no `gradient_clip_val`: each of them keeps the stage's parameters as "
            f"they were when training started, and the callback adds parameters later. Remove those settings, or "
            f"freeze the modules in `__init__` and unfreeze them in a second `fit` from the checkpoint.")
    stage = strategy.stage  # its optimizer and one device's optimizer layout
    module = strategy.lightning_module
    assert stage is not None and stage.optimizer is not None and module is not None
    if stage.one_device is None:
        raise ValueError(
            f"`{name}` under `PACIStrategy` needs `configure_optimizers` to return one optimizer over the module's "
            f"own parameters (its param groups are matched by name on every stage).")
    groups = _StageGroups(stage, module)
    optimizer = stage.optimizer.optimizer
    undos = [api.patch_method(optimizer, "add_param_group", groups.add_user_group,  # called in `finetune_function`
                              parameters=("param_group",))]
    for callback in callbacks:
        undos += [
            api.patch_method(callback, "unfreeze_and_add_param_group", groups.unfreeze_and_add_param_group,
                             parameters=("modules", "optimizer", "lr", "initial_denom_lr", "train_bn")),
            api.patch_method(callback, "_store", partial(_store, callback, groups),
                             parameters=("pl_module", "opt_idx", "num_param_groups", "current_param_groups")),
            api.patch_method(callback, "on_fit_start", partial(_on_fit_start, callback, groups, callback.on_fit_start),
                             parameters=("trainer", "pl_module")),
        ]
    return undos


class _StageGroups:
    """This stage's side of one device's param groups, by the whole model's parameter names."""

    def __init__(self, stage: Any, module: nn.Module) -> None:
        self.stage, self.module = stage, module

    def names_held(self) -> set[str]:
        return {name for group in self.stage.one_device.groups for name in group}

    def add(self, names: list[str], hyper: dict[str, Any]) -> None:
        """One device's ``add_param_group`` of the parameters ``names``: this stage's of them join its optimizer."""
        own = dict(self.module.named_parameters())
        optimizer = self.stage.optimizer
        _ = self.stage.runtime.records.backwards  # read the pending updates' per-tensor norms (DriftMonitor) now:
        # the next updates have one more tensor each, and the pending ones are stacked together when read
        optimizer.add_param_group({k: v for k, v in hyper.items() if k != "params"},
                                  [own[name] for name in names if name in own])
        self.stage.one_device = self.stage.one_device.with_group(tuple(names), optimizer.optimizer.param_groups[-1])

    def add_user_group(self, group: dict[str, Any]) -> None:
        """``optimizer.add_param_group(group)`` called by user code: the group's parameters by their names here."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.add([names[id(p)] for p in params if id(p) in names], group)

    def unfreeze_and_add_param_group(self, modules: nn.Module | Iterable[Any], optimizer: torch.optim.Optimizer,
                                     lr: float | None = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``, deciding by the whole model's names."""
        leaves = _leaves(modules, {id(p): n for n, p in self.module.named_parameters()})
        BaseFinetuning.make_trainable([leaf for leaf, _ in leaves])
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        held = self.names_held()
        names: list[str] = []
        for leaf, named in leaves:
            if isinstance(leaf, _BatchNorm) and not train_bn:
                continue
            for p in leaf.parameters(recurse=False):
                name = named[id(p)]
                if p.requires_grad and name not in held and name not in names:
                    names.append(name)
        if names:
            self.add(names, {"lr": params_lr / denom_lr})


def _leaves(modules: nn.Module | Iterable[Any], names: dict[int, str]) -> list[tuple[nn.Module, dict[int, str]]]:
    """``BaseFinetuning.flatten_modules(modules)`` with each placeholder's leaves read off its meta copy of the
    real module, each leaf with the whole model's names of its parameters (by id)."""
    out: list[tuple[nn.Module, dict[int, str]]] = []
    for leaf in BaseFinetuning.flatten_modules(modules):
        if not isinstance(leaf, Placeholder):
            out.append((leaf, names))
            continue
        path, shadow = leaf.stands_for()
        for sub_name, sub in shadow.named_modules():
            if not list(sub.children()) or sub._parameters:
                prefix = f"{path}.{sub_name}" if sub_name else path
                out.append((sub, {id(p): f"{prefix}.{n}" for n, p in sub.named_parameters(recurse=False)}))
    return out


def _store(callback: BaseFinetuning, groups: _StageGroups, pl_module: LightningModule, opt_idx: int,
           num_param_groups: int, current_param_groups: list[dict[str, Any]]) -> None:
    """Lightning's ``BaseFinetuning._store`` with every group's names in the whole model (one device's metadata)."""
    described = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
                 for group, names in zip(current_param_groups, groups.stage.one_device.groups)]
    metadata = callback._internal_optimizer_metadata
    if opt_idx not in metadata:
        metadata[opt_idx] = described
    elif num_param_groups != len(current_param_groups):
        metadata[opt_idx].extend(described[num_param_groups:])


def _on_fit_start(callback: BaseFinetuning, groups: _StageGroups, original: Callable[[Trainer, LightningModule], None],
                  trainer: Trainer, pl_module: LightningModule) -> None:
    """Resumed: the groups the checkpoint's run added are added again, by name, before the optimizer's state is
    loaded (which then sets every group's hyper-parameters), as Lightning's ``on_fit_start`` does on one device."""
    saved = callback._internal_optimizer_metadata.get(0) if callback._restarting else None
    if saved:
        for group in saved[len(groups.stage.optimizer.optimizer.param_groups):]:
            groups.add(list(group["params"]), group)
    callback._restarting = False
    original(trainer, pl_module)
