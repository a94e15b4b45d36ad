"""Lightning's ``ModelPruning`` on each stage: the callback prunes the stage's own layers at one device's epochs,
a global amount is ranked over every stage, and what a checkpoint or the end of ``fit`` holds is one device's.

Why it needs care: ``torch.nn.utils.prune`` keeps a pruned weight's ``Parameter`` but re-registers it as
``weight_orig``, adds a ``weight_mask`` buffer and a forward pre-hook that sets ``weight = weight_orig *
weight_mask`` before each forward. The stage optimizer's aliases share the ``Parameter``'s storage ([Note: alias
optimizer]), so they go on stepping it and the forward reads the masked weight; the rest needs the following.

* The callback lists its layers in its own ``setup``, on the whole module before the strategy carves it; after
  carving, another stage's layers are on the meta device. Here the list keeps the stage's own layers, and the
  lottery ticket's copies (``use_lottery_ticket_hypothesis``, on by default) keep theirs, renumbered.
* A global amount (``use_global_unstructured``, the default) ranks every layer's weights together: the smallest
  ``k`` magnitudes of the whole model. Each stage ranks its own: the ``k``-th smallest magnitude over every stage
  is found by bisection on its float64 bits, one all-reduce of one number per process per step (63), then each stage
  prunes its magnitudes below it; those equal to it are taken stage by stage, in the order of the stages and of
  each stage's layers, until ``k`` (``torch.topk``, one device's, leaves the choice among equal values
  unspecified). ``torch.nn.utils.prune.custom_from_mask`` then applies each layer's mask as
  ``global_unstructured`` does: the same buffers and hooks as on one device.
* The lottery ticket puts the initial weights back with ``weight_orig.data = copy.data``, a new storage the
  optimizer's aliases would not see; here they are copied into the parameter's own storage, which the callback's
  copy then shares, as it shares the parameter's on one device (later resets leave the trained values alone
  there, and here).
* A checkpoint holds the pruning made permanent (``make_pruning_permanent``, the default): each pruned layer's
  state-dict hook writes ``weight = weight_mask * weight_orig`` under the name carving saw, so the stages' gather is
  one device's ``state_dict`` (the callback's own ``on_save_checkpoint``, which would put this stage's state alone
  there, does nothing), and :func:`parameter_names` names the optimizer state by ``weight`` too (checkpoint.py).
  The masks are not saved, on one device either: a resumed run trains the zeros until the next pruning. At the
  end of ``fit`` the callback makes the pruning permanent on every stage before the stages' weights are gathered.

Refused at setup, naming the setting and the fix: ``make_pruning_permanent=False`` (the end of ``fit`` and a
checkpoint would hold ``weight_orig`` and ``weight_mask``, which neither the gather nor a fresh module takes), random
pruning and ``resample_parameters`` (each stage would draw other numbers than one device from the generator that
also orders its batches), a global method other than L1, a weight shared by two modules, a model built in
``configure_model`` or on the meta device with the lottery ticket (the callback lists or copies the layers before
they exist), and virtual stages or data-parallel replicas. With ``verbose`` the callback logs rank 0's stage only.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.prune as torch_prune
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_paci.engine.supervision.activity import activity
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["check_pruning", "parameter_names", "pruning_per_stage"]

_PER_LAYER = ("l1_unstructured", "ln_structured")  # the per-layer functions that draw no random numbers
_Pairs = list[tuple[nn.Module, str]]


def check_pruning(callback: ModelPruning, module: LightningModule) -> None:
    """Refuse, at setup, a ``ModelPruning`` setting a stage cannot run as one device does: ``ValueError`` naming
    the setting and the fix."""
    def refuse(subject: str, why: str, fix: str) -> None:
        raise ValueError(f"`ModelPruning{subject} is not supported by `PACIStrategy`: {why}. {fix}.")

    if not callback._make_pruning_permanent:
        refuse("(make_pruning_permanent=False)`", "the end of `fit` and every checkpoint would hold each pruned "
               "weight as `weight_orig` with a `weight_mask`, which the stages' gather, the main process and a fresh "
               "module (on one device too) cannot take", "Keep the default `make_pruning_permanent=True`")
    if callback._use_global_unstructured and callback.pruning_fn is not torch_prune.L1Unstructured:
        method = getattr(callback.pruning_fn, "__name__", callback.pruning_fn)
        refuse(f"(pruning_fn={method}, use_global_unstructured=True)`", "a global amount is ranked here over every "
               "stage by magnitude, and another method scores the whole model in one call no stage can make",
               "Use `'l1_unstructured'`, or `use_global_unstructured=False` with `'l1_unstructured'` or "
               "`'ln_structured'` (per layer)")
    if not callback._use_global_unstructured and callback._pruning_method_name not in _PER_LAYER:
        refuse(f"(pruning_fn={callback._pruning_method_name!r})`", "each stage would draw its random masks from the "
               "generator that also orders its batches, other numbers than one device's", "Use `'l1_unstructured'` "
               "or `'ln_structured'`")
    if callback._resample_parameters and callback._use_lottery_ticket_hypothesis:
        refuse("(resample_parameters=True)`", "each stage would draw its layers' new weights from the generator "
               "that also orders its batches, other numbers than one device's", "Keep `resample_parameters=False`, "
               "or pass `use_lottery_ticket_hypothesis=False`")
    if is_overridden("configure_model", module):
        refuse("` with a model built in `configure_model`", "the callback lists the layers to prune in its own "
               "`setup`, before `configure_model` builds them (it finds none, on one device too)", "Build the model "
               "in `__init__`, or remove the callback")
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    shared = [f"{names.get(id(m), type(m).__name__)}.{name}" for m, name in callback._parameters_to_prune
              if isinstance(getattr(m, name, None), nn.Parameter) and uses[id(getattr(m, name))] > 1]
    if shared:
        refuse(f"` of a weight two modules share (`{shared[0]}`)", "each module would prune it with its own mask, "
               "and a weight tied across stages is updated on the first stage only", "Leave the shared weight out "
               "with `parameters_to_prune=` or `filter_parameters_to_prune`")


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Every parameter of ``module`` by id, under the name one device's checkpoint gives it: a weight pruned by
    ``torch.nn.utils.prune`` (``<name>_orig`` beside a ``<name>_mask`` buffer, the same ``Parameter``) keeps
    ``<name>``, as the callback's permanent ``state_dict`` does."""
    names = {id(p): n for n, p in module.named_parameters()}
    for prefix, sub in module.named_modules():
        masks = {n for n, _ in sub.named_buffers(recurse=False) if n.endswith("_mask")}
        for name, param in sub.named_parameters(recurse=False):
            if name.endswith("_orig") and f"{name[:-5]}_mask" in masks:
                names[id(param)] = f"{prefix}.{name[:-5]}" if prefix else name[:-5]
    return names


