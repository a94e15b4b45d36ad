"""Host time per action on the emulated cluster: what a stage's main thread spends in CPU, outside the emulated kernels.

``python -m benchmarks overhead --host`` runs ``"paci"`` through the Trainer with ``HostCost`` and prints, per action
kind, the main thread's CPU time per call (``time.thread_time``: sleeps and blocking waits are not counted), the
rest per micro-batch ("between": Lightning's loop and the strategy's per-batch work), and the strategy's own
bookkeeping per micro-batch, each row measured around the functions that do it:

* log recording -- ``self.log`` shadowed by the recorder during a step, and the recorder put in and taken out
  (inside ``F``, on the stage that computes the loss);
* log replay -- the records of a finished mini-batch replayed through Lightning's ``self.log`` (inside "between");
* fingerprint -- the batch's fingerprint that the stages compare at a drain (inside "between");
* records -- the intervals, backward and update records the monitors read (inside every action);
* look-ahead -- posting the next receive of a link as the previous one is taken (inside ``RECV_F`` / ``RECV_B``);
* cursor -- cutting the stream's next segment of actions (inside "between");
* micro-batches -- splitting the batch and handing the parts to the runtime (inside "between").

With ``--torch``, torch's ``Schedule1F1B`` stage on the same blocks: ``forward_one_chunk``, ``backward_one_chunk``
and the rest of its ``step()`` per micro-batch (``benchmarks.throughput.torch_host_costs``).

``F`` and ``B`` hold the blocks' own host work as well as the framework's, ours and torch's alike. ``blocks_alone``
measures that part by itself: the same blocks called in one process with no pipeline, once with their emulated
kernel times (``blocks_us``) and once with none (``hot_us``). On a machine whose caches are cold after an idle wait
(a shared VM) the first is several times the second: work run right after a wait as long as an emulated kernel is
slower than the same work run back to back, and every action of a stage runs right after such a wait. The row
"outside F and B, per micro-batch" is the rest of the main thread's time, the framework's own host work, beside
the rest of torch's stage's step and, with ``--floor``, the bare message loop's messages (``floor_us``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L

from benchmarks.harness import median, print_table, run_emulated

__all__ = ["BOOKKEEPING", "HostCost", "blocks_alone", "host_costs", "host_table"]

# (row, module, class or "" for a module-level function, attribute); the functions are wrapped in the stage's
# process for the measured batches only
BOOKKEEPING: tuple[tuple[str, str, str, str], ...] = (
    ("log replay", "lightning_paci.integration.stage.logs", "LogRelay", "emit"),
    ("fingerprint", "lightning_paci.integration.trainer.fingerprint", "BatchFingerprint", "update"),
    ("records", "lightning_paci.engine.runtime.records", "StageRecords", "account"),
    ("records", "lightning_paci.engine.runtime.records", "StageRecords", "add_backward"),
    ("records", "lightning_paci.engine.runtime.records", "StageRecords", "record_update"),
    ("look-ahead", "lightning_paci.engine.transport.receives_ahead", "ReceivesAhead", "taken"),
    ("cursor", "lightning_paci.engine.streams.cursor", "StreamCursor", "segment"),
    ("micro-batches", "lightning_paci.engine.streams.driver", "", "split_weighted"),  # the name the driver calls
    ("micro-batches", "lightning_paci.engine.runtime.runtime", "StageRuntime", "add_microbatch"),
)
_LOG_RECORDING = "log recording"
_ROWS = (_LOG_RECORDING, *dict.fromkeys(row for row, *_ in BOOKKEEPING))
_INSIDE = {_LOG_RECORDING: "F (loss stage)", "log replay": "between", "fingerprint": "between",
           "records": "every action", "look-ahead": "RECV_F / RECV_B", "cursor": "between",
           "micro-batches": "between"}
_OUTSIDE = "outside F and B, per micro-batch"  # the framework's host work, the blocks' own left out (torch: "other")
_KIND_ORDER = ["F", "B", "OPT", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_T", "RECV_T", "between",
               "total per micro-batch", _OUTSIDE, *(f"bookkeeping: {row}" for row in _ROWS)]


class _Spent:
    """Thread CPU seconds and calls per row, and the wrappers that add to them."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}  # row -> [seconds, calls]

    def timed(self, row: str, function: Callable[..., Any]) -> Callable[..., Any]:
        entry = self.rows.setdefault(row, [0.0, 0])

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                entry[0] += time.thread_time() - start
                entry[1] += 1

        return timed

    def recording(self, plain: Callable[..., Any]) -> Callable[..., Any]:
        """``recording_logs`` timed: entering and leaving it, and every call of the recorder it installs (the step
        it surrounds is not counted)."""
        spent = self

        class Recording:
            def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
                self.module, self.inner = module, plain(module, *args, **kwargs)

            def __enter__(self) -> None:
                start = time.thread_time()
                self.inner.__enter__()
                log = self.module.__dict__["log"]
                self.module.__dict__["log"] = spent.timed(_LOG_RECORDING, log)
                spent.rows[_LOG_RECORDING][0] += time.thread_time() - start

            def __exit__(self, *exc: Any) -> Any:
                start = time.thread_time()
                try:
                    return self.inner.__exit__(*exc)
                finally:
                    spent.rows[_LOG_RECORDING][0] += time.thread_time() - start

        self.rows.setdefault(_LOG_RECORDING, [0.0, 0])
        return Recording


