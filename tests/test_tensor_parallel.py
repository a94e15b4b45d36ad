"""Tensor parallelism inside a stage ([Note: tensor parallelism in a stage]): a module written for Lightning's
``ModelParallelStrategy`` (layers in ``__init__``, ``parallelize_module`` in ``configure_model``), unchanged, at
2 stages x 2 tensor-parallel ranks on gloo, against one device's plain step on the whole batch (float64)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.multiprocessing import ProcessRaisedException

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition

from helpers import fit
from models import TensorParallelFeedForward, feed_forward_loader

pytestmark = pytest.mark.distributed


class DumpOwnWeights(Callback):
    """Every rank writes its own stage's parameters whole (a DTensor's ``full_tensor()``, a collective over the
    stage's tensor-parallel ranks) and what its module's ``device_mesh`` is."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        weights, sharded = {}, []
        for name, param in pl_module.named_parameters():
            if param.is_meta or (isinstance(param, DTensor) and param.to_local().is_meta):
                continue
            if isinstance(param, DTensor):
                sharded.append(name)
                weights[name] = param.full_tensor().detach().tolist()
            else:
                weights[name] = param.detach().tolist()
        mesh = pl_module.device_mesh
        record = {"weights": weights, "sharded": sharded, "rank": trainer.global_rank,
                  "stage": trainer.strategy.stage_index,
                  "mesh_names": list(mesh.mesh_dim_names) if mesh is not None else None,
                  "mesh": mesh.mesh.tolist() if mesh is not None else None}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _one_device(model: TensorParallelFeedForward, loader: Any, steps: int) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    optimizer = reference.configure_optimizers()
    for (x, y), _ in zip(loader, range(steps)):
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in reference.named_parameters()}


def _reference(model: TensorParallelFeedForward, loader: Any, schedule: str) -> dict[str, torch.Tensor]:
    """The one-process reference executor over the same 2 stages, one rank each (no tensor parallelism: the
    module's ``configure_model`` does nothing without a mesh)."""
    reference_model = copy.deepcopy(model)
    reference = ReferencePipeline(reference_model, plan_partition(reference_model, 2, partition="parameters"),
                                  compensation="none")
    batches = list(loader)
    reference.run(build_schedule(schedule, 2, 2, 2, num_minibatches=len(batches)), batches)
    return {k: v.detach() for k, v in reference.state_dict().items()}


def _run(tmp_path: Path, optimizer: str, schedule: str, steps: int = 3,
         **settings: Any) -> tuple[dict[str, Any], dict[int, dict]]:
    torch.manual_seed(0)
    model = TensorParallelFeedForward(optimizer=optimizer, lr=0.05 if optimizer == "adamw" else 0.1).double()
    expected = _one_device(model, feed_forward_loader(), steps) if schedule == "1f1b" else \
        _reference(model, feed_forward_loader(num_batches=steps), schedule)
    fit(model, feed_forward_loader(num_batches=steps), devices=4, max_steps=steps,
        callbacks=[DumpOwnWeights(tmp_path)], schedule=schedule, tensor_parallel_size=2, microbatches=2,
        partition="parameters", compensation="none", **settings)
    return expected, {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}


def _assert_equal(expected: dict[str, torch.Tensor], records: dict[int, dict]) -> None:
    assert sorted(records) == [0, 1, 2, 3]
    seen = set()
    for rank, record in records.items():
        for name, value in record["weights"].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), expected[name], rtol=1e-12,
                                       atol=1e-12, msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
            seen.add(name)
    assert seen == set(expected)  # every parameter of the model lives on one of the stages


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_stages_of_two_tensor_parallel_ranks_train_as_one_device_under_1f1b(tmp_path, optimizer):
    expected, records = _run(tmp_path, optimizer, "1f1b")
    _assert_equal(expected, records)
    for rank, record in records.items():
        assert record["stage"] == (1 if rank < 2 else 0)  # rank 0 holds the last stage ([Note: rank layout])
        assert record["mesh_names"] == ["data_parallel", "tensor_parallel"]
        assert record["mesh"] == ([[0, 1]] if rank < 2 else [[2, 3]])
        assert record["sharded"] and all(n.startswith("blocks.") for n in record["sharded"])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_paci_with_tensor_parallel_stages_equals_the_reference_executor(tmp_path, optimizer):
    expected, records = _run(tmp_path, optimizer, "paci", steps=4)
    _assert_equal(expected, records)


def test_tensor_parallel_stages_run_under_the_nccl_emulation(tmp_path, monkeypatch):
    # [Note: NCCL emulation]: the 3D mesh's groups, the pipeline's per-lane groups and the host group created in
    # one order on every rank, every point-to-point message on its lane's communicator
    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
    expected, records = _run(tmp_path, "sgd", "1f1b")
    _assert_equal(expected, records)


