"""The strategy's checkpoint hooks: what Lightning's checkpoint calls do with a pipeline.

Lightning asks a strategy for the module's weights, each optimizer's state, to save and load a file, and to load
weights and optimizer states back. Under a pipeline each answer first drains (the last updates are in), then is
gathered from every stage to rank 0 or written per stage (checkpoint.py owns the format); a stage built on the
meta device reads its own tensors only, memory-mapped; a checkpoint records the cut it was trained with
(``PARTITION_KEY``), which a resume of a measured cut reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

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
                                   replicas=s.data_parallel_size, group=self.host())

    def weights(self) -> dict[str, Any]:
        """``lightning_module_state_dict``: every stage's weights on rank 0 (each its own without a world)."""
        self._drain()
        module, stage = self.strategy.lightning_module, self.strategy.stage
        assert module is not None
        if not (dist.is_available() and dist.is_initialized()):
            return cpu_state(module)
        return self.pipeline.weights(module, stage.carve.foreign_buffers if stage is not None else set())

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
        if stage is None or stage.runtime is None:
            raise ValueError("Resuming optimizer state needs a fitting PACIStrategy (`trainer.fit(ckpt_path=...)`).")
        stage.load_optimizer_state(self.pipeline, checkpoint)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None) -> None:
        for key, states in (self.after_fit() or {}).items():  # a fork/spawn run's main process has no optimizer
            if key in checkpoint and not checkpoint[key]:
                checkpoint[key] = states
        stage = self.strategy.stage
        if stage is not None:  # the split, reused by a resume of a measured one (partition="time")
            checkpoint[PARTITION_KEY] = {"num_stages": stage.plan.num_stages, "cut": stage.plan.cut}
        self.pipeline.save(checkpoint, filepath, storage_options)

    def load(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        # a model built on the meta device reads its stage's tensors only: memory-mapped, never whole
        return self.pipeline.load(path, weights_only, mmap=self.built_on_meta())

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool,
                         lightning_default: Callable[[], None]) -> None:
        """A carved stage (a model built on the meta device restores after setup) takes its own keys only."""
        module = self.strategy.lightning_module
        assert module is not None
        if self.strategy.stage is None:
            return lightning_default()
        own = module.state_dict(keep_vars=True)
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in own}, strict=strict)
        return None
