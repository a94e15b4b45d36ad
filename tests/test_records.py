"""StageRecords: every per-micro-batch record is bounded, and readers consume them through counts, not len()."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_paci.engine.runtime.records import BackwardRecord, RecentDict, StageRecords
from lightning_paci.engine.runtime.reference import run_lists
from lightning_paci.engine.runtime.runtime import ForwardOutput, StageRuntime
from lightning_paci.engine.streams.cursor import StreamCursor
from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.integration.stage.logs import LogRecord, LogRelay
from lightning_paci.optim.stage_optimizer import StageOptimizer


class _LinearStage:
    """A stage program for the runtime's protocol: one Linear per stage, MSE loss on the last stage."""

    def __init__(self, stage: int, num_stages: int) -> None:
        torch.manual_seed(stage)
        self.module = nn.Linear(4, 4)
        self.last = stage == num_stages - 1

    def forward(self, data, *step_args, received):
        x = data if received is None else received
        out = self.module(x)
        if self.last:
            return ForwardOutput(loss=out.pow(2).mean(), logs=[LogRecord("train_loss", 0.5, x.shape[0], ())])
        return ForwardOutput(outgoing=out)


class _CountingSink(nn.Module):
    """Receives the relay's replayed ``log`` calls (the relay's consumer, as a LightningModule's ``log`` would)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def log(self, *args, **kwargs) -> None:
        self.calls += 1


def _record_sizes(runtime: StageRuntime) -> dict[str, int]:
    records = runtime.records
    return {
        "losses": len(records.losses), "version_gaps": len(records.version_gaps), "tied_lags": len(records.tied_lags),
        "backwards": len(records.backwards), "intervals": len(records.intervals),
        "activation_bytes": len(records.activation_bytes), "pending_logs": len(runtime.logs),
        "forward_version": len(runtime.forward_version), "held": len(runtime.held), "inbox": len(runtime.inbox),
        "data": len(runtime.data), "input_grads": len(runtime.input_grads),
    }


def test_a_300_batch_stream_keeps_every_stage_record_constant_after_the_cap():
    num_stages, m, retention, num_batches = 4, 2, 64, 300
    comms = LocalComm.network(num_stages)
    runtimes, sinks, relays, cursors = [], [], [], []
    for s in range(num_stages):
        program = _LinearStage(s, num_stages)
        optimizer = StageOptimizer(torch.optim.SGD(program.module.parameters(), lr=0.01),
                                   list(program.module.parameters()))
        runtime = StageRuntime(s, num_stages, program, comms[s], optimizer, loss_scale=1 / m, retention=retention,
                               keep_intervals=4 * retention)
        runtime.records.measure(weight_drift=True, activation_bytes=True)
        runtimes.append(runtime)
        sinks.append(_CountingSink())
        relays.append(LogRelay(m))
        cursors.append(StreamCursor("paci", num_stages, m, m, s))
    sizes: dict[int, list[dict[str, int]]] = {}
    for call in range(num_batches):
        batch = torch.randn(m, 4, generator=torch.Generator().manual_seed(call))
        for runtime in runtimes:
            for i, part in enumerate(batch.split(1)):
                runtime.add_microbatch(call * m + i, part, call)
        last_call = call == num_batches - 1
        run_lists(runtimes, [c.drain(num_batches) if last_call else c.segment(call) for c in cursors])
        for runtime, relay, sink in zip(runtimes, relays, sinks):
            relay.emit(sink, runtime.logs)
        if call in (149, 224, 298):
            sizes[call] = [_record_sizes(r) for r in runtimes]
    for s in range(num_stages):
        assert sizes[149][s] == sizes[224][s] == sizes[298][s], f"stage {s} records grew after the cap"
        intervals = sizes[298][s].pop("intervals")  # bounded on their own (the timeline's window)
        assert intervals == runtimes[s].records.intervals.maxlen
        assert max(sizes[298][s].values()) <= retention
        assert runtimes[s].records.num_backwards == num_batches * m  # the counters keep counting
    assert runtimes[-1].records.losses.count == num_batches * m
    # the last stage replays each mini-batch in its own call; upstream ranks merge the ones the drain completes
    assert sinks[-1].calls == num_batches and all(num_batches - num_stages < sink.calls for sink in sinks)
    assert all(not r.logs and not r.held for r in runtimes)


def test_readers_get_what_came_after_their_count_even_past_the_cap():
    records = StageRecords(clock=lambda: 0.0, retention=3)
    for i in range(5):
        records.add_backward(BackwardRecord(i, i % 2, 0.0, True))
    assert [b.microbatch for b in records.backwards] == [2, 3, 4]
    assert [b.microbatch for b in records.backwards_since(3)] == [3, 4]
    assert [b.microbatch for b in records.backwards_since(0)] == [2, 3, 4]  # older ones are gone, not repeated
    assert records.backwards_since(5) == []
    lags: RecentDict[int, int] = RecentDict(2)
    for i in range(4):
        lags[i] = 10 + i
    assert dict(lags) == {2: 12, 3: 13} and lags.count == 4 and lags.since(3) == [13] and lags.since(4) == []


def test_retention_must_be_positive():
    with pytest.raises(ValueError, match="`retention` must be >= 1"):
        StageRecords(clock=lambda: 0.0, retention=0)
