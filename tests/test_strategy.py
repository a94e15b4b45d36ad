"""PACIStrategy through the real Lightning Trainer (fork-launched gloo ranks) against one-process references."""

from __future__ import annotations

import copy
import json
import math
import pickle

import lightning as L
import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

import lightning_paci
from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition
from lightning_paci.schedules import drift_bound

from helpers import DumpStageRecords, KeepVersion, RecordFreezeCount, RecordLosses, fit, read_stage_records
from models import (
    LoopTransformer,
    SequentialMLP,
    no_block_container,
    reference_accumulation,
    regression_loader,
    token_loader,
)

pytestmark = pytest.mark.distributed


def _assert_state_close(actual, expected, rtol):
    actual, expected = actual.state_dict(), expected if isinstance(expected, dict) else expected.state_dict()
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_import_registers_strategy_names():
    registry = L.pytorch.strategies.StrategyRegistry
    for name in ("paci", "paci_fork", "paci_spawn"):
        assert name in registry
        assert isinstance(registry.get(name), PACIStrategy)


def test_the_spawn_launcher_pickles_with_what_it_hands_back():
    # "spawn" pickles the launcher's per-rank function with the launcher: a class defined inside a function, or a
    # lambda among its callables, failed there before any rank started
    trainer = L.Trainer(strategy="paci_spawn", accelerator="cpu", devices=2, logger=False)
    function = pickle.loads(pickle.dumps(trainer.strategy.launcher._wrapping_function))
    assert type(function.__self__) is type(trainer.strategy.launcher)
    assert function.__self__._strategy.config.start_method == "spawn"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("devices", [2, 4])
def test_flush_schedules_equal_single_device_gradient_accumulation(schedule, devices):
    torch.manual_seed(0)
    model = SequentialMLP(depth=4)
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=6)
    fit(model, loader, devices=devices, schedule=schedule, microbatches=4)
    reference_accumulation(reference, list(loader), num_microbatches=4, num_steps=5)
    _assert_state_close(model, reference, rtol=1e-5)


def test_paci_with_accumulation_beyond_the_run_equals_gradient_accumulation():
    # a = 20 = all micro-batches of the run (5 batches x 4): one step per stage at the very end, no drift
    torch.manual_seed(1)
    model = SequentialMLP(depth=4)
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=6)
    fit(model, loader, devices=4, schedule="paci", microbatches=4, accumulation=20)
    optimizer = reference.configure_optimizers()
    batches = list(loader)[:5]
    for batch in batches:
        for parts in zip(*(torch.tensor_split(t, 4) for t in batch)):
            (torch.nn.functional.mse_loss(reference(parts[0]), parts[1]) / 20).backward()
    optimizer.step()
    _assert_state_close(model, reference, rtol=1e-5)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_paci_equals_reference_executor_and_drift_is_at_the_bound(tmp_path, accumulation):
    torch.manual_seed(2)
    num_stages, m, steps = 4, 4, 5
    model = SequentialMLP(depth=4)
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=6)
    fit(model, loader, devices=num_stages, schedule="paci", microbatches=m, accumulation=accumulation,
        max_steps=steps, callbacks=[DumpStageRecords(tmp_path)])
    plan = plan_partition(initial, num_stages)
    reference = ReferencePipeline(initial, plan)
    reference.run(build_schedule("paci", num_stages, m, accumulation, steps), list(loader)[:steps])
    _assert_state_close(model, reference.state_dict(), rtol=1e-6)
    for record in read_stage_records(tmp_path, num_stages):
        s = record["stage"]
        assert max(record["gaps"].values()) == drift_bound(num_stages, s, accumulation) == math.ceil(
            (num_stages - 1 - s) / accumulation
        )
        # the same gaps the reference executor measured for the same lists
        assert {int(k): v for k, v in record["gaps"].items()} == reference.runtimes[s].records.version_gaps
        assert record["peak_inflight"] <= num_stages - s
        assert record["peak_inflight"] == min(num_stages - s, m * steps)
        # no copies: the optimizer steps the module's own storage, and no parameter storage appears while
        # micro-batches are in flight (a weight stash would)
        assert record["optimizer_shares_storage"]
        assert record["extra_param_bytes_in_flight"] == 0
        assert record["own_param_bytes"] == 4 * plan.stage_params[s]


