"""Validation, test and predict steps as a forward-only pipeline schedule, run by the same stage runtime.

Evaluation is synchronous (the training stream is drained before it): each batch is split into micro-batches and
every stage runs the list ``[RECV_F i] F i [SEND_F i]`` for each micro-batch, so stage ``s`` works on micro-batch
``i`` while stage ``s+1`` works on ``i-1``. Running it through
:class:`~lightning_paci.engine.runtime.StageRuntime` means a lost neighbour fails with the same named error as in
training (``stage 1: receiving from stage 0 failed at 1RECV_F2 (...)``). The last stage's ``self.log`` records
reach every rank with one broadcast per batch; predictions stay on the last stage, which is global rank 0 (see
`PACIStrategy.stage_index`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule

from lightning_paci.engine.comm import Comm
from lightning_paci.engine.microbatch import merge_microbatch_outputs, microbatch_size, split_microbatches
from lightning_paci.engine.runtime import StageRuntime
from lightning_paci.integration.lightning_program import LightningStageProgram
from lightning_paci.integration.logs import LogRecord, host_records, replay_logs
from lightning_paci.partition import StageCarve
from lightning_paci.schedules import RECV_F, SEND_F, Action, F

__all__ = ["PipelineEvaluator", "forward_only_actions"]


def forward_only_actions(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """One stage's forward-only list: receive, forward and send each micro-batch in order."""
    out: list[Action] = []
    for i in range(num_microbatches):
        if stage > 0:
            out.append(Action(stage, RECV_F, i))
        out.append(Action(stage, F, i))
        if stage < num_stages - 1:
            out.append(Action(stage, SEND_F, i))
    return out


class PipelineEvaluator:
    """Runs one evaluation step (``validation_step``, ``test_step`` or ``predict_step``) across the stages.

    Args:
        module, carve: this stage's carved module.
        comm: messages between stages (the training pipeline is drained while evaluation runs).
        num_microbatches: the most micro-batches a batch is split into (fewer for a smaller batch).
        broadcast: ``broadcast(obj, src)`` over all stages (the strategy's), used once per batch for the logs.
        context: the precision plugin's evaluation context.
    """

    def __init__(self, module: LightningModule, carve: StageCarve, comm: Comm, *, num_microbatches: int,
                 broadcast: Callable[[Any, int], Any],
                 context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.module, self.carve, self.comm = module, carve, comm
        self.num_microbatches = num_microbatches
        self.broadcast = broadcast
        self.context = context
        self._runtimes: dict[str, StageRuntime] = {}

    def _runtime(self, step_name: str) -> StageRuntime:
        if step_name not in self._runtimes:
            program = LightningStageProgram(self.module, self.carve, step_name=step_name, context=self.context)
            self._runtimes[step_name] = StageRuntime(self.carve.stage, self.carve.plan.num_stages, program, self.comm,
                                                     None, loss_scale=1.0, retention=1)
        return self._runtimes[step_name]

    def step(self, step_name: str, batch: Any, rest: tuple[Any, ...]) -> Any:
        """Run ``step_name`` on ``batch`` (``rest``: batch_idx, dataloader_idx); the merged output on the last stage
        (global rank 0), None elsewhere."""
        carve = self.carve
        num_stages = carve.plan.num_stages
        parts = split_microbatches(batch, max(1, min(self.num_microbatches, microbatch_size(batch))))
        runtime = self._runtime(step_name)
        for i, part in enumerate(parts):
            runtime.add_microbatch(i, part, *rest)
        try:
            runtime.run(forward_only_actions(carve.stage, num_stages, len(parts)))
            outputs = [runtime.held.pop(i).output for i in range(len(parts))]
        finally:
            runtime.held.clear()
            runtime.data.clear()
            runtime.forward_version.clear()
        results = [out.result for out in outputs]
        records: list[LogRecord] = [record for out in outputs for record in out.logs]
        output = merge_microbatch_outputs(results) if carve.is_last else None
        if step_name == "predict_step":  # the last stage is global rank 0, where Lightning collects predictions
            return output
        self.comm.flush()
        replay_logs(self.module, self.broadcast(host_records(records), num_stages - 1))  # one read per batch
        return output
