"""Lightning's callbacks that act on a model's weights, set up on each stage: the strategy's one hook for them.

Each callback was written for one device and builds or walks the whole module; under a pipeline each acts on the
stage's own carved part, at the stage's own updates: ``WeightAveraging`` (weight_averaging.py),
``StochasticWeightAveraging`` (stochastic_weight_averaging.py), the fine-tuning callbacks (finetuning.py) and
``ModelPruning`` (pruning.py).
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Trainer

from lightning_paci.integration.lightning_callbacks.finetuning import finetune_per_stage
from lightning_paci.integration.lightning_callbacks.pruning import pruning_per_stage
from lightning_paci.integration.lightning_callbacks.stochastic_weight_averaging import stochastic_averaging_per_stage
from lightning_paci.integration.lightning_callbacks.weight_averaging import weight_averaging_per_stage
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["callbacks_per_stage"]


def callbacks_per_stage(trainer: Trainer, strategy: PipelineStrategy) -> list[Callable[[], None]]:
    """At setup, for fitting: a ``StochasticWeightAveraging`` averages this stage's own parameters at its epochs, a
    fine-tuning callback's new param groups reach the stage's optimizer, a ``ModelPruning`` prunes the stage's own
    layers, every ``WeightAveraging`` averages the stage's own parameters at its updates; returns the undos for
    teardown, in that order."""
    return (stochastic_averaging_per_stage(trainer, strategy) + finetune_per_stage(trainer, strategy)
            + pruning_per_stage(trainer, strategy) + weight_averaging_per_stage(trainer, strategy))
