"""``PACIStrategy(virtual_stages=2)`` through the real Trainer: each process carves its two stages of an unchanged
module in place and runs its device's list ([Note: chunks of one device]). Flush schedules equal one device in
float64 (training, logged values and validation), "paci" equals the one-process reference executor of the same
lists (also with staleness compensation and momentum, with data-parallel replicas, and a tied GPT-2 under the V
placement), checkpoints resume exactly and into one stage per process."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition

from helpers import KeepMetrics, Momentum, RecordBatches, fit, one_device, replica_batches
from models import HFCausalLM, SequentialMLP, regression_loader, token_loader

pytestmark = pytest.mark.distributed

P, V = 2, 2


class _Scheduled(Momentum):
    """SGD with momentum and a per-step LR schedule: every stage's update uses its own update count's rate."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _doubles(num_batches: int, batch_size: int = 8) -> DataLoader:
    x, y = regression_loader(num_batches=num_batches, batch_size=batch_size).dataset.tensors
    return DataLoader(TensorDataset(x.double(), y.double()), batch_size=batch_size)


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], initial=None) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-12, atol=1e-12, msg=lambda m: f"{key}: {m}")
        if initial is not None and key.endswith("weight"):
            assert not torch.equal(value, initial[key]), f"{key} did not train"


def _reference(initial, schedule: str, m: int, a: int, loader, *, placement: str, tied: bool = False,
               compensation: str = "auto"):
    reference = ReferencePipeline(copy.deepcopy(initial), plan_partition(initial, P * V, partition="parameters"),
                                  compensation=compensation)
    batches = list(loader)
    reference.run(build_schedule(schedule, P, m, a, len(batches), virtual_stages=V, placement=placement, tied=tied),
                  batches)
    return reference.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule, placement", [("interleaved", "loop"), ("bfs", "v")])
def test_flush_schedules_over_two_stages_per_process_equal_one_device(tmp_path, schedule, placement):
    torch.manual_seed(0)
    model = _Scheduled(width=8, depth=8).double()
    initial = copy.deepcopy(model)
    loader, val = _doubles(3), _doubles(2)
    fit(model, loader, devices=P, max_steps=3, schedule=schedule, microbatches=2, partition="parameters",
        virtual_stages=V, placement=placement, val_dataloaders=val, callbacks=[KeepMetrics(tmp_path / "m.json")],
        trainer_kwargs={"limit_val_batches": 2, "val_check_interval": 3})
    expected = copy.deepcopy(initial)
    one_device(max_steps=3, limit_val_batches=2, val_check_interval=3,
               callbacks=[KeepMetrics(tmp_path / "one.json")]).fit(expected, loader, val)
    _assert_equal(model.state_dict(), expected.state_dict(), initial.state_dict())
    metrics, one = (json.loads((tmp_path / name).read_text()) for name in ("m.json", "one.json"))
    assert set(metrics) == set(one) == {"train_loss", "val_loss"}
    for key in one:  # the last batch's loss and the validation loss, from the stage holding the loss (rank 0)
        assert metrics[key] == pytest.approx(one[key], rel=1e-6)  # a logged float is kept as a float32 tensor


@pytest.mark.timeout(120)
@pytest.mark.parametrize("placement, accumulation", [("loop", 4), ("v", 1)])
def test_paci_over_two_stages_per_process_equals_the_reference_executor(placement, accumulation):
    # SGD with momentum, a per-step LR schedule and the default compensation: each stage's weight prediction reads
    # its share of the one optimizer the process holds, its updates cross its own drift and use its own count's rate
    torch.manual_seed(1)
    model = _Scheduled(width=8, depth=8).double()
    initial = copy.deepcopy(model)
    loader = _doubles(4)
    fit(model, loader, devices=P, max_steps=4, schedule="paci", microbatches=4, accumulation=accumulation,
        partition="parameters", virtual_stages=V, placement=placement)
    expected = _reference(initial, "paci", 4, accumulation, loader, placement=placement)
    _assert_equal(model.state_dict(), expected, initial.state_dict())


