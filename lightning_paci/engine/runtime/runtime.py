"""Execute one stage's action list: forward, backward, local optimizer step, sends and receives, in list order.

The runtime knows nothing about Lightning: what a forward *is* comes from a :class:`StageProgram` (for an unchanged
LightningModule, :class:`lightning_paci.integration.stage.lightning_program.LightningStageProgram`), how bytes move from
a :class:`Comm`, and how the stage updates its weights from a
:class:`~lightning_paci.optim.stage_optimizer.StageOptimizer`. Each action kind has one handler
(``StageRuntime._handlers``); what a stage measures goes to its bounded
:class:`~lightning_paci.engine.runtime.records.StageRecords`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_paci.engine.replicas.grad_buckets import ReplicaCheck
from lightning_paci.engine.runtime.microbatch import microbatch_rng, microbatch_size
from lightning_paci.engine.runtime.norm_table import carried, merged
from lightning_paci.engine.runtime.program import (
    LOSS_KEY,
    BackwardHooks,
    ForwardOutput,
    LogRecord,
    StageProgram,
    loss_value,
    own_values,
    padding_forward,
)
from lightning_paci.engine.runtime.records import BackwardRecord, StageRecords
from lightning_paci.engine.runtime.runtime_state import RuntimeState
from lightning_paci.engine.runtime.updates import checked_update
from lightning_paci.engine.runtime.whole_batch import LossCall, WholeBatch
from lightning_paci.engine.transport.messages import flatten
from lightning_paci.engine.transport.point_to_point import Comm
from lightning_paci.engine.transport.receives_ahead import ReceivesAhead
from lightning_paci.errors import StageFailure
from lightning_paci.optim.prediction_cost import prediction_pays
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.optim.weight_prediction import WeightPrediction
from lightning_paci.schedules import (
    OPT,
    RECV_B,
    RECV_F,
    RECV_KINDS,
    RECV_T,
    SEND_B,
    SEND_F,
    SEND_KINDS,
    SEND_T,
    Action,
    B,
    F,
    Interval,
    message_key,
)
from lightning_paci.schedules.analysis import DEFERRED_UPDATE_BEFORE

__all__ = ["BackwardHooks", "ForwardOutput", "StageProgram", "StageRuntime"]

# how each action kind's time is accounted, and the kind its interval shows in a timeline
_CATEGORY = {F: "compute", B: "compute", OPT: "optimizer", RECV_F: "wait", RECV_B: "wait", RECV_T: "wait",
             SEND_F: "comm", SEND_B: "comm", SEND_T: "comm"}
_INTERVAL_KIND = {F: "F", B: "B", OPT: "OPT", RECV_F: "WAIT_F", RECV_B: "WAIT_B", RECV_T: "WAIT_F",
                  SEND_F: "SEND", SEND_B: "SEND", SEND_T: "SEND"}


_DEVICE_TIMED = (F, B, OPT)  # timed with device events when the stage has a device clock ([Note: device clocks])
_NO_CONTEXT = contextlib.nullcontext()


@dataclass
class _Held:
    """A micro-batch between its forward and its backward: the received leaves and the graph to backward."""

    leaves: list[torch.Tensor]
    output: ForwardOutput


class StageRuntime(RuntimeState):
    """One stage: executes actions; owns the in-flight micro-batches and the received messages.

    Args:
        stage, num_stages: this stage's index and the pipeline's length. program: the stage's forward; comm:
            messages to and from the other stages; optimizer: ``None`` on a stage whose list has no ``OPT``.
        loss_scale: the last stage back-propagates ``loss * loss_scale`` (``1 / accumulation``).
        clock: time source of the records. tied: tied-weight parameters (see [Note: tied weights]).
        skip_nonfinite: drop a micro-batch whose loss is not finite instead of failing.
        retention, keep_intervals: per-micro-batch records and intervals kept
            (:class:`~lightning_paci.engine.runtime.records.StageRecords`). hooks: called
            around each local backward (:class:`BackwardHooks`).
        seed: base of every forward's random stream (``torch.initial_seed()``; [Note: randomness per micro-batch]).
        prediction: the staleness compensation's weight prediction ([Note: weight prediction]), or None.
        whole_batch: on the last stage, the loss computed once per mini-batch ([Note: the whole-batch loss]), or None.

    Its counters (runtime_state.py) change through their methods only, never by another module writing its fields
    (tests/test_layout.py checks).
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        program: StageProgram,
        comm: Comm,
        optimizer: StageOptimizer | None,
        *,
        loss_scale: float,
        clock: Callable[[], float] = time.perf_counter,
        tied: Sequence[nn.Parameter] = (),
        skip_nonfinite: bool = False,
        retention: int = 16384,
        keep_intervals: int = 8192,
        seed: int | None = None,
        hooks: BackwardHooks | None = None,
        prediction: WeightPrediction | None = None,
        whole_batch: WholeBatch | None = None,
    ) -> None:
        self.stage, self.num_stages, self.program, self.comm = stage, num_stages, program, comm
        super().__init__(loss_scale)
        self.optimizer, self.hooks = optimizer, hooks
        self.seed = torch.initial_seed() if seed is None else seed  # the same on every rank after seeding
        self.clock = clock
        self.records = StageRecords(clock=clock, retention=retention, keep_intervals=keep_intervals)
        # micro-batch -> (data, step args after the batch, loss weight; see microbatch.split_weighted)
        self.data: dict[int, tuple[Any, tuple[Any, ...], float]] = {}
        self.loss_weights: dict[int, float] = {}  # micro-batch in flight -> its loss weight, where not 1.0
        self.inbox: dict[tuple[str, int], Any] = {}  # (RECV kind, micro-batch) -> payload
        self.held: dict[int, _Held] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.logs: dict[int, list[LogRecord]] = {}  # micro-batch -> log records not yet replayed (see logs.py)
        self.upstream_logs: dict[int, list[LogRecord]] = {}  # a whole-batch loss's records until their SEND_B
        self.forward_version: dict[int, int] = {}  # micro-batch in flight -> version at its forward
        self.skip_nonfinite = skip_nonfinite
        self._skipping: set[int] = set()  # dropped micro-batches whose "skip" still has to travel upstream
        self.tied = list(tied)
        self.tied_version = 0  # updates of the tied weights applied here (stage 0: made, last stage: installed)
        # [Note: weight prediction]: a forward crossing ``crossings(mb)`` updates runs with the weights ahead
        self.prediction = prediction
        self.whole = whole_batch
        self.current: tuple[Action, float] | None = None  # the action running and when it began
        # [Note: no host sync per micro-batch]: losses kept on the device (None: where the loss is) until the update
        self.device_losses: bool | None = None
        self.unchecked_losses: list[tuple[int, torch.Tensor]] = []
        # [Note: after the send]: the last backward's (micro-batch, forward's version, run the hooks), if not finished
        self._after_backward: tuple[int, int, bool] | None = None
        self._update_pending = False  # [Note: deferred update]: an OPT whose update is not made yet
        self._handlers: dict[str, Callable[[Any], None]] = {
            F: self._forward, B: self._backward, OPT: self._optimizer_step,
            SEND_F: self._send_activation, SEND_B: self._send_gradient, RECV_F: self._receive_activation,
            RECV_B: self._receive_gradient, SEND_T: lambda _: _send_tied(self), RECV_T: lambda _: _receive_tied(self),
        }

    # -- execution ------------------------------------------------------------------------------------------------
    def add_microbatch(self, microbatch: int, data: Any, *step_args: Any, weight: float = 1.0) -> None:
        """Micro-batch ``microbatch``'s data and the step's other arguments (``batch_idx``, ...); ``weight``
        multiplies its loss (its share of the batch's samples); 0: a short last batch's padding, run without gradient
        or side effects and dropped like a skipped one."""
        self.data[microbatch] = (data, step_args, weight)

    def run(self, actions: Iterable[Action]) -> None:
        """Execute ``actions`` in order, the next activation and gradient receives posted ahead."""
        actions = list(actions)
        ahead = ReceivesAhead(self.comm, self.stage, actions)
        for action in actions:
            self.execute(action)
            ahead.taken(action)
        self.settle()

    def settle(self) -> None:
        """Finish what the last action left for later ([Note: after the send]); after ``execute``'s last action."""
        if self._after_backward is not None:
            self._finish_backward()

    def execute(self, action: Action) -> None:
        """Run one action and account its time; a failed message names the peer, the action and the step."""
        kind, mb = action.kind, action.microbatch
        if self._after_backward is not None and kind not in SEND_KINDS:
            self._finish_backward()
        if self._update_pending and kind in DEFERRED_UPDATE_BEFORE:  # [Note: deferred update]
            self.apply_pending_update()
        start = self.clock()
        self.current = (action, start)  # read by the watchdog's thread (supervision.runtime_activity)
        began = self.records.begin_on_device(kind in _DEVICE_TIMED)  # [Note: device clocks]
        try:
            self._handlers[kind](mb)
        except (RuntimeError, ConnectionError) as err:
            if kind not in RECV_KINDS and kind not in SEND_KINDS or isinstance(err, StageFailure):
                raise
            raise _message_failure(self, action, err) from err
        self.current = None
        index = None if mb is None else mb + self.microbatch_base
        self.records.account_action(_CATEGORY[kind], (self.stage, _INTERVAL_KIND[kind], index), start, began)
        if kind is B and self.records.phase == "startup":
            self.records.set_phase("steady")

    # -- compute ----------------------------------------------------------------------------------------------
    def _forward(self, mb: int) -> None:
        data, step_args, weight = self.data.pop(mb)
        received = self.inbox.pop((RECV_F, mb), None)
        leaves = [t for t in flatten(received)[1] if t.requires_grad] if received is not None else []
        records = self.records
        key = mb + self.microbatch_base
        padding = weight == 0.0
        ahead: contextlib.AbstractContextManager[Any] = _NO_CONTEXT
        if self.prediction is not None and not padding:
            ahead = self.prediction.moved(self.crossings(mb), max(0.0, 1.0 - self.window_backwards * self.loss_scale))
        context = padding_forward(self.program.module) if padding else ahead
        cutting = self.layered.cuts.recording() if self.layered is not None else _NO_CONTEXT
        with microbatch_rng(self.seed, self.stage, key, self.replica), context, cutting as cuts:
            if records.activations:
                output = records.metered(mb, self.program, data, step_args, received, leaves)
            else:
                output = self.program.forward(data, *step_args, received=received)
        self.held[mb] = _Held(leaves, output)
        if self.layered is not None:
            self.layered.of[mb] = cuts
        records.peak_inflight = max(records.peak_inflight, len(self.held))
        self.forward_version[mb] = self.version
        if self.tied and self.stage == self.num_stages - 1:
            records.tied_lags[key] = self.version - self.tied_version
        if padding and (output.loss is not None or isinstance(output.outgoing, LossCall)):
            # no gradient, no logs: dropped on every stage
            self._skipping.add(key)
            self.logs[key] = []
            self.held[mb] = _Held(leaves, ForwardOutput(skipped=True))
            return
        if output.loss is not None:
            if weight != 1.0:
                self.loss_weights[mb] = weight
            loss = loss_value(output.loss.detach(), key, self.unchecked_losses,
                              keep=self.device_losses, skip=self.skip_nonfinite)
            if isinstance(loss, float) and not math.isfinite(loss):
                _check_skipping(self, key, loss)
                # no backward from it: its log records are dropped and upstream stages receive zero gradients
                self._skipping.add(key)
                self.logs[key] = []
                self.held[mb] = _Held(leaves, ForwardOutput(skipped=True))
                return
            self.logs[key] = [*output.logs, LogRecord(LOSS_KEY, loss, microbatch_size(data), ())]
            records.losses[key] = loss

    def _backward(self, mb: int) -> None:
        # layered: the first B of a mini-batch runs all of its backwards, the others none
        group = 1 if self.layered is None else 0 if mb in self.layered.done else len(self.held)
        if self.arm_reduction is not None and group and self.window_backwards + group == self.window_size:
            self.arm_reduction(group)  # the OPT follows these backwards
        if self.gradient_sync is not None and group:
            self.gradient_sync(self.window_backwards + group == self.window_size)
        if self.whole is not None and (RECV_B, mb) not in self.inbox and not self.held[mb].output.skipped:
            self.whole.backward(self, mb, lambda key, loss: _check_skipping(self, key, loss))
        held = self.held.pop(mb)
        self.records.activation_bytes.pop(mb, None)
        key = mb + self.microbatch_base
        if self.layered is not None:  # [Note: layered backward]: the first B of a mini-batch runs them all
            self.layered.run(self, mb, held)
        if held.output.skipped:
            pass  # a dropped micro-batch: its input gradients below are zeros
        elif held.output.loss is not None:
            loss = held.output.loss * self.loss_scale
            if mb in self.loss_weights:
                loss = loss * self.loss_weights.pop(mb)
            if self.hooks is not None and self.layered is None:
                self.hooks.before_backward(loss)
            if self.layered is None:
                loss.backward()
        else:
            payload = self.inbox.pop((RECV_B, mb))
            grads = payload["grads"]
            outputs = [t for t in flatten(held.output.outgoing)[1] if t.requires_grad]
            if payload.get("skip"):  # dropped downstream (non-finite loss, padding): no backward, zero input grads
                self._skipping.add(key)
                held = _Held(held.leaves, ForwardOutput(skipped=True))
            elif len(outputs) != len(grads):
                raise AssertionError(f"stage {self.stage}: {len(outputs)} outputs need grads, received {len(grads)}")
            elif outputs and self.layered is None:
                torch.autograd.backward(outputs, grads)
            if "logs" in payload:  # received (a whole-batch loss recorded its own: whole_batch.py)
                self.logs[key] = own_values(payload["logs"])
                carried = next((r.value for r in self.logs[key] if r.name == LOSS_KEY), None)
                if carried is not None:
                    self.records.losses[key] = carried
        if self.stage > 0:
            self.input_grads[mb] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in held.leaves]
        self.window_backwards += 1
        self._after_backward = (key, self.forward_version.pop(mb), not held.output.skipped)

    def _optimizer_step(self, _: None) -> None:
        if self.optimizer is None:
            raise AssertionError(f"stage {self.stage}: OPT scheduled on a stage without an optimizer")
        if self.deferred is not None:  # [Note: deferred update]
            self.deferred.start()
            self._update_pending = True
            return
        # before the check: every replica then sees (and names) a bad value
        self._apply_update(self.reduce_gradients() if self.reduce_gradients is not None else None)

    def apply_pending_update(self) -> None:
        """Make the update an ``OPT`` deferred, if any ([Note: deferred update]; the stream driver after drains)."""
        if self._update_pending:
            self._update_pending, start = False, self.clock()
            self._apply_update(self.deferred.finish())
            self.records.account("optimizer", Interval(self.stage, "OPT", None, start, self.clock()))

    def _apply_update(self, replicas: ReplicaCheck | None = None) -> None:
        assert self.optimizer is not None
        step = checked_update(self, self.optimizer, replicas)
        if self.prediction is not None and not prediction_pays(self):  # [Note: the prediction's budget]
            self.prediction = None
        self.version += 1
        self.window_backwards = 0
        if self.records.weight_drift:
            self.records.record_update(self.version, step.squares)
        if self.tied and self.stage == 0:
            self.records.fingerprint(self.tied)
        for hook in self.update_hooks:
            hook(self.version)

    # -- messages ---------------------------------------------------------------------------------------------
    def _send_activation(self, mb: int) -> None:
        logs: list[LogRecord] = []
        if self.hooks is not None:
            logs, self.hooks.logs[:] = list(self.hooks.logs), []
        self.comm.send(carried(self.norms, (self.held[mb].output.outgoing, logs)), self.stage + 1)

    def _send_gradient(self, mb: int) -> None:
        key = mb + self.microbatch_base
        logs = self.upstream_logs.pop(key) if key in self.upstream_logs else self.logs.get(key, [])
        message = {"grads": self.input_grads.pop(mb), "logs": logs, "skip": key in self._skipping}
        self.comm.send(carried(self.norms, message), self.stage - 1)
        self._skipping.discard(key)

    def _receive_activation(self, mb: int) -> None:
        outgoing, logs = merged(self.norms, self.comm.recv(self.stage - 1))
        self.inbox[(RECV_F, mb)] = outgoing
        if self.hooks is not None:
            self.hooks.logs.extend(own_values(logs))

    def _receive_gradient(self, mb: int) -> None:
        self.inbox[(RECV_B, mb)] = merged(self.norms, self.comm.recv(self.stage + 1))

    def _finish_backward(self) -> None:
        """The rest of the last backward, once its gradient message is sent ([Note: after the send])."""
        key, forward_version, hooks = self._after_backward  # type: ignore[misc]
        self._after_backward = None
        start = self.clock()
        if self.hooks is not None and hooks:
            self.hooks.after_backward()
        drift, exact = self.records.weight_drift_between(forward_version, self.version)
        self.records.add_backward(BackwardRecord(key, self.version - forward_version, drift, exact))
        self.records.add_time("compute", self.clock() - start)


