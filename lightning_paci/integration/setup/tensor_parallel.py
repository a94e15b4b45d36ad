"""Tensor parallelism and FSDP2 inside a stage: the user's ``configure_model``, written for Lightning's
``ModelParallelStrategy``, run on the stage after the cut.

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

With replicas (``data_parallel_size`` > 1) the module shards itself over them, as Lightning's guide has it:
``fully_shard(block, mesh=self.device_mesh["data_parallel"])`` on its blocks and the rest; every parameter of the
stage must be so sharded (refused at setup otherwise, naming the first ones), and the strategy's own replica
average is off. FSDP2 reduce-scatters a gradient once per update window: every backward but the window's last
runs with ``set_requires_gradient_sync(False)``, so the unsharded gradients accumulate on the rank until then
(one reduction per update, as the strategy's replicas average; the window's peak holds the stage's gradients
unsharded). Each rank holds its stage's parameters, gradients and optimizer state / (D x T); parameters are
gathered for each forward and backward by FSDP2's own rule (the module's ``reshard_after_forward``).

``tensor_parallel_size`` given (1 included) switches this on; unset, a stage's module gets no mesh and its
replicas are averaged by the strategy. Its checkpoints are
``torch.distributed.checkpoint`` directories ([Note: distributed checkpoints]). In this release such a stage runs one
stage per process, without clipping under ``"paci"`` (the flush schedules clip by the global norm over the shards,
trainer/clipping.py), weight prediction or the weight drift measurement (each refused at setup, naming the fix); at
the end of ``fit`` each rank keeps its own stage's shards, as under ``ModelParallelStrategy``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_paci.config import PACIConfig
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.clipping import FLUSH_SCHEDULES, clips_by_norm

__all__ = ["check_tensor_parallel_run", "deferred_configure_model", "parallelize_stage"]

log = logging.getLogger(__name__)

# torch's warning for a plan key no child of a placeholder matches
_SKIPPED = re.compile(r"Parallelize plan key .* could not be resolved: .* in module Placeholder\(")


@contextlib.contextmanager
def deferred_configure_model(module: LightningModule | None, model_parallel: bool) -> Iterator[None]:
    """Around Lightning's call of ``configure_model`` (``tensor_init_context``): with tensor parallelism the call
    does nothing; :func:`parallelize_stage` makes it on the cut stage ([Note: tensor parallelism in a stage])."""
    if not model_parallel or module is None:
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
    stage_mesh = mesh["data_parallel", "tensor_parallel"]
    api.set_device_mesh(module, stage_mesh)
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
    if stage_mesh["data_parallel"].size() > 1:
        _check_sharded(module)


def _check_sharded(module: LightningModule) -> None:
    """With replicas, every parameter of the stage sharded over them (``fully_shard`` in ``configure_model``):
    nothing else would keep the replicas equal."""
    from torch.distributed.tensor import DTensor, Replicate

    def sharded(p: torch.nn.Parameter) -> bool:  # placed on the replicas' dimension other than replicated
        if not isinstance(p, DTensor):
            return False
        names = p.device_mesh.mesh_dim_names or ()
        return "data_parallel" in names and not isinstance(p.placements[names.index("data_parallel")], Replicate)

    unsharded = [name for name, p in module.named_parameters() if not sharded(p)]  # (the stage's own: on meta too)
    if unsharded:
        raise ValueError(
            f"`PACIStrategy(tensor_parallel_size=..., data_parallel_size>1)`: {len(unsharded)} parameters of this "
            f"stage are not sharded over the replicas ({', '.join(unsharded[:3])}"
            f"{', ...' if len(unsharded) > 3 else ''}): with the module's own parallelism the replicas are kept "
            f"equal by FSDP2. Call `fully_shard(module, mesh=self.device_mesh['data_parallel'])` on the blocks and "
            f"the rest in `configure_model`, or leave `tensor_parallel_size` unset for replicas averaged by the "
            f"strategy.")


def check_tensor_parallel_run(trainer: Trainer, config: PACIConfig) -> None:
    """At setup: what a stage with tensor parallelism does not run in this release, refused naming the fix."""
    if not config.model_parallel:
        return
    settings = f"`PACIStrategy(tensor_parallel_size={config.tensor_parallel_size})`"
    for option, value, default in (("dp_shard", config.dp_shard, "none"), ("deferred_update", config.deferred_update,
                                                                           False)):
        if value != default:
            raise ValueError(f"{settings} with `{option}={value!r}`: with the module's own parallelism its replicas "
                             f"are sharded by its `configure_model` (`fully_shard`), not by the strategy. Drop "
                             f"`{option}`, or leave `tensor_parallel_size` unset.")
    if clips_by_norm(trainer) and config.schedule not in FLUSH_SCHEDULES:
        raise ValueError(f"{settings} with `gradient_clip_val` under `schedule={config.schedule!r}`: the stages' "
                         f"latest norms over DTensor shards are not carried in this release. Use a flush schedule "
                         f"('1f1b', 'gpipe'), which clips by the global norm, or remove `gradient_clip_val`.")
