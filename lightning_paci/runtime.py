"""Execute one stage's action list: forward, backward, local optimizer step, sends and receives, in list order.

The runtime knows nothing about Lightning: what a forward *is* comes from a :class:`StageProgram` (for an unchanged
LightningModule, :class:`lightning_paci.program.LightningStageProgram`), how bytes move from a :class:`Comm`.
It records, per micro-batch, the stage's weight version at its forward and at its backward, and the time spent in
compute and waiting, which the monitors read.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from lightning_paci.comm import Comm, flatten
from lightning_paci.schedules import (
    B,
    F,
    OPT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SEND_T,
    RECV_T,
    Action,
    assign_rounds,
    build,
)
from lightning_paci.timeline import Interval

LOSS_KEY = "__paci_loss__"  # the log record carrying the step's returned loss upstream

__all__ = ["LOSS_KEY", "ForwardOutput", "StageOptimizer", "StageProgram", "StageRuntime", "StreamCursor", "LogRecord"]


class LogRecord(NamedTuple):
    """One ``self.log`` call made by the user's step on the last stage, travelling upstream with the gradients."""

    name: str
    value: float
    batch_size: int
    options: tuple[tuple[str, Any], ...]  # prog_bar, logger, on_step, on_epoch, ...


@dataclass
class ForwardOutput:
    """What a stage's forward produced: ``outgoing`` (the next stage's block inputs, graph attached) on a non-last
    stage, or ``loss`` and the ``logs`` on the last stage."""

    outgoing: Any = None
    loss: torch.Tensor | None = None
    logs: list[LogRecord] = field(default_factory=list)
    result: Any = None  # an evaluation step's return value (last stage)


class StageProgram(Protocol):
    """Runs one micro-batch's forward through this stage's part of the model."""

    def forward(self, data: Any, *step_args: Any, received: Any | None) -> ForwardOutput: ...


