"""What a stage records while it runs, bounded: losses, version gaps, backwards, tied-weight lags, intervals, time.

Every record that grows with the number of micro-batches keeps only its most recent ``retention`` entries, so a
stage's record memory is constant however long the run (a 380k-step run would otherwise hold millions of entries
per stage). Readers that consume a stream of records (the monitors) keep a *count* of what they have read and ask
for what came after it (``backwards_since``, ``tied_lags_since``); they never index by ``len()``, which stops
growing at the cap.

Measurements that cost time are off until a monitor asks for them (``measure``): the relative weight drift (steps
the optimizer one tensor at a time), activation bytes (``saved_tensors_hooks`` during each forward) and a digest of
every tied-weight version (tests).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from lightning_paci.engine.runtime.device_clock import DeviceClock, Resolved
from lightning_paci.engine.transport.messages import flatten
from lightning_paci.schedules import Interval

__all__ = ["PHASES", "ActivationMeter", "BackwardRecord", "RecentDict", "StageRecords"]

PHASES = ("startup", "steady", "drain", "outside")
_RESOLVE_AFTER = 256  # pending update norms or unresolved backwards read at the latest
_K = TypeVar("_K")
_V = TypeVar("_V")


class BackwardRecord(NamedTuple):
    """One backward of this stage, in execution order."""

    microbatch: int  # index in the whole run
    version_gap: int  # this stage's optimizer steps between the micro-batch's forward and its backward
    weight_drift: float  # ||theta_B - theta_F|| / ||theta_B|| (0 when not measured, nan when unknown)
    # (None inside StageRecords until the update norms it needs are read: ``backwards`` never shows that)
    exact: bool  # False when ``weight_drift`` is the triangle-inequality upper bound


def _after(kept: list[_V], total: int, count: int) -> list[_V]:
    """Of the last ``len(kept)`` of ``total`` items, those after the first ``count``."""
    return kept[max(0, len(kept) - (total - count)):]


class RecentDict(dict, Generic[_K, _V]):
    """A dict that keeps its ``retention`` most recently inserted keys (insertion order, oldest evicted first)."""

    def __init__(self, retention: int) -> None:
        super().__init__()
        self.retention = retention
        self.count = 0  # insertions ever made

    def __setitem__(self, key: _K, value: _V) -> None:
        super().__setitem__(key, value)
        self.count += 1
        if len(self) > self.retention:
            del self[next(iter(self))]

    def since(self, count: int) -> list[_V]:
        """Values inserted after the first ``count`` insertions (those still kept)."""
        return _after(list(self.values()), self.count, count)


class ActivationMeter:
    """Bytes a micro-batch keeps alive from its forward to its backward: the tensors autograd saves for the
    backward, the received inputs and the outgoing activations, each storage counted once; parameters (and their
    views) are not activations and are left out. Counted with ``saved_tensors_hooks`` while the forward runs,
    so the figure is exact and deterministic (no allocator or RSS noise) -- what the paper's "identical peak
    memory" claim is about, since the weights and optimizer state are the same single copy under every schedule.
    """

    _active: list[ActivationMeter] = []  # the meters counting now (innermost last)

    @staticmethod
    def keep(structure: Any) -> None:
        """Count the tensors of ``structure`` that a forward keeps alive for its backward outside autograd's saved
        tensors (a recomputed block's input, recompute.py) in the meter that is counting, if any; without one,
        nothing is walked (this runs at every recomputed block's forward)."""
        if ActivationMeter._active:
            for tensor in flatten(structure)[1]:
                ActivationMeter._active[-1]._add(tensor)

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in parameters}
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
        ActivationMeter._active.append(self)

    def __exit__(self, *exc: Any) -> None:
        ActivationMeter._active.pop()
        self._hooks.__exit__(*exc)

    def total(self, leaves: list[torch.Tensor], outgoing: Any) -> int:
        for tensor in [*leaves, *flatten(outgoing)[1]]:
            self._add(tensor)
        return sum(self._storages.values())


class StageRecords:
    """One stage's records (see the module docstring). ``retention`` bounds every per-micro-batch record."""

    def __init__(self, *, clock: Callable[[], float], retention: int = 16384, keep_intervals: int = 8192) -> None:
        if retention < 1:
            raise ValueError(f"`retention` must be >= 1 micro-batches, got {retention}.")
        self.clock = clock
        # micro-batch -> loss (last stage: its own); a 0-dim device tensor on an accelerator ([Note: no host sync
        # per micro-batch] in program.py)
        self.losses: RecentDict[int, float | torch.Tensor] = RecentDict(retention)
        self.version_gaps: RecentDict[int, int] = RecentDict(retention)
        self.tied_lags: RecentDict[int, int] = RecentDict(retention)  # last stage: tied updates a forward was behind
        self._backwards: deque[BackwardRecord] = deque(maxlen=retention)
        self.num_backwards = 0
        # the drift measurement's update norms, read lazily ([Note: drift norms read when read]): version -> the
        # stage's per-tensor squared norms (tensors, 2) on the device, and the backwards waiting for them
        self._pending: dict[int, torch.Tensor] = {}
        self._unresolved: deque[tuple[int, int]] = deque()  # (backward's number, its forward's version)
        self._latest = 0  # the last version whose update was recorded
        self._intervals: deque[Interval] = deque(maxlen=keep_intervals)
        self.device_clock: DeviceClock | None = None  # on CUDA: compute timed on the device ([Note: device clocks])
        self.peak_inflight = 0
        self.activation_bytes: dict[int, int] = {}  # micro-batch in flight -> bytes (only while measured)
        self.peak_activation_bytes = 0
        # bytes of values relayed past the next stage in one activation message (partition/relay.py), the largest
        self.peak_relayed_bytes = 0
        # compensation="auto": the weight prediction's measured quality, once decided ([Note: the prediction's
        # quality] in optim/prediction_quality.py); None: not measured here
        self.prediction_quality: float | None = None
        self.tied_fingerprints: deque[str] | None = None
        self.weight_drift = False
        self.activations = False
        # the stage's weights are DTensor shards ([Note: tensor parallelism in a stage]): a shard's drift is not
        # the stage's, so the drift is not measured
        self.sharded_weights = False
        self._update_norms: dict[int, float] = {}  # version v -> ||theta_v - theta_{v-1}||
        self._weight_norms: dict[int, float] = {}  # version v -> ||theta_v||
        # time per phase: "startup" until the stream's first backward here, "steady", "drain" (the stream's
        # cool-down), "outside" (between streams: validation, checkpoints)
        self.phase = "startup"
        self._phase_since = clock()
        self.phase_time = {p: {"wall": 0.0, "compute": 0.0, "wait": 0.0, "comm": 0.0, "optimizer": 0.0}
                           for p in PHASES}
        self._retention = retention

    def measure(self, *, weight_drift: bool | None = None, activation_bytes: bool | None = None,
                tied_fingerprints: bool | None = None) -> None:
        """Switch the costly measurements on or off (``None`` leaves one as it is)."""
        if weight_drift and self.sharded_weights:
            raise ValueError("The weight drift of a stage with tensor parallelism is not measured in this release "
                             "(a shard's drift is not the stage's): remove `DriftMonitor` (or its weight drift), or "
                             "use `tensor_parallel_size=1`.")
        if weight_drift is not None:
            self.weight_drift = weight_drift
        if activation_bytes is not None:
            self.activations = activation_bytes
        if tied_fingerprints is not None:
            self.tied_fingerprints = deque(maxlen=self._retention) if tied_fingerprints else None

    # -- per micro-batch ---------------------------------------------------------------------------------------
    def metered(self, microbatch: int, program: Any, data: Any, step_args: tuple[Any, ...], received: Any,
                leaves: list[torch.Tensor]) -> Any:
        """Run ``program.forward`` counting the micro-batch's activation bytes (``measure(activation_bytes=True)``);
        return its output."""
        meter = ActivationMeter(program.module.parameters())
        with meter:
            output = program.forward(data, *step_args, received=received)
        self.activation_bytes[microbatch] = meter.total(leaves, output.outgoing)
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(self.activation_bytes.values()))
        outgoing = output.outgoing
        if isinstance(outgoing, tuple) and len(outgoing) == 3:  # (args, kwargs, relayed values)
            relayed = sum(t.numel() * t.element_size() for t in outgoing[2].values())
            self.peak_relayed_bytes = max(self.peak_relayed_bytes, relayed)
        return output

    def add_backward(self, record: BackwardRecord) -> None:
        self.version_gaps[record.microbatch] = record.version_gap
        if record.weight_drift is None:  # its update norms are not read yet; its backward ran at the latest version
            self._unresolved.append((self.num_backwards, self._latest - record.version_gap))
        self._backwards.append(record)
        self.num_backwards += 1
        if len(self._unresolved) > _RESOLVE_AFTER or len(self._pending) > _RESOLVE_AFTER:  # bounded
            self._resolve()

    @property
    def backwards(self) -> deque[BackwardRecord]:
        """The backwards kept, in execution order, each with its weight drift."""
        self._resolve()
        return self._backwards

    def backwards_since(self, count: int) -> list[BackwardRecord]:
        """The backwards after the first ``count`` (those still kept); pair with ``num_backwards``."""
        return _after(list(self.backwards), self.num_backwards, count)

    def tied_lags_since(self, count: int) -> list[int]:
        return self.tied_lags.since(count)

    def fingerprint(self, tensors: Sequence[torch.Tensor]) -> None:
        """Record a digest of one tied-weight version (when measured)."""
        if self.tied_fingerprints is not None:
            digest = hashlib.sha1()
            for p in tensors:
                digest.update(p.detach().cpu().contiguous().numpy().tobytes())
            self.tied_fingerprints.append(digest.hexdigest())

    # -- weight drift ------------------------------------------------------------------------------------------
    def record_update(self, version: int, squares: torch.Tensor | None) -> None:
        """[Note: drift norms read when read]
        Update ``version``'s per-tensor squared norms (``StageOptimizer.step(measure=True)``), kept on the device:
        reading them at each update was a host read per update on top of the check before it. They are read, all
        pending versions at once, when a backward's drift is first looked at (``backwards``: the monitors, at
        their logging interval) or when more than a bound of them wait; a backward that needs them carries
        ``None`` until then. Summed on the host in the tensors' order, in float64: the bits a per-tensor read
        gave."""
        self._latest = version
        if squares is None:
            self._update_norms[version] = self._weight_norms[version] = 0.0
        else:
            self._pending[version] = squares

    def _resolve(self) -> None:
        if self._pending:
            versions = sorted(self._pending)
            values = torch.stack([self._pending.pop(v) for v in versions]).double().tolist()  # the one read
            for version, rows in zip(versions, values):
                update_sq = weight_sq = 0.0
                for u, w in rows:
                    update_sq, weight_sq = update_sq + u, weight_sq + w
                self._update_norms[version], self._weight_norms[version] = update_sq ** 0.5, weight_sq ** 0.5
        first = self.num_backwards - len(self._backwards)  # the number of the oldest backward kept
        while self._unresolved:
            number, forward_version = self._unresolved.popleft()
            if number < first:
                continue  # no longer kept
            record = self._backwards[number - first]
            drift, exact = self.weight_drift_between(forward_version, forward_version + record.version_gap)
            self._backwards[number - first] = record._replace(weight_drift=drift, exact=exact)

    def weight_drift_between(self, forward_version: int, version: int) -> tuple[float, bool]:
        """||theta_B - theta_F|| / ||theta_B|| from the recorded update norms, without any copy of the weights.

        Exact when at most one update fell between the forward and the backward (every ``a >= N - 1``); with
        several it is the triangle-inequality upper bound sum ||update|| (exactness would need the updates
        themselves, i.e. a copy of the weights), and the second value is False.
        """
        if not self.weight_drift or forward_version == version:
            return 0.0, True
        needed = range(forward_version + 1, version + 1)
        if any(v in self._pending for v in needed) and all(v in self._pending or v in self._update_norms
                                                            for v in needed):
            return None, False  # type: ignore[return-value]  # read later ([Note: drift norms read when read])
        updates = [self._update_norms.get(v) for v in range(forward_version + 1, version + 1)]
        norm = self._weight_norms.get(version)
        if any(u is None for u in updates) or not norm:
            return float("nan"), False  # measuring started while this micro-batch was in flight
        for v in [v for v in self._update_norms if v < forward_version - 64]:  # keep the dicts small
            self._update_norms.pop(v, None)
            self._weight_norms.pop(v, None)
        return sum(updates) / norm, len(updates) == 1  # type: ignore[arg-type]

    # -- time --------------------------------------------------------------------------------------------------
    @property
    def intervals(self) -> deque[Interval]:
        """The latest actions' spans (at most ``keep_intervals``), device-timed ones resolved first."""
        self.resolve_device()
        return self._intervals

    def account(self, category: str, interval: Interval) -> None:
        """Add one action's span to the current phase (``category``: compute, optimizer, wait or comm)."""
        self.phase_time[self.phase][category] += interval.end - interval.start
        self._intervals.append(interval)

    def begin_on_device(self, timed: bool) -> Any:
        """An action's start event on the device where it is ``timed`` there ([Note: device clocks]), else None."""
        return self.device_clock.begin() if timed and self.device_clock is not None else None

    def account_action(self, category: str, fields: tuple[int, str, int | None], start: float, began: Any) -> None:
        """Add an action's span: from ``start`` to now on the host clock, or, with the device event ``began``
        (``begin_on_device``), from it to now on the device, once resolved."""
        if began is None:
            self.account(category, Interval(*fields, start, self.clock()))
        else:
            assert self.device_clock is not None
            self._add_resolved(self.device_clock.end(began, category, self.phase, fields))

    def resolve_device(self) -> None:
        """Read the device-timed spans pending, if any: one host wait ([Note: device clocks])."""
        if self.device_clock is not None and self.device_clock.pending:
            self._add_resolved(self.device_clock.resolve())

    def _add_resolved(self, spans: list[Resolved]) -> None:
        for category, phase, fields, start, end in spans:
            self.phase_time[phase][category] += end - start
            stage, kind, microbatch = fields
            self._intervals.append(Interval(stage, kind, microbatch, start, end))

    def add_time(self, category: str, seconds: float) -> None:
        """Add time spent outside any action (a backward's deferred hooks) to the current phase's ``category``;
        host time, so not with a device clock ([Note: device clocks])."""
        if self.device_clock is not None:
            return
        self.phase_time[self.phase][category] += seconds

    def set_phase(self, phase: str) -> None:
        """Close the current phase's wall-clock span and open ``phase``'s."""
        now = self.clock()
        self.phase_time[self.phase]["wall"] += now - self._phase_since
        self.phase, self._phase_since = phase, now

    def time_snapshot(self) -> dict[str, dict[str, float]]:
        """Cumulative seconds per phase (wall, compute, wait, comm, optimizer), the open span included. With a
        device clock, compute and optimizer are the device's and wait is the device's idle time ([Note: device
        clocks])."""
        self.resolve_device()
        snap = {p: dict(v) for p, v in self.phase_time.items()}
        snap[self.phase]["wall"] += self.clock() - self._phase_since
        if self.device_clock is not None:  # idle: what the device did not spend on F, B, OPT or message posting
            for accounts in snap.values():
                busy = accounts["compute"] + accounts["optimizer"] + accounts["comm"]
                accounts["wait"] = max(0.0, accounts["wall"] - busy)
        return snap