def _install(spent: _Spent) -> Callable[[], None]:
    """Wrap every bookkeeping function (and ``recording_logs`` where the program calls it); returns the undo."""
    import importlib

    undo: list[Callable[[], None]] = []
    for row, module_name, owner_name, attribute in BOOKKEEPING:
        module = importlib.import_module(module_name)
        owner: Any = getattr(module, owner_name) if owner_name else module
        plain = owner.__dict__[attribute]  # a plain function: a method when looked up on an instance
        setattr(owner, attribute, spent.timed(row, plain))
        undo.append(lambda owner=owner, attribute=attribute, plain=plain: setattr(owner, attribute, plain))
    # the forward's step runs inside ``recording_logs``, imported by name where the program uses it
    program = importlib.import_module("lightning_paci.integration.stage.lightning_program")
    plain_recording = program.recording_logs
    program.recording_logs = spent.recording(plain_recording)  # type: ignore[attr-defined]
    undo.append(lambda: setattr(program, "recording_logs", plain_recording))

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore


class HostCost(L.Callback):
    """The main thread's CPU time per action kind and per micro-batch between the actions, and the strategy's
    bookkeeping per micro-batch (see the module docstring), over Lightning batches ``[first, last)``; each stage
    writes ``host<stage>.json`` into ``directory``. The emulated kernels' spin is off in such a run
    (``harness.SPIN_S = 0``), so a block's figure is its real host work."""

    def __init__(self, directory: Path, first: int, last: int) -> None:
        self.directory, self.first, self.last = directory, first, last
        self.spent: dict[str, list[float]] = {}  # kind -> [seconds, calls]
        self.bookkeeping = _Spent()
        self.undo: Callable[[], None] | None = None
        self.start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        runtime: Any = trainer.strategy.runtime  # type: ignore[attr-defined]
        if batch_idx == self.first:
            plain = runtime.execute

            def execute(action: Any) -> None:
                start = time.thread_time()
                plain(action)
                entry = self.spent.setdefault(str(action.kind), [0.0, 0])
                entry[0] += time.thread_time() - start
                entry[1] += 1

            runtime.execute = execute
            self.undo = _install(self.bookkeeping)
            self.start = time.thread_time()
        elif batch_idx == self.last:
            total = time.thread_time() - self.start
            del runtime.execute
            if self.undo is not None:
                self.undo()
            strategy: Any = trainer.strategy
            microbatches = (self.last - self.first) * strategy.num_microbatches
            per_call = {kind: seconds / calls * 1e6 for kind, (seconds, calls) in self.spent.items()}
            per_call["between"] = (total - sum(v[0] for v in self.spent.values())) / microbatches * 1e6
            per_call["total per micro-batch"] = total / microbatches * 1e6
            blocks = sum(self.spent.get(kind, [0.0])[0] for kind in ("F", "B"))
            per_call[_OUTSIDE] = (total - blocks) / microbatches * 1e6
            for row, (seconds, _) in self.bookkeeping.rows.items():
                per_call[f"bookkeeping: {row}"] = seconds / microbatches * 1e6
            (self.directory / f"host{strategy.stage_index}.json").write_text(json.dumps(per_call))


def host_costs(n: int, m: int, k: int, fwd: float, bwd: float, per_stage: int, schedule: str) -> list[dict[str, float]]:
    """Per stage, microseconds of host time per call of each action kind, and of each bookkeeping row per
    micro-batch (see ``HostCost``), ours."""
    from benchmarks import harness

    spin, harness.SPIN_S = harness.SPIN_S, 0.0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_emulated(num_stages=n, schedule=schedule, num_microbatches=m, num_minibatches=k, forward_ms=fwd,
                         backward_ms=bwd, blocks_per_stage=per_stage, callbacks=[HostCost(Path(tmp), 1, k - 1)])
            return [json.loads((Path(tmp) / f"host{s}.json").read_text()) for s in range(n)]
    finally:
        harness.SPIN_S = spin


