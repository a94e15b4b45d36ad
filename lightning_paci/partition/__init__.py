"""Partition an unchanged module into pipeline stages, in place, keeping every parameter's name.

Three steps, one module each, run in this order by the strategy (and by ``ReferencePipeline``):

* ``profile.py``: time each block's forward+backward on a sample micro-batch (``profile_block_costs``);
* ``plan.py``: choose the block boundaries over every container's blocks and the owners of the outside modules
  (``plan_partition`` -> ``PartitionPlan``; ``outside.py`` finds where each runs), by parameter counts, or by the
  measured times when they clearly win;
* ``carve.py``: reduce a module to one stage and install the boundary hooks (``carve_stage`` -> ``StageCarve``);
  see [Note: stage boundaries are block inputs] there.

``blocks.py`` holds what the first two share: finding the block containers and the contiguous min-max split.
Around the carve:

* ``chunks.py``: several stages of one process carved out of one module ([Note: chunks of one device]);
* ``placeholder.py``: the placeholders of other stages' modules ([Note: placeholders answer attribute reads]);
* ``crossing.py``: the values a stage reads from other stages, collected at setup, refused at training if missed;
* ``relay.py``: the values carried past stage boundaries ([Note: relayed crossings]);
* ``stage_init.py``: a model recorded on the meta device and replayed, a stage holding only its own parameters;
* ``weights.py``: pretrained weights read per stage.
"""

from __future__ import annotations

from lightning_paci.partition.blocks import find_block_container
from lightning_paci.partition.carve import BoundaryState, StageCarve, StageDone, carve_stage, share_tied_weights
from lightning_paci.partition.plan import PartitionPlan, PartitionSpec, plan_partition
from lightning_paci.partition.profile import (
    TIME_BALANCE_MIN_GAIN,
    TIME_BALANCE_MIN_SECONDS,
    BlockCosts,
    profile_block_costs,
    stage_costs,
)

__all__ = [
    "TIME_BALANCE_MIN_GAIN",
    "TIME_BALANCE_MIN_SECONDS",
    "BlockCosts",
    "BoundaryState",
    "PartitionPlan",
    "PartitionSpec",
    "StageCarve",
    "StageDone",
    "carve_stage",
    "find_block_container",
    "plan_partition",
    "profile_block_costs",
    "share_tied_weights",
    "stage_costs",
]
