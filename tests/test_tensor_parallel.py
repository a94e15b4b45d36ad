"""Tensor parallelism and FSDP2 inside a stage ([Note: tensor parallelism in a stage]): a module written for
Lightning's ``ModelParallelStrategy`` (layers in ``__init__``, ``parallelize_module`` and ``fully_shard`` in
``configure_model``), unchanged, at 2 stages x TP 2, 2 x FSDP 2 and 2 x 2 x 2 on gloo, against one device's plain
step on the replicas' batches together (float64) and the reference executor."""

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

from helpers import RecordBatches, fit, replica_batches
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
                  "stage": getattr(trainer.strategy, "stage_index", 0),
                  "mesh_names": list(mesh.mesh_dim_names) if mesh is not None else None,
                  "mesh": mesh.mesh.tolist() if mesh is not None else None}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _one_device(model: TensorParallelFeedForward, loader: Any, steps: int,
                clip: float | None = None) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    optimizer = reference.configure_optimizers()
    for (x, y), _ in zip(loader, range(steps)):
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
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


def _run(tmp_path: Path, optimizer: str, schedule: str, steps: int = 3, devices: int = 4,
         **settings: Any) -> tuple[dict[str, Any], dict[int, dict]]:
    torch.manual_seed(0)
    model = TensorParallelFeedForward(optimizer=optimizer, lr=0.05 if optimizer == "adamw" else 0.1).double()
    expected = _one_device(model, feed_forward_loader(), steps) if schedule == "1f1b" else \
        _reference(model, feed_forward_loader(num_batches=steps), schedule)
    fit(model, feed_forward_loader(num_batches=steps), devices=devices, max_steps=steps,
        callbacks=[DumpOwnWeights(tmp_path)], schedule=schedule, microbatches=2, partition="parameters",
        compensation="none", **{"tensor_parallel_size": 2, **settings})
    return expected, {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}


def _assert_equal(expected: dict[str, torch.Tensor], records: dict[int, dict], world: int = 4) -> None:
    assert sorted(records) == list(range(world))
    seen = set()
    for rank, record in records.items():
        for name, value in record["weights"].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), expected[name], rtol=1e-12,
                                       atol=1e-12, msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
            seen.add(name)
    assert seen == set(expected)  # every parameter of the model lives on one of the stages


def test_two_stages_of_two_tensor_parallel_ranks_train_as_one_device_under_1f1b(tmp_path):
    expected, records = _run(tmp_path, "adamw", "1f1b")
    _assert_equal(expected, records)
    for rank, record in records.items():
        assert record["stage"] == (1 if rank < 2 else 0)  # rank 0 holds the last stage ([Note: rank layout])
        assert record["mesh_names"] == ["data_parallel", "tensor_parallel"]
        assert record["mesh"] == ([[0, 1]] if rank < 2 else [[2, 3]])
        assert record["sharded"] and all(n.startswith("blocks.") for n in record["sharded"])


def test_paci_with_tensor_parallel_stages_equals_the_reference_executor(tmp_path):
    expected, records = _run(tmp_path, "adamw", "paci", steps=4)
    _assert_equal(expected, records)


def _read_weights(directory: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in directory.glob("rank*.json")}