@pytest.mark.timeout(150)
def test_a_tied_gpt2_under_the_v_placement_shares_one_weight_and_equals_the_reference_executor():
    torch.manual_seed(2)
    model = HFCausalLM("gpt2", layers=4, tied=True).double()  # AdamW
    initial = copy.deepcopy(model)
    loader = token_loader(num_batches=3)
    fit(model, loader, devices=P, max_steps=3, schedule="paci", microbatches=2, accumulation=2,
        partition="parameters", virtual_stages=V, placement="v", compensation="none")
    expected = _reference(initial, "paci", 2, 2, loader, placement="v", tied=True, compensation="none")
    _assert_equal(model.state_dict(), expected, initial.state_dict())
    assert model.model.lm_head.weight is model.model.transformer.wte.weight  # tied again after fit


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dp_shard", ["none", "optimizer"])
def test_replicas_of_two_stages_per_process_equal_the_reference_executor(tmp_path, dp_shard):
    # with dp_shard="optimizer" each replica steps its share of every stage's tensors (ZeRO-1) and sends them to
    # the other: bit for bit the unsharded update for SGD with momentum
    torch.manual_seed(3)
    model = Momentum(width=8, depth=8, lr=0.05).double()
    initial = copy.deepcopy(model)
    loader = _doubles(8, batch_size=4)
    fit(model, loader, devices=2 * P, max_steps=3, schedule="paci", microbatches=2, accumulation=2,
        partition="parameters", virtual_stages=V, data_parallel_size=2, dp_shard=dp_shard, compensation="none",
        trainer_kwargs={"use_distributed_sampler": True},
        callbacks=[RecordBatches(tmp_path), _StateBytes(tmp_path)])
    per_replica = replica_batches(tmp_path, loader, 2)
    for process in range(P):  # each replica holds the momentum of its share of the process's two stages
        held = [json.loads((tmp_path / f"state{process}_{r}.json").read_text()) for r in range(2)]
        whole = held[0]["params"]  # SGD's momentum: one buffer per parameter
        assert sum(h["state"] for h in held) == (whole if dp_shard == "optimizer" else 2 * whole)
        assert all(h["state"] < h["params"] for h in held) == (dp_shard == "optimizer")
    reference = ReferencePipeline(initial, plan_partition(initial, P * V, partition="parameters"), replicas=2,
                                  compensation="none")
    reference.run(build_schedule("paci", P, 2, 2, 3, virtual_stages=V), per_replica)
    _assert_equal(model.state_dict(), reference.state_dict())


