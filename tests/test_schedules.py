"""Schedules as data: builders, text form, validator (no process group needed)."""

from __future__ import annotations

import math

import pytest

from lightning_paci.schedules import (
    Action,
    ActionKind,
    ScheduleError,
    build_schedule,
    drift_bound,
    parse_actions,
    stage_lists_from_text,
    static_drift,
    validate_schedule,
)


@pytest.mark.parametrize("name", ["paci", "1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages,num_microbatches,accumulation",
                         [(1, 1, 1), (2, 4, 4), (4, 4, 2), (4, 3, 3), (8, 8, 8), (8, 4, 4)])
def test_built_schedules_validate_and_run_every_microbatch_once(name, num_stages, num_microbatches, accumulation):
    schedule = build_schedule(name, num_stages, num_microbatches, accumulation, 3)
    validate_schedule(schedule)
    total = num_microbatches * 3
    for stage in range(num_stages):
        compute = schedule.compute_actions(stage)
        assert sorted(a.microbatch for a in compute if a.kind == "F") == list(range(total))
        assert sorted(a.microbatch for a in compute if a.kind == "B") == list(range(total))
        assert sum(a.kind == "OPT" for a in compute) == total // accumulation


def test_same_arguments_give_the_same_lists():
    assert build_schedule("paci", 4, 4, 2, 5) == build_schedule("paci", 4, 4, 2, 5)
    assert build_schedule("paci", 4, 4, 2, 5).actions != build_schedule("1f1b", 4, 4, 2, 5).actions


def test_paci_golden_two_stages():
    schedule = build_schedule("paci", 2, 2, 2, 2)
    assert schedule.stage_text(0) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0OPT 0F3 0SEND_F3 0RECV_B2 0B2 "
        "0RECV_B3 0B3 0OPT"
    )
    assert schedule.stage_text(1, compute_only=True) == "1F0 1B0 1F1 1B1 1OPT 1F2 1B2 1F3 1B3 1OPT"


def test_1f1b_flushes_between_minibatches_and_paci_does_not():
    # stage 0 of 2: 1f1b finishes both backwards of mini-batch 0 before forwarding micro-batch 2
    flush = build_schedule("1f1b", 2, 2, 2, 2).stage_text(0, compute_only=True)
    assert flush == "0F0 0F1 0B0 0B1 0OPT 0F2 0F3 0B2 0B3 0OPT"
    nonflush = build_schedule("paci", 2, 2, 2, 2).stage_text(0, compute_only=True)
    assert nonflush.index("0F2") < nonflush.index("0B1")


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert build_schedule("gpipe", 2, 3, 3, 1).stage_text(1, compute_only=True) == "1F0 1F1 1F2 1B0 1B1 1B2 1OPT"


@pytest.mark.parametrize("token", ["1F0", "0SEND_F2", "3RECV_B11", "2OPT", "12B7", "0SEND_B3", "5RECV_F0"])
def test_action_text_round_trips(token):
    assert str(Action.from_str(token)) == token


def test_whole_schedule_text_round_trips():
    schedule = build_schedule("paci", 4, 4, 4, 2)
    for stage in range(4):
        assert tuple(parse_actions(schedule.stage_text(stage))) == schedule.actions[stage]


@pytest.mark.parametrize("kind", list(ActionKind))
def test_every_action_kind_round_trips_through_its_text(kind):
    microbatch = None if kind is ActionKind.OPT else 7
    action = Action(3, kind, microbatch)
    text = str(action)
    assert text == f"3{kind.value}{'' if microbatch is None else 7}"
    parsed = Action.from_str(text)
    assert parsed == action and parsed.kind is kind  # the member itself, not an equal string