@pytest.mark.parametrize(("settings", "trainer_settings", "match"), [
    (dict(tensor_parallel_size=2, data_parallel_size=2), {}, r"tensor_parallel_size=2\)` with 2 data-parallel"),
    (dict(tensor_parallel_size=2, virtual_stages=2), {}, r"virtual_stages=2\)`: a process runs one stage"),
    (dict(tensor_parallel_size=2, nonfinite="skip"), {}, r"nonfinite='skip'\)` is not supported with tensor"),
    (dict(tensor_parallel_size=2, compensation="predict"), {}, r"compensation='predict'`: the weight prediction"),
    (dict(tensor_parallel_size=3), {}, r"`tensor_parallel_size=3` does not divide"),
])
def test_what_a_tensor_parallel_stage_does_not_run_is_refused_naming_the_fix(tmp_path, settings, trainer_settings,
                                                                               match):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=match):
        fit(TensorParallelFeedForward().double(), feed_forward_loader(), devices=8 if settings.get(
            "data_parallel_size") or settings.get("virtual_stages") else 4, max_steps=1,
            trainer_kwargs=dict(default_root_dir=tmp_path, **trainer_settings), partition="parameters", **settings)


@pytest.mark.parametrize(("trainer_settings", "match"), [
    (dict(gradient_clip_val=1.0), r" with `gradient_clip_val`: the global norm over tensor-parallel shards"),
    (dict(enable_checkpointing=True), r": checkpoints of tensor-parallel stages are not written in this release"),
])
def test_what_a_tensor_parallel_stage_does_not_run_is_refused_at_setup(tmp_path, trainer_settings, match):
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `PACIStrategy\(tensor_parallel_size=2\)`" + match):
        fit(TensorParallelFeedForward().double(), feed_forward_loader(), devices=4, max_steps=1,
            trainer_kwargs=dict(default_root_dir=tmp_path, **trainer_settings), tensor_parallel_size=2,
            partition="parameters")


def test_a_module_without_configure_model_is_refused_with_tensor_parallelism(tmp_path):
    class Plain(TensorParallelFeedForward):
        configure_model = L.LightningModule.configure_model

    with pytest.raises(ProcessRaisedException, match=r"needs `Plain.configure_model` to apply the tensor-parallel "
                                                      r"plan"):
        fit(Plain().double(), feed_forward_loader(), devices=4, max_steps=1, tensor_parallel_size=2,
            partition="parameters")


def test_the_rank_layout_puts_a_stages_tensor_ranks_side_by_side():
    strategy = PACIStrategy(tensor_parallel_size=2)
    topology = strategy.config.topology(8, 1)
    assert (topology.pipeline, topology.data, topology.tensor, topology.lanes) == (4, 1, 2, 2)
    assert topology.mesh_ranks_3d() == [[[6, 7]], [[4, 5]], [[2, 3]], [[0, 1]]]
    assert [topology.stage_of(r) for r in range(8)] == [3, 3, 2, 2, 1, 1, 0, 0]
    assert [topology.tensor_of(r) for r in range(8)] == [0, 1] * 4
    assert topology.watch_name(5) == "stage 1 (tensor 1)"


class MeasureOwnBytes(Callback):
    """Each rank's bytes of its own stage's parameters, gradients (at its updates, when they are whole) and
    optimizer state, counted on what the rank holds (a DTensor's local shard), and the stage's whole size."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.gradients = 0

    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def _own(self, module: L.LightningModule) -> list[torch.nn.Parameter]:
        return [p for p in module.parameters() if not self._local(p).is_meta]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.gradients = max(self.gradients, sum(self._local(p.grad).nbytes for p in self._own(pl_module)
                                                 if p.grad is not None))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        own = self._own(pl_module)
        state = trainer.strategy.stage.optimizer.optimizer.state
        record = {"parameters": sum(self._local(p).nbytes for p in own), "gradients": self.gradients,
                  "optimizer": sum(self._local(v).nbytes for s in state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0),
                  "stage_parameters": sum(p.numel() * p.element_size() for p in own)}
        (self.directory / f"bytes{trainer.global_rank}.json").write_text(json.dumps(record))


def test_each_rank_holds_its_share_of_its_stage(tmp_path):
    # parameters, gradients and AdamW's two moments per rank: the stage's whole / T, within 10% (the embedding and
    # the head are not split by the plan)
    torch.manual_seed(0)
    model = TensorParallelFeedForward(width=64, depth=4, optimizer="adamw", lr=0.01).double()
    fit(model, feed_forward_loader(), devices=4, max_steps=2, callbacks=[MeasureOwnBytes(tmp_path)],
        schedule="1f1b", tensor_parallel_size=2, microbatches=2, partition="parameters", compensation="none")
    for path in sorted(tmp_path.glob("bytes*.json")):
        record = json.loads(path.read_text())
        share = record["stage_parameters"] / 2
        held = record["parameters"] + record["gradients"] + record["optimizer"]
        assert record["gradients"] == record["parameters"] and record["optimizer"] == 2 * record["parameters"]
        assert abs(held - 4 * share) <= 0.1 * 4 * share, (path.name, record)
        assert record["parameters"] < record["stage_parameters"]  # no rank holds its stage whole