def pruning_per_stage(trainer: Trainer, strategy: PipelineStrategy) -> list[Callable[[], None]]:
    """At setup, for fitting: every ``ModelPruning`` callback prunes this stage's own layers, a global amount
    ranked over every stage, and checkpoints hold the pruning made permanent; returns the undos for teardown.

    Raises:
        ValueError: virtual stages, data-parallel replicas, or the lottery ticket's copies made on the meta device.
    """
    callbacks = [c for c in trainer.callbacks if isinstance(c, ModelPruning)]  # type: ignore[attr-defined]
    if not callbacks:
        return []
    if strategy.config.virtual_stages > 1 or strategy.data_parallel_size > 1:
        raise ValueError(
            "`ModelPruning` under `PACIStrategy` needs one stage per process and no data-parallel replicas: a "
            "process's stages swap their layers in and out, and a global amount is ranked over one pipeline. Remove "
            "`virtual_stages` or train with as many devices as stages, or remove the callback.")
    module = strategy.lightning_module
    assert module is not None
    members = {id(m) for m in module.modules()}  # the carved module's: another stage's layers are not in it
    undos: list[Callable[[], None]] = []
    for callback in callbacks:
        whole: _Pairs = list(callback._parameters_to_prune)
        own = [(m, name) for m, name in whole if id(m) in members and not getattr(m, name).is_meta]
        callback._parameters_to_prune = own
        if callback._original_layers is not None:
            callback._original_layers = _own_copies(callback._original_layers, own)
        handles = [m.register_state_dict_post_hook(partial(_permanent, names))
                   for m, names in _names_by_module(own).items()]
        undos += [h.remove for h in handles] + [partial(setattr, callback, "_parameters_to_prune", whole)]
        undos.append(api.patch_method(callback, "on_save_checkpoint", _gathered,
                                      parameters=("trainer", "pl_module", "checkpoint")))
        undos.append(api.patch_method(callback, "apply_lottery_ticket_hypothesis",
                                      partial(_lottery_in_place, callback), parameters=()))
        undos.append(api.patch_method(callback, "_apply_global_pruning", _GlobalL1(callback, strategy),
                                      parameters=("amount",)))
    return undos


def _own_copies(layers: dict[int, Any], own: _Pairs) -> dict[int, Any]:
    """The lottery ticket's copies of the stage's own layers, numbered by their place in ``own``."""
    out: dict[int, Any] = {}
    for index, (m, name) in enumerate(own):
        copy = layers[id(m)]["data"]
        if any(t.is_meta for t in [*copy.parameters(), *copy.buffers()]):
            raise ValueError(
                "`ModelPruning(use_lottery_ticket_hypothesis=True)` with a model built on the meta device is not "
                "supported by `PACIStrategy`: the callback copies the initial weights in its `setup`, before each "
                "stage makes its own. Pass `use_lottery_ticket_hypothesis=False`, or build the model in `__init__` "
                "outside `trainer.init_module(empty_init=True)`.")
        out.setdefault(id(m), {"data": copy, "names": []})["names"].append((index, name))
    return out


def _names_by_module(pairs: _Pairs) -> dict[nn.Module, tuple[str, ...]]:
    out: dict[nn.Module, tuple[str, ...]] = {}
    for m, name in pairs:
        out[m] = out.get(m, ()) + (name,)
    return out