def test_update_hooks_give_version_k_weights_mid_stream_equal_to_the_reference(tmp_path):
    # every stage keeps its weights right after its 3rd update while the PACI stream keeps running (no drain):
    # merged, they are exactly the reference executor's version-3 weights (what time_to_accuracy.py evaluates)
    torch.manual_seed(6)
    num_stages, m, steps, version = 4, 4, 6, 3
    model = SequentialMLP(depth=4)
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=steps)
    fit(model, loader, devices=num_stages, schedule="paci", microbatches=m, max_steps=steps,
        callbacks=[KeepVersion(tmp_path, version)])
    reference = ReferencePipeline(initial, plan_partition(initial, num_stages))
    expected: dict[str, torch.Tensor] = {}
    for stage, runtime in enumerate(reference.runtimes):
        def keep(v: int, stage: int = stage) -> None:
            if v == version:
                expected.update({k: t.clone() for k, t in reference.modules[stage].state_dict().items()})
        runtime.update_hooks.append(keep)
    reference.run(build_schedule("paci", num_stages, m, m, steps), list(loader)[:steps])
    kept: dict[str, torch.Tensor] = {}
    for stage in range(num_stages):
        assert json.loads((tmp_path / f"versions{stage}.json").read_text()) == list(range(1, steps + 1))
        kept.update(torch.load(tmp_path / f"stage{stage}.pt"))
    assert kept.keys() == expected.keys() == initial.state_dict().keys()
    for key in expected:
        torch.testing.assert_close(kept[key], expected[key], rtol=1e-6, atol=1e-7, msg=lambda msg: f"{key}: {msg}")
    assert not all(torch.equal(kept[k], model.state_dict()[k]) for k in kept)  # version 3 is not the final model


def test_peak_activation_bytes_equal_1f1b_for_m_at_least_n():
    # the paper's memory claim, in bytes: PACI keeps exactly 1F1B's in-flight activations (cap N - s); GPipe keeps m.
    # Counted by the reference executor running the lists the ranks run (MemoryMonitor shows the same through the
    # Trainer: test_callbacks.py)
    num_stages, m, steps = 4, 6, 3
    batches = list(regression_loader(num_batches=steps, batch_size=12))
    peaks = {}
    for schedule in ("paci", "1f1b", "gpipe"):
        torch.manual_seed(5)
        model = SequentialMLP(depth=4)
        reference = ReferencePipeline(model, plan_partition(model, num_stages, partition="parameters"))
        for runtime in reference.runtimes:
            runtime.records.measure(activation_bytes=True)
        reference.run(build_schedule(schedule, num_stages, m, m, steps), batches)
        peaks[schedule] = [(r.records.peak_inflight, r.records.peak_activation_bytes) for r in reference.runtimes]
    assert peaks["paci"] == peaks["1f1b"]
    for s, ((inflight, nbytes), (gpipe_inflight, gpipe_bytes)) in enumerate(zip(peaks["paci"], peaks["gpipe"])):
        assert inflight == num_stages - s and gpipe_inflight == m
        assert nbytes > 0 and nbytes % inflight == 0  # equal micro-batches keep equal bytes
        assert gpipe_bytes == nbytes // inflight * m


class _Dropout(SequentialMLP):
    """An ordinary MLP with dropout between its layers (blocks of the container on every stage)."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16)]
        for _ in range(6):
            layers += [torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16)]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))


class _RecordMasks(L.Callback):
    """Every rank writes which activations its first Dropout zeroed in each forward."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module) -> None:
        self.masks: list[list[bool]] = []
        blocks = trainer.strategy.plan.blocks(trainer.strategy.stage_index)
        dropout = next(pl_module.net[i] for i in blocks if isinstance(pl_module.net[i], torch.nn.Dropout))
        dropout.register_forward_hook(lambda module, args, out: self.masks.append((out[0] == 0).tolist()))

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        (self.directory / f"masks{trainer.strategy.stage_index}.json").write_text(json.dumps(self.masks))


