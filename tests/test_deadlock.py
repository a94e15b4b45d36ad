"""The strict deadlock model of NCCL messaging ([Note: deadlock model]): it finds 0.1's deadlock and the batch-0 hang
of lazily created communicators ([Note: communicator creation]), and proves the communicator layout and setup the
runtime uses free of both for every list the builder makes (no process group needed)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_paci.engine.streams.driver import closing_actions
from lightning_paci.engine.transport import nccl_emulation
from lightning_paci.integration.stage.evaluation import forward_only_actions
from lightning_paci.schedules import (
    SCHEDULE_NAMES,
    ScheduleError,
    build_schedule,
    check_deadlock_free,
    check_group_creation,
    communicator,
    layout_communicators,
    setup_groups,
    stage_lists_from_text,
    validate_schedule,
)

from helpers import fit
from models import SequentialMLP, regression_loader


@pytest.mark.parametrize("name", ["paci", "1f1b"])
@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_one_shared_communicator_deadlocks_in_the_1f1b_steady_state(name, num_stages):
    # 0.1's layout: activations and gradients on one communicator; gloo's buffered sends hid it
    schedule = build_schedule(name, num_stages, 8, 8, 2)
    validate_schedule(schedule)  # the buffered-send model accepts it
    with pytest.raises(ScheduleError, match="deadlock under strict send-receive pairing with the 'shared'") as info:
        check_deadlock_free(schedule, layout="shared")
    # the cycle named: a stage's gradient receive queued behind its own activation send
    assert "waits for RECV_B" in str(info.value) and "first in its communicators: SEND_F" in str(info.value)
    assert "<-- ERROR HERE" in str(info.value)


def test_gpipe_alone_survives_the_shared_communicator():
    # all forwards, then all backwards: no stage ever has a send and a receive to opposite sides pending
    check_deadlock_free(build_schedule("gpipe", 4, 8, 8, 2), layout="shared")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_lazily_created_communicators_deadlock_at_batch_0_with_receives_posted_ahead(name, num_stages):
    # NCCL left to itself ([Note: communicator creation]): stage 0 posts its first RECV_B on B(1->0) and waits
    # there for stage 1, which posted its first RECV_F on F(0->1) and waits for stage 0
    schedule = build_schedule(name, num_stages, 8, 8 if name == "layered" else 4, 3)
    check_deadlock_free(schedule, connect="eager")  # gloo's groups, connected when created: no deadlock
    check_deadlock_free(schedule, connect="lazy", posted_ahead=False)  # the lists alone meet in order
    with pytest.raises(ScheduleError, match="deadlock under strict send-receive pairing with the 'directed' "
                                            "communicator layout and 'lazy' communicator creation") as info:
        check_deadlock_free(schedule, connect="lazy")
    text = str(info.value)
    assert "stage 0 waits for the creation of communicator ('p2p', 0, 'B', 1, 0)" in text
    assert "stage 1 waits for the creation of communicator ('p2p', 0, 'F', 0, 1)" in text
    check_deadlock_free(schedule, connect="warm")  # the runtime: all connected at setup, in the layout's order


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_lazily_created_tied_communicators_deadlock_even_without_posting(name):
    # stage 0's first SEND_T creates T(0->3) and waits for stage 3, which waits for an activation stage 0 has not
    # sent yet
    schedule = build_schedule(name, 4, 8, 8, 3, tied=True)
    with pytest.raises(ScheduleError, match=r"stage 0 waits for the creation of communicator \('p2p', 0, 'T', 0, 3\)"):
        check_deadlock_free(schedule, connect="lazy", posted_ahead=False)
    check_deadlock_free(schedule, connect="warm")


def _accumulations(m: int) -> list[int]:
    """Every a <= 16 with PACI_DEADLOCK_FULL_GRID=1; else a = 1, m, 16, a multiple of m above it, and two values
    coprime with most m (3 and 7): the window ends at every backward, at the mini-batch's end, past it, and in its
    middle with every phase."""
    if os.environ.get("PACI_DEADLOCK_FULL_GRID"):
        return list(range(1, 17))
    return sorted({1, 3, 7, m, 2 * m if 2 * m <= 16 else m, 16})


def test_every_built_list_set_is_deadlock_free_under_the_directed_layout():
    """paci, 1f1b, gpipe, layered (its windows whole mini-batches); N <= 8, m <= 16, the accumulations of
    ``_accumulations`` (all a <= 16 with PACI_DEADLOCK_FULL_GRID=1); tied weights when N > 1; one and two
    data-parallel replicas (the gradient all-reduce before every OPT); plus the epoch-end closing step."""
    cases = [(name, n, m, a) for name, n, m in itertools.product(SCHEDULE_NAMES, range(1, 9), range(1, 17))
             for a in _accumulations(m) if name != "layered" or a % m == 0]  # layered: whole mini-batches
    for name, n, m, a in cases:
        schedule = build_schedule(name, n, m, a, 2, tied=n > 1)
        lists = [list(actions) + closing_actions(s, n, tied=n > 1) for s, actions in enumerate(schedule.actions)]
        # as the runtime runs them: communicators connected at setup, receives posted ahead
        check_deadlock_free(lists, layout="directed", replicas=2 if (m + a) % 2 else 1, connect="warm",
                         posted_ahead=True)
    # the grid's size, so that it cannot shrink unnoticed: 6544 list sets in full, 2224 by default
    assert len(cases) == (3 * 8 * 16 * 16 + 8 * sum(16 // m for m in range(1, 17))
                          if os.environ.get("PACI_DEADLOCK_FULL_GRID") else 2224)


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_streams_after_a_drain_and_replicas_are_deadlock_free(replicas, offset):
    for name in SCHEDULE_NAMES:
        schedule = build_schedule(name, 4, 6, 12 if name == "layered" else 7, 3, backward_offset=offset, tied=True)
        validate_schedule(schedule, communicators="directed", replicas=replicas)


@pytest.mark.parametrize("replicas", [1, 2])
def test_lists_cut_into_the_runtimes_calls_are_deadlock_free(replicas):
    # a Schedule is posted ahead per call (its rounds), as ReceivesAhead does within each Lightning call
    for name, n, m, a in itertools.product(SCHEDULE_NAMES, (2, 3, 8), (1, 4, 8), (1, 3, 8)):
        if name != "layered" or a % m == 0:
            check_deadlock_free(build_schedule(name, n, m, a, 4, tied=True), replicas=replicas)


@pytest.mark.parametrize("num_stages", [1, 2, 8])
def test_evaluation_lists_are_deadlock_free(num_stages):
    lists = [forward_only_actions(s, num_stages, 5) for s in range(num_stages)]
    validate_schedule(lists, communicators="directed", replicas=2)


def test_messages_received_in_another_order_than_sent_are_refused():
    # the buffered model pairs messages by their keys; NCCL pairs the first send with the first receive
    lists = stage_lists_from_text([
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B1 1SEND_B1 1B0 1SEND_B0",
    ])
    validate_schedule(lists)
    with pytest.raises(ScheduleError, match="NCCL would pair them, the messages are in different orders"):
        check_deadlock_free(lists)


def test_replicas_reductions_are_modelled_where_the_runtime_issues_them():
    # every replica of a stage must reach its all-reduce before any of them steps; the model counts the updates
    lists = stage_lists_from_text([
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0OPT 0RECV_B1 0B1 0OPT",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT",
    ])
    for replicas in (1, 2, 3):
        check_deadlock_free(lists, replicas=replicas)
    # a stage that is missing its partner's message is reported with every replica's wait
    with pytest.raises(ScheduleError, match=r"stage 1 \(replica 1\) waits for RECV_F1 \(0->1\)"):
        check_deadlock_free(stage_lists_from_text(["0F0 0SEND_F0 0OPT", "1RECV_F0 1F0 1OPT 1RECV_F1"]), replicas=2)


def test_directed_layout_gives_each_direction_of_each_pair_its_own_communicator():
    seen = {communicator("directed", c, s, d, r) for r in (0, 1) for c, s, d in
            [("F", 0, 1), ("B", 1, 0), ("F", 1, 2), ("B", 2, 1), ("T", 0, 2), ("T", 2, 0)]}
    assert len(seen) == 12
    assert communicator("shared", "F", 0, 1) == communicator("shared", "B", 1, 0)


def test_bad_layout_and_replicas_are_refused():
    with pytest.raises(ValueError, match="`layout` must be one of 'directed', 'shared', got 'ring'"):
        check_deadlock_free(build_schedule("paci", 2, 2, 2, 1), layout="ring")
    with pytest.raises(ValueError, match="`replicas` must be an int >= 1, got 0"):
        check_deadlock_free(build_schedule("paci", 2, 2, 2, 1), replicas=0)
    with pytest.raises(ValueError, match="`connect` must be one of 'eager', 'lazy', 'warm', got 'late'"):
        check_deadlock_free(build_schedule("paci", 2, 2, 2, 1), connect="late")


def test_the_setups_group_creation_is_deadlock_free_on_a_bound_world():
    # [Note: group creation]: every pipeline length and replica count the grid holds (only NCCL runs bind the world)
    for num_stages, replicas in itertools.product(range(2, 9), range(1, 4)):
        check_group_creation(setup_groups(num_stages, replicas, "nccl"), num_stages * replicas)


def test_per_link_gloo_header_groups_deadlock_at_three_stages_and_more():
    # the header groups as they were made up to 8b97681: after the NCCL groups, one 2-rank gloo group per link
    def per_link(num_stages: int) -> list:
        nccl = [g for g in setup_groups(num_stages, 1, "nccl") if g[0][0] == "p2p"]
        return nccl + [(("header",) + key[1:], members, "gloo") for key, members, _ in nccl]

    check_group_creation(per_link(2), 2)  # no rank outside a group: why 2-stage runs never showed it
    for num_stages in (3, 4, 8):
        with pytest.raises(ScheduleError, match=r"ranks \[2\] wait in the no-color split" if num_stages == 3
                           else "no-color split"):
            check_group_creation(per_link(num_stages), num_stages)
    check_group_creation(per_link(4), 4, bound=False)  # gloo alone (an unbound world) connects them


class _WriteGroups(Callback):
    """Every rank writes the process groups its strategy created for the pipeline's messages, and under the NCCL
    emulation every group creation it saw."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        groups = {repr(comm): dist.get_process_group_ranks(group) for comm, group in strategy.process_groups.p2p.items()
                  if dist.get_rank() in dist.get_process_group_ranks(group)}
        ranks = [strategy.rank_of(s) for s in range(strategy.num_stages)]
        emulation = nccl_emulation.emulation()
        created = [[list(members), backend] for members, backend in emulation.created] if emulation else None
        (self.directory / f"groups{dist.get_rank()}.json").write_text(
            json.dumps({"groups": groups, "ranks": ranks, "created": created}))


@pytest.mark.distributed
def test_the_runtime_creates_exactly_the_layout_the_model_proves(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")  # the GPU path: NCCL groups and the host group
    torch.manual_seed(0)
    fit(SequentialMLP(), regression_loader(num_batches=2), devices=3, max_steps=2, microbatches=4,
        callbacks=[_WriteGroups(tmp_path)])
    expected = layout_communicators("directed", 3)
    assert len(expected) == 2 * 2 + 2
    for rank in range(3):
        record = json.loads((tmp_path / f"groups{rank}.json").read_text())
        ranks = record["ranks"]
        mine = {repr(comm): sorted(ranks[s] for s in members) for comm, members in expected.items()
                if rank in {ranks[s] for s in members}}
        assert record["groups"] == mine  # each communicator: its two stages' ranks, nothing shared
        # the groups created, in order, are the list the group-creation model checks
        modelled = [[sorted(ranks[m] for m in members), backend] for _, members, backend in setup_groups(3, 1, "nccl")]
        assert record["created"] == modelled
