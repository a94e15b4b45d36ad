"""Validation, test and predict steps as a forward-only pipeline schedule, run by the same stage runtime.

Evaluation is synchronous (the training stream is drained before it): each batch is split into micro-batches and
every stage runs the list ``[RECV_F i] F i [SEND_F i]`` for each micro-batch, so stage ``s`` works on micro-batch
``i`` while stage ``s+1`` works on ``i-1``. Running it through
:class:`~lightning_paci.engine.runtime.runtime.StageRuntime` means a lost neighbour fails with the same named error as
in training (``stage 1: receiving from stage 0 failed at 1RECV_F2 (...)``). The last stage's ``self.log`` records
reach every rank with one broadcast per batch, of host floats only (``host_records``), over the host group of every
rank under NCCL, never through an NCCL group ([Note: host groups on a bound world]; the NCCL emulation refuses an
object collective on one); predictions stay on the last stage, which is global rank 0 (see
`PACIStrategy.stage_index`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch import LightningModule

from lightning_paci.engine.runtime.microbatch import merge_microbatch_outputs, microbatch_size, split_microbatches
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.transport.point_to_point import Comm
from lightning_paci.integration.stage.lightning_program import LightningStageProgram
from lightning_paci.integration.stage.logs import LogRecord, host_records, replay_logs
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
        module, carves: this process's carved module and its stages (one, or its chunks with virtual stages: they
            run one after the other, each over every micro-batch, which needs nothing of a later chunk).
        comms: each stage's messages (the training pipeline is drained while evaluation runs).
        num_microbatches: the most micro-batches a batch is split into (fewer for a smaller batch).
        broadcast: ``broadcast(obj, src)`` over all processes of the pipeline (the strategy's, on the host group),
            used once per batch for the logs from ``log_source``, the process holding the last stage.
        context: the precision plugin's evaluation context.
    """

    def __init__(self, module: LightningModule, carves: Sequence[StageCarve], comms: Mapping[int, Comm], *,
                 num_microbatches: int, broadcast: Callable[[Any, int], Any], log_source: int,
                 context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.module, self.carves, self.comms = module, list(carves), dict(comms)
        self.num_microbatches = num_microbatches
        self.broadcast = broadcast
        self.log_source = log_source
        self.context = context
        self._runtimes: dict[tuple[str, int], StageRuntime] = {}

    def _runtime(self, step_name: str, carve: StageCarve) -> StageRuntime:
        key = (step_name, carve.stage)
        if key not in self._runtimes:
            program = LightningStageProgram(self.module, carve, step_name=step_name, context=self.context)
            self._runtimes[key] = StageRuntime(carve.stage, carve.plan.num_stages, program, self.comms[carve.stage],
                                               None, loss_scale=1.0, retention=1)
        return self._runtimes[key]

    def step(self, step_name: str, batch: Any, rest: tuple[Any, ...]) -> Any:
        """Run ``step_name`` on ``batch`` (``rest``: batch_idx, dataloader_idx); the merged output where the last
        stage runs (global rank 0), None elsewhere."""
        parts = split_microbatches(batch, max(1, min(self.num_microbatches, microbatch_size(batch))))
        outputs = []
        for carve in self.carves:
            runtime = self._runtime(step_name, carve)
            for i, part in enumerate(parts):
                runtime.add_microbatch(i, part, *rest)
            try:
                runtime.run(forward_only_actions(carve.stage, carve.plan.num_stages, len(parts)))
                outputs = [runtime.held.pop(i).output for i in range(len(parts))]
            finally:
                runtime.held.clear()
                runtime.data.clear()
                runtime.forward_version.clear()
        last = self.carves[-1].is_last
        results = [out.result for out in outputs]
        records: list[LogRecord] = [record for out in outputs for record in out.logs]
        output = merge_microbatch_outputs(results) if last else None
        if step_name == "predict_step":  # the last stage is global rank 0, where Lightning collects predictions
            return output
        for comm in self.comms.values():
            comm.flush()
        replay_logs(self.module, self.broadcast(host_records(records), self.log_source))  # one read per batch
        return output
