"""Building schedules: the compute order of each stage, its lowering to messages, and the tied-weight exchange.

A schedule is built in three pure passes (no torch, no torch.distributed), so that the runtime, the one-process
reference executor, the simulator and the monitors all read one definition of what a stage does and when:

1. compute order: forwards ``F`` and backwards ``B`` per stage (``_compute_order``; a device's over its chunks,
   virtual.py),
2. an ``OPT`` after every ``accumulation``-th local backward, and
3. the point-to-point messages the compute order implies (2 and 3 in one sweep, ``_lower``).

[Note: PACI order]
``"paci"`` is one-forward-one-backward (1F1B) over the *whole stream* of micro-batches with no flush between
mini-batches. Stage ``s`` runs ``w = N - 1 - s`` warm-up forwards, then alternates ``F(w + i), B(i)``, so it holds at
most ``N - s`` micro-batches between their forward and backward, and backwards are processed in forward order
(FIFO). Between ``F(j)`` and ``B(j)`` stage ``s`` runs the ``w`` backwards ``B(j - w) .. B(j - 1)``, and an ``OPT``
follows every ``a``-th backward, so at most ``ceil(w / a)`` optimizer steps fall inside that window: the drift bound
``ceil((N - 1 - s) / a)``, reached exactly in a long run::

    stage 0 (N=3):  F0 F1 F2 B0 F3 B1 F4 B2 ...      <- 3 in flight
    stage 1:           F0 F1 B0 F2 B1 F3 B2 ...      <- 2 in flight
    stage 2:              F0 B0 F1 B1 F2 B2 ...      <- 1 in flight (forward, loss, backward back to back)

``"1f1b"`` is the same rule applied to each mini-batch separately (a flush at every mini-batch boundary: the
paper's synchronous baseline); ``"gpipe"`` runs all forwards of a mini-batch, then all its backwards.

[Note: whole-batch order]
With a loss computed once over the whole batch ([Note: the whole-batch loss] in engine/runtime/whole_batch.py) the
last stage cannot run a mini-batch's first backward before its last forward. Every stage's warm-up then grows by
``m - 1`` forwards: ``w = N - 1 - s + m - 1``, the rest as above. Under ``"1f1b"`` (warm-up capped by ``m``) that is
``"gpipe"``'s order: each stage holds all ``m`` micro-batches of the batch at its peak instead of ``N - s``, and
the fill and drain bubbles are ``"gpipe"``'s. Under ``"paci"`` the backwards of one mini-batch interleave with
the forwards of the next as before: stage ``s`` holds ``N - s + m - 1`` micro-batches at its peak and the drift
bound is ``ceil((N - 1 - s + m - 1) / a)``, read off the lists like every other bound.

[Note: layered backward]
``"layered"`` is ``"gpipe"`` with the backward of layered gradient accumulation (Lamy-Poirier, arXiv 2106.02679): a
stage runs its mini-batch's backward block by block -- its last block for every micro-batch, then the block before
it, ... -- so a block's gradient is final while the blocks before it still have every micro-batch to go, and its
reduction over data-parallel replicas overlaps all of that (engine/blocks/layered.py). A micro-batch's input gradient is
then known only at the end, so a stage receives every gradient of the mini-batch first, runs its backwards, then
sends them: ``RECV_B x m, B x m, SEND_B x m`` (the stages' backwards follow one another), and the window is whole
mini-batches (``accumulation`` a multiple of ``m``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal, get_args

from lightning_paci.schedules.actions import (
    OPT,
    RECV_B,
    RECV_F,
    RECV_T,
    SEND_B,
    SEND_F,
    SEND_T,
    Action,
    B,
    F,
    Schedule,
)
from lightning_paci.schedules.analysis import assign_rounds
from lightning_paci.schedules.virtual import Unit, device_orders, stage_devices

__all__ = ["SCHEDULE_NAMES", "VIRTUAL_SCHEDULE_NAMES", "ScheduleName", "build_schedule"]

# what PACIStrategy(schedule=...) runs: ``"paci"`` with any number of stages per device, the next three with one,
# the last two over virtual stages ([Note: virtual stages]; with one stage per device they build 1f1b's and gpipe's)
ScheduleName = Literal["paci", "1f1b", "gpipe", "layered", "interleaved", "bfs"]
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)[:4]  # one stage per device
VIRTUAL_SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)[4:]


def _check_positive(name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r} of type {type(value).__name__}. {fix}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}. {fix}")
    return value


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    accumulation: int,
    num_minibatches: int,
    *,
    backward_offset: int = 0,
    tied: bool = False,
    virtual_stages: int = 1,
    placement: str = "loop",
    whole_batch: bool = False,
) -> Schedule:
    """Build the action list of every stage.

    Args:
        name: ``"paci"`` (asynchronous 1F1B, no flush), ``"1f1b"`` (1F1B with a flush per mini-batch), ``"gpipe"``,
            ``"layered"``, or over virtual stages ``"interleaved"`` and ``"bfs"``.
        num_stages: pipeline stages ``N``, one process each.
        num_microbatches: micro-batches ``m`` per mini-batch (any ``m >= 1``; ``m < N`` runs, it only fills less).
        accumulation: ``a``; every stage steps its optimizer after every ``a``-th local backward.
        num_minibatches: mini-batches in the stream (``K``); micro-batches are numbered ``0 .. K*m - 1``.
        backward_offset: backwards every stage already ran before this stream (after a drain), so that the
            ``OPT`` positions continue the count: an ``OPT`` follows backward number ``n`` when
            ``(backward_offset + n) % a == 0``.
        tied: the first and last stage share tied weights (an embedding and an LM head); see [Note: tied weights].
        virtual_stages: ``v`` chunks per device ([Note: virtual stages] in virtual.py): ``num_stages`` devices run
            ``v * num_stages`` pipeline stages; ``"interleaved"`` and ``"bfs"`` are the flush schedules for it
            (with ``v = 1`` the same lists as ``"1f1b"`` and ``"gpipe"``), ``"paci"`` runs over the chunks too.
        placement: ``"loop"`` (chunk ``c`` on device ``c mod P``) or ``"v"`` (zig-zag: the first and last chunk on
            device 0).
        whole_batch: the loss is computed once over each whole mini-batch on the last stage: every warm-up grows
            by ``m - 1`` ([Note: whole-batch order]); ``"paci"``, ``"1f1b"`` and ``"gpipe"`` with one stage per
            device.

    Raises:
        ValueError / TypeError: naming the argument, its value and the fix.
    """
    if name not in SCHEDULE_NAMES + VIRTUAL_SCHEDULE_NAMES:
        names = SCHEDULE_NAMES + VIRTUAL_SCHEDULE_NAMES
        raise ValueError(f"`schedule` must be one of {', '.join(map(repr, names))}, got {name!r}.")
    _check_positive("num_stages", num_stages, "Use one stage per pipeline process, e.g. num_stages=4.")
    _check_positive("num_microbatches", num_microbatches, "Split each mini-batch into at least one micro-batch.")
    _check_positive("accumulation", accumulation, "Use accumulation=num_microbatches for one step per mini-batch.")
    _check_positive("num_minibatches", num_minibatches, "Run at least one mini-batch.")
    if isinstance(backward_offset, bool) or not isinstance(backward_offset, int) or backward_offset < 0:
        raise ValueError(f"`backward_offset` must be an int >= 0, got {backward_offset!r}.")

    _check_positive("virtual_stages", virtual_stages, "Use virtual_stages=1 for one stage per device.")
    devices = stage_devices(num_stages, virtual_stages, placement)
    if whole_batch and (virtual_stages > 1 or name not in ("paci", "1f1b", "gpipe")):
        raise ValueError(f"a whole-batch loss (`whole_batch_loss`) runs under schedule='paci', '1f1b' or 'gpipe' with "
                         f"one stage per device, got schedule={name!r} with virtual_stages={virtual_stages}: use one "
                         f"of those schedules and virtual_stages=1.")
    if virtual_stages > 1:
        return _build_virtual(name, num_stages, num_microbatches, accumulation, num_minibatches, backward_offset,
                              tied, devices, placement)
    if name == "layered" and accumulation % num_microbatches:
        raise ValueError(f"`schedule='layered'` steps after whole mini-batches (a stage's backward runs block by block "
                         f"over all of a mini-batch's micro-batches): `accumulation` must be a multiple of "
                         f"`microbatches` ({num_microbatches}), got {accumulation}.")
    with _collector_paused():
        lowered = [
            _lower(_compute_order(name, num_stages, stage, num_microbatches, num_minibatches,
                                  extra=num_microbatches - 1 if whole_batch else 0), num_stages,
                   accumulation, backward_offset)
            if name != "layered" else
            _lower_layered(stage, num_stages, num_microbatches, num_minibatches, accumulation, backward_offset)
            for stage in range(num_stages)
        ]
        schedule = Schedule(
            name=name,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            accumulation=accumulation,
            num_minibatches=num_minibatches,
            actions=tuple(lowered),
        )
        if tied and num_stages > 1:
            schedule = _add_tied_exchange(schedule)
    return schedule


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the lists are built.

    A large build allocates millions of actions. ``Action`` is a tuple subclass, so the collector tracks every one
    (it only stops tracking plain tuples of atomic values), and each one holds an ``ActionKind`` member, which it
    visits too. Every burst of allocations then starts a collection that walks all of them, and every other live
    object too (torch's, in a training process). These collections free nothing, because the lists hold no
    reference cycles. They took about 80% of the time of ``build_schedule("paci", 64, 64, 64, 100)``: 3.0-3.4 s before
    kinds were Enum members, 3.7-4.1 s after, 0.7 s without the collections. The previous state is restored, so
    a caller that had disabled the collector keeps it disabled.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _add_tied_exchange(schedule: Schedule) -> Schedule:
    """[Note: tied weights]
    A weight used on the first and the last stage (GPT-2's ``wte`` / ``lm_head``) is owned by stage 0, which applies
    update ``k`` with the gradient of *both* uses: before its ``k``-th ``OPT`` it receives the last stage's
    tied-weight gradient of that stage's ``k``-th window (``RECV_T``), after it sends the updated weights
    (``SEND_T``). The last stage keeps a replica that its own optimizer never steps: right before its ``k``-th
    ``OPT`` it sends the replica's gradient (final then; its update never reads it, and nothing of the update -- a
    collective such as gradient clipping's global norm -- can then hold stage 0's update back), and it installs
    stage 0's weights ``k`` (``RECV_T``) right before its first action of the call after the one in which stage 0
    sent them -- so the receive never waits for a later call and no flush or global collective is added. The replica
    therefore goes through exactly stage 0's sequence of weights, some updates late: under a flush schedule it is up
    to date before the next mini-batch's first forward (exact single-device semantics); under ``"paci"`` the last
    stage uses weights one or two updates old. The drain at the end of a stream installs every outstanding update,
    so both copies are equal afterwards.
    """
    n = schedule.num_stages
    last = n - 1
    rounds = assign_rounds(schedule)
    first, tail = list(schedule.actions[0]), list(schedule.actions[last])
    first_rounds, tail_rounds = rounds[0], rounds[last]
    new = tuple.__new__
    # stage 0: RECV_T(k) before its k-th OPT, SEND_T(k) after it; remember the round of each SEND_T
    out0: list[Action] = []
    sent_round: list[int] = []
    k = 0
    for action, rnd in zip(first, first_rounds):
        if action.kind is OPT:
            k += 1
            out0 += [new(Action, (0, RECV_T, k)), action, new(Action, (0, SEND_T, k))]
            sent_round.append(rnd)
        else:
            out0.append(action)
    # last stage: SEND_T(k) before its k-th OPT; RECV_T(k) before the first action of a round > sent_round[k]
    out_last: list[Action] = []
    pending = 0  # next weights update to install (0-based into sent_round)
    k = 0
    for action, rnd in zip(tail, tail_rounds):
        if action.kind is OPT:  # the window's tied gradient is final: out before the update's own work
            k += 1
            out_last.append(new(Action, (last, SEND_T, k)))
        out_last.append(action)
        # right after the activation receive that opens a later round, before that forward runs
        while pending < len(sent_round) and rnd > sent_round[pending] and action.kind is RECV_F:
            pending += 1
            out_last.append(new(Action, (last, RECV_T, pending)))
    while pending < len(sent_round):
        pending += 1
        out_last.append(new(Action, (last, RECV_T, pending)))
    lists = list(schedule.actions)
    lists[0], lists[last] = tuple(out0), tuple(out_last)
    return Schedule(schedule.name, n, schedule.num_microbatches, schedule.accumulation, schedule.num_minibatches,
                    tuple(lists))


def _one_f_one_b(stage: int, num_stages: int, first: int, count: int, extra: int = 0) -> list[Unit]:
    """1F1B of ``stage`` over micro-batches ``first .. first+count-1`` with warm-up ``N-1-s`` (``+ extra``: [Note:
    whole-batch order]), capped by ``count``."""
    warmup = min(num_stages - 1 - stage + extra, count)
    order: list[Unit] = [(stage, F, first + i) for i in range(warmup)]
    for i in range(count - warmup):
        order.append((stage, F, first + warmup + i))
        order.append((stage, B, first + i))
    order.extend((stage, B, first + i) for i in range(count - warmup, count))
    return order


def _compute_order(name: str, num_stages: int, stage: int, num_microbatches: int, num_minibatches: int, *,
                   extra: int = 0) -> list[Unit]:
    if name == "paci":  # see [Note: PACI order]: one 1F1B over the whole stream, no flush
        return _one_f_one_b(stage, num_stages, 0, num_microbatches * num_minibatches, extra)
    order: list[Unit] = []
    for minibatch in range(num_minibatches):
        first = minibatch * num_microbatches
        if name in ("1f1b", "interleaved"):  # one chunk per device: interleaved 1F1B is 1F1B, bfs is gpipe
            order += _one_f_one_b(stage, num_stages, first, num_microbatches, extra)
        else:  # gpipe
            order += [(stage, F, first + i) for i in range(num_microbatches)]
            order += [(stage, B, first + i) for i in range(num_microbatches)]
    return order


def _lower_layered(stage: int, num_stages: int, m: int, num_minibatches: int, accumulation: int,
                   backward_offset: int) -> tuple[Action, ...]:
    """``"layered"``: per mini-batch, ``"gpipe"``'s forwards, then every gradient received, every backward, every
    gradient sent ([Note: layered backward]), and an ``OPT`` where the count of backwards reaches a window's end."""
    has_prev, has_next = stage > 0, stage < num_stages - 1
    out: list[Action] = []
    done = backward_offset
    for minibatch in range(num_minibatches):
        batch = range(minibatch * m, (minibatch + 1) * m)
        for mb in batch:
            out += [Action(stage, RECV_F, mb)] * has_prev + [Action(stage, F, mb)]
            out += [Action(stage, SEND_F, mb)] * has_next
        out += [Action(stage, RECV_B, mb) for mb in batch if has_next]
        out += [Action(stage, B, mb) for mb in batch]
        out += [Action(stage, SEND_B, mb) for mb in batch if has_prev]
        for _ in batch:
            done += 1
            if done % accumulation == 0:
                out.append(Action(stage, OPT, None))
    return tuple(out)