def blocks_alone(per_stage: int, fwd_ms: float, bwd_ms: float, calls: int = 20) -> dict[str, dict[str, float]]:
    """Thread CPU microseconds per ``F`` and per ``B`` of one stage's ``per_stage`` emulated blocks (2 samples, as
    in ``run_emulated``), called in this process with no pipeline and the kernels' spin off (as ``HostCost``):
    ``{"blocks_us": {"F": .., "B": ..}, "hot_us": {...}}``, with the emulated times and with none (medians)."""
    import torch

    from benchmarks import harness

    spin, harness.SPIN_S = harness.SPIN_S, 0.0
    try:
        out: dict[str, dict[str, float]] = {}
        for name, fwd, bwd in (("blocks_us", fwd_ms, bwd_ms), ("hot_us", 0.0, 0.0)):
            blocks = torch.nn.Sequential(*[harness.SleepBlock(32, fwd / 1e3, bwd / 1e3) for _ in range(per_stage)])
            x = torch.randn(2, 32, requires_grad=True)
            forward: list[float] = []
            backward: list[float] = []
            for _ in range(calls + 2):  # the first two warm up
                start = time.thread_time()
                y = blocks(x)
                middle = time.thread_time()
                y.backward(torch.ones_like(y))
                forward.append(middle - start)
                backward.append(time.thread_time() - middle)
            out[name] = {"F": median(forward[2:]) * 1e6, "B": median(backward[2:]) * 1e6}
        return out
    finally:
        harness.SPIN_S = spin


def host_table(args: argparse.Namespace, n: int, m: int,
               theirs: Callable[..., list[dict[str, float]]] | None = None,
               floor_us: float | None = None) -> dict[str, Any]:
    """Print and return host microseconds per call of each action kind and per micro-batch of each bookkeeping
    row (median over the stages that run it), ours and, given ``theirs`` (torch's stage), torch's; ``floor_us``:
    the bare message loop's host time per micro-batch (its messages: all it does outside the kernels), shown in the
    row outside F and B."""
    k, fwd, bwd, per_stage = args.minibatches, args.forward_ms, args.backward_ms, args.blocks_per_stage
    ours = host_costs(n, m, k, fwd, bwd, per_stage, "paci")
    alone = blocks_alone(per_stage, fwd, bwd)
    out: dict[str, Any] = {"paci": ours, "blocks_alone": alone}
    rows = []
    for kind in sorted({key for stage in ours for key in stage}, key=_KIND_ORDER.index):
        values = sorted(stage[kind] for stage in ours if kind in stage and (stage[kind] or "bookkeeping" not in kind))
        if not values:  # a bookkeeping row no stage spent anything on
            continue
        row = {"action": kind, "paci_us": median(values), "range": f"{values[0]:.0f}-{values[-1]:.0f}"}
        if kind.startswith("bookkeeping: "):
            row["inside"] = _INSIDE[kind.removeprefix("bookkeeping: ")]
        for column, figures in alone.items():
            if kind in figures:
                row[column] = figures[kind]
        if kind == _OUTSIDE and floor_us is not None:
            row["floor_us"] = floor_us
        rows.append(row)
    if theirs is not None:
        torch_stages = theirs(n, m, k, fwd, bwd, per_stage)
        out["torch_1f1b"] = torch_stages
        for row in rows:
            name = "other per micro-batch" if row["action"] in ("between", _OUTSIDE) else str(row["action"])
            found = [stage[name] for stage in torch_stages if name in stage]
            if found:
                row["torch_us"] = median(found)
    print_table(f"host time per call, microseconds (thread CPU time, median over stages); N = {n}, m = {m}, "
                f"{per_stage} block(s) of F/B {fwd:g}/{bwd:g} ms; torch: F, B and the rest of its step per "
                f"micro-batch; bookkeeping: per micro-batch, already inside the row named; blocks_us / hot_us: the "
                f"stage's blocks alone, with their emulated times / with none (inside F and B, ours and torch's); "
                f"floor_us: the bare message loop's messages",
                rows, [("action", "s"), ("paci_us", ".0f"), ("range", "s"), ("torch_us", ".0f"),
                       ("floor_us", ".0f"), ("blocks_us", ".0f"), ("hot_us", ".0f"), ("inside", "s")])
    return out