class StageOptimizer:
    """The stage's optimizer, stepped without bumping autograd's version counters and without a parameter copy.

    [Note: alias optimizer]
    A micro-batch still in flight saved these weights in its graph; a plain in-place ``optimizer.step()`` bumps
    their version counters and its backward would fail ("modified by an inplace operation"). The user's optimizer
    is re-pointed at *alias* parameters ``nn.Parameter(p.data)``: same storage (no copy), own version counter. At a
    step the real gradients are handed over, the optimizer updates the shared storage in place, and the in-flight
    backward uses the updated weights (PACI's "backward with current weights", see docs/paci-algorithm.md sec. 3-4).
    Because the optimizer only sees the aliases, Lightning's own ``zero_grad`` cannot wipe gradients the schedule
    is still accumulating.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[nn.Parameter],
        *,
        schedulers: Sequence[Any] = (),
        clip: Callable[[list[nn.Parameter]], None] | None = None,
        exclude: Sequence[nn.Parameter] = (),
    ) -> None:
        owned = {id(p): p for p in params}
        skipped = {id(p) for p in exclude}  # tied-weight replicas: stage 0 updates them, see [Note: tied weights]
        self.optimizer = optimizer
        self.schedulers = list(schedulers)
        self.clip = clip
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (alias, real)
        for group in optimizer.param_groups:
            aliases = []
            for p in group["params"]:
                if id(p) in skipped:
                    continue
                if id(p) not in owned:
                    raise ValueError(
                        f"The optimizer holds a parameter of shape {tuple(p.shape)} that is not one of this stage's "
                        f"module parameters. `configure_optimizers` must build its optimizer from `self.parameters()` "
                        f"(or named subsets of it), which the strategy restricts to the stage's own parameters."
                    )
                alias = nn.Parameter(p.data, requires_grad=p.requires_grad)
                aliases.append(alias)
                self.pairs.append((alias, p))
            group["params"] = aliases
        if optimizer.state:
            raise ValueError("The optimizer already has state; build it fresh in `configure_optimizers`.")

    def step(self) -> None:
        real = [p for _, p in self.pairs if p.grad is not None]
        if self.clip is not None:
            self.clip(real)
        for alias, p in self.pairs:
            alias.grad = p.grad
        self.optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        for alias, p in self.pairs:
            alias.grad = None
            p.grad = None


@dataclass
class _Held:
    """A micro-batch between its forward and its backward: the received leaves and the graph to backward."""

    leaves: list[torch.Tensor]
    output: ForwardOutput


class StageRuntime:
    """One stage: executes actions; owns the in-flight micro-batches, the received messages and the records."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        program: StageProgram,
        comm: Comm,
        optimizer: StageOptimizer | Callable[[], None] | None,
        *,
        loss_scale: float,
        clock: Callable[[], float] = time.perf_counter,
        keep_intervals: int = 8192,
        tied: Sequence[nn.Parameter] = (),
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.program = program
        self.comm = comm
        self._step = optimizer.step if isinstance(optimizer, StageOptimizer) else optimizer
        self.loss_scale = loss_scale
        self.clock = clock
        self.data: dict[int, tuple[Any, int]] = {}  # micro-batch -> (data, Lightning batch index)
        self.inbox: dict[tuple[str, int], Any] = {}  # (RECV kind, micro-batch) -> payload
        self.held: dict[int, _Held] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.logs: dict[int, list[LogRecord]] = {}  # micro-batch -> the last stage's log records
        self.losses: dict[int, float] = {}
        # records
        self.version = 0
        self.forward_version: dict[int, int] = {}
        self.version_gaps: dict[int, int] = {}  # micro-batch -> optimizer steps between its F and B
        self.peak_inflight = 0
        self.intervals: deque[Interval] = deque(maxlen=keep_intervals)
        self.busy_time = 0.0
        self.wait_time = 0.0
        self.microbatch_base = 0  # stream-local index -> run-global index (for records across drains)
        # tied weights (see [Note: tied weights]): stage 0 owns them, the last stage holds replicas
        self.tied = list(tied)
        self.tied_version = 0  # updates of the tied weights applied here (stage 0: made, last stage: installed)
        self.tied_lags: dict[int, int] = {}  # last stage: micro-batch -> tied updates its forward was behind
        self.tied_fingerprints: list[str] | None = None  # set to [] to record a digest of every tied version

    # -- data -----------------------------------------------------------------------------------------------------
    def add_microbatch(self, microbatch: int, data: Any, batch_index: int) -> None:
        self.data[microbatch] = (data, batch_index)

    @property
    def inflight(self) -> int:
        return len(self.held)

    # -- execution ------------------------------------------------------------------------------------------------
    def run(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self.execute(action)

    def execute(self, action: Action) -> None:
        kind, mb = action.kind, action.microbatch
        start = self.clock()
        if kind is F:
            self._forward(mb)  # type: ignore[arg-type]
        elif kind is B:
            self._backward(mb)  # type: ignore[arg-type]
        elif kind is OPT:
            assert self._step is not None, "OPT scheduled on a stage without an optimizer"
            self._step()
            self.version += 1
            if self.tied and self.stage == 0:
                self._fingerprint()
        elif kind is SEND_F:
            self.comm.send(self.held[mb].output.outgoing, self.stage + 1)  # type: ignore[index]
        elif kind is SEND_B:
            grads = self.input_grads.pop(mb)  # type: ignore[arg-type]
            self.comm.send({"grads": grads, "logs": self.logs.get(mb + self.microbatch_base, [])}, self.stage - 1)  # type: ignore[operator]
        elif kind is RECV_F:
            self.inbox[(RECV_F, mb)] = self.comm.recv(self.stage - 1)  # type: ignore[index]
        elif kind is RECV_B:
            self.inbox[(RECV_B, mb)] = self.comm.recv(self.stage + 1)  # type: ignore[index]
        elif kind is SEND_T:
            self._send_tied()
        elif kind is RECV_T:
            self._receive_tied()
        else:
            raise AssertionError(f"unknown action kind {kind!r}")
        end = self.clock()
        if kind in (F, B, OPT):
            self.busy_time += end - start
            self.intervals.append(Interval(self.stage, kind, None if mb is None else mb + self.microbatch_base, start, end))
        elif kind in (RECV_F, RECV_B):
            self.wait_time += end - start
            wait_kind = "WAIT_F" if kind is RECV_F else "WAIT_B"
            self.intervals.append(Interval(self.stage, wait_kind, mb + self.microbatch_base, start, end))  # type: ignore[operator]

    def _send_tied(self) -> None:
        if self.stage == 0:  # the weights after this update, for the last stage's replicas
            self.comm.send([p.detach() for p in self.tied], self.num_stages - 1, channel=1)
        else:  # the replicas' gradient of this window, for stage 0's update; replicas are never stepped here
            self.comm.send([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.tied], 0, channel=1)
            for p in self.tied:
                p.grad = None

    def _receive_tied(self) -> None:
        if self.stage == 0:
            for p, grad in zip(self.tied, self.comm.recv(self.num_stages - 1, channel=1)):
                p.grad = grad.to(p.dtype) if p.grad is None else p.grad.add_(grad)
            self.tied_version += 1  # the OPT that follows makes this update
        else:
            weights = self.comm.recv(0, channel=1)
            with torch.no_grad():
                for p, w in zip(self.tied, weights):
                    p.data.copy_(w)  # no micro-batch is in flight on the last stage here
            self.tied_version += 1
            self._fingerprint()

    def _fingerprint(self) -> None:
        if self.tied_fingerprints is not None:
            digest = hashlib.sha1()
            for p in self.tied:
                digest.update(p.detach().cpu().contiguous().numpy().tobytes())
            self.tied_fingerprints.append(digest.hexdigest())

    def _forward(self, mb: int) -> None:
        data, batch_index = self.data.pop(mb)
        received = self.inbox.pop((RECV_F, mb), None)
        leaves = [t for t in flatten(received)[1] if t.requires_grad] if received is not None else []
        output = self.program.forward(data, batch_index, received=received)
        self.held[mb] = _Held(leaves, output)
        self.peak_inflight = max(self.peak_inflight, len(self.held))
        self.forward_version[mb] = self.version
        if self.tied and self.stage == self.num_stages - 1:
            self.tied_lags[mb + self.microbatch_base] = self.version - self.tied_version
        if output.loss is not None:
            key = mb + self.microbatch_base
            loss = float(output.loss.detach())
            self.logs[key] = [*output.logs, LogRecord(LOSS_KEY, loss, microbatch_size(data), ())]
            self.losses[key] = loss

    def _backward(self, mb: int) -> None:
        held = self.held.pop(mb)
        if held.output.loss is not None:
            (held.output.loss * self.loss_scale).backward()
        else:
            payload = self.inbox.pop((RECV_B, mb))
            grads = payload["grads"]
            outputs = [t for t in flatten(held.output.outgoing)[1] if t.requires_grad]
            if len(outputs) != len(grads):
                raise AssertionError(f"stage {self.stage}: {len(outputs)} outputs need grads, received {len(grads)}")
            if outputs:
                torch.autograd.backward(outputs, grads)
            key = mb + self.microbatch_base
            self.logs[key] = payload["logs"]
            if payload["logs"]:
                loss = next((r.value for r in payload["logs"] if r.name == LOSS_KEY), None)
                if loss is not None:
                    self.losses[key] = loss
        if self.stage > 0:
            self.input_grads[mb] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in held.leaves]
        self.version_gaps[mb + self.microbatch_base] = self.version - self.forward_version.pop(mb)