def _build_virtual(name: str, num_devices: int, m: int, accumulation: int, num_minibatches: int,
                   backward_offset: int, tied: bool, devices: tuple[int, ...], placement: str) -> Schedule:
    """``v > 1`` chunks per device ([Note: virtual stages]): the device orders of virtual.py, lowered per chunk."""
    v = len(devices) // num_devices
    if name not in ("paci", "interleaved", "bfs"):
        other = {"1f1b": "interleaved", "gpipe": "bfs"}.get(name)
        fix = f"use schedule={other!r}, its order over chunks" if other else "use 'interleaved', 'bfs' or 'paci'"
        raise ValueError(f"`schedule={name!r}` runs one stage per device, got `virtual_stages={v}`: {fix}, or "
                         f"virtual_stages=1.")
    if name != "bfs" and placement == "loop" and m % num_devices:
        raise ValueError(f"`schedule={name!r}` with `placement='loop'` runs micro-batches in groups of one per device "
                         f"through each chunk (Megatron's interleaved order): `microbatches` ({m}) must be a multiple "
                         f"of the devices ({num_devices}). Use microbatches={-(-m // num_devices) * num_devices}, "
                         f"schedule='bfs', or placement='v'.")
    if tied and devices[0] != devices[-1]:
        raise ValueError(f"tied weights with `virtual_stages={v}` need the first and the last chunk on one device: "
                         f"use placement='v' with an even virtual_stages (got placement={placement!r}).")
    with _collector_paused():
        orders = device_orders(name, devices, m, num_minibatches, _one_f_one_b, placement)
        lowered = tuple(_lower(order, len(devices), accumulation, backward_offset) for order in orders)
    # tied weights on one device: no exchange, the device's two chunks share the parameter (see the runtime)
    return Schedule(name, len(devices), m, accumulation, num_minibatches, lowered, placement=devices)


