"""A tied GPT-2 under the V placement of virtual stages: the embedding (chunk 0) and the LM head (the last chunk)
on device 0 use one Parameter object, so there is no tied-weight exchange and no lag. Flush schedules equal one
device in float64; "paci" over real process groups equals the one-process executor of the same devices' lists,
and every chunk's measured drift is the one its list states. [Note: virtual stages]"""

from __future__ import annotations

import copy
import functools
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_paci.engine.runtime.microbatch import loss_scale_for, split_microbatches
from lightning_paci.engine.runtime.reference import run_device_lists
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.runtime.virtual_stages import ChunkComm, DeviceRuntime, local_network
from lightning_paci.engine.transport.local_mailbox import LocalComm
from lightning_paci.engine.transport.point_to_point import DistComm
from lightning_paci.integration.stage.lightning_program import LightningStageProgram
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.partition import carve_stage, plan_partition, share_tied_weights
from lightning_paci.schedules import (
    RECV_T,
    SEND_B,
    SEND_F,
    SEND_T,
    build_schedule,
    chunk_drift_bounds,
    layout_communicators,
    static_drift,
)

from helpers import run_forked_ranks
from models import HFCausalLM, token_loader

pytestmark = pytest.mark.distributed

P, V, M, K, LR = 4, 2, 4, 4, 0.5


def _model() -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM("gpt2", layers=P * V, tied=True).double()


def _batches() -> list[list[torch.Tensor]]:
    return [list(batch) for batch in token_loader(num_batches=K, batch_size=8)]


def _device_chunks(schedule: Any, device: int, comm_of: Any) -> tuple[dict[int, StageRuntime], dict[int, Any]]:
    """This device's chunks: carved copies, the tied weights shared where the first and last chunk meet, one
    runtime each (``comm_of(stage)`` its transport), every micro-batch added."""
    model = _model()
    num_stages = schedule.num_stages
    plan = plan_partition(model, num_stages, partition="parameters")
    assert plan.tied, "the tied GPT-2 should tie its embedding and head"
    mine = [s for s in range(num_stages) if schedule.devices[s] == device]
    modules = {s: copy.deepcopy(model) for s in mine}
    carves = {s: carve_stage(modules[s], plan, s) for s in mine}
    shared = share_tied_weights(modules[0], modules[num_stages - 1], plan) if {0, num_stages - 1} <= set(mine) else []
    runtimes = {}
    for s in mine:
        params = list(modules[s].parameters())
        optimizer = StageOptimizer(torch.optim.SGD(params, lr=LR), params,
                                   exclude=shared if s == num_stages - 1 else ())
        runtime = StageRuntime(s, num_stages, LightningStageProgram(modules[s], carves[s]), comm_of(s), optimizer,
                               loss_scale=1.0)
        runtime.begin_stream(static_drift(schedule.stage_actions(s)).__getitem__, 0,
                             loss_scale_for(schedule.accumulation))
        for k, batch in enumerate(_batches()):
            for i, part in enumerate(split_microbatches(batch, M)):
                runtime.add_microbatch(k * M + i, part, k)
        runtimes[s] = runtime
    return runtimes, modules


def _rank(rank: int, path: str, errors: Any, *, name: str, a: int, out: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=P,
                                timeout=timedelta(seconds=30))
        schedule = build_schedule(name, P, M, a, K, virtual_stages=V, placement="v", tied=True)
        groups = {key: dist.new_group(list(members)) for key, members in
                  layout_communicators("directed", schedule.num_stages, 1, schedule.devices).items()}
        mine = [s for s in range(schedule.num_stages) if schedule.devices[s] == rank]
        local = local_network(mine, schedule.num_stages)
        remotes: dict[int, DistComm] = {}

        def comm_of(s: int) -> ChunkComm:
            remotes[s] = DistComm(list(schedule.devices), groups=groups, stage=s)
            return ChunkComm(remotes[s], local[s], frozenset(mine) - {s})

        runtimes, modules = _device_chunks(schedule, rank, comm_of)
        device = DeviceRuntime(runtimes)
        device.run(schedule.actions[rank])
        device.flush()
        torch.save({"states": {s: m.state_dict() for s, m in modules.items()},
                    "gaps": {s: dict(r.records.version_gaps.items()) for s, r in runtimes.items()},
                    "losses": dict(runtimes[schedule.num_stages - 1].records.losses.items()) if rank == 0 else {},
                    "sent": {s: (c.sent_messages, c.sent_bytes) for s, c in remotes.items()}},
                   f"{out}/{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _run(tmp_path: Path, name: str, a: int) -> list[dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    run_forked_ranks(functools.partial(_rank, name=name, a=a, out=str(out)), P, tmp_path / "rdv", timeout=90)
    return [torch.load(out / f"{d}.pt") for d in range(P)]


def _union(saved: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for device in saved:
        for state in device["states"].values():
            full.update(state)
    return full


def _assert_equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=lambda m, key=key: f"{key}: {m}")


def _remote_sends(schedule: Any, stage: int) -> int:
    """The activations and gradients stage ``stage`` sends to a chunk on another device."""
    count = 0
    for action in schedule.stage_actions(stage):
        if action.kind in (SEND_F, SEND_B):
            peer = stage + 1 if action.kind is SEND_F else stage - 1
            count += schedule.devices[peer] != schedule.devices[stage]
    return count


def _one_device() -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in _batches():
        for part in split_microbatches(batch, M):
            (model.model(input_ids=part[0], labels=part[0]).loss / M).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["interleaved", "bfs"])
def test_flush_schedules_with_the_embedding_and_head_on_one_device_equal_one_device(tmp_path: Path,
                                                                                    name: str) -> None:
    saved = _run(tmp_path, name, M)
    _assert_equal(_union(saved), _one_device())


@pytest.mark.timeout(120)
def test_paci_over_a_v_trains_a_tied_gpt2_with_no_exchange_and_the_drift_its_lists_state(tmp_path: Path) -> None:
    a = 2
    schedule = build_schedule("paci", P, M, a, K, virtual_stages=V, placement="v", tied=True)
    assert not [x for actions in schedule.actions for x in actions if x.kind in (SEND_T, RECV_T)]
    saved = _run(tmp_path, "paci", a)
    # the one-process executor of the same devices' lists (mailboxes for every link)
    endpoints = LocalComm.network(schedule.num_stages)
    devices = [_device_chunks(schedule, d, endpoints.__getitem__) for d in range(P)]
    run_device_lists([runtimes for runtimes, _ in devices], schedule.actions, schedule.num_stages)
    expected: dict[str, torch.Tensor] = {}
    for _, modules in devices:
        for module in modules.values():
            expected.update(module.state_dict())
    _assert_equal(_union(saved), expected)
    # no tied-weight message crossed a device: every chunk's bytes are activations and gradients, as many as its
    # forwards and backwards send
    for device in saved:
        for stage, (messages, _) in device["sent"].items():
            assert messages == _remote_sends(schedule, stage)
    # each chunk's measured gaps are its list's, within its bound
    bounds = chunk_drift_bounds(schedule)
    for device in saved:
        for stage, gaps in device["gaps"].items():
            assert gaps == static_drift(schedule.stage_actions(stage))
            assert max(gaps.values()) <= bounds[stage]
    losses = saved[0]["losses"]
    first, last = [losses[j] for j in range(M)], [losses[j] for j in range((K - 1) * M, K * M)]
    assert sum(last) < sum(first)  # it trains