def test_2x2x2_under_the_nccl_emulation_and_its_distributed_checkpoint_resuming_bit_for_bit_and_on_another_layout(
        tmp_path, monkeypatch):
    # [Note: NCCL emulation]: the 3D mesh's groups, the pipeline's per-lane groups and the host group created in
    # one order on every rank, every point-to-point message on its lane's communicator, the tensor-parallel and
    # FSDP2 collectives and the checkpoint's (DCP over the host group); 2 x 2 x 2 with AdamW, two epochs of two
    # steps, equal to one device under "1f1b". [Note: distributed checkpoints]: the checkpoint of the first epoch
    # resumes at 2 x 2 x 2 to the same bits, and at 2 stages x FSDP 2 x TP 1 (4 processes) to one device's weights
    from lightning.pytorch.callbacks import ModelCheckpoint

    tensor, data, devices = 2, 2, 8
    torch.manual_seed(0)
    model = TensorParallelFeedForward(optimizer="adamw", lr=0.05).double()
    initial, loader = copy.deepcopy(model), feed_forward_loader(num_batches=2 * data)
    options: dict[str, Any] = dict(max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
                                   compensation="none", data_parallel_size=data)
    trainer_options = dict(use_distributed_sampler=True, max_epochs=2, enable_checkpointing=True)
    first, saved = tmp_path / "first", tmp_path / "checkpoints"
    first.mkdir()
    with monkeypatch.context() as emulated:
        emulated.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
        fit(model, loader, devices=devices, tensor_parallel_size=tensor, **options,
            callbacks=[DumpOwnWeights(first), RecordBatches(first),
                       ModelCheckpoint(dirpath=saved, filename="{epoch}", save_top_k=-1)],
            trainer_kwargs=trainer_options)
    per_replica = [torch.load(first / f"batches{r}.pt") for r in range(data)]
    assert all(len(batches) == 4 for batches in per_replica)  # two epochs of two batches per replica
    union = [tuple(torch.cat(parts) for parts in zip(*(per_replica[r][k] for r in range(data)))) for k in range(4)]
    expected = _one_device(initial, union, 4)
    trained = _read_weights(first)
    _assert_equal(expected, trained, world=devices)

    checkpoint = saved / "epoch=0.ckpt"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "meta.pt").is_file()
    meta = torch.load(checkpoint / "meta.pt", weights_only=False)
    assert "state_dict" not in meta and meta["paci_layout"] == {"pipeline": 2, "data": 2, "tensor": 2}
    again = tmp_path / "again"
    again.mkdir()
    fit(TensorParallelFeedForward(optimizer="adamw", lr=0.05).double(), loader, devices=devices,
        tensor_parallel_size=tensor, **options, callbacks=[DumpOwnWeights(again)],
        trainer_kwargs={**trainer_options, "enable_checkpointing": False}, ckpt_path=str(checkpoint))
    resumed = _read_weights(again)
    for rank, record in trained.items():  # the same layout: the same bits
        assert resumed[rank]["weights"] == record["weights"], rank

    other = tmp_path / "other"
    other.mkdir()
    fit(TensorParallelFeedForward(optimizer="adamw", lr=0.05).double(), loader, devices=4, tensor_parallel_size=1,
        **options, callbacks=[DumpOwnWeights(other)],
        trainer_kwargs={**trainer_options, "enable_checkpointing": False}, ckpt_path=str(checkpoint))
    _assert_equal(expected, _read_weights(other), world=4)


