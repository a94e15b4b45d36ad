"""Data parallel x pipeline: stages x replicas through the real Trainer (fork-launched gloo ranks), against one
device on the replicas' samples together and against the reference executor with the replicas' gradients
averaged."""

from __future__ import annotations

import copy
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.replicas.data_parallel import ReplicaMismatchError, average_gradients
from lightning_paci.engine.replicas.topology import Topology, resolve_sizes

from helpers import RecordBatches, fit, replica_batches, run_forked_ranks
from models import SequentialMLP, reference_accumulation, regression_loader


def _assert_state_close(model: torch.nn.Module, expected: dict[str, torch.Tensor], rtol: float) -> None:
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=rtol, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.distributed
def test_two_stages_by_two_replicas_flush_equals_one_device_on_the_replicas_samples(tmp_path):
    torch.manual_seed(0)
    model = SequentialMLP(depth=4)
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=8, batch_size=4)  # 4 samples per replica and step
    steps = 3
    fit(model, loader, devices=4, max_steps=steps, schedule="1f1b", microbatches=2, pipeline_parallel_size=2,
        trainer_kwargs={"use_distributed_sampler": True}, callbacks=[RecordBatches(tmp_path)])
    per_replica = replica_batches(tmp_path, loader, 2)
    union = [tuple(torch.cat(parts) for parts in zip(*(per_replica[r][k] for r in range(2)))) for k in range(steps)]
    reference_accumulation(reference, union, num_microbatches=1, num_steps=steps)  # one device, 8 samples a step
    _assert_state_close(model, reference.state_dict(), rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("accumulation", [2, 4])
def test_paci_replicas_equal_the_reference_executor_with_averaged_gradients(tmp_path, accumulation):
    torch.manual_seed(4)
    model = SequentialMLP(depth=4)
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=10, batch_size=4)
    steps, m = 4, 2
    fit(model, loader, devices=4, max_steps=steps, schedule="paci", microbatches=m, accumulation=accumulation,
        data_parallel_size=2, trainer_kwargs={"use_distributed_sampler": True}, callbacks=[RecordBatches(tmp_path)])
    per_replica = replica_batches(tmp_path, loader, 2)
    reference = ReferencePipeline(initial, plan_partition(initial, 2), replicas=2)
    reference.run(build_schedule("paci", 2, m, accumulation, steps), per_replica)
    replica1 = {k: v for module in reversed(reference.replica_modules[1]) for k, v in module.state_dict().items()}
    for key, value in reference.state_dict().items():  # the replicas stayed equal bit for bit
        torch.testing.assert_close(replica1[key], value, rtol=0, atol=0)
    for key, value in reference.state_dict().items():  # gloo's sum of two replicas is the reference's, bit for bit
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    # and the averaging matters: one replica alone ends elsewhere
    alone = ReferencePipeline(copy.deepcopy(initial), plan_partition(initial, 2))
    alone.run(build_schedule("paci", 2, m, accumulation, steps), per_replica[0])
    assert not torch.allclose(alone.state_dict()["net.0.weight"], reference.state_dict()["net.0.weight"])