# [Note: after the send]
# A backward's input gradients are on the next stage's critical path; its Lightning ``on_after_backward`` hooks and
# its drift record are not. They run when the stage's next action other than a send begins (or when the call ends,
# ``settle``), so the gradient message leaves first (0.1-0.3 ms sooner on a 2-core CPU host). No hook can see the
# difference: they still run after this backward and before the next backward, the next update and the next
# activation message (which carries the log records they make).


def _send_tied(runtime: StageRuntime) -> None:
    """``SEND_T``. Stage 0: the weights after this update, for the last stage's replicas. Last stage: the replicas'
    gradient of this window, for stage 0's update; replicas are never stepped there."""
    if runtime.stage == 0:
        runtime.comm.send([p.detach() for p in runtime.tied], runtime.num_stages - 1, channel=1)
    else:
        runtime.comm.send([p.grad if p.grad is not None else torch.zeros_like(p) for p in runtime.tied], 0, channel=1)
        for p in runtime.tied:
            p.grad = None


def _receive_tied(runtime: StageRuntime) -> None:
    """``RECV_T``. Stage 0 adds the last stage's gradient before the ``OPT`` that makes this update; the last stage
    installs the new weights (no micro-batch is in flight there at that point)."""
    if runtime.stage == 0:
        for p, grad in zip(runtime.tied, runtime.comm.recv(runtime.num_stages - 1, channel=1)):
            p.grad = grad.to(p.dtype) if p.grad is None else p.grad.add_(grad)
        runtime.tied_version += 1
    else:
        weights = runtime.comm.recv(0, channel=1)
        with torch.no_grad():
            for p, w in zip(runtime.tied, weights):
                p.data.copy_(w)
        runtime.tied_version += 1
        runtime.records.fingerprint(runtime.tied)


def _message_failure(runtime: StageRuntime, action: Action, err: BaseException) -> StageFailure:
    """A failed send or receive, naming the peer, the action and the step."""
    key = message_key(action, runtime.num_stages)
    if key is None:
        raise AssertionError(f"no message for {action}") from err
    receiving = action.kind in RECV_KINDS
    return StageFailure(
        f"stage {runtime.stage}{runtime.replica_tag}: {'receiving from' if receiving else 'sending to'} stage "
        f"{key[1] if receiving else key[2]}{runtime.replica_tag} failed at {action} ({runtime.step_label}): {err}")


def _check_skipping(runtime: StageRuntime, key: int, loss: float) -> None:
    """A non-finite loss stops the run unless ``nonfinite="skip"``."""
    if not runtime.skip_nonfinite:
        raise StageFailure(f"stage {runtime.stage}: the loss of micro-batch {key} is {loss} at {runtime.step_label}. "
                           f"Pass `PACIStrategy(nonfinite='skip')` to drop such micro-batches instead of stopping.")