@pytest.mark.parametrize(("settings", "trainer_settings", "match"), [
    (dict(tensor_parallel_size=2, virtual_stages=2), {}, r"virtual_stages=2\)`: a process runs one stage with"),
    (dict(tensor_parallel_size=2, nonfinite="skip"), {}, r"nonfinite='skip'\)` is not supported with `tens"),
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
    (dict(gradient_clip_val=1.0), r" with `gradient_clip_val` under `schedule='paci'`: the stages' latest norms"),
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


def _status_bytes(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


class MeasurePeaks(MeasureOwnBytes):
    """Also each rank's host memory peak (``VmHWM``) over its resident size when the peak was last reset: from
    before the strategy's setup (materialization and the module's ``configure_model``) to the start of training, and
    through training."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.peaks: dict[str, int] = {}
        self.base = 0

    def _reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # the peak is the resident size from here on
        self.base = _status_bytes("VmRSS")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._reset()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peaks["setup"] = _status_bytes("VmHWM") - self.base
        self._reset()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peaks["training"] = _status_bytes("VmHWM") - self.base
        super().on_train_end(trainer, pl_module)
        path = self.directory / f"bytes{trainer.global_rank}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **self.peaks}))


@pytest.mark.heavy
def test_a_1gb_model_built_on_meta_never_held_whole_by_a_rank_each_holding_its_share(tmp_path):
    # [Note: a stage built in shards]: 2 x 2 x 2, a 1.08 GB model (8 blocks of width 2368, float32) built on the meta
    # device: the module's `configure_model` shards each stage there and each rank materializes its shards only.
    # Parameters, gradients and AdamW's two moments per rank: the stage's whole / (D x T), within 10% (the
    # embedding and the head are split over the replicas only). A rank's host memory from before setup to the start
    # of training (its shards made and initialized, then the setup's sample step, for which FSDP2 gathers the
    # blocks' tensor-parallel halves and their gradients) grows by less than its stage's parameters alone; no rank
    # gathers its stage at the end (the main process's model stays on the meta device)
    tensor, data, devices, width, depth = 2, 2, 8, 2368, 8
    with torch.device("meta"):
        model = TensorParallelFeedForward(width=width, depth=depth, optimizer="adamw", lr=0.01)
    block = 6 * width * width * 4  # bytes of one block
    assert 8 * block > 2**30
    fit(model, feed_forward_loader(num_batches=data, dtype=torch.float32), devices=devices, max_steps=1,
        schedule="1f1b", callbacks=[MeasurePeaks(tmp_path)], tensor_parallel_size=tensor, data_parallel_size=data,
        microbatches=2, partition="parameters", compensation="none", trainer_kwargs={"use_distributed_sampler": True})
    assert len(list(tmp_path.glob("bytes*.json"))) == devices
    assert all(p.is_meta for p in model.parameters())
    figures = []
    for path in sorted(tmp_path.glob("bytes*.json")):
        record = json.loads(path.read_text())
        stage = record["stage_parameters"]  # its parameters' bytes whole (a DTensor's numel is the whole's)
        assert stage > depth // 2 * block
        share = stage / (tensor * data)
        held = record["parameters"] + record["gradients"] + record["optimizer"]
        assert record["gradients"] == record["parameters"] and record["optimizer"] == 2 * record["parameters"]
        assert abs(held - 4 * share) <= 0.1 * 4 * share, (path.name, record)
        figures.append(f"{path.stem}: setup +{record['setup'] / 2**20:.0f} MiB, training +"
                       f"{record['training'] / 2**20:.0f} MiB, share {share / 2**20:.0f} MiB, stage "
                       f"{stage / 2**20:.0f} MiB")
        assert record["setup"] < stage, figures[-1]
    print("; ".join(figures))


def test_a_model_built_on_meta_reads_its_shards_from_weights_and_trains_as_one_device_at_2x2x2(tmp_path):
    # [Note: a stage built in shards]: the stage's DTensor shards are made on meta by `configure_model`, then each
    # rank copies its own slice of every tensor of a `weights=` file: the run equals one device from those weights
    steps, data = 2, 2
    torch.manual_seed(0)
    model = TensorParallelFeedForward(optimizer="sgd", lr=0.1).double()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    with torch.device("meta"):
        meta_model = TensorParallelFeedForward(optimizer="sgd", lr=0.1).double()
    loader = feed_forward_loader(num_batches=steps * data)
    fit(meta_model, loader, devices=8, max_steps=steps, callbacks=[DumpOwnWeights(tmp_path), RecordBatches(tmp_path)],
        schedule="1f1b", microbatches=2, partition="parameters", compensation="none", tensor_parallel_size=2,
        data_parallel_size=data, weights=str(tmp_path / "weights.pt"), trainer_kwargs={"use_distributed_sampler": True})
    per_replica = replica_batches(tmp_path, loader, data)
    union = [tuple(torch.cat(parts) for parts in zip(*(per_replica[r][k] for r in range(data)))) for k in range(steps)]
    _assert_equal(_one_device(model, union, steps), _read_weights(tmp_path), world=8)


class CountReductions(Callback):
    """Each rank counts FSDP2's gradient reduce-scatters during training."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.count = directory, 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        original = getattr(dist, name)  # what FSDP2 calls, by this torch's name

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)  # a forked rank's own module object

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.directory / f"reductions{trainer.global_rank}.json").write_text(json.dumps(
            {"count": self.count, "updates": trainer.strategy.runtime.version, "stage": trainer.strategy.stage_index}))


@pytest.mark.parametrize(("tensor", "data", "devices", "optimizer"), [(1, 2, 4, "adamw")])  # 2 x 2 x 2: below
def test_fsdp2_replicas_in_each_stage_train_as_one_device_under_1f1b(tmp_path, tensor, data, devices, optimizer):
    # the module's `fully_shard(..., mesh=self.device_mesh["data_parallel"])` shards each stage over its replicas
    # (and, at 2 x 2 x 2, over the tensor-parallel shards too); each replica reads its own half of the data; the
    # gradients are reduce-scattered once per update, not per micro-batch
    steps = 3
    torch.manual_seed(0)
    model = TensorParallelFeedForward(optimizer=optimizer, lr=0.05 if optimizer == "adamw" else 0.1).double()
    initial, loader = copy.deepcopy(model), feed_forward_loader(num_batches=steps * data)
    fit(model, loader, devices=devices, max_steps=steps, schedule="1f1b", microbatches=2, partition="parameters",
        callbacks=[DumpOwnWeights(tmp_path), RecordBatches(tmp_path), CountReductions(tmp_path)],
        compensation="none", tensor_parallel_size=tensor, data_parallel_size=data,
        trainer_kwargs={"use_distributed_sampler": True})
    for path in tmp_path.glob("reductions*.json"):
        counted = json.loads(path.read_text())
        modules = 3 if counted["stage"] == 0 else 3  # embed + 2 blocks; 2 blocks + head
        assert counted["updates"] == steps and counted["count"] == steps * modules, (path.name, counted)
    per_replica = replica_batches(tmp_path, loader, data)
    union = [tuple(torch.cat(parts) for parts in zip(*(per_replica[r][k] for r in range(data)))) for k in range(steps)]
    expected = _one_device(initial, union, steps)  # one device, the replicas' batches together
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    _assert_equal(expected, records, world=devices)
    for record in records.values():
        assert set(record["sharded"]) == set(record["weights"])  # every parameter a DTensor shard


def test_an_unsharded_replica_is_refused_with_the_modules_own_parallelism(tmp_path):
    class Unsharded(TensorParallelFeedForward):
        def configure_model(self):  # no fully_shard: nothing would keep the replicas equal
            pass

    with pytest.raises(ProcessRaisedException, match=r"ValueError: .* parameters of this stage are not sharded over "
                                                      r"the replicas \((embed|blocks)\..*Call `fully_shard"):
        fit(Unsharded().double(), feed_forward_loader(), devices=4, max_steps=1, tensor_parallel_size=1,
            data_parallel_size=2, partition="parameters")


@pytest.mark.parametrize(("tensor", "devices"), [(2, 8)])
def test_fsdp2_replicas_under_paci_equal_the_reference_executor_with_averaged_gradients(tmp_path, tensor, devices):
    steps, data = 4, 2
    torch.manual_seed(0)
    model = TensorParallelFeedForward().double()
    initial, loader = copy.deepcopy(model), feed_forward_loader(num_batches=steps * data)
    fit(model, loader, devices=devices, max_steps=steps, schedule="paci", microbatches=2, partition="parameters",
        callbacks=[DumpOwnWeights(tmp_path), RecordBatches(tmp_path)], compensation="none",
        tensor_parallel_size=tensor, data_parallel_size=data, trainer_kwargs={"use_distributed_sampler": True})
    per_replica = replica_batches(tmp_path, loader, data)
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"), replicas=data,
                                  compensation="none")
    reference.run(build_schedule("paci", 2, 2, 2, steps), per_replica)
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    _assert_equal(expected, {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")},
                  world=devices)


@pytest.mark.parametrize(("tensor", "data", "devices"), [(2, 1, 4), (2, 2, 8)])
def test_global_norm_clipping_over_shards_equals_one_device_under_1f1b(tmp_path, tensor, data, devices):
    # the norm over every stage's whole gradients: DTensor shards summed over the ranks that split them, counted
    # once where replicated ([Note: global-norm clipping]); 0.05 clips every step here
    steps = 3
    torch.manual_seed(0)
    model = TensorParallelFeedForward().double()
    initial, loader = copy.deepcopy(model), feed_forward_loader(num_batches=steps * data)
    fit(model, loader, devices=devices, max_steps=steps, schedule="1f1b", microbatches=2, partition="parameters",
        callbacks=[DumpOwnWeights(tmp_path), RecordBatches(tmp_path)], compensation="none",
        tensor_parallel_size=tensor, data_parallel_size=data,
        trainer_kwargs={"use_distributed_sampler": True, "gradient_clip_val": 0.05})
    per_replica = replica_batches(tmp_path, loader, data)
    union = [tuple(torch.cat(parts) for parts in zip(*(per_replica[r][k] for r in range(data)))) for k in range(steps)]
    expected = _one_device(initial, union, steps, clip=0.05)
    unclipped = _one_device(initial, union, steps)
    assert not torch.allclose(expected["head.weight"], unclipped["head.weight"])  # the clip acts
    _assert_equal(expected, {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")},
                  world=devices)


def _model_parallel_rank(rank: int, port: int, directory: str) -> None:
    """One rank of Lightning's own ``ModelParallelStrategy`` (TP 2), started by the test as torchrun would: the
    environment names the rank, so Lightning launches nothing."""
    import os

    from lightning.pytorch.strategies import ModelParallelStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TensorParallelFeedForward().double()
    trainer = L.Trainer(strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
                        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[DumpOwnWeights(Path(directory))])
    trainer.fit(model, feed_forward_loader())


def test_the_same_module_under_model_parallel_strategy_equals_one_device_too(tmp_path):
    # the module is ModelParallelStrategy's own: under it (2 ranks, TP 2) it trains as one device, as under PACI
    import multiprocessing
    import socket

    torch.manual_seed(0)
    expected = _one_device(TensorParallelFeedForward().double(), feed_forward_loader(), 3)
    with socket.socket() as probe:  # a free port, found now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_model_parallel_rank, args=(r, port, str(tmp_path))) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(records) == [0, 1] and records[0]["mesh_names"] == ["data_parallel", "tensor_parallel"]
    for record in records.values():
        assert set(record["weights"]) == set(expected)  # one rank holds the whole model, its blocks split
        for name, value in record["weights"].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), expected[name], rtol=1e-12,
                                       atol=1e-12)


