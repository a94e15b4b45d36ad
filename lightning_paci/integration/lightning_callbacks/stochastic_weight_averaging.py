"""Lightning's ``StochasticWeightAveraging`` on each stage: the averaged copy holds the stage's own parameters, the
SWA learning rates switch on the stage's own optimizer, and a checkpoint holds every stage's average.

Why it runs per stage unchanged but for its copy: the callback averages once per epoch, at the start of an epoch
(``on_train_epoch_start``), and an epoch's end drains the pipeline (fit_loop.py), so every stage's weights then are
one device's; its ``SWALR`` is an epoch-interval scheduler over ``trainer.optimizers[0]``, the user's optimizer whose
groups each stage steps (through aliases, [Note: alias optimizer]), and Lightning steps it after the drain, so each
stage's next updates use one device's learning rate. What breaks is its copy: Lightning deep-copies the whole module
in ``setup``, before the strategy carves it, and its update and its transfer at the end of ``fit`` zip the copy's
parameters with the module's -- on a stage, with a carved module that holds only its own. Here, after carving, the
copy becomes a :class:`StageAverage`: the stage's own parameters and buffers with the values the whole copy holds
by name (so a copy resumed from a checkpoint keeps them), in the carved module's parameter order, and the dtype
and device the whole copy had (one device averages in that copy's dtype too). A checkpoint gathers the stages'
averages to rank 0 into the callback's ``average_model_state``, the whole model's keys, Lightning's format: it
resumes here and on one device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn

from lightning_paci.engine.transport.collectives import gather_to_first
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["StageAverage", "stochastic_averaging_per_stage"]


class StageAverage(nn.Module):
    """A stage's averaged copy: its own parameters and buffers under their names in the whole model, the parameters
    in the carved module's ``parameters()`` order (Lightning's update and transfer zip the two), ``state_dict()``
    keyed as the whole module's is.

    Args:
        module: the carved module (its own parameters and buffers).
        whole: the callback's copy of the whole module, whose values are taken by name (None: the module's).
    """

    def __init__(self, module: nn.Module, whole: nn.Module | None) -> None:
        super().__init__()
        own = module.state_dict()
        values = whole.state_dict() if whole is not None else {}
        self.param_names = [name for name, _ in module.named_parameters()]
        params = set(self.param_names)
        self.buffer_names = [name for name in own if name not in params]
        self.averaged = nn.ParameterList(
            [nn.Parameter(values.get(name, own[name]).detach().clone(), requires_grad=False)
             for name in self.param_names])
        for index, name in enumerate(self.buffer_names):
            self.register_buffer(f"buffer_{index}", values.get(name, own[name]).detach().clone())

    def _named(self) -> dict[str, torch.Tensor]:
        tensors = dict(zip(self.param_names, self.averaged))
        tensors.update({name: getattr(self, f"buffer_{i}") for i, name in enumerate(self.buffer_names)})
        return tensors

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The stage's averaged tensors under their names in the whole module."""
        return {name: tensor.detach() for name, tensor in self._named().items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Take the values of this stage's names from a state of the whole module (or of a stage)."""
        with torch.no_grad():
            for name, tensor in self._named().items():
                if name in state_dict:
                    tensor.copy_(state_dict[name])


def stochastic_averaging_per_stage(trainer: Trainer, strategy: PipelineStrategy) -> list[Callable[[], None]]:
    """At setup, for fitting: every ``StochasticWeightAveraging`` callback averages this stage's own parameters;
    returns the undos for teardown.

    Raises:
        ValueError: virtual stages or sharded checkpoints, or a step-interval scheduler (the stage steps it at its
            own updates and would go on stepping it after the callback swaps it for its ``SWALR``).
    """
    callbacks = [c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]  # type: ignore[attr-defined]
    if not callbacks:
        return []
    if strategy.config.virtual_stages > 1 or strategy.config.checkpoint_layout != "consolidated":
        raise ValueError(
            "`StochasticWeightAveraging` under `PACIStrategy` needs one stage per process and consolidated "
            "checkpoints: remove `virtual_stages` and `checkpoint_layout='sharded'`, or the callback.")
    if any(config.interval == "step" for config in strategy.lr_scheduler_configs):
        raise ValueError(
            "`StochasticWeightAveraging` with a step-interval learning-rate scheduler is not supported by "
            "`PACIStrategy`: each stage steps that scheduler at its own updates, and would go on stepping it after "
            "the callback swaps it for its `SWALR`. Use an epoch-interval scheduler (`'interval': 'epoch'`), or "
            "remove the callback.")
    module = strategy.lightning_module
    assert module is not None
    undos: list[Callable[[], None]] = []
    for callback in callbacks:
        callback._average_model = StageAverage(module, callback._average_model)  # type: ignore[assignment]
        undos.append(api.patch_method(callback, "on_save_checkpoint", _SaveAverage(callback, strategy),
                                      parameters=("trainer", "pl_module", "checkpoint")))
    return undos


class _SaveAverage:
    """``on_save_checkpoint`` on every rank: the stages' averages gathered to rank 0 into the callback's state
    (``average_model_state``, the whole module's keys, as one device writes it)."""

    def __init__(self, callback: StochasticWeightAveraging, strategy: PipelineStrategy) -> None:
        self.callback, self.strategy = callback, strategy

    def __call__(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        average = self.callback._average_model
        if average is None:
            return
        local = {k: v.detach().cpu() for k, v in average.state_dict().items()}
        merged = gather_to_first(local, self.strategy.data_parallel_size, self.strategy.process_groups.host)
        state = checkpoint.get("callbacks", {}).get(self.callback.state_key)
        if merged is not None and state is not None:  # rank 0, which writes the file
            state["average_model_state"] = merged