def test_action_kinds_are_str_enum_members_equal_to_their_values():
    assert Action.from_str("0F1").kind is ActionKind.F
    assert str(Action(1, ActionKind.SEND_F, 0)) == "1SEND_F0" and str(Action(3, ActionKind.OPT)) == "3OPT"
    for kind in ActionKind:
        assert isinstance(kind, str) and kind == kind.value and hash(kind) == hash(kind.value)
        assert str(kind) == f"{kind}" == kind.value and f"{kind:>8}" == f"{kind.value:>8}"
        assert ActionKind(kind.value) is kind
    assert {"F": 1}[ActionKind.F] == 1 and ActionKind.B in {"B"} and "OPT" in {ActionKind.OPT}
    import lightning_paci.schedules as schedules

    for name in ("F", "B", "OPT", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_T", "RECV_T"):
        assert getattr(schedules, name) is ActionKind[name]


@pytest.mark.parametrize("name", ["paci", "1f1b", "gpipe"])
def test_built_lists_hold_the_kind_members(name):
    schedule = build_schedule(name, 3, 2, 3, 3, backward_offset=1, tied=True)
    kinds = {action.kind for actions in schedule.actions for action in actions}
    assert kinds == set(ActionKind)  # every kind occurs: tied messages, OPT, both directions
    members = set(map(id, ActionKind))
    assert all(id(action.kind) in members for actions in schedule.actions for action in actions)


@pytest.mark.parametrize("token,match", [("F0", "Cannot parse"), ("1X0", "Cannot parse"), ("1OPT3", "OPT takes no"),
                                         ("1F", "needs a micro-batch")])
def test_bad_tokens_are_rejected(token, match):
    with pytest.raises(ValueError, match=match):
        Action.from_str(token)


@pytest.mark.parametrize("num_stages", [2, 4, 8, 16])
@pytest.mark.parametrize("accumulation", [1, 2, 4, 8, 16])
def test_paci_drift_equals_the_bound_exactly(num_stages, accumulation):
    # long enough that every stage reaches steady state with every phase of the step counter: K = 4 + 2a/m
    num_microbatches = num_stages
    num_minibatches = max(4, math.ceil(4 * accumulation / num_microbatches) + 2)
    schedule = build_schedule("paci", num_stages, num_microbatches, accumulation, num_minibatches)
    for stage in range(num_stages):
        gaps = static_drift(schedule.actions[stage])
        expected = math.ceil((num_stages - 1 - stage) / accumulation)
        assert max(gaps.values()) == drift_bound(num_stages, stage, accumulation) == expected


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 2), (4, 4), (8, 8), (4, 8), (8, 4)])
def test_flush_schedules_have_no_drift(name, num_stages, num_microbatches):
    schedule = build_schedule(name, num_stages, num_microbatches, num_microbatches, 4)
    for stage in range(num_stages):
        assert set(static_drift(schedule.actions[stage]).values()) == {0}


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(num_stages=0), "num_stages"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(accumulation=0), "accumulation"),
        (dict(num_minibatches=0), "num_minibatches"),
        (dict(name="zb"), "schedule"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, argument):
    args = dict(name="paci", num_stages=4, num_microbatches=4, accumulation=4, num_minibatches=2) | kwargs
    with pytest.raises(ValueError, match=f"`{argument}`") as info:
        build_schedule(**args)
    assert "got" in str(info.value)


def test_non_int_argument_raises_type_error():
    with pytest.raises(TypeError, match="`num_microbatches` must be an int"):
        build_schedule("paci", 4, 2.5, 4, 2)  # type: ignore[arg-type]


def test_uneven_splits_that_can_run_are_accepted():
    # fewer micro-batches than stages, and an accumulation that does not divide the stream
    for name in ("paci", "1f1b", "gpipe"):
        validate_schedule(build_schedule(name, 8, 3, 5, 3))


def test_validator_rejects_backward_before_forward_with_a_grid():
    lists = stage_lists_from_text(["0B0 0F0"])
    with pytest.raises(ScheduleError, match="backward of micro-batch 0 runs before its forward") as info:
        validate_schedule(lists)
    assert "<-- ERROR HERE" in str(info.value)
    assert "stage 0" in str(info.value)


def test_validator_rejects_receive_without_send():
    lists = stage_lists_from_text(["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1"])
    with pytest.raises(ScheduleError, match="no matching send"):
        validate_schedule(lists)


def test_validator_finds_a_pure_circular_wait():
    lists = stage_lists_from_text([
        "0F0 0F1 0RECV_B0 0SEND_F0 0SEND_F1 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ])
    with pytest.raises(ScheduleError, match="deadlock: stage 0 waits at 0RECV_B0, stage 1 waits at 1RECV_F0"):
        validate_schedule(lists)


@pytest.mark.parametrize("name", ["paci", "1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_tied_exchange_validates_and_every_update_reaches_the_replica(name, num_stages):
    schedule = build_schedule(name, num_stages, 4, 4, 5, tied=True)
    validate_schedule(schedule)
    last = num_stages - 1
    sends = [a.microbatch for a in schedule.actions[0] if a.kind == "SEND_T"]
    installs = [a.microbatch for a in schedule.actions[last] if a.kind == "RECV_T"]
    assert sends == installs == list(range(1, 6))
    # stage 0 receives the last stage's gradient right before each of its optimizer steps
    text = schedule.stage_text(0)
    assert all(f"0RECV_T{k} 0OPT 0SEND_T{k}" in text for k in range(1, 6))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_flush_schedules_install_tied_weights_before_the_next_minibatch(name):
    schedule = build_schedule(name, 4, 4, 4, 3, tied=True)
    text = schedule.stage_text(3)
    assert "3RECV_F4 3RECV_T1 3F4" in text and "3RECV_F8 3RECV_T2 3F8" in text


def test_paci_installs_tied_weights_without_waiting_for_a_later_call():
    from lightning_paci.schedules import assign_rounds, message_key

    schedule = build_schedule("paci", 4, 4, 4, 6, tied=True)
    rounds = assign_rounds(schedule)
    sent = {message_key(a, 4): r for a, r in zip(schedule.actions[0], rounds[0]) if a.kind == "SEND_T"}
    installs = [(action, rnd) for action, rnd in zip(schedule.actions[3], rounds[3])
                if action.kind == "RECV_T" and action.microbatch < 5]
    assert [action.microbatch for action, _ in installs] == [1, 2, 3, 4]  # the updates of the first 4 mini-batches
    for action, rnd in installs:
        assert rnd > sent[message_key(action, 4)]  # sent in an earlier call


def test_build_pauses_the_garbage_collector_only_while_it_runs():
    import gc

    assert gc.isenabled()
    build_schedule("paci", 4, 4, 4, 2, tied=True)
    assert gc.isenabled()
    gc.disable()
    try:
        build_schedule("paci", 4, 4, 4, 2)
        assert not gc.isenabled()  # a caller that disabled it keeps it disabled
    finally:
        gc.enable()