class DTensorAtTheBoundary(TensorParallelFeedForward):
    """Its plan hands each block's output on as a replicated DTensor (``use_local_output=False``) and takes a
    block's input back to a local tensor: it runs within a stage, and what would cross between stages is a
    DTensor."""

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = self.device_mesh["tensor_parallel"]
        for block in self.blocks:
            parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                             "w2": RowwiseParallel()})
            parallelize_module(block, mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(Replicate(),),
                                                               use_local_output=True))
            parallelize_module(block, mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                desired_output_layouts=Replicate(),
                                                                use_local_output=False))


def test_a_dtensor_at_a_stage_boundary_is_refused_naming_its_placements_and_the_fix(tmp_path):
    with pytest.raises(ProcessRaisedException, match=r"A DTensor of shape \(4, 8\) \(\(Replicate\(\),\)\) reached a "
                                                      r"stage boundary.*`use_local_output=True`"):
        fit(DTensorAtTheBoundary().double(), feed_forward_loader(), devices=4, max_steps=1, tensor_parallel_size=2,
            partition="parameters", microbatches=2, compensation="none")


def test_the_weight_drift_of_a_sharded_stage_is_refused_naming_the_fix(tmp_path):
    from lightning_paci import DriftMonitor

    with pytest.raises(ProcessRaisedException, match=r"weight drift of a stage with tensor parallelism is not "
                                                      r"measured in this release.*remove `DriftMonitor`"):
        fit(TensorParallelFeedForward().double(), feed_forward_loader(), devices=4, max_steps=1,
            tensor_parallel_size=2, partition="parameters", microbatches=2, compensation="none",
            callbacks=[DriftMonitor()], trainer_kwargs={"default_root_dir": tmp_path})