def test_dropout_is_independent_across_stages_and_equals_the_reference_executor(tmp_path):
    import json

    torch.manual_seed(12)
    model = _Dropout()
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=4)
    fit(model, loader, devices=4, max_steps=4, microbatches=4, partition="parameters",
        callbacks=[_RecordMasks(tmp_path)])
    reference = ReferencePipeline(initial, plan_partition(initial, 4, partition="parameters"))
    reference.run(build_schedule("paci", 4, 4, 4, 4), list(loader))
    _assert_state_close(model, reference.state_dict(), rtol=0)
    masks = [json.loads((tmp_path / f"masks{s}.json").read_text()) for s in range(4)]
    assert all(len(m) == 16 for m in masks)
    for s in range(1, 4):  # drawing in lock step, stage s would repeat stage 0's masks
        assert masks[s] != masks[0]


def test_same_seed_same_losses(tmp_path):
    losses = []
    for _ in range(2):
        torch.manual_seed(3)
        model = SequentialMLP()
        trainer = fit(model, regression_loader(), devices=4, schedule="paci", microbatches=4, accumulation=2)
        losses.append(float(trainer.callback_metrics["train_loss"]))
    assert losses[0] == losses[1]


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
def test_unchanged_modules_train_with_decreasing_loss(tmp_path, model_name, devices):
    torch.manual_seed(4)
    if model_name == "mlp":
        model, loader = SequentialMLP(depth=4, lr=0.3), regression_loader(num_batches=8, batch_size=16)
    else:
        model, loader = LoopTransformer(layers=4, lr=1e-2), token_loader(num_batches=8)

    losses = RecordLosses(tmp_path)
    fit(model, loader, devices=devices, max_steps=-1, trainer_kwargs={"max_epochs": 6}, callbacks=[losses],
        schedule="paci", microbatches=4)
    # rank 0 is the process whose callback the parent sees; its train_loss comes from the last stage's records
    values = losses.values()
    assert len(values) >= 6
    assert values[-1] < 0.8 * values[0]


def test_module_without_block_container_fails_with_a_fix():
    with pytest.raises(ProcessRaisedException, match="block_container"):
        fit(no_block_container(), regression_loader(), devices=2)


def test_manual_optimization_is_rejected_at_setup():
    class Manual(SequentialMLP):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ProcessRaisedException, match="automatic optimization"):
        fit(Manual(), regression_loader(), devices=2)


def test_two_optimizers_are_rejected_at_setup():
    class Two(SequentialMLP):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    # before Lightning's own check, whose advice (manual optimization) the strategy refuses too
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `configure_optimizers` returned 2 optimizers; "
                                                     r"`PACIStrategy` steps exactly one optimizer per stage"):
        fit(Two(), regression_loader(), devices=2)


def test_bad_strategy_options_name_the_argument():
    with pytest.raises(ValueError, match="`microbatches` must be an int >= 1"):
        PACIStrategy(microbatches=0)
    with pytest.raises(ValueError, match="`accumulation` must be an int >= 1"):
        PACIStrategy(accumulation=-1)
    with pytest.raises(ValueError, match="`schedule` must be one of"):
        PACIStrategy(schedule="zb")


@pytest.mark.parametrize("freeze_gc", [True, False])
def test_gc_is_frozen_during_training_and_restored(tmp_path, freeze_gc):
    # a full collection over the ~470k objects of an imported torch/Lightning stack pauses a stage for ~1 s and
    # stalls the whole pipeline: by default they are moved to the permanent generation for the run
    fit(SequentialMLP(depth=4), regression_loader(num_batches=3), devices=2, max_steps=3, microbatches=2,
        freeze_gc=freeze_gc, callbacks=[RecordFreezeCount(tmp_path)])
    for stage in range(2):
        record = json.loads((tmp_path / f"freeze{stage}.json").read_text())
        if freeze_gc:  # what setup made is frozen too, and all of it is let go at teardown
            assert record["during"] > max(10_000, record["at_setup"]) and record["teardown"] == 0
        else:  # nothing beyond what the rank inherited frozen (the test process's heap), which only dies off
            assert record["teardown"] <= record["during"] <= record["at_setup"], record
    with pytest.raises(ValueError, match="`freeze_gc` must be True or False, got 'yes'"):
        PACIStrategy(freeze_gc="yes")  # type: ignore[arg-type]