def _mismatch_worker(rank: int, path: str, errors: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        params = [torch.nn.Parameter(torch.ones(n)) for n in (3, 2, 1)]
        params[0].grad = torch.full((3,), float(rank + 1))
        if rank == 0:
            params[1].grad = torch.ones(2)  # only replica 0 used this parameter
        check = average_gradients(params, 2, lambda flat: dist.all_reduce(flat), names=["a", "b", "c"])
        assert not bool(check.agree)  # kept on the device for the update's one read
        try:
            check.verify()
        except ReplicaMismatchError as err:
            assert "b has a gradient on 1 of 2 data-parallel replicas" in str(err), str(err)
        else:
            raise AssertionError("no ReplicaMismatchError")
        # without a mismatch: the mean, and a parameter without a gradient anywhere keeps None
        params[1].grad = torch.full((2,), 2.0 * rank)
        check = average_gradients(params, 2, lambda flat: dist.all_reduce(flat))
        assert bool(check.agree)
        check.verify()
        assert torch.equal(params[0].grad, torch.full((3,), 1.5)) and torch.equal(params[1].grad, torch.ones(2))
        assert params[2].grad is None
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")


@pytest.mark.timeout(60)
def test_gradient_average_refuses_replicas_that_used_different_parameters(tmp_path: Path):
    run_forked_ranks(_mismatch_worker, 2, tmp_path / "rdv")


def test_rank_layout_keeps_a_stages_replicas_on_consecutive_ranks():
    topology = Topology(pipeline=4, data=2)
    assert topology.mesh_ranks() == [[6, 7], [4, 5], [2, 3], [0, 1]]  # the last stage of replica 0 on rank 0
    assert [(topology.stage_of(r), topology.replica_of(r)) for r in range(8)] == [
        (3, 0), (3, 1), (2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert Topology(pipeline=3).mesh_ranks() == [[2], [1], [0]]  # a pure pipeline: as before


def test_sizes_resolve_and_bad_splits_name_the_numbers():
    assert resolve_sizes("auto", "auto", 8, devices=8, num_nodes=1) == (8, 1)  # every device a stage
    assert resolve_sizes(2, "auto", 8, devices=8, num_nodes=1) == (2, 4)
    assert resolve_sizes("auto", 2, 8, devices=4, num_nodes=2) == (4, 2)
    assert resolve_sizes(4, 2, 8, devices=8, num_nodes=1) == (4, 2)
    # only accepted values are suggested: every one leaves 2 stages or more
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 does not divide 8.*one of \[2, 4, 8\] for"):
        resolve_sizes(3, "auto", 8, devices=8, num_nodes=1)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide 4.*one of \[1, 2\] for"):
        resolve_sizes("auto", 3, 4, devices=4, num_nodes=1)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide 2.*Use one of \[1\] for"):
        resolve_sizes("auto", 3, 2, devices=2, num_nodes=1)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 x data_parallel_size=4 = 16.*make the product 8"):
        resolve_sizes(4, 4, 8, devices=4, num_nodes=2)
    with pytest.raises(ValueError, match="`data_parallel_size` must be an int >= 1 or 'auto', got 0"):
        PACIStrategy(data_parallel_size=0)
    with pytest.raises(ValueError, match="`pipeline_parallel_size` must be an int >= 1 or 'auto', got 'two'"):
        PACIStrategy(pipeline_parallel_size="two")


@pytest.mark.distributed
def test_a_pipeline_size_that_does_not_divide_the_world_fails_at_setup():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 does not divide 4"):
        fit(SequentialMLP(), regression_loader(num_batches=2), devices=4, pipeline_parallel_size=3)


@pytest.mark.distributed
def test_more_stages_than_blocks_fails_at_setup():
    # 4 processes as 4 stages x 1 replica of a 3-block model: the split cannot give every stage a block; the same
    # processes as 2 stages x 2 replicas train
    with pytest.raises(ProcessRaisedException, match="into 4 stages: every stage needs at least one block"):
        fit(SequentialMLP(depth=2), regression_loader(num_batches=2), devices=4, pipeline_parallel_size=4)
    fit(SequentialMLP(depth=2), regression_loader(num_batches=2), devices=4, pipeline_parallel_size=2, max_steps=1)


def test_replicas_draw_their_own_dropout_masks():
    from lightning_paci.engine.runtime.microbatch import microbatch_rng

    def draw(replica: int) -> torch.Tensor:
        with microbatch_rng(3, 1, 5, replica):
            return torch.rand(4)

    assert torch.equal(draw(0), draw(0)) and not torch.equal(draw(0), draw(1))
    torch.manual_seed(3)
    with microbatch_rng(3, 1, 5):  # replica 0 keeps the streams of a pure pipeline
        before = torch.rand(4)
    assert torch.equal(before, draw(0))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_checkpoint_one_copy_per_stage_and_resume_exact_or_onto_another_shape(tmp_path, layout):
    # 2 batches per replica and epoch, 4 micro-batches: a = 3 leaves a window open at the checkpoint, whose
    # gradients differ per replica until the next step (the checkpoint holds their average)
    loader = regression_loader(num_batches=4, batch_size=4)
    kwargs = dict(devices=4, schedule="paci", microbatches=2, accumulation=3, data_parallel_size=2,
                  checkpoint_layout=layout,
                  trainer_kwargs={"use_distributed_sampler": True, "max_steps": -1})
    torch.manual_seed(5)
    whole = SequentialMLP(depth=4)
    first = copy.deepcopy(whole)
    # uninterrupted, saving at the same points (a save averages the open window: the same update, other rounding)
    fit(whole, loader, trainer_kwargs={**kwargs.pop("trainer_kwargs"), "max_epochs": 2, "enable_checkpointing": True,
                                       "default_root_dir": str(tmp_path / "whole")}, **kwargs)
    # the epoch-end checkpoint written inside the run (sharded: every stage's first replica writes its shard)
    fit(first, loader, trainer_kwargs={"use_distributed_sampler": True, "max_steps": -1, "max_epochs": 1,
                                       "enable_checkpointing": True, "default_root_dir": str(tmp_path)}, **kwargs)
    path = next((tmp_path / "checkpoints").iterdir())
    if layout == "sharded":
        assert sorted(p.name for p in path.iterdir()) == ["meta.pt", "stage_000.pt", "stage_001.pt"]
    resumed = SequentialMLP(depth=4)
    fit(resumed, loader, trainer_kwargs={"use_distributed_sampler": True, "max_steps": -1, "max_epochs": 2},
        ckpt_path=str(path), **kwargs)
    for key, value in whole.state_dict().items():  # the same shape: exact
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    other = SequentialMLP(depth=4)  # 4 stages x 1 replica from the 2 x 2 checkpoint: trains on
    fit(other, loader, devices=4, schedule="paci", microbatches=2, accumulation=3, checkpoint_layout=layout,
        ckpt_path=str(path),
        trainer_kwargs={"max_steps": -1, "max_epochs": 2})
    assert not torch.equal(other.state_dict()["net.0.weight"], first.state_dict()["net.0.weight"])


class _ValLoss(SequentialMLP):
    def __init__(self, sync: bool) -> None:
        super().__init__(depth=4)
        self.sync = sync

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=self.sync)


@pytest.mark.distributed
@pytest.mark.parametrize("sync", [True, False])
def test_validation_is_sharded_by_replica_and_sync_dist_reduces_across_replicas(tmp_path, sync):
    torch.manual_seed(6)
    model = _ValLoss(sync)
    val = regression_loader(num_batches=4, batch_size=4, seed=1)  # 2 batches per replica
    trainer = fit(model, regression_loader(num_batches=4, batch_size=4), devices=4, microbatches=2,
                  pipeline_parallel_size=2, trainer_kwargs={"use_distributed_sampler": True, "limit_val_batches": 1.0,
                                                            "max_steps": -1, "max_epochs": 1},
                  val_dataloaders=val)
    x, y = val.dataset.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        losses = ((model(x) - y) ** 2).mean(dim=1)  # per sample
    whole = float(losses.mean())
    replica0 = float(losses[0::2].mean())  # DistributedSampler(shuffle=False) for validation: samples 0, 2, 4, ...
    logged = float(trainer.callback_metrics["val_loss"])
    assert logged == pytest.approx(whole if sync else replica0, rel=1e-5)
    assert abs(whole - replica0) > 1e-4  # the two cases are told apart


@pytest.mark.distributed
def test_monitors_write_one_run_per_stage_and_replica(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_paci import BubbleMonitor, DriftMonitor

    torch.manual_seed(7)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    fit(SequentialMLP(depth=4), regression_loader(num_batches=8, batch_size=4), devices=4, max_steps=3,
        microbatches=2, data_parallel_size=2, callbacks=[DriftMonitor(), BubbleMonitor()],
        trainer_kwargs={"logger": logger, "log_every_n_steps": 1, "use_distributed_sampler": True})
    directory = tmp_path / "tb" / "version_0"
    runs = sorted(p.name for p in directory.iterdir() if p.name.startswith("stage_"))
    assert runs == ["stage_0", "stage_0_replica_1", "stage_1", "stage_1_replica_1"]
    for run in runs:
        events = EventAccumulator(str(directory / run))
        events.Reload()
        stage = run.split("_")[1]
        assert f"paci/drift_max/stage_{stage}" in events.Tags()["scalars"]


@pytest.mark.distributed
def test_local_sgd_equals_the_reference_executor_and_ends_with_one_model(tmp_path):
    """``local_sgd_steps=3``: the replicas step on their own gradients and average their parameters after every
    third local step and at the final drain; 5 steps end between two averages, so the drain's average is needed."""
    torch.manual_seed(8)
    model = SequentialMLP(depth=4)
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=10, batch_size=4)
    steps, m = 5, 2
    fit(model, loader, devices=4, max_steps=steps, schedule="paci", microbatches=m, data_parallel_size=2,
        local_sgd_steps=3, trainer_kwargs={"use_distributed_sampler": True}, callbacks=[RecordBatches(tmp_path)])
    per_replica = replica_batches(tmp_path, loader, 2)
    reference = ReferencePipeline(initial, plan_partition(initial, 2), replicas=2, local_sgd_steps=3)
    reference.run(build_schedule("paci", 2, m, m, steps), per_replica)
    replica1 = {k: v for module in reversed(reference.replica_modules[1]) for k, v in module.state_dict().items()}
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(replica1[key], value, rtol=0, atol=0)  # one model after the drain
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    every_step = ReferencePipeline(copy.deepcopy(initial), plan_partition(initial, 2), replicas=2)
    every_step.run(build_schedule("paci", 2, m, m, steps), per_replica)  # gradient averaging: another run
    assert not torch.allclose(every_step.state_dict()["net.0.weight"], model.state_dict()["net.0.weight"])


def test_what_data_parallelism_cannot_run_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"local_sgd_steps=2\)` averages data-parallel replicas"):
        fit(SequentialMLP(), regression_loader(num_batches=2), devices=2, local_sgd_steps=2)
    with pytest.raises(ValueError, match=r"`pipeline_parallel_size` >= 2 stages, got 1 stage x 4 replicas"):
        fit(SequentialMLP(), regression_loader(num_batches=2), devices=4, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"nonfinite='skip'\)` is not supported with data parallelism"):
        fit(SequentialMLP(), regression_loader(num_batches=2), devices=4, data_parallel_size=2, nonfinite="skip")
    with pytest.raises(ValueError, match="`local_sgd_steps` must be an int >= 1"):
        PACIStrategy(local_sgd_steps=0)


class RecordReduction(L.Callback):
    """Every rank writes how its replicas' gradient average ran: buckets, buckets started during a backward, and
    averages (``reduction<rank>.txt``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        average = trainer.strategy.runtime.reduce_gradients
        figures = [len(getattr(average, "buckets", [])), getattr(average, "started_in_backward", 0),
                   average.reductions]
        (self.directory / f"reduction{trainer.global_rank}.txt").write_text(" ".join(map(str, figures)))


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_buckets_reduced_during_the_backward_equal_the_blocking_average_bit_for_bit(tmp_path, schedule):
    # one bucket per block (a tiny bucket size): each starts its all-reduce when the window's last backward leaves
    # the block; the result is the blocking average's, bit for bit (a sum of two replicas has one order)
    torch.manual_seed(6)
    model = SequentialMLP(depth=6)
    blocking = copy.deepcopy(model)
    loader = regression_loader(num_batches=12, batch_size=4)
    # the split by parameters: a split by measured time could differ between the two runs, and under paci a block's
    # staleness is its stage's
    shape = dict(devices=4, max_steps=4, schedule=schedule, microbatches=2, data_parallel_size=2,
                 partition="parameters", trainer_kwargs={"use_distributed_sampler": True})
    fit(model, loader, reduce_bucket_mb=1e-6, callbacks=[RecordReduction(tmp_path)], **shape)
    fit(blocking, loader, reduce_bucket_mb=None, **shape)
    for key, value in blocking.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for rank in range(4):
        buckets, started, reductions = map(int, (tmp_path / f"reduction{rank}.txt").read_text().split())
        assert buckets >= 3 and reductions == 4  # 2 stages of 3-4 blocks; one average per step
        assert started == buckets * reductions  # every bucket started during the backward, none at the step


def test_buckets_follow_the_backward_and_keep_blocks_whole():
    from lightning_paci.engine.replicas.grad_buckets import backward_order, plan_buckets

    names = ["embed.weight", "blocks.2.a.weight", "blocks.2.a.bias", "blocks.3.weight", "blocks.4.weight",
             "head.weight", "blocks.10.weight"]
    order = [backward_order(n, blocks=[f"blocks.{i}" for i in range(2, 5)], after=["head"]) for n in names]
    assert order == [4, 3, 3, 2, 1, 0, 4]  # head first, then blocks 4, 3, 2, then everything else
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in names]
    params[3] = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))  # a dtype of its own: a bucket of its own
    buckets, first_late = plan_buckets(params, order, bucket_bytes=20, late=[0])
    assert buckets == [[5], [4], [3], [1, 2], [6], [0]] and first_late == 5  # block 2's two tensors stay together
    assert plan_buckets(params, order, bucket_bytes=1 << 20) == ([[5, 4], [3], [1, 2, 0, 6]], 3)


class SaveStageStates(L.Callback):
    """Every rank saves its stage's weights at the end of training (``weights<rank>.pt``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        own = {name: p.detach().clone() for name, p in pl_module.named_parameters() if p.device.type != "meta"}
        torch.save(own, self.directory / f"weights{trainer.global_rank}.pt")


@pytest.mark.distributed
def test_deferred_updates_keep_the_replicas_equal_and_their_drift_is_the_lists(tmp_path):
    from lightning_paci.schedules import drift_bound, static_drift

    from helpers import DumpStageRecords, read_stage_records

    torch.manual_seed(9)
    steps, m, a = 5, 2, 2
    fit(SequentialMLP(depth=6), regression_loader(num_batches=12, batch_size=4), devices=4, max_steps=steps,
        schedule="paci", microbatches=m, accumulation=a, data_parallel_size=2, reduce_bucket_mb=1e-6,
        deferred_update=True, compensation="none", callbacks=[DumpStageRecords(tmp_path), SaveStageStates(tmp_path)],
        trainer_kwargs={"use_distributed_sampler": True})
    lists = build_schedule("paci", 2, m, a, steps).actions
    for record in read_stage_records(tmp_path, 2):
        s = record["stage"]
        gaps = {int(k): v for k, v in record["gaps"].items()}
        assert gaps == static_drift(lists[s], deferred=True)  # each update made before the stage's next backward
        assert max(gaps.values()) <= drift_bound(2, s, a) + 1
    assert max(static_drift(lists[1], deferred=True).values()) == 1 > drift_bound(2, 1, a)  # the last stage lags
    for stage_ranks in ((0, 1), (2, 3)):  # ranks 2s, 2s+1: one stage's replicas, equal bit for bit
        first, second = (torch.load(tmp_path / f"weights{r}.pt") for r in stage_ranks)
        assert first.keys() == second.keys() and first
        assert all(torch.equal(first[k], second[k]) for k in first)


def test_deferred_updates_are_refused_where_there_is_nothing_to_defer_or_predict():
    with pytest.raises(ValueError, match=r"`deferred_update=True` .* needs `schedule='paci'` \(got '1f1b'\)"):
        PACIStrategy(schedule="1f1b", deferred_update=True)
    with pytest.raises(ValueError, match=r"needs .*a `reduce_bucket_mb` \(got None\)"):
        PACIStrategy(deferred_update=True, reduce_bucket_mb=None)
    with pytest.raises(ProcessRaisedException, match=r"`deferred_update=True` .* this run has one replica per stage"):
        fit(SequentialMLP(depth=4), regression_loader(num_batches=2), devices=2, max_steps=1, deferred_update=True)


@pytest.mark.distributed
def test_deferred_updates_with_tied_weights_keep_the_tied_copies_and_the_replicas_equal(tmp_path):
    # stage 0 makes a deferred update before it sends the tied weights (SEND_T), the last stage before it sends its
    # tied gradient: every installed copy is a version stage 0 made, on both replicas alike
    from helpers import DumpStageRecords, read_stage_records
    from models import HFCausalLM, token_loader

    torch.manual_seed(17)
    fit(HFCausalLM("gpt2", layers=4, tied=True), token_loader(num_batches=12, vocab=64, seq=12), devices=4,
        max_steps=5, schedule="paci", microbatches=2, data_parallel_size=2, partition="parameters",
        reduce_bucket_mb=1e-6, deferred_update=True, compensation="none",
        callbacks=[DumpStageRecords(tmp_path), SaveStageStates(tmp_path)],
        trainer_kwargs={"use_distributed_sampler": True})
    first, last = read_stage_records(tmp_path, 2)
    assert len(first["tied_fingerprints"]) == 5 and last["tied_fingerprints"] == first["tied_fingerprints"]
    for stage_ranks in ((0, 1), (2, 3)):
        one, two = (torch.load(tmp_path / f"weights{r}.pt") for r in stage_ranks)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    head, embedding = torch.load(tmp_path / "weights0.pt"), torch.load(tmp_path / "weights2.pt")
    assert torch.equal(head["model.lm_head.weight"], embedding["model.transformer.wte.weight"])