class _StateBytes(L.Callback):
    """Every rank writes its optimizer-state bytes and its parameters' bytes at the end of training."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        from lightning_paci.engine.replicas.optimizer_shards import optimizer_state_bytes

        strategy = trainer.strategy
        record = {"state": optimizer_state_bytes(strategy.stage.optimizer.optimizer),
                  "params": sum(p.numel() * p.element_size() for p in pl_module.parameters())}
        path = self.directory / f"state{strategy.stage_index}_{strategy.replica_index}.json"
        path.write_text(json.dumps(record))


def _resumable(directory, epochs: int, **options) -> L.Trainer:
    return L.Trainer(
        strategy=PACIStrategy(start_method="fork", microbatches=4, partition="parameters", **options),
        accelerator="cpu", devices=P, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")])


@pytest.mark.timeout(150)
def test_a_sharded_checkpoint_of_two_stages_per_process_resumes_exactly(tmp_path):
    # a = 5: an epoch's 12 micro-batches leave a window open at the checkpoint (12 mod 5 = 2): every stage of a
    # process saves its open window's gradients, and the tied weight (one Parameter on process 0) its own
    loader = token_loader(num_batches=3, vocab=64, seq=10)
    torch.manual_seed(4)
    model = HFCausalLM("gpt2", layers=4, tied=True, lr=1e-2)
    first = copy.deepcopy(model)
    options = dict(schedule="paci", accumulation=5, virtual_stages=V, placement="v", checkpoint_layout="sharded")
    _resumable(tmp_path / "full", 2, **options).fit(model, loader)
    _resumable(tmp_path / "part", 1, **options).fit(first, loader)
    shards = sorted(p.name for p in (tmp_path / "part" / "epoch=0.ckpt").iterdir())
    assert shards == ["meta.pt", "stage_000.pt", "stage_001.pt"]  # one file per process, its two stages in it
    _resumable(tmp_path / "part", 2, **options).fit(first, loader, ckpt_path=str(tmp_path / "part" / "epoch=0.ckpt"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(first.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.timeout(150)
def test_a_checkpoint_of_two_stages_per_process_resumes_on_one_stage_per_process(tmp_path):
    torch.manual_seed(5)
    model = Momentum(width=8, depth=8, lr=0.05).double()
    initial = copy.deepcopy(model)
    loader = _doubles(2)
    _resumable(tmp_path, 1, schedule="interleaved", virtual_stages=V).fit(model, loader)
    path = tmp_path / "epoch=0.ckpt"
    assert torch.load(path, weights_only=False)["optimizer_states"][0]["paci"]["steps"] == 2
    resumed = copy.deepcopy(initial)
    _resumable(tmp_path / "one", 2, schedule="1f1b").fit(resumed, loader, ckpt_path=str(path))
    expected = copy.deepcopy(initial)
    one_device(max_epochs=2).fit(expected, loader)  # momentum: a lost optimizer state changes every later step
    _assert_equal(resumed.state_dict(), expected.state_dict(), initial.state_dict())


@pytest.mark.timeout(150)
def test_monitors_report_every_stage_of_every_process_and_drift_within_its_stage_bound(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_paci import BubbleMonitor, DriftMonitor, MemoryMonitor, TimelineMonitor
    from lightning_paci.schedules import chunk_drift_bounds

    torch.manual_seed(6)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [DriftMonitor(), BubbleMonitor(), MemoryMonitor(), TimelineMonitor(every_n_steps=4)]
    fit(SequentialMLP(width=8, depth=8), regression_loader(num_batches=5), devices=P,
        max_steps=4, schedule="paci", microbatches=2, accumulation=1, partition="parameters", virtual_stages=V,
        placement="v", callbacks=callbacks, trainer_kwargs={"logger": logger, "log_every_n_steps": 1})
    directory = tmp_path / "tb" / "version_0"
    bounds = chunk_drift_bounds(build_schedule("paci", P, 2, 1, 6, virtual_stages=V, placement="v"))
    devices = {0: (0, 3), 1: (1, 2)}  # the V placement
    for process, stages in devices.items():
        events = EventAccumulator(str(directory / f"stage_{process}"))
        events.Reload()
        scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
        assert f"paci/bubble_fraction/stage_{process}" in scalars  # the process's time
        for stage in stages:
            assert scalars[f"paci/drift_bound/stage_{stage}"][-1] == bounds[stage]
            assert 0 <= max(scalars[f"paci/drift_max/stage_{stage}"]) <= bounds[stage]
            assert max(scalars[f"paci/peak_activation_bytes/stage_{stage}"]) > 0
    assert bounds[0] > 0  # stage 0's micro-batches cross updates of its own
    trace = json.loads((directory / "timeline" / "trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}  # a row per process


@pytest.mark.timeout(120)
def test_tied_weights_under_the_loop_placement_are_refused_at_setup():
    from torch.multiprocessing import ProcessRaisedException

    tied = HFCausalLM("gpt2", layers=4, tied=True)
    with pytest.raises(ProcessRaisedException, match=r"tied weights with `virtual_stages=2` need the first and the "
                                                     r"last chunk on one device: use placement='v'"):
        fit(tied, token_loader(num_batches=2), devices=P, max_steps=1, microbatches=2, virtual_stages=V,
            placement="loop")


@pytest.mark.timeout(120)
def test_recomputation_per_stage_equals_the_reference_executor_recomputing():
    torch.manual_seed(7)
    model = Momentum(width=8, depth=8, lr=0.05).double()
    initial = copy.deepcopy(model)
    loader = _doubles(3)
    fit(model, loader, devices=P, max_steps=3, schedule="paci", microbatches=2, accumulation=1,
        partition="parameters", virtual_stages=V, recompute="blocks", compensation="none")
    reference = ReferencePipeline(copy.deepcopy(initial), plan_partition(initial, P * V, partition="parameters"),
                                  compensation="none", recompute="blocks")
    reference.run(build_schedule("paci", P, 2, 1, 3, virtual_stages=V), list(loader))
    _assert_equal(model.state_dict(), reference.state_dict(), initial.state_dict())


@pytest.mark.timeout(200)
def test_stage_only_construction_and_weights_per_stage_hold_each_process_s_stages_only(tmp_path):
    from test_big_models import DumpWeights, _assert_equal_states, _pretrained_directory

    from models import LaterLoopTransformer, LoopTransformer, PretrainedGPT2

    def run(name: str, model, vocab: int = 32, **options) -> DumpWeights:
        dump = DumpWeights(tmp_path / name)
        dump.directory.mkdir()
        L.seed_everything(0)
        fit(model, token_loader(vocab=vocab), devices=P, max_steps=3, callbacks=[dump], partition="parameters",
            virtual_stages=V, **options)
        return dump

    # configure_model: recorded on meta, each process replays only its two stages' parameters, bit for bit
    built = run("configure_model", LaterLoopTransformer(layers=4))
    _assert_equal_states(built.weights(), run("init", LoopTransformer(layers=4)).weights())
    stage_params = plan_partition(LoopTransformer(layers=4), P * V, partition="parameters").stage_params
    for process in range(P):  # the loop placement: stages p and p + P
        assert built.start(process)["params"] == stage_params[process] + stage_params[process + P]
    # weights=: a tied GPT-2 read per process under the V placement trains as from_pretrained in __init__ does
    directory = _pretrained_directory(tmp_path / "pretrained")
    read = run("staged", PretrainedGPT2(directory, load_now=False), 64, weights=str(directory), placement="v")
    ordinary = run("ordinary", PretrainedGPT2(directory, load_now=True), 64, placement="v")
    _assert_equal_states(read.weights(), ordinary.weights())
    keys = [set(read.start(process)["weights_read"]["keys"]) for process in range(P)]
    assert {"transformer.wte.weight", "transformer.ln_f.weight"} <= keys[0]  # stages 0 and 3: embedding and head
    assert not keys[1] & {"transformer.wte.weight", "transformer.ln_f.weight"} and not keys[0] & keys[1]


class _StageGaps(L.Callback):
    """Every rank writes each of its stages' measured version gaps and its weights at the end of training."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        gaps = {stage: dict(runtime.records.version_gaps) for stage, runtime in strategy.runtimes.items()}
        (self.directory / f"gaps{trainer.global_rank}.json").write_text(json.dumps(gaps))
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   self.directory / f"weights{trainer.global_rank}.pt")