def _lower(order: Iterable[Unit], num_stages: int, accumulation: int, backward_offset: int) -> tuple[Action, ...]:
    """Passes 2 and 3 in one sweep, over a device's units (a stage and an ``F`` or ``B``; several chunks with virtual
    stages): an ``OPT`` of stage ``s`` after every ``accumulation``-th backward of ``s`` (counting continues from
    ``backward_offset``) and the messages each unit implies with its own stage's neighbours. A ``RECV`` goes right
    before the action that needs it; a ``SEND`` right after the action that produced it and before a following
    ``OPT``, so an optimizer step never delays a neighbour."""
    new = tuple.__new__  # about twice as fast as Action(...): large simulations build millions of actions
    last = num_stages - 1
    done = [backward_offset] * num_stages
    out: list[Action] = []
    append = out.append
    for stage, kind, microbatch in order:
        if kind is F:
            if stage > 0:
                append(new(Action, (stage, RECV_F, microbatch)))
            append(new(Action, (stage, F, microbatch)))
            if stage < last:
                append(new(Action, (stage, SEND_F, microbatch)))
        else:
            if stage < last:
                append(new(Action, (stage, RECV_B, microbatch)))
            append(new(Action, (stage, B, microbatch)))
            if stage > 0:
                append(new(Action, (stage, SEND_B, microbatch)))
            done[stage] += 1
            if done[stage] % accumulation == 0:
                append(new(Action, (stage, OPT, None)))
    return tuple(out)