def test_uneven_microbatch_split_is_accepted():
    # batch 10 into 4 micro-batches: sizes 3, 3, 2, 2, each loss weighted by its share of the samples -- the
    # weights equal one device's on the whole batch (not the mean of the micro-batch means)
    torch.manual_seed(5)
    model = SequentialMLP()
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=6, batch_size=10)
    fit(model, loader, devices=2, schedule="1f1b", microbatches=4)
    reference_accumulation(reference, list(loader), num_microbatches=1, num_steps=5)
    _assert_state_close(model, reference, rtol=1e-5)


assert lightning_paci


def test_logged_metrics_reach_tensorboard_and_callback_metrics_on_rank_zero(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(6)
    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="run")
    trainer = fit(SequentialMLP(), regression_loader(num_batches=6), devices=4, max_steps=6,
                  trainer_kwargs={"logger": logger, "log_every_n_steps": 1}, schedule="paci", microbatches=4)
    assert "train_loss" in trainer.callback_metrics
    events = EventAccumulator(str(tmp_path / "run" / "version_0"))
    events.Reload()
    scalars = events.Scalars("train_loss")
    # under "paci" stage 0 (rank 0) learns a mini-batch's loss one call after the last stage: 6 batches, the
    # last ones arrive in the final (draining) call, so every batch is logged exactly once
    assert len(scalars) >= 5
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(scalars[-1].value, rel=1e-6)
    # the partition stays known after fit, in the process that called it (rank 0 sent it back from the fork)
    assert trainer.strategy.plan.num_stages == 4 and trainer.strategy.plan.boundaries == (0, 1, 3, 5, 7)


def test_accumulate_grad_batches_multiplies_the_accumulation():
    # 1f1b, m=4, Trainer(accumulate_grad_batches=2): one step every 8 micro-batches = single-device accumulation
    # over pairs of batches; Lightning counts max_steps=3 in such steps, i.e. 6 batches
    torch.manual_seed(7)
    model = SequentialMLP()
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=8)
    fit(model, loader, devices=2, max_steps=3, trainer_kwargs={"accumulate_grad_batches": 2},
        schedule="1f1b", microbatches=4)
    optimizer = reference.configure_optimizers()
    for k, batch in enumerate(list(loader)[:6]):
        for parts in zip(*(torch.tensor_split(t, 4) for t in batch)):
            (torch.nn.functional.mse_loss(reference(parts[0]), parts[1]) / 8).backward()
        if k % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    _assert_state_close(model, reference, rtol=1e-5)


@pytest.mark.parametrize("scheduling", [{0: 2}, {0: 1, 1: 2}])
def test_a_gradient_accumulation_scheduler_trains_as_on_one_device(scheduling):
    # the window (and the loss scale) follows Lightning's accumulate_grad_batches of the epoch each stream runs in
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    torch.manual_seed(9)
    model = SequentialMLP()
    single = copy.deepcopy(model)
    loader = regression_loader(num_batches=4)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              callbacks=[GradientAccumulationScheduler(scheduling)]).fit(single, loader)
    fit(model, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=4, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, callbacks=[GradientAccumulationScheduler(scheduling)])
    _assert_state_close(model, single, rtol=1e-5)


