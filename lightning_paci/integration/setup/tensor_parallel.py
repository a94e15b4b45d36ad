"""Tensor parallelism inside a stage: the user's ``configure_model``, written for Lightning's ``ModelParallelStrategy``,
run on the stage after the cut.

[Note: tensor parallelism in a stage]
``PACIStrategy(tensor_parallel_size=T)`` gives each stage ``T`` ranks ([Note: rank layout]). A module written for
``ModelParallelStrategy`` builds its layers (in ``__init__``) and applies its plan in ``configure_model``:
``parallelize_module(block, self.device_mesh["tensor_parallel"], {"w1": ColwiseParallel(), ...})``. Under the
pipeline that hook runs once the module is cut to this stage, not when Lightning calls it: Lightning's call comes
before the strategy's setup, with the whole model and no mesh; here it finds ``self.device_mesh`` -- the stage's own
2D sub-mesh ``("data_parallel", "tensor_parallel")`` of the pipeline's 3D one, ModelParallelStrategy's dimension
names -- and the blocks of other stages as placeholders. ``parallelize_module`` resolves a plan's keys among a
module's children, and a placeholder has none: torch skips each such entry (its warning per key is gathered here
into one line), so the plan needs no change for the cut. A plan applied to a placeholder's attribute reaches its
copy of the real module on the meta device, where parameters become meta DTensors: no memory, no collective.

What crosses between stages is what each rank's part of the step returns at the boundary: with the usual plans
(``ColwiseParallel`` then ``RowwiseParallel``, ``use_local_output=True``) a plain tensor, the same on every
tensor-parallel rank of the stage; each rank sends it to the rank of the same coordinate in the next stage. A
DTensor at a boundary is refused at the first forward that sends one, naming the block
(``check_plain_boundary``).

In this release a stage with tensor parallelism runs one data-parallel replica, one stage per process, without
global-norm clipping, weight prediction or checkpoints (each refused at setup, naming the fix); at the end of
``fit`` each rank keeps its own stage's shards, as under ``ModelParallelStrategy``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

from lightning_paci.config import PACIConfig
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.clipping import clips_by_norm

__all__ = ["check_tensor_parallel_run", "deferred_configure_model", "parallelize_stage"]

log = logging.getLogger(__name__)

# torch's warning for a plan key no child of a placeholder matches
_SKIPPED = re.compile(r"Parallelize plan key .* could not be resolved: .* in module Placeholder\(")


@contextlib.contextmanager
def deferred_configure_model(module: LightningModule | None, tensor: int) -> Iterator[None]:
    """Around Lightning's call of ``configure_model`` (``tensor_init_context``): with tensor parallelism the call
    does nothing; :func:`parallelize_stage` makes it on the cut stage ([Note: tensor parallelism in a stage])."""
    if tensor == 1 or module is None:
        yield
        return
    undo = api.patch_method(module, "configure_model", _later, parameters=())
    try:
        yield
    finally:
        undo()


def _later() -> None:
    """Lightning's call of ``configure_model`` under tensor parallelism: made later, on the cut stage."""


def parallelize_stage(module: LightningModule, mesh: Any) -> None:
    """Give the cut ``module`` its stage's 2D sub-mesh of ``mesh`` as ``self.device_mesh`` and run its
    ``configure_model``, which applies its tensor-parallel plan."""
    if not api.overrides_configure_model(module):
        raise ValueError(
            f"`PACIStrategy(tensor_parallel_size=...)` needs `{type(module).__name__}.configure_model` to apply the "
            f"tensor-parallel plan, as under Lightning's `ModelParallelStrategy`: build the layers in `__init__` and "
            f"call `parallelize_module(block, self.device_mesh['tensor_parallel'], plan)` in `configure_model`.")
    api.set_device_mesh(module, mesh["data_parallel", "tensor_parallel"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.call_configure_model(module)
    skipped = 0
    for warning in caught:
        if _SKIPPED.search(str(warning.message)):
            skipped += 1
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if skipped:
        log.info(f"lightning_paci: the tensor-parallel plan passed over {skipped} entries on blocks of other stages "
                 f"(placeholders here)")


def check_tensor_parallel_run(trainer: Trainer, config: PACIConfig) -> None:
    """At setup: what a stage with tensor parallelism does not run in this release, refused naming the fix."""
    if config.tensor_parallel_size == 1:
        return
    settings = f"`PACIStrategy(tensor_parallel_size={config.tensor_parallel_size})`"
    if clips_by_norm(trainer):
        raise ValueError(f"{settings} with `gradient_clip_val`: the global norm over tensor-parallel shards is not "
                         f"computed in this release. Remove `gradient_clip_val`, or use `tensor_parallel_size=1`.")
    if any(isinstance(c, Checkpoint) for c in trainer.callbacks):  # type: ignore[attr-defined]
        raise ValueError(f"{settings}: checkpoints of tensor-parallel stages are not written in this release. Pass "
                         f"`Trainer(enable_checkpointing=False)` (and no checkpoint callback), or use "
                         f"`tensor_parallel_size=1`.")