class StreamCursor:
    """Which actions of its list one stage runs in each Lightning call of a *stream* (the run between two drains).

    Call ``k`` runs the actions of round ``k`` (:func:`lightning_paci.schedules.assign_rounds`) of a list built
    for a horizon of at least ``k + 2`` mini-batches (whose rounds up to ``k`` equal those of any longer list); a
    drain after ``K`` mini-batches runs the rest of the list built for exactly ``K``, whose unexecuted part starts
    where the cursor stands.
    """

    def __init__(self, name: str, num_stages: int, num_microbatches: int, accumulation: int, stage: int,
                 *, backward_offset: int = 0, tied: bool = False) -> None:
        self.args = (name, num_stages, num_microbatches, accumulation)
        self.stage = stage
        self.backward_offset = backward_offset
        self.tied = tied
        self.position = 0
        self._horizon = 0
        self._actions: tuple[Action, ...] = ()
        self._rounds: tuple[int, ...] = ()

    def _ensure(self, horizon: int) -> None:
        if horizon <= self._horizon:
            return
        horizon = max(horizon, 2 * self._horizon, 8)
        schedule = build(*self.args, horizon, backward_offset=self.backward_offset, tied=self.tied)
        self._actions = schedule.actions[self.stage]
        self._rounds = assign_rounds(schedule)[self.stage]
        self._horizon = horizon

    def segment(self, call: int) -> list[Action]:
        self._ensure(call + 2)
        end = self.position
        while end < len(self._actions) and self._rounds[end] <= call:
            end += 1
        out = list(self._actions[self.position:end])
        self.position = end
        return out

    def drain(self, num_minibatches: int) -> list[Action]:
        if num_minibatches == 0:
            return []
        schedule = build(*self.args, num_minibatches, backward_offset=self.backward_offset, tied=self.tied)
        actions = schedule.actions[self.stage]
        if tuple(actions[:self.position]) != tuple(self._actions[:self.position]):
            raise AssertionError("drained list does not extend the executed prefix")
        out = list(actions[self.position:])
        self.position = len(actions)
        return out


def loss_scale_for(accumulation: int) -> float:
    """The last stage back-propagates ``loss / a``: every stage then accumulates the mean over its a micro-batches."""
    return 1.0 / accumulation


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of a (nested) batch along dim 0 into ``m`` parts; the first ``B mod m`` parts get one
    extra sample (``torch.tensor_split``). Non-tensor leaves are shared by all parts."""
    skeleton, tensors = flatten(batch)
    if not tensors:
        raise ValueError("The batch holds no tensor to split into micro-batches.")
    size = tensors[0].shape[0] if tensors[0].dim() else 0
    if size < num_microbatches:
        raise ValueError(
            f"A batch of {size} samples cannot be split into `microbatches={num_microbatches}` micro-batches: every "
            f"micro-batch needs at least one sample. Use a batch size >= {num_microbatches} (also for the last, "
            f"smaller batch: set `drop_last=True` in the DataLoader) or fewer micro-batches."
        )
    from lightning_paci.comm import unflatten

    parts = [torch.tensor_split(t, num_microbatches, dim=0) if t.dim() and t.shape[0] == size else [t] * num_microbatches
             for t in tensors]
    return [unflatten(skeleton, [p[i] for p in parts]) for i in range(num_microbatches)]


def microbatch_size(data: Any) -> int:
    tensors = flatten(data)[1]
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1