def test_gradient_clipping_by_norm_under_1f1b_uses_the_norm_over_every_stage():
    """[Note: global-norm clipping]: each stage scales by the norm over both stages' gradients, as one device."""
    torch.manual_seed(8)
    model = SequentialMLP(lr=0.5)
    reference = copy.deepcopy(model)
    plan = plan_partition(reference, 2)
    stage_params = [[p for i in plan.blocks(s) for p in reference.net[i].parameters()] for s in range(2)]
    loader = regression_loader(num_batches=6)
    fit(model, loader, devices=2, max_steps=3, trainer_kwargs={"gradient_clip_val": 0.05},
        schedule="1f1b", microbatches=4)
    optimizer = reference.configure_optimizers()
    for batch in list(loader)[:3]:
        for parts in zip(*(torch.tensor_split(t, 4) for t in batch)):
            (torch.nn.functional.mse_loss(reference(parts[0]), parts[1]) / 4).backward()
        stage_norms = [torch.nn.utils.get_total_norm([p.grad for p in params]) for params in stage_params]
        assert all(n > 0.05 for n in stage_norms)  # clipping is active, so the test can tell per-stage from global
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)  # one norm over every parameter
        optimizer.step()
        optimizer.zero_grad()
    _assert_state_close(model, reference, rtol=1e-5)


def test_validation_runs_through_the_pipeline_after_a_drain(tmp_path):
    torch.manual_seed(9)
    model = SequentialMLP()
    loader = regression_loader(num_batches=4)
    val = regression_loader(num_batches=2, seed=1)
    trainer = L.Trainer(
        strategy=PACIStrategy(start_method="fork", microbatches=4), accelerator="cpu", devices=2, max_epochs=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, loader, val)
    # the last validation ran on the final weights, which rank 0's module holds after fit
    with torch.no_grad():
        expected = sum(torch.nn.functional.mse_loss(model(x), y) * len(x) for x, y in val) / sum(len(x) for x, _ in val)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(float(expected), rel=1e-5)


def test_setup_logs_the_time_balanced_split(tmp_path, monkeypatch):
    # block times come from a clock the blocks themselves advance, so CPU load cannot change the decision
    from functools import partial

    from lightning_paci.integration.stage import setup_probe
    from lightning_paci.partition import profile_block_costs

    from test_partition import FakeClock, TickBlock

    clock = FakeClock()
    monkeypatch.setattr(setup_probe, "profile_block_costs", partial(profile_block_costs, clock=clock))  # forked

    class Ticking(SequentialMLP):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), *[TickBlock(16, clock, 0.004) for _ in range(6)],
                                           TickBlock(16, clock, 0.012), torch.nn.Linear(16, 4))

    fit(Ticking(), regression_loader(num_batches=3), devices=4, max_steps=2, microbatches=4, partition="time",
        callbacks=[DumpStageRecords(tmp_path)])
    line = read_stage_records(tmp_path, 4)[0]["plan"]  # the text of the setup log line
    assert "by parameters [8.0, 16.0, 16.0, 32.0], by time [24.0, 24.0, 24.0, 0.0];" in line
    assert "-> using time (time only when in all)" in line
    assert "stage 2: net[7:8]" in line  # the slow block alone on its stage
    assert line.endswith("; split partition=[4, 7, 8]")  # what to pass to reproduce it


