"""Gradient clipping by the norm over every stage's parameters, as one device clips.

[Note: global-norm clipping]
``Trainer(gradient_clip_val=c)`` (algorithm ``"norm"``, Lightning's default) clips on one device by the norm over
every parameter of the model; a stage holds only its own, and clipping each stage by its own norm scales every
stage differently (a transformers GPT-2 under ``"1f1b"`` ended 0.6 (2 stages) to 1.4 (4 stages) away from one
device's weights, relative). Under the flush schedules (``"1f1b"``, ``"gpipe"``, ``"layered"``) every stage makes
its k-th update at the same point of the same stream, after the batch's last backward, which the flush waits for
anyway: there each stage's squared norm (one multi-tensor norm, on the device) is summed over every process with
one all-reduce of ``replicas`` numbers on the default process group -- a process writes its own replica's slot, so
the sum is each replica's pipeline's, and the replicas' gradients, averaged before, give the same total -- and
the stage scales its gradients by ``min(1, c / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does,
without a host read. Lightning's precision plugin clips through ``clip_grad_by_norm``, so a module's own
``configure_gradient_clipping`` calling ``self.clip_gradients(..., "norm")`` is global too; a direct call of
``clip_grad_norm_`` in a hook stays the stage's own. With the module's own parallelism ([Note: tensor parallelism
in a stage]) the gradients are DTensor shards: each rank adds its shards' squares, each counted once over the
ranks holding the same values (``sharded_norm_clipping``), and one all-reduce of one number gives the total.

Under ``"paci"`` the stages update at different times, and a collective at every update would be the global
synchronisation PACI removes. There (with ``virtual_stages=1``) each stage clips by the norm over every stage's
*latest* squared norms, which travel on the pipeline's own messages ([Note: norm table] in
engine/runtime/norm_table.py):
its own at this update, the others' as the last messages brought them (0 before the first), a function of the
action lists alone, so ``ReferencePipeline(gradient_clip_val=...)`` computes the same bits. It is not one device's
clipping: another stage's norm may be a few updates old, as its weights are. The patched ``clip_grad_by_norm``
reaches the stage's table through its closure: a process runs one stage there. Replicas average their gradients
before the clip, so every replica's pipeline carries the same norms (under LocalSGD each its own); a tied weight's
norm is stage 0's (its gradient, the last stage's part added, is there at the update). A resumed run starts with an
empty table (entries 0) and refills it with the first messages. With virtual stages a process updates each of its
stages at its own point of the list, and clipping by norm stays per stage, said at setup (``per_stage_clipping``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_paci.engine.runtime.norm_table import NormTable, clip_scale, squared_norm
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["FLUSH_SCHEDULES", "clipping_by_norm", "clips_by_norm", "global_norm_clipping", "per_stage_clipping",
           "sharded_norm_clipping", "table_norm_clipping"]

FLUSH_SCHEDULES = ("1f1b", "gpipe", "layered")  # every stage's k-th update at the same point of the stream


def clips_by_norm(trainer: Any) -> bool:
    """Whether the Trainer clips gradients by their norm (``gradient_clip_val`` set, algorithm ``"norm"``)."""
    algorithm = trainer.gradient_clip_algorithm
    return bool(trainer.gradient_clip_val) and (algorithm is None or str(getattr(algorithm, "value", algorithm)) ==
                                                "norm")


def per_stage_clipping(trainer: Any, schedule: str, virtual_stages: int) -> str | None:
    """The setup warning where clipping by norm stays per stage ([Note: global-norm clipping]), else None."""
    if not clips_by_norm(trainer) or (schedule in (*FLUSH_SCHEDULES, "paci") and virtual_stages == 1):
        return None
    why = (f"virtual_stages={virtual_stages}: a process updates each of its stages at its own point of the list"
           if virtual_stages > 1 else
           f"schedule={schedule!r}: the stages update at different times, and a collective at every update would "
           f"be the global synchronisation it removes")
    return (f"lightning_paci: `Trainer(gradient_clip_val={trainer.gradient_clip_val})` clips by norm, and under "
            f"{why}, so each stage clips by the norm of its own gradients (one device clips by the norm over "
            f"every parameter). With `virtual_stages=1`, `schedule='1f1b'` or `'gpipe'` clips by the global norm "
            f"and `schedule='paci'` by the latest norms of every stage its messages carry; "
            f"`gradient_clip_algorithm='value'` is the same as on one device everywhere.")


def global_norm_clipping(plugin: Any, replica: int, replicas: int) -> Callable[[], None]:
    """Make ``plugin`` (the strategy's precision plugin) clip by the norm over every stage's gradients of this
    process's replica; returns the undo."""

    def clip_grad_by_norm(self: Any, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        dtype = grads[0].dtype if grads else torch.float32
        squares = torch.zeros(replicas, dtype=dtype, device=device)  # (replicas,): this replica's slot only
        if grads:
            squares[replica] = squared_norm(grads, dtype)
        dist.all_reduce(squares)  # every stage of every replica: each replica's pipeline's sum in its slot
        scale = clip_scale(squares[replica].sqrt(), clip_val)
        if grads:
            torch._foreach_mul_(grads, scale)

    return _clip_with(plugin, clip_grad_by_norm)


def sharded_norm_clipping(plugin: Any, lanes: int) -> Callable[[], None]:
    """Under the flush schedules with the module's own parallelism ([Note: tensor parallelism in a stage]): make
    ``plugin`` clip by the norm over every stage's whole gradients, its parameters DTensor shards over the stage's
    ``lanes`` ranks or plain tensors every one of them holds. Each rank adds its shards' squared norms, a shard held
    alike by ``k`` ranks counted ``1 / k`` -- the stage's ranks outside the DTensor's mesh (an FSDP2 shard over the
    replicas is the same on every tensor-parallel rank) times its replicated mesh dimensions; all ``lanes`` for a
    plain tensor; one all-reduce over every rank gives the model's total; returns the undo."""
    from torch.distributed.tensor import DTensor, Replicate

    def share(grad: torch.Tensor) -> tuple[torch.Tensor, float]:  # (what this rank holds, 1 / its holders)
        if not isinstance(grad, DTensor):
            return grad, 1.0 / lanes
        holders = lanes // grad.device_mesh.size()
        for size, placement in zip(grad.device_mesh.mesh.shape, grad.placements):
            holders *= size if isinstance(placement, Replicate) else 1
        return grad.to_local(), 1.0 / holders

    def clip_grad_by_norm(self: Any, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        held = [share(p.grad) for p in self.main_params(optimizer) if p.grad is not None]
        local = [g for g, _ in held]
        device = local[0].device if local else torch.device("cpu")
        dtype = local[0].dtype if local else torch.float32
        total = torch.zeros((), dtype=dtype, device=device)
        for weight in sorted({w for _, w in held}):  # one multi-tensor norm per weight
            total += weight * squared_norm([g for g, w in held if w == weight], dtype)
        dist.all_reduce(total)  # every stage, every lane: the model's squared norm, once
        scale = clip_scale(total.sqrt(), clip_val)
        if local:
            torch._foreach_mul_(local, scale)

    return _clip_with(plugin, clip_grad_by_norm)


def table_norm_clipping(plugin: Any, table: NormTable) -> Callable[[], None]:
    """Make ``plugin`` clip by the norm over every stage's latest squared norms, ``table`` (the stage's, [Note: norm
    table]); returns the undo."""

    def clip_grad_by_norm(self: Any, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        table.clip(self.main_params(optimizer), clip_val)

    return _clip_with(plugin, clip_grad_by_norm)


def _clip_with(plugin: Any, clip_grad_by_norm: Callable[..., None]) -> Callable[[], None]:
    """``plugin.clip_grad_by_norm`` replaced by ``clip_grad_by_norm`` (bound to it); returns the undo."""
    original = plugin.clip_grad_by_norm
    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)

    def undo() -> None:
        plugin.clip_grad_by_norm = original

    return undo


def clipping_by_norm(trainer: Any, strategy: PipelineStrategy) -> list[Callable[[], None]]:
    """At setup: the Trainer's clipping by norm over every stage -- by one all-reduce per update under the flush
    schedules, by the stage's norm table under ``"paci"`` -- else said to be per stage; returns the undos for
    teardown."""
    per_stage = per_stage_clipping(trainer, strategy.config.schedule, strategy.config.virtual_stages)
    if per_stage is not None:
        rank_zero_warn(per_stage)
        return []
    if not clips_by_norm(trainer):
        return []
    if strategy.config.schedule in FLUSH_SCHEDULES and strategy.config.model_parallel:
        return [sharded_norm_clipping(strategy.precision_plugin, strategy.topology.lanes)]
    if strategy.config.schedule in FLUSH_SCHEDULES:
        return [global_norm_clipping(strategy.precision_plugin, strategy.replica_index, strategy.data_parallel_size)]
    runtime = strategy.runtime  # the process's one stage (virtual_stages=1)
    assert runtime.optimizer is not None
    table = NormTable.for_parameters(runtime.stage, runtime.num_stages, [p for _, p in runtime.optimizer.pairs])
    runtime.carry_norms(table)
    return [table_norm_clipping(strategy.precision_plugin, table), lambda: runtime.carry_norms(None)]
