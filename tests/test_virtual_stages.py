"""Several stages per device, run over real gloo process groups (forked ranks): each rank carves its chunks of an
unchanged LightningModule, runs its device's list of a virtual schedule, and the result equals one device (flush
schedules) or the one-process reference executor ("paci"), in float64. [Note: virtual stages]"""

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

from lightning_paci.engine.replicas.data_parallel import GradientAverage
from lightning_paci.engine.runtime.microbatch import loss_scale_for, split_microbatches
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.runtime.virtual_stages import ChunkComm, DeviceRuntime, local_network
from lightning_paci.engine.transport.point_to_point import DistComm
from lightning_paci.integration.stage.lightning_program import LightningStageProgram
from lightning_paci.integration.stage.reference_pipeline import ReferencePipeline
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.partition import carve_stage, plan_partition
from lightning_paci.schedules import (
    activation_peaks,
    build_schedule,
    inflight_profile,
    layout_communicators,
    static_drift,
)

from helpers import run_forked_ranks
from models import SequentialMLP, reference_accumulation, regression_loader

pytestmark = pytest.mark.distributed

P, V, M, K = 4, 2, 4, 3  # devices, chunks per device, micro-batches, mini-batches


def _model() -> SequentialMLP:
    torch.manual_seed(0)
    return SequentialMLP(width=8, depth=8, lr=0.05).double()


def _batches(replicas: int) -> list[list[Any]]:
    """``[replica][k]``: mini-batch ``k`` of each replica, float64."""
    loader = list(regression_loader(num_batches=K * replicas, batch_size=8))
    batches = [[t.double() for t in batch] for batch in loader]
    return [batches[r * K:(r + 1) * K] for r in range(replicas)]


def _rank(rank: int, path: str, errors: Any, *, name: str, placement: str, replicas: int, a: int,
          out: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=P * replicas,
                                timeout=timedelta(seconds=30))
        replica, device = divmod(rank, P)
        schedule = build_schedule(name, P, M, a, K, virtual_stages=V, placement=placement)
        devices = schedule.devices
        num_stages = schedule.num_stages
        # every rank creates every group, in one order: the links', then each device's replicas
        groups = {key: dist.new_group([key[1] * P + d for d in members])
                  for key, members in layout_communicators("directed", num_stages, replicas, devices).items()}
        data_parallel = [dist.new_group([r * P + d for r in range(replicas)]) for d in range(P)]
        model = _model()
        plan = plan_partition(model, num_stages, partition="parameters")
        mine = [s for s in range(num_stages) if devices[s] == device]
        local = local_network(mine, num_stages)
        runtimes, modules = {}, {}
        for s in mine:
            module = copy.deepcopy(model)
            carve = carve_stage(module, plan, s)
            params = list(module.parameters())
            optimizer = StageOptimizer(torch.optim.SGD(params, lr=0.05), params)
            remote = DistComm([replica * P + d for d in devices], groups=groups, replica=replica, stage=s)
            comm = ChunkComm(remote, local[s], frozenset(t for t in mine if t != s))
            runtime = StageRuntime(s, num_stages, LightningStageProgram(module, carve), comm, optimizer,
                                   loss_scale=1.0)
            if replicas > 1:
                runtime.join_replicas(replica, GradientAverage(params, data_parallel[device], replicas))
            runtime.begin_stream(static_drift(schedule.stage_actions(s)).__getitem__, 0, loss_scale_for(a))
            runtime.records.measure(activation_bytes=True)
            for k, batch in enumerate(_batches(replicas)[replica]):
                for i, part in enumerate(split_microbatches(batch, M)):
                    runtime.add_microbatch(k * M + i, part, k)
            runtimes[s], modules[s] = runtime, module
        device_runtime = DeviceRuntime(runtimes)
        device_runtime.run(schedule.actions[device])
        device_runtime.flush()
        torch.save({"states": {s: modules[s].state_dict() for s in mine},
                    "chunk_peaks": {s: runtime.records.peak_activation_bytes for s, runtime in runtimes.items()},
                    "device_peak": device_runtime.peak_activation_bytes}, f"{out}/{replica}_{device}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _run(tmp_path: Path, *, name: str, placement: str = "loop", replicas: int = 1,
         a: int = M) -> list[dict[str, torch.Tensor]]:
    """Each replica's full state dict, the union of its devices' chunks (each chunk's state holds only its own
    tensors)."""
    return [state for state, _ in _run_measured(tmp_path, name=name, placement=placement, replicas=replicas, a=a)]


