"""The strategy's checkpoint hooks: what Lightning's checkpoint calls do with a pipeline.

Lightning asks a strategy for the module's weights, each optimizer's state, to save and load a file, and to load
weights and optimizer states back. Under a pipeline each answer first drains (the last updates are in), then is
gathered from every stage to rank 0 or written per stage (checkpoint.py owns the format); a stage built on the
meta device reads its own tensors only, memory-mapped; a checkpoint records the cut it was trained with
(``PARTITION_KEY``), which a resume of a measured cut reuses. Stages with their own parallelism write one
``torch.distributed.checkpoint`` directory instead ([Note: distributed checkpoints]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_paci.integration.checkpoints import distributed_checkpoint as distributed
from lightning_paci.integration.checkpoints.checkpoint import PARTITION_KEY, PipelineCheckpoints, cpu_state
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """The checkpoint side of one strategy. ``host``: the host group once the processes started
    ([Note: host groups on a bound world]); ``after_fit``: rank 0's optimizer and scheduler states gathered at the
    end of ``fit``; ``built_on_meta``: whether the model was built on the meta device."""

    def __init__(self, strategy: PipelineStrategy, *, host: Callable[[], Any],
                 after_fit: Callable[[], dict[str, list[Any]] | None], built_on_meta: Callable[[], bool]) -> None:
        self.strategy, self.host, self.after_fit, self.built_on_meta = strategy, host, after_fit, built_on_meta

    def _drain(self) -> None:
        if self.strategy.stage is not None:
            self.strategy.stage.drain()

    @property
    def pipeline(self) -> PipelineCheckpoints:
        s = self.strategy
        return PipelineCheckpoints(s.config.checkpoint_layout, s.stage_index, s.num_stages, s.checkpoint_io,
                                   rank=s.global_rank, first_replica=s.replica_index == 0,
                                   replicas=s.data_parallel_size, group=self.host(),
                                   host_copies=not self.distributed)

    @property
    def distributed(self) -> bool:
        """Whether checkpoints are DCP directories: the stages apply their own parallelism."""
        return self.strategy.config.model_parallel

    def _foreign(self) -> set[str]:
        stage = self.strategy.stage
        return stage.carve.foreign_buffers if stage is not None else set()

    def weights(self) -> dict[str, Any]:
        """``lightning_module_state_dict``: every stage's weights on rank 0 (each its own without a world)."""
        self._drain()
        module = self.strategy.lightning_module
        assert module is not None
        if not (dist.is_available() and dist.is_initialized()):
            return cpu_state(module)
        if self.distributed:
            return distributed.own_state(module, self._foreign())
        return self.pipeline.weights(module, self._foreign())

    def optimizer_state(self, lightning_default: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``optimizer_state``: the stages' optimizer states by parameter name; after ``fit``, what teardown
        gathered; without a stage, Lightning's."""
        self._drain()
        stage, after_fit = self.strategy.stage, self.after_fit()
        if stage is not None and stage.runtime is not None:
            return stage.optimizer_state(self.pipeline)
        if after_fit is not None:  # `trainer.save_checkpoint` after `fit`: what teardown gathered
            return after_fit["optimizer_states"][0]
        return lightning_default()

    def load_optimizer_state(self, checkpoint: Any) -> None:
        stage = self.strategy.stage
        if stage is None or stage.runtime is None or stage.optimizer is None:
            raise ValueError("Resuming optimizer state needs a fitting PACIStrategy (`trainer.fit(ckpt_path=...)`).")
        if distributed.DISTRIBUTED_KEY in checkpoint:  # the tensors are read from the DCP directory now
            saved = checkpoint["optimizer_states"][0]["paci"]
            params = distributed.load_optimizer_params(stage.optimizer, stage.module,
                                                       checkpoint[distributed.DISTRIBUTED_KEY], group=self.host(),
                                                       tied_copies=stage.tied_copies)
            checkpoint = {**checkpoint, "optimizer_states": [{"paci": {**saved, "params": params}}]}
        stage.load_optimizer_state(self.pipeline, checkpoint)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None) -> None:
        for key, states in (self.after_fit() or {}).items():  # a fork/spawn run's main process has no optimizer
            if key in checkpoint and not checkpoint[key]:
                checkpoint[key] = states
        stage = self.strategy.stage
        if stage is not None:  # the split, reused by a resume of a measured one (partition="time")
            checkpoint[PARTITION_KEY] = {"num_stages": stage.plan.num_stages, "cut": stage.plan.cut}
        if not self.distributed:
            self.pipeline.save(checkpoint, filepath, storage_options)
            return
        if stage is None:
            raise ValueError(
                "`trainer.save_checkpoint` after `fit` with `PACIStrategy(tensor_parallel_size=...)`: the stages' "
                "shards ended with their processes. Save during `fit` (a `ModelCheckpoint` callback, or "
                "`trainer.save_checkpoint` in a callback's `on_train_end`).")
        s = self.strategy
        distributed.save_distributed(checkpoint, filepath, group=self.host(), writes_meta=s.global_rank == 0,
                                     layout={"pipeline": s.num_stages, "data": s.data_parallel_size,
                                             "tensor": s.tensor_parallel_size})

    def load(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        written_so = distributed.is_distributed_checkpoint(path)
        if written_so != self.distributed and Path(path).exists():
            raise ValueError(
                f"`ckpt_path={str(path)!r}` is a " + (
                    "torch.distributed.checkpoint directory, written by stages with their own parallelism "
                    "(`PACIStrategy(tensor_parallel_size=...)`); this run has none. Resume with "
                    "`tensor_parallel_size` set (any number of stages, replicas or tensor-parallel ranks), or read "
                    "its weights with `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`."
                    if written_so else
                    "checkpoint of stages without their own parallelism; this run applies the module's "
                    "`configure_model` (`tensor_parallel_size`) and resumes torch.distributed.checkpoint "
                    "directories only. Resume it without `tensor_parallel_size`, or load its weights into the module "
                    "before `fit` (`Model.load_from_checkpoint`) and start a new run."))
        if written_so:
            return distributed.load_meta(path, weights_only)
        # a model built on the meta device reads its stage's tensors only: memory-mapped, never whole
        return self.pipeline.load(path, weights_only, mmap=self.built_on_meta())

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool,
                         lightning_default: Callable[[], None]) -> None:
        """A carved stage (a model built on the meta device restores after setup) takes its own keys only."""
        module = self.strategy.lightning_module
        assert module is not None
        if self.strategy.stage is None:
            return lightning_default()
        if distributed.DISTRIBUTED_KEY in checkpoint:
            return distributed.load_weights(module, checkpoint[distributed.DISTRIBUTED_KEY], group=self.host(),
                                            exclude=self._foreign())
        own = module.state_dict(keep_vars=True)
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in own}, strict=strict)
        return None
