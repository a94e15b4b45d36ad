"""Execute one stage's action list: forward, backward, local optimizer step, sends and receives, in list order.

The runtime knows nothing about Lightning: what a forward *is* comes from a :class:`StageProgram` (for an unchanged
LightningModule, :class:`lightning_paci.program.LightningStageProgram`), how bytes move from a :class:`Comm`.
It records, per micro-batch, the stage's weight version at its forward and at its backward, and the time spent in
compute and waiting, which the monitors read.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from lightning_paci.comm import Comm, flatten
from lightning_paci.supervision import StageFailure
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
    RECV_KINDS,
    SEND_KINDS,
    Action,
    assign_rounds,
    build,
    message_key,
)
from lightning_paci.timeline import Interval

COMM_KINDS = RECV_KINDS | SEND_KINDS
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
    skipped: bool = False  # dropped for a non-finite loss


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

    track_updates = False  # set by DriftMonitor: measure each update's size (see step)
    last_update_norm = 0.0  # ||theta_after - theta_before|| of the last step (when tracking)
    weight_norm = 0.0  # ||theta|| after the last step (when tracking)

    def step(self) -> None:
        real = [p for _, p in self.pairs if p.grad is not None]
        if self.clip is not None:
            self.clip(real)
        if self.track_updates:
            self._step_measuring()
        else:
            for alias, p in self.pairs:
                alias.grad = p.grad
            self.optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        for alias, p in self.pairs:
            alias.grad = None
            p.grad = None

    def _step_measuring(self) -> None:
        """Step one tensor at a time so that measuring the update needs at most one tensor's transient copy:
        the optimizer skips parameters whose gradient is ``None``. Equivalent for per-parameter optimizers
        (SGD, Adam, AdamW, ...), not for ones that couple parameters (e.g. a global-norm LAMB)."""
        update_sq = weight_sq = 0.0
        for alias, p in self.pairs:
            if p.grad is None:
                weight_sq += float(p.detach().float().pow(2).sum())
                continue
            before = p.detach().clone()  # the one transient copy
            alias.grad = p.grad
            self.optimizer.step()
            alias.grad = None
            update_sq += float((p.detach() - before).float().pow(2).sum())
            weight_sq += float(p.detach().float().pow(2).sum())
            del before
        self.last_update_norm, self.weight_norm = update_sq ** 0.5, weight_sq ** 0.5

    def current_weight_norm(self) -> float:
        return float(sum(p.detach().float().pow(2).sum() for _, p in self.pairs)) ** 0.5


@dataclass
class _Held:
    """A micro-batch between its forward and its backward: the received leaves and the graph to backward."""

    leaves: list[torch.Tensor]
    output: ForwardOutput


class _ActivationMeter:
    """Bytes a micro-batch keeps alive from its forward to its backward: the tensors autograd saves for the
    backward, the received inputs and the outgoing activations, each storage counted once; parameters (and their
    views) are not activations and are left out. Counted with ``saved_tensors_hooks`` while the forward runs,
    so the figure is exact and deterministic (no allocator or RSS noise) -- what the paper's "identical peak
    memory" claim is about, since the weights and optimizer state are the same single copy under every schedule.
    """

    def __init__(self, program: Any) -> None:
        module = getattr(program, "module", None)
        self._exclude = {p.untyped_storage().data_ptr() for p in module.parameters()} if module is not None else set()
        self._storages: dict[int, int] = {}  # storage pointer -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _add(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":  # other stages' placeholders: no memory
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._exclude:
            self._storages[storage.data_ptr()] = storage.nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._add(tensor)
        return tensor

    def __enter__(self) -> None:
        self._hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def total(self, leaves: list[torch.Tensor], outgoing: Any) -> int:
        for tensor in [*leaves, *flatten(outgoing)[1]]:
            self._add(tensor)
        return sum(self._storages.values())


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
        skip_nonfinite: bool = False,
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.program = program
        self.comm = comm
        self.optimizer = optimizer if isinstance(optimizer, StageOptimizer) else None
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
        # activation memory (opt-in, see _ActivationMeter): bytes each in-flight micro-batch keeps alive
        self.track_activation_bytes = False
        self.activation_bytes: dict[int, int] = {}  # micro-batch in flight -> bytes
        self.peak_activation_bytes = 0
        self.intervals: deque[Interval] = deque(maxlen=keep_intervals)
        self.busy_time = 0.0
        self.wait_time = 0.0
        self.microbatch_base = 0  # stream-local index -> run-global index (for records across drains)
        self.skip_nonfinite = skip_nonfinite
        self.skipped: list[int] = []  # micro-batches dropped for a non-finite loss (skip_nonfinite)
        self._skipping: set[int] = set()  # dropped micro-batches whose "skip" still has to travel upstream
        self.step_label = ""  # where the run is, for error messages ("Lightning batch 7 (global step 7)")
        # tied weights (see [Note: tied weights]): stage 0 owns them, the last stage holds replicas
        self.tied = list(tied)
        self.tied_version = 0  # updates of the tied weights applied here (stage 0: made, last stage: installed)
        self.tied_lags: dict[int, int] = {}  # last stage: micro-batch -> tied updates its forward was behind
        self.tied_fingerprints: list[str] | None = None  # set to [] to record a digest of every tied version
        # monitors: backwards in order as (micro-batch, version gap, relative weight drift, exact?)
        self.backward_log: list[tuple[int, int, float, bool]] = []
        self.track_weight_drift = False  # set by DriftMonitor (steps the optimizer one tensor at a time)
        # called with the new version right after every local update: the weights are then exactly that version
        # on this stage, with no other stage involved (e.g. to keep version-k weights without draining)
        self.update_hooks: list[Callable[[int], None]] = []
        self._update_norms: dict[int, float] = {}  # version v -> ||theta_v - theta_{v-1}||
        self._weight_norms: dict[int, float] = {}  # version v -> ||theta_v||
        # time accounting per phase: "startup" until the stream's first backward here, "steady", "drain" (the
        # stream's cool-down), "outside" (between streams: validation, checkpoints)
        self.phase = "startup"
        self._phase_since = clock()
        self.phase_time: dict[str, dict[str, float]] = {
            p: {"wall": 0.0, "compute": 0.0, "wait": 0.0, "comm": 0.0, "optimizer": 0.0}
            for p in ("startup", "steady", "drain", "outside")
        }

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
        kind = action.kind
        if kind in COMM_KINDS:
            try:
                self._execute(action)
            except (RuntimeError, ConnectionError) as err:
                if isinstance(err, StageFailure):
                    raise
                key = message_key(action, self.num_stages)
                assert key is not None
                peer = key[1] if kind in RECV_KINDS else key[2]
                raise StageFailure(
                    f"stage {self.stage}: {'receiving from' if kind in RECV_KINDS else 'sending to'} stage {peer} "
                    f"failed at {action} ({self.step_label}): {err}"
                ) from err
        else:
            self._execute(action)

    def _execute(self, action: Action) -> None:
        kind, mb = action.kind, action.microbatch
        start = self.clock()
        if kind is F:
            self._forward(mb)  # type: ignore[arg-type]
        elif kind is B:
            self._backward(mb)  # type: ignore[arg-type]
        elif kind is OPT:
            assert self._step is not None, "OPT scheduled on a stage without an optimizer"
            self._check_finite_gradients()
            measuring = self.track_weight_drift and self.optimizer is not None
            if measuring:
                assert self.optimizer is not None
                self._weight_norms.setdefault(self.version, self.optimizer.current_weight_norm())
                self.optimizer.track_updates = True
            self._step()
            self.version += 1
            if measuring:
                assert self.optimizer is not None
                self.optimizer.track_updates = False
                self._update_norms[self.version] = self.optimizer.last_update_norm
                self._weight_norms[self.version] = self.optimizer.weight_norm
            if self.tied and self.stage == 0:
                self._fingerprint()
            for hook in self.update_hooks:
                hook(self.version)
        elif kind is SEND_F:
            self.comm.send(self.held[mb].output.outgoing, self.stage + 1)  # type: ignore[index]
        elif kind is SEND_B:
            grads = self.input_grads.pop(mb)  # type: ignore[arg-type]
            key = mb + self.microbatch_base  # type: ignore[operator]
            self.comm.send({"grads": grads, "logs": self.logs.get(key, []), "skip": key in self._skipping}, self.stage - 1)
            self._skipping.discard(key)
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
        spent = end - start
        totals = self.phase_time[self.phase]
        index = None if mb is None else mb + self.microbatch_base
        if kind is F or kind is B:
            self.busy_time += spent
            totals["compute"] += spent
            self.intervals.append(Interval(self.stage, kind, index, start, end))
        elif kind is OPT:
            self.busy_time += spent
            totals["optimizer"] += spent
            self.intervals.append(Interval(self.stage, kind, None, start, end))
        elif kind is RECV_F or kind is RECV_B or kind is RECV_T:
            self.wait_time += spent
            totals["wait"] += spent
            self.intervals.append(Interval(self.stage, "WAIT_B" if kind is RECV_B else "WAIT_F", index, start, end))
        else:  # sends: serialisation and posting
            totals["comm"] += spent
            self.intervals.append(Interval(self.stage, "SEND", index, start, end))
        if kind is B and self.phase == "startup":
            self.set_phase("steady")

    def set_phase(self, phase: str) -> None:
        """Close the current phase's wall-clock span and open ``phase``'s."""
        now = self.clock()
        self.phase_time[self.phase]["wall"] += now - self._phase_since
        self.phase, self._phase_since = phase, now

    def time_snapshot(self) -> dict[str, dict[str, float]]:
        """Cumulative seconds per phase (wall, compute, wait, comm, optimizer), the open span included."""
        snap = {p: dict(v) for p, v in self.phase_time.items()}
        snap[self.phase]["wall"] += self.clock() - self._phase_since
        return snap

    def _check_finite_gradients(self) -> None:
        if self.optimizer is None:
            return
        grads = [p.grad for _, p in self.optimizer.pairs if p.grad is not None] + [
            p.grad for p in self.tied if p.grad is not None]
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            names = {id(p): n for n, p in self.program.module.named_parameters()} if hasattr(self.program, "module") else {}
            bad = [names.get(id(p), "?") for _, p in self.optimizer.pairs if p.grad is not None and not torch.isfinite(p.grad).all()]
            raise StageFailure(
                f"stage {self.stage}: non-finite gradient in {bad[:3]} before optimizer step {self.version + 1} at "
                f"{self.step_label}."
            )

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
        if self.track_activation_bytes:
            meter = _ActivationMeter(self.program)
            with meter:
                output = self.program.forward(data, batch_index, received=received)
            self.activation_bytes[mb] = meter.total(leaves, output.outgoing)
            self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.activation_bytes.values()))
        else:
            output = self.program.forward(data, batch_index, received=received)
        self.held[mb] = _Held(leaves, output)
        self.peak_inflight = max(self.peak_inflight, len(self.held))
        self.forward_version[mb] = self.version
        if self.tied and self.stage == self.num_stages - 1:
            self.tied_lags[mb + self.microbatch_base] = self.version - self.tied_version
        if output.loss is not None:
            key = mb + self.microbatch_base
            loss = float(output.loss.detach())
            if not math.isfinite(loss):
                if not self.skip_nonfinite:
                    raise StageFailure(
                        f"stage {self.stage}: the loss of micro-batch {key} is {loss} at {self.step_label}. Pass "
                        f"`PACIStrategy(nonfinite='skip')` to drop such micro-batches instead of stopping."
                    )
                self.skipped.append(key)
                self._skipping.add(key)
                self.logs[key] = []  # its log records are dropped with it  # no backward from it: upstream stages receive zero gradients
                self.held[mb] = _Held(leaves, ForwardOutput(outgoing=None, loss=None, skipped=True))
                return
            self.logs[key] = [*output.logs, LogRecord(LOSS_KEY, loss, microbatch_size(data), ())]
            self.losses[key] = loss

    def _backward(self, mb: int) -> None:
        held = self.held.pop(mb)
        self.activation_bytes.pop(mb, None)
        if held.output.skipped:
            pass  # a dropped micro-batch: its input gradients below are zeros
        elif held.output.loss is not None:
            (held.output.loss * self.loss_scale).backward()
        else:
            payload = self.inbox.pop((RECV_B, mb))
            grads = payload["grads"]
            outputs = [t for t in flatten(held.output.outgoing)[1] if t.requires_grad]
            if len(outputs) != len(grads):
                raise AssertionError(f"stage {self.stage}: {len(outputs)} outputs need grads, received {len(grads)}")
            key = mb + self.microbatch_base
            if payload.get("skip"):  # dropped downstream (non-finite loss): no backward, zero input gradients
                self._skipping.add(key)
                held = _Held(held.leaves, ForwardOutput(skipped=True))
            elif outputs:
                torch.autograd.backward(outputs, grads)
            self.logs[key] = payload["logs"]
            if payload["logs"]:
                loss = next((r.value for r in payload["logs"] if r.name == LOSS_KEY), None)
                if loss is not None:
                    self.losses[key] = loss
        if self.stage > 0:
            self.input_grads[mb] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in held.leaves]
        forward_version = self.forward_version.pop(mb)
        gap = self.version - forward_version
        self.version_gaps[mb + self.microbatch_base] = gap
        drift, exact = self._weight_drift(forward_version)
        self.backward_log.append((mb + self.microbatch_base, gap, drift, exact))

    def _weight_drift(self, forward_version: int) -> tuple[float, bool]:
        """||theta_B - theta_F|| / ||theta_B|| from the recorded update norms, without any copy of the weights.

        Exact when at most one update fell between the forward and the backward (every ``a >= N - 1``); with
        several it is the triangle-inequality upper bound sum ||update|| (exactness would need the updates
        themselves, i.e. a copy of the weights), and the second value is False.
        """
        if not self.track_weight_drift or forward_version == self.version:
            return 0.0, True
        updates = [self._update_norms.get(v) for v in range(forward_version + 1, self.version + 1)]
        norm = self._weight_norms.get(self.version)
        if any(u is None for u in updates) or not norm:
            return float("nan"), False  # tracking started while this micro-batch was in flight
        for v in [v for v in self._update_norms if v < forward_version - 64]:  # keep the dicts small
            self._update_norms.pop(v, None)
            self._weight_norms.pop(v, None)
        return sum(updates) / norm, len(updates) == 1  # type: ignore[arg-type]




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