def _run_measured(tmp_path: Path, *, name: str, placement: str = "loop", replicas: int = 1,
                  a: int = M) -> list[tuple[dict[str, torch.Tensor], list[dict[str, Any]]]]:
    """``_run``'s state dicts, each with its devices' saved measurements."""
    out = tmp_path / "out"
    out.mkdir()
    run_forked_ranks(functools.partial(_rank, name=name, placement=placement, replicas=replicas, a=a, out=str(out)),
                     P * replicas, tmp_path / "rdv", timeout=90)
    states = []
    for replica in range(replicas):
        full: dict[str, torch.Tensor] = {}
        measured = []
        for device in range(P):
            saved = torch.load(out / f"{replica}_{device}.pt")
            for state in saved["states"].values():
                full.update(state)
            measured.append(saved)
        states.append((full, measured))
    return states


def _assert_equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["interleaved", "bfs"])
def test_flush_schedules_over_loops_equal_one_device(tmp_path: Path, name: str) -> None:
    (state,) = _run(tmp_path, name=name)
    expected = reference_accumulation(_model(), _batches(1)[0], M, K).state_dict()
    _assert_equal(state, expected)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["interleaved", "bfs"])
def test_with_two_replicas_each_equals_one_device_on_both_replicas_samples(tmp_path: Path, name: str) -> None:
    states = _run(tmp_path, name=name, replicas=2)
    per_replica = _batches(2)
    union = [[torch.cat([per_replica[0][k][i], per_replica[1][k][i]]) for i in range(2)] for k in range(K)]
    # one device over the same 2m micro-batches: replica 0's m, then replica 1's (each a quarter of its batch)
    expected = reference_accumulation(_model(), union, 2 * M, K).state_dict()
    for state in states:
        _assert_equal(state, expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_paci_over_chunks_equals_the_reference_executor(tmp_path: Path, placement: str) -> None:
    a = 2
    (state,) = _run(tmp_path, name="paci", placement=placement, a=a)
    schedule = build_schedule("paci", P, M, a, K, virtual_stages=V, placement=placement)
    model = _model()
    reference = ReferencePipeline(model, plan_partition(model, P * V, partition="parameters"),
                                  optimizer_factory=lambda module: (torch.optim.SGD(module.parameters(), lr=0.05), []))
    reference.run(schedule, _batches(1)[0], accumulation_scale=a)
    _assert_equal(state, reference.state_dict())
    # and it is not one device's result: the chunks' updates crossed micro-batches in flight
    one_device = reference_accumulation(_model(), _batches(1)[0], M, K).state_dict()
    assert any(not torch.allclose(state[k], v) for k, v in one_device.items())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "placement"), [("interleaved", "loop"), ("bfs", "loop"), ("paci", "loop"),
                                                 ("paci", "v")])
def test_each_devices_peak_activation_memory_is_the_one_its_list_predicts(tmp_path: Path, name: str,
                                                                          placement: str) -> None:
    """The bytes every chunk holds per micro-batch (its meter's peak over its peak in flight), weighted along the
    device's list (``activation_peaks``, the simulator's reading with the chunks' own sizes), give the device's
    measured peak exactly."""
    a = M if name != "paci" else 2
    ((_, measured),) = _run_measured(tmp_path, name=name, placement=placement, a=a)
    schedule = build_schedule(name, P, M, a, K, virtual_stages=V, placement=placement)
    per_microbatch = [0.0] * schedule.num_stages
    for saved in measured:
        for stage, peak in saved["chunk_peaks"].items():
            per_microbatch[stage] = peak / inflight_profile(schedule.stage_actions(stage))[0]
    assert all(b > 0 for b in per_microbatch)
    predicted = activation_peaks(schedule, per_microbatch)
    assert [saved["device_peak"] for saved in measured] == pytest.approx(predicted, rel=1e-12)