@pytest.mark.timeout(150)
def test_deferred_updates_per_stage_keep_the_replicas_equal_and_each_stage_s_drift_is_its_lists(tmp_path):
    from lightning_paci.schedules import chunk_drift_bounds, static_drift

    torch.manual_seed(9)
    steps, m, a = 4, 2, 2
    fit(SequentialMLP(width=8, depth=8), regression_loader(num_batches=10, batch_size=4), devices=2 * P,
        max_steps=steps, schedule="paci", microbatches=m, accumulation=a, partition="parameters", virtual_stages=V,
        data_parallel_size=2, reduce_bucket_mb=1e-6, deferred_update=True, compensation="none",
        callbacks=[_StageGaps(tmp_path)], trainer_kwargs={"use_distributed_sampler": True})
    schedule = build_schedule("paci", P, m, a, steps, virtual_stages=V)
    bounds = chunk_drift_bounds(schedule, deferred=True)
    assert bounds != chunk_drift_bounds(schedule)  # the deferral shows in the bound
    for rank in range(2 * P):
        for stage, gaps in json.loads((tmp_path / f"gaps{rank}.json").read_text()).items():
            measured = {int(k): v for k, v in gaps.items()}
            assert measured == static_drift(schedule.stage_actions(int(stage)), deferred=True)
            assert max(measured.values()) <= bounds[int(stage)]
    for first, second in ((0, 1), (2, 3)):  # ranks 2p, 2p+1: one process's replicas, equal bit for bit
        one, other = (torch.load(tmp_path / f"weights{r}.pt") for r in (first, second))
        assert one.keys() == other.keys() and one
        assert all(torch.equal(one[k], other[k]) for k in one)