def test_the_default_split_is_the_same_on_every_machine_and_a_measured_one_is_reused_on_resume(tmp_path,
                                                                                                monkeypatch):
    """``partition`` defaults to parameter counts: no block is timed, whatever the clock says. A measured split
    (``"time"``) is saved in the checkpoint and reused by a resume, where a new measurement would cut elsewhere."""
    from functools import partial

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_paci.integration.stage import setup_probe
    from lightning_paci.partition import profile_block_costs

    from test_partition import FakeClock, TickBlock

    clock = FakeClock()
    monkeypatch.setattr(setup_probe, "profile_block_costs", partial(profile_block_costs, clock=clock))  # forked

    class Ticking(SequentialMLP):
        def __init__(self, last_seconds: float):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), *[TickBlock(16, clock, 0.004) for _ in range(6)],
                                           TickBlock(16, clock, last_seconds), torch.nn.Linear(16, 4))

    def plan_line(name, *, last_seconds=0.012, checkpoints=(), max_steps=2, ckpt_path=None, **kwargs):
        directory = tmp_path / name
        directory.mkdir()
        fit(Ticking(last_seconds), regression_loader(num_batches=3), devices=4, max_steps=max_steps, microbatches=4,
            callbacks=[DumpStageRecords(directory), *checkpoints], ckpt_path=ckpt_path,
            trainer_kwargs={"enable_checkpointing": bool(checkpoints)}, **kwargs)
        return read_stage_records(directory, 4)[0]["plan"]

    default = plan_line("default")
    assert "by time" not in default and default.endswith("; split partition=[2, 4, 6]")  # parameter counts
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = plan_line("first", partition="time", checkpoints=[saved])
    assert first.endswith("; split partition=[4, 7, 8]")
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert checkpoint["paci_partition"] == {"num_stages": 4, "cut": [4, 7, 8]}
    # every block as fast as the others now: measured again, the split would be parameter counts' [2, 4, 6]
    resumed = plan_line("resumed", partition="time", last_seconds=0.004, max_steps=4,
                        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert "by time" not in resumed and "the split the checkpoint recorded, partition=[4, 7, 8]" in resumed
    assert resumed.endswith("; split partition=[4, 7, 8]")


def test_torchmetrics_object_logged_in_validation_reaches_every_rank(tmp_path):
    import torchmetrics

    class EveryRank(L.Callback):  # each rank's own value, written where the test reads it
        def on_fit_end(self, trainer, pl_module):
            value = float(trainer.callback_metrics["val_mse"])
            (tmp_path / f"val_mse{trainer.global_rank}.txt").write_text(repr(value))

    class WithMetric(SequentialMLP):
        def __init__(self):
            super().__init__()
            self.val_mse = torchmetrics.MeanSquaredError()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_mse.update(self(x), y)
            self.log("val_mse", self.val_mse)

    torch.manual_seed(17)
    model = WithMetric()
    val = regression_loader(num_batches=3, seed=2)
    trainer = L.Trainer(
        strategy=PACIStrategy(start_method="fork", microbatches=4), accelerator="cpu", devices=4, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[EveryRank()],
    )
    trainer.fit(model, regression_loader(num_batches=3), val)
    with torch.no_grad():
        x = torch.cat([b[0] for b in val])
        y = torch.cat([b[1] for b in val])
        expected = torch.nn.functional.mse_loss(model(x), y)
    assert float(trainer.callback_metrics["val_mse"]) == pytest.approx(float(expected), rel=1e-5)
    ranks = [float((tmp_path / f"val_mse{r}.txt").read_text()) for r in range(4)]
    assert ranks == pytest.approx([float(expected)] * 4, rel=1e-5)  # every rank's own callback_metrics


def test_long_streams_drain_every_max_stream_batches_and_equal_the_reference():
    # 7 batches with max_stream_batches=3: streams of 3, 3 and 1 batches; accumulation 3 does not divide m = 4,
    # so the optimizer-step positions must continue across the drains (backward_offset)
    torch.manual_seed(23)
    model = SequentialMLP(depth=4)
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=7)
    fit(model, loader, devices=4, max_steps=7, schedule="paci", microbatches=4, accumulation=3,
        partition="parameters", max_stream_batches=3)
    reference = ReferencePipeline(initial, plan_partition(initial, 4, partition="parameters"))
    batches = list(loader)
    done = 0
    for start, count in ((0, 3), (3, 3), (6, 1)):
        reference.run(build_schedule("paci", 4, 4, 3, count, backward_offset=done % 3), batches[start:start + count])
        done += 4 * count
    _assert_state_close(model, reference.state_dict(), rtol=1e-6)


def test_stage_processes_on_the_cpu_share_the_cores_unless_omp_num_threads_is_set():
    import os

    from lightning_paci.integration.processes.process_groups import share_cpu_cores

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        assert share_cpu_cores(torch.device("cpu"), 10**6, environ={"OMP_NUM_THREADS": "4"}) is None  # the user's
        assert share_cpu_cores(torch.device("meta"), 10**6, environ={}) is None  # not a CPU run
        line = share_cpu_cores(torch.device("cpu"), 10**6, environ={})
        assert line is not None and "1 intra-op thread(s) each" in line and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
