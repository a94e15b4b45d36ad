"""One device's optimizer, its param groups by name: pipeline checkpoints resume on one device, one-device
checkpoints under the pipeline.

A pipeline checkpoint keys the optimizer state by parameter name (checkpoint.py), because each stage's optimizer
holds another subset of the parameters. ``Trainer(devices=1)`` restores ``optimizer.load_state_dict(entry)``:
torch's index format, whose indices count the parameters in the order ``configure_optimizers`` put them into the
param groups. That order belongs to the module, so it is read, not guessed: at setup, before carving, the unchanged
module's ``configure_optimizers`` runs once on the whole model and :class:`OneDeviceOptimizer` keeps each group's
parameter names in order (the optimizer itself is dropped; it holds no state yet).

The consolidated checkpoint then carries both forms in ``optimizer_states[0]``: ``"paci"`` (name-keyed, with the
accumulation counters and open-window gradients) and torch's ``"state"``/``"param_groups"`` for one device (torch
ignores the extra key). A one-device checkpoint resumed under the pipeline is converted back by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_paci.integration.trainer import lightning_api as api

__all__ = ["ONE_DEVICE_KEY", "OneDeviceOptimizer", "one_optimizer_message"]

# in a sharded checkpoint's optimizer entry: the layout, so that the file consolidated from it holds torch's form
ONE_DEVICE_KEY = "one_device_layout"


def one_optimizer_message(count: int) -> str:
    return (f"`configure_optimizers` returned {count} optimizers; `PACIStrategy` steps exactly one optimizer per stage "
            f"(under automatic optimization: manual optimization is not supported either). Return one optimizer; "
            f"its param groups may differ per submodule (e.g. a group per part, each with its own lr).")


@dataclass(frozen=True)
class OneDeviceOptimizer:
    """Per param group of the single-device optimizer: its parameter names in order, and its hyper-parameters at
    construction (used for a group none of whose parameters has a saved entry)."""

    groups: tuple[tuple[str, ...], ...]
    defaults: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, module: Any) -> OneDeviceOptimizer | None:
        """The layout ``module.configure_optimizers()`` gives on the whole model; None when it gives none, or its
        optimizer holds tensors other than the module's own parameters.

        Raises:
            ValueError: not one optimizer, before Lightning's own check would advise manual optimization, which
                the strategy refuses.
        """
        optimizers = api.configured_optimizers(module)
        if len(optimizers) > 1:
            raise ValueError(one_optimizer_message(len(optimizers)))
        if not optimizers:  # None: Lightning's warning, and a run without updates
            return None
        names = {id(p): n for n, p in module.named_parameters()}
        groups = optimizers[0].param_groups
        if any(id(p) not in names for g in groups for p in g["params"]):
            return None
        return cls(tuple(tuple(names[id(p)] for p in g["params"]) for g in groups),
                   tuple({k: v for k, v in g.items() if k != "params"} for g in groups))

    def layout(self) -> dict[str, Any]:
        """What a sharded checkpoint keeps of it: plain lists and dicts (``torch.load(weights_only=True)`` reads
        them); :meth:`from_layout` makes it again."""
        return {"groups": [list(g) for g in self.groups], "defaults": [dict(d) for d in self.defaults]}

    @classmethod
    def from_layout(cls, layout: Mapping[str, Any]) -> OneDeviceOptimizer:
        return cls(tuple(tuple(g) for g in layout["groups"]), tuple(dict(d) for d in layout["defaults"]))

    def with_group(self, names: tuple[str, ...], hyper: Mapping[str, Any]) -> OneDeviceOptimizer:
        """The layout after ``optimizer.add_param_group`` of the parameters ``names`` (a fine-tuning schedule's,
        finetuning.py) with the hyper-parameters ``hyper``."""
        return OneDeviceOptimizer(self.groups + (names,), self.defaults + ({k: v for k, v in hyper.items()
                                                                         if k != "params"},))

    def to_torch(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """torch's ``Optimizer.state_dict()`` of the single-device optimizer, from the name-keyed entries."""
        state: dict[int, Any] = {}
        param_groups = []
        index = 0
        for names, default in zip(self.groups, self.defaults):
            hyper = next((params[n]["group"] for n in names if "group" in params.get(n, {})), default)
            ids = []
            for name in names:
                saved = params.get(name, {}).get("state")
                if saved:
                    state[index] = saved
                ids.append(index)
                index += 1
            param_groups.append({**hyper, "params": ids})
        return {"state": state, "param_groups": param_groups}

    def from_torch(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """Name-keyed entries (checkpoint.py's ``params``) from a single-device optimizer state.

        Raises:
            ValueError: the entry's groups do not match this module's ``configure_optimizers``.
        """
        saved_groups = entry.get("param_groups")
        shapes = [len(g.get("params", ())) for g in saved_groups or ()]
        if shapes != [len(g) for g in self.groups]:
            raise ValueError(
                f"The checkpoint's optimizer has param groups of sizes {shapes}, but this module's "
                f"`configure_optimizers` builds {[len(g) for g in self.groups]}: it was written for another model or "
                f"another optimizer setup. Resume with the same `configure_optimizers`, or load only the weights "
                f"(`Model.load_from_checkpoint`)."
            )
        out: dict[str, Any] = {}
        for names, group in zip(self.groups, saved_groups or ()):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for name, index in zip(names, group["params"]):
                out[name] = {"state": dict(entry["state"].get(index, {})), "group": hyper, "grad": None}
        return out


    def as_pipeline_checkpoint(self, checkpoint: Mapping[str, Any], accumulation: int) -> Mapping[str, Any]:
        """A one-device checkpoint (torch's format, no ``"paci"`` entry) with its optimizer state converted by name
        into the pipeline's entry, resuming at its last optimizer step (``global_step`` steps of ``accumulation``
        micro-batches: a one-device file saved inside an accumulation window has no gradients to resume, on one
        device either); any other checkpoint unchanged."""
        states = checkpoint.get("optimizer_states") or [{}]
        if "paci" in states[0] or "param_groups" not in states[0]:
            return checkpoint
        steps = int(checkpoint.get("global_step", 0))
        entry = {"num_stages": 1, "backwards": steps * accumulation, "steps": steps,
                 "params": self.from_torch(states[0])}
        return {**checkpoint, "optimizer_states": [{"paci": entry}, *states[1:]]}
