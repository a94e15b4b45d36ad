"""The checkpoint side of ``PACIStrategy``: Lightning's checkpoint hooks, each delegating to checkpoint.py (the
format's sole owner), and what a ``trainer.save_checkpoint`` after ``fit`` needs -- the optimizer and scheduler
states gathered at teardown, handed to the main process of a fork/spawn run with the fit loop's progress."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Trainer
from typing_extensions import override

from lightning_paci.integration import lightning_api as api
from lightning_paci.integration.checkpoint import PipelineCheckpoints, cpu_state
from lightning_paci.integration.pipeline_stage import PipelineStage
from lightning_paci.integration.processes import PipelineProcesses
from lightning_paci.integration.stage_build import StageBuilder

__all__ = ["CheckpointingProcesses"]


class CheckpointingProcesses(PipelineProcesses):
    """Lightning's checkpoint hooks for a pipeline (the stage is set up by the strategy that subclasses this)."""

    _stage: PipelineStage | None = None
    # after `fit`: rank 0's gathered optimizer and scheduler states, for `trainer.save_checkpoint` after `fit`
    _after_fit: dict[str, list[Any]] | None = None
    _builder: StageBuilder

    def _drain(self) -> None:
        if self._stage is not None:
            self._stage.drain()

    @property
    def _checkpoints(self) -> PipelineCheckpoints:
        return PipelineCheckpoints(self.config.checkpoint_layout, self.stage_index, self.num_stages,
                                   self.checkpoint_io, rank=self.global_rank,
                                   first_replica=self.replica_index == 0, replicas=self.data_parallel_size,
                                   group=self.host_group)

    def _keep_after_fit(self, stage: PipelineStage) -> None:
        """At teardown, before the full model is restored: keep what a later ``save_checkpoint`` needs."""
        if stage.runtime is not None and api.distributed_is_initialized():
            self._after_fit = {"optimizer_states": [stage.optimizer_state(self._checkpoints)],
                               "lr_schedulers": [cfg.scheduler.state_dict() for cfg in self.lr_scheduler_configs]}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._drain()
        assert self.lightning_module is not None
        if not api.distributed_is_initialized():
            return cpu_state(self.lightning_module)
        foreign = self._stage.carve.foreign_buffers if self._stage is not None else set()
        return self._checkpoints.weights(self.lightning_module, foreign)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._drain()
        if self._stage is None or self._stage.runtime is None:
            if self._after_fit is not None:  # `trainer.save_checkpoint` after `fit`: what teardown gathered
                return self._after_fit["optimizer_states"][0]
            return super().optimizer_state(optimizer)
        return self._stage.optimizer_state(self._checkpoints)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._stage is None or self._stage.runtime is None:
            raise ValueError("Resuming optimizer state needs a fitting PACIStrategy (`trainer.fit(ckpt_path=...)`).")
        self._stage.load_optimizer_state(self._checkpoints, checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._after_fit is not None:  # the main process of a fork/spawn run has no optimizer of its own
            for key, states in self._after_fit.items():
                if key in checkpoint and not checkpoint[key]:
                    checkpoint[key] = states
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # a model built on the meta device reads its stage's tensors only: memory-mapped, never whole
        return self._checkpoints.load(checkpoint_path, weights_only, mmap=self._builder.built is not None)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A carved stage (a model built on the meta device restores after setup) takes its own keys only."""
        module = self.lightning_module
        assert module is not None
        if self._stage is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        own = module.state_dict(keep_vars=True)
        state = {k: v for k, v in checkpoint["state_dict"].items() if k in own}
        module.load_state_dict(state, strict=strict)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.remove(filepath)

    def _send_after_fit(self, trainer: Trainer) -> Any:
        """To the main process of a fork/spawn run, for a ``trainer.save_checkpoint`` there after ``fit``: the
        optimizer and scheduler states, the fit loop's progress (epoch, step) and the callbacks' states."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Trainer.__init__, not declared
        return {"states": self._after_fit, "fit_loop": trainer.fit_loop.state_dict(),
                "callbacks": {cb.state_key: cb.state_dict() for cb in callbacks}}

    def _receive_after_fit(self, trainer: Trainer, sent: Any) -> None:
        self._after_fit = sent["states"]
        trainer.fit_loop.load_state_dict(sent["fit_loop"])
        for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Trainer.__init__, not declared
            if sent["callbacks"].get(callback.state_key):
                callback.load_state_dict(sent["callbacks"][callback.state_key])