def _permanent(names: tuple[str, ...], module: nn.Module, state_dict: dict[str, Any], prefix: str,
               local_metadata: Any) -> None:
    """A pruned layer's ``state_dict`` made permanent in place, as ``ModelPruning`` saves it on one device."""
    for name in names:
        mask = state_dict.pop(f"{prefix}{name}_mask", None)
        if mask is not None:
            orig = state_dict.pop(f"{prefix}{name}_orig")
            state_dict[f"{prefix}{name}"] = (mask.to(dtype=orig.dtype) * orig).detach()


def _gathered(trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """The callback's ``on_save_checkpoint``: the strategy's gather already holds the permanent weights."""


def _lottery_in_place(callback: ModelPruning) -> None:
    """Lightning's ``apply_lottery_ticket_hypothesis`` (``resample_parameters`` refused), writing each initial
    weight into the parameter's own storage; the copy then shares it, as Lightning's ``.data`` assignment makes it
    do wherever the copy is on the parameter's device."""
    assert callback._original_layers is not None
    for layer in callback._original_layers.values():
        for index, name in layer["names"]:
            target, _ = callback._parameters_to_prune[index]
            dst = getattr(target, f"{name}_orig", None)
            dst = getattr(target, name) if dst is None else dst
            src = getattr(layer["data"], name)
            if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
                continue
            moved = src.data.to(dst.device)
            dst.data.copy_(moved)
            if moved.data_ptr() == src.data_ptr() and moved.dtype == dst.dtype:
                src.data = dst.data


def _mask(module: nn.Module, name: str) -> torch.Tensor:
    """The layer's mask, all ones where it is not pruned yet (as ``global_unstructured`` takes it)."""
    mask = getattr(module, f"{name}_mask", None)
    return torch.ones_like(getattr(module, name)) if mask is None else mask


def _count(keys: list[torch.Tensor], where: Callable[[torch.Tensor], torch.Tensor]) -> int | torch.Tensor:
    """How many keys ``where`` holds for, on their device (no host read)."""
    return sum(where(k).sum() for k in keys)


class _GlobalL1:
    """The callback's ``_apply_global_pruning(amount)``: ``torch.nn.utils.prune.global_unstructured`` with
    ``L1Unstructured`` over every stage's layers (module docstring)."""

    def __init__(self, callback: ModelPruning, strategy: PipelineStrategy) -> None:
        self.callback, self.strategy = callback, strategy

    def __call__(self, amount: float) -> None:
        method = torch_prune.L1Unstructured(amount)  # torch's checks of `amount`
        pairs = self.callback._parameters_to_prune
        masks = [_mask(m, name) for m, name in pairs]
        kept = [mask.reshape(-1) == 1 for mask in masks]
        # |score| of the entries still kept, as float64 bits (ordered as the values are: they are not negative)
        keys = [getattr(m, name).detach().reshape(-1)[k].abs().double().view(torch.int64)
                for (m, name), k in zip(pairs, kept)]
        size = sum(self._per_stage(sum(k.numel() for k in keys)))
        amount = method.amount  # torch's count: an int as it is, a fraction of every stage's kept entries rounded
        count = int(amount) if isinstance(amount, numbers.Integral) else round(float(amount) * size)
        if count > size:
            raise ValueError(f"amount={count} should be smaller than the number of parameters to prune={size}")
        threshold = self._kth_smallest(keys, count) if count else -1  # -1: no key is below or at it
        below = sum(self._per_stage(_count(keys, lambda k: k < threshold)))
        ties = self._per_stage(_count(keys, lambda k: k == threshold))
        stage = self.strategy.stage_index
        take = min(ties[stage], max(0, count - below - sum(ties[:stage])))  # this stage's share of the ties
        for (m, name), mask, keep, key in zip(pairs, masks, kept, keys):
            pruned = key < threshold
            equal = (key == threshold).nonzero().reshape(-1)[:take]
            pruned[equal] = True
            take -= int(equal.numel())
            new = mask.detach().clone().reshape(-1).to(dtype=getattr(m, name).dtype)
            new[keep.nonzero().reshape(-1)[pruned]] = 0
            torch_prune.custom_from_mask(m, name, mask=new.view_as(getattr(m, name)))

    def _kth_smallest(self, keys: list[torch.Tensor], count: int) -> int:
        """The smallest bit pattern with at least ``count`` keys of every stage at or below it: bisection."""
        low, high = 0, (1 << 63) - 1
        while low < high:
            middle = (low + high) // 2
            if sum(self._per_stage(_count(keys, lambda k: k <= middle))) >= count:
                high = middle
            else:
                low = middle + 1
        return low

    def _per_stage(self, value: int | torch.Tensor) -> list[int]:
        """``value`` of every stage of the pipeline, in stage order: one all-reduce of a number per process, and
        one host read."""
        strategy = self.strategy
        values = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=strategy.root_device)
        values[dist.get_rank()] = value
        with activity.collective("`ModelPruning`'s global amount over the stages"):
            dist.all_reduce(values)
        by_rank = values.tolist()
        return [by_rank[strategy.rank_of(stage)] for stage in range(strategy.num_stages)]