def test_a_distributed_checkpoint_and_a_run_without_the_modules_own_parallelism_refuse_each_other(tmp_path):
    # [Note: distributed checkpoints]: each form is resumed by its own kind of run, the other refused naming the fix
    import torch.distributed.checkpoint as dcp


    torch.manual_seed(0)
    directory = tmp_path / "dcp"
    dcp.save({"model": TensorParallelFeedForward().double().state_dict()}, checkpoint_id=directory, no_dist=True)
    with pytest.raises(ProcessRaisedException, match=r"is a torch.distributed.checkpoint directory, written by stages "
                                                      r"with their own parallelism.*Resume with `tensor_parallel_size"):
        fit(TensorParallelFeedForward().double(), feed_forward_loader(), devices=2, max_steps=1,
            partition="parameters", ckpt_path=str(directory))
    single = tmp_path / "one.ckpt"
    torch.save({"state_dict": TensorParallelFeedForward().double().state_dict()}, single)
    with pytest.raises(ProcessRaisedException, match=r"is a checkpoint of stages without their own parallelism; this "
                                                      r"run .* resumes torch.distributed.checkpoint directories only"):
        fit(TensorParallelFeedForward().double(), feed_forward_loader(), devices=2, max_steps=1,
            partition="parameters", tensor_parallel_size=1, ckpt_path=str(single))


def test_a_checkpoint_inside_an_open_fsdp2_window_is_refused_naming_the_fix(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    with pytest.raises(ProcessRaisedException, match=r"A checkpoint after 2 of the 3 backwards of an update window: "
                                                      r"FSDP2 holds the window's gradients unsharded.*Use an "
                                                      r"`accumulation` that is a multiple of `microbatches`"):
        fit(TensorParallelFeedForward().double(), feed_forward_loader(num_batches=2), devices=4, max_steps=-1,
            partition="parameters", tensor_parallel_size=1, data_parallel_size=2, microbatches=2, accumulation=3,
            compensation="none", callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{epoch}")],
            trainer_kwargs={"max_epochs": 1, "use_distributed_sampler": True, "enable_checkpointing": True})
