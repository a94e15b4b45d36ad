"""Lightning's own callbacks (every class ``lightning.pytorch.callbacks`` exports) under a 2-stage pipeline: each
runs and does its job, and a setting a stage cannot run is refused at setup naming the callback, the setting and the
fix (``ModelPruning``'s);
``on_train_batch_end`` hands every stage the batch's loss as one device does when a callback compares it per rank
(``SpikeDetection``);
``EMAWeightAveraging`` averages each stage's own weights as one device does (float64, SGD), also through a
checkpoint."""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path

import lightning as L
import lightning.pytorch.callbacks as lightning_callbacks
import pytest
import torch
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch.callbacks import (
    DeviceStatsMonitor,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LambdaCallback,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    OnExceptionCheckpoint,
    RichModelSummary,
    RichProgressBar,
    SpikeDetection,
    StochasticWeightAveraging,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
)
from torch.multiprocessing import ProcessRaisedException
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from lightning_paci.integration.lightning_callbacks.batch_outputs import check_callbacks
from lightning_paci.integration.stage.reference_pipeline import ReferencePipeline
from lightning_paci.partition import plan_partition
from lightning_paci.schedules import build_schedule

from helpers import fit, one_device
from models import LaterLoopTransformer, SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed

# run by this file's Trainer runs (the rest: shown by the named tests, or no callback to run)
RUN_HERE = {"EMAWeightAveraging", "WeightAveraging", "SpikeDetection", "LambdaCallback",
             "RichProgressBar", "RichModelSummary", "Timer", "LearningRateMonitor",
            "DeviceStatsMonitor", "ThroughputMonitor", "TQDMProgressBar",
            "GradientAccumulationScheduler", "OnExceptionCheckpoint"}
_CHECKPOINTS = "test_transformers.py::test_model_checkpoint_and_early_stopping_on_val_loss_behave_as_on_one_device"
_FINETUNING = "test_callbacks_per_stage.py::test_an_unfrozen_param_group_reaches_only_its_stage_as_on_one_device"
SHOWN_ELSEWHERE = {
    "StochasticWeightAveraging":
        "test_callbacks_per_stage.py::test_swa_averages_each_stage_and_switches_its_learning_rate_as_one_device",
    "BaseFinetuning": _FINETUNING,
    "ModelPruning": "test_callbacks_per_stage.py::"
                    "test_pruning_prunes_each_stage_as_one_device_and_checkpoints_its_permanent_weights",
    "BackboneFinetuning": "test_callbacks_per_stage.py::"
                          "test_backbone_finetuning_sets_the_backbone_groups_learning_rate_on_every_stage_as_one_device",
    "ModelSummary": "test_one_device.py::test_the_model_summary_reports_the_whole_model",
    "ModelCheckpoint": _CHECKPOINTS,
    "EarlyStopping": _CHECKPOINTS,
    "BasePredictionWriter": "test_transformers.py::test_predict_gives_single_device_predictions_on_rank_zero_in_order",
    "LearningRateFinder":
        "test_support.py::test_the_tuner_under_a_fork_launcher_is_refused_naming_the_default_launcher",
    "BatchSizeFinder": "test_support.py::test_scale_batch_size_is_refused_by_lightning_for_the_distributed_strategy",
}
BASES = {"Callback", "Checkpoint", "ProgressBar"}  # abstract: what a user subclasses, nothing of their own to run


def _spiked_loader(spike_at: int | None, num_batches: int = 6) -> DataLoader:
    x, y = regression_loader(num_batches=num_batches).dataset.tensors
    y = y.clone()
    if spike_at is not None:
        y[spike_at * 8:(spike_at + 1) * 8] *= 40.0  # one batch with targets far off: its loss jumps
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _record_outputs(path: Path):
    def record(trainer, pl_module, outputs, batch, batch_idx):
        with (path / f"stage{trainer.strategy.stage_index}.txt").open("a") as fh:
            fh.write(f"{batch_idx} {float(outputs['loss'])!r} {outputs['loss'].dtype}\n")
    return record


def test_every_lightning_callback_is_run_here_shown_elsewhere_or_refused():
    exported = set(lightning_callbacks.__all__)
    assert exported == RUN_HERE | set(SHOWN_ELSEWHERE) | BASES, "a callback no test covers"
    tests = Path(__file__).parent
    for where in SHOWN_ELSEWHERE.values():
        file, name = where.split("::")
        assert f"def {name}(" in (tests / file).read_text(), where


@pytest.mark.parametrize(("kwargs", "module", "match"), [
    ({"make_pruning_permanent": False}, SequentialMLP,
     r"`ModelPruning\(make_pruning_permanent=False\)` is not supported by `PACIStrategy`: .*`weight_orig`.* Keep "
     r"the default `make_pruning_permanent=True`"),
    ({"pruning_fn": "random_unstructured"}, SequentialMLP,
     r"`ModelPruning\(pruning_fn=RandomUnstructured, use_global_unstructured=True\)` is not supported .* Use "
     r"`'l1_unstructured'`"),
    ({"pruning_fn": "random_structured", "use_global_unstructured": False, "pruning_dim": 0}, SequentialMLP,
     r"`ModelPruning\(pruning_fn='random_structured'\)` is not supported .* generator that also orders its "
     r"batches.* Use `'l1_unstructured'`"),
    ({"resample_parameters": True}, SequentialMLP,
     r"`ModelPruning\(resample_parameters=True\)` is not supported .* Keep `resample_parameters=False`"),
    ({}, LaterLoopTransformer,
     r"`ModelPruning` with a model built in `configure_model` is not supported .* Build the model in `__init__`"),
], ids=["not-permanent", "global-random", "random", "resampled", "configure-model"])
def test_a_pruning_setting_a_stage_cannot_run_is_refused_naming_it_and_the_fix(kwargs, module, match):
    callback = ModelPruning(**{"pruning_fn": "l1_unstructured", "amount": 0.2, **kwargs})
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    with pytest.raises(ValueError, match=match):
        check_callbacks(trainer, module())


def test_pruning_a_weight_two_modules_share_is_refused_naming_it():
    model = SequentialMLP()
    model.net[4].weight = model.net[2].weight  # a tied pair
    callback = ModelPruning("l1_unstructured", amount=0.2, parameters_to_prune=[(model.net[4], "weight")])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    with pytest.raises(ValueError, match=r"`ModelPruning` of a weight two modules share \(`net.4.weight`\) is not "
                                         r"supported .* Leave the shared weight out"):
        check_callbacks(trainer, model)


def test_a_refused_pruning_setting_stops_fit_at_setup_with_its_sentence():
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `ModelPruning\(make_pruning_permanent=False\)` "
                                                     r"is not supported by `PACIStrategy`"):
        fit(SequentialMLP(), regression_loader(), devices=2,
            callbacks=[ModelPruning("l1_unstructured", amount=0.2, make_pruning_permanent=False)])


def test_pruning_with_virtual_stages_is_refused_naming_one_stage_per_process():
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `ModelPruning` under `PACIStrategy` needs one "
                                                     r"stage per process and no data-parallel replicas"):
        fit(SequentialMLP(), regression_loader(), devices=2, virtual_stages=2, schedule="interleaved",
            callbacks=[ModelPruning("l1_unstructured", amount=0.2)])


@pytest.mark.parametrize("callback", [EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=0.01)],
                         ids=lambda c: type(c).__name__)
def test_weight_averaging_of_a_model_built_in_configure_model_is_refused_naming_init(callback):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    with pytest.raises(ValueError, match=rf"`{type(callback).__name__}` with a model built in `configure_model` is "
                                         r"not supported .* Build the model in `__init__`"):
        check_callbacks(trainer, LaterLoopTransformer())


def test_every_stage_gets_one_devices_batch_loss_under_1f1b_in_float64(tmp_path, capfd):
    torch.manual_seed(3)
    model = SequentialMLP(lr=0.05)
    expected: list[float] = []
    reference = SequentialMLP(lr=0.05)
    reference.load_state_dict(model.state_dict())
    keep = LambdaCallback(on_train_batch_end=lambda t, m, outputs, b, i: expected.append(float(outputs["loss"])))
    one_device(max_steps=4, precision="64-true", callbacks=[keep, SpikeDetection(exclude_batches_path=tmp_path)]
               ).fit(reference, regression_loader())
    timer = Timer()
    fit(model, regression_loader(), devices=2, max_steps=4, schedule="1f1b", microbatches=2,
        partition="parameters", callbacks=[
            SpikeDetection(exclude_batches_path=tmp_path), LambdaCallback(on_train_batch_end=_record_outputs(tmp_path)),
            RichProgressBar(), RichModelSummary(), timer],
        trainer_kwargs={"precision": "64-true", "enable_progress_bar": True, "enable_model_summary": True})
    for stage in range(2):
        rows = [line.split() for line in (tmp_path / f"stage{stage}.txt").read_text().splitlines()]
        assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
        assert {r[2] for r in rows} == {"torch.float64"}
        torch.testing.assert_close(torch.tensor([float(r[1]) for r in rows], dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert timer.time_elapsed("train") > 0.0  # handed back to the main process with the callbacks' states
    assert "Total params" in capfd.readouterr().out


def test_lightnings_monitors_and_spike_detection_with_defaults_run_under_paci(tmp_path, capfd):
    torch.manual_seed(4)
    one_device(max_steps=6, callbacks=[SpikeDetection(exclude_batches_path=tmp_path)]).fit(
        SequentialMLP(lr=0.05), _spiked_loader(None))  # one device finishes it cleanly
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="csv", version=0)
    fit(SequentialMLP(lr=0.05), _spiked_loader(None), devices=2, max_steps=6, schedule="paci", microbatches=2,
        partition="parameters", callbacks=[
            SpikeDetection(exclude_batches_path=tmp_path), LearningRateMonitor(), DeviceStatsMonitor(),
            ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0], window_size=2), TQDMProgressBar(),
            GradientAccumulationScheduler({0: 1}), OnExceptionCheckpoint(tmp_path / "exception"),
            LambdaCallback(on_train_batch_end=_record_outputs(tmp_path))],
        trainer_kwargs={"logger": logger, "log_every_n_steps": 1, "enable_progress_bar": True,
                        "enable_checkpointing": True, "default_root_dir": tmp_path})
    assert not (tmp_path / "skip_batches.json").exists()
    # every stage handed SpikeDetection the last stage's loss of the same batch (none a placeholder 0.0)
    stage0, stage1 = ((tmp_path / f"stage{s}.txt").read_text().splitlines() for s in range(2))
    assert stage0 == stage1 and len(stage0) == 6 and all(float(row.split()[1]) > 0.0 for row in stage0)
    assert not (tmp_path / "exception").exists()  # no exception, no checkpoint
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as fh:
        columns = set(next(csv.reader(fh)))
    assert "lr-SGD" in columns
    assert "DeviceStatsMonitor.on_train_batch_end/cpu_percent" in columns, columns
    assert {"train/batches", "train/samples_per_sec"} <= columns, columns
    assert "Epoch 0: 100%" in capfd.readouterr().out


def test_a_planted_spike_stops_the_pipeline_at_one_devices_batch_and_the_exception_checkpoint_is_written(tmp_path):
    torch.manual_seed(5)
    with pytest.raises(TrainingSpikeException, match=r"Training spike detected in batch 3"):
        one_device(max_steps=6, callbacks=[SpikeDetection(exclude_batches_path=tmp_path / "one")]).fit(
            SequentialMLP(lr=0.05), _spiked_loader(3))
    with pytest.raises(ProcessRaisedException, match=r"TrainingSpikeException: Training spike detected in batch 3"):
        fit(SequentialMLP(lr=0.05), _spiked_loader(3), devices=2, max_steps=6, schedule="paci", microbatches=2,
            partition="parameters", callbacks=[SpikeDetection(exclude_batches_path=tmp_path / "pipe"),
                                               OnExceptionCheckpoint(tmp_path / "exception")],
            trainer_kwargs={"enable_checkpointing": True, "default_root_dir": tmp_path})
    assert (tmp_path / "pipe" / "skip_batches.json").read_text().split() == ["[", "2,", "3", "]"]
    assert (tmp_path / "exception" / "on_exception.ckpt").is_file()


class RecordValLoss(L.Callback):
    """Rank 0 appends each validation's ``val_loss`` to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with self.path.open("a") as fh:
                fh.write(f"{float(trainer.callback_metrics['val_loss'])!r}\n")


def _val_losses(path: Path) -> list[float]:
    return [float(v) for v in path.read_text().split()]


def _ema_callbacks(directory: Path | None, val_losses: Path) -> list[L.Callback]:
    callbacks: list[L.Callback] = [EMAWeightAveraging(decay=0.5), RecordValLoss(val_losses)]
    if directory is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1))
    return callbacks


_VALIDATION = {"limit_val_batches": 2, "val_check_interval": 2, "num_sanity_val_steps": 0}  # after steps 2, 4


def _ema_fit(model, val_losses: Path, *, schedule="1f1b", stages=2, ckpt_path=None, checkpoints: Path | None = None):
    fit(model, regression_loader(), devices=stages, max_steps=4, schedule=schedule, microbatches=2,
        partition="parameters", callbacks=_ema_callbacks(checkpoints, val_losses), ckpt_path=ckpt_path,
        val_dataloaders=regression_loader(num_batches=2, seed=1),
        trainer_kwargs={"precision": "64-true", "enable_checkpointing": checkpoints is not None, **_VALIDATION})


def _one_device_ema(model, val_losses: Path, *, ckpt_path=None, checkpoints: Path | None = None):
    one_device(max_steps=4, precision="64-true", callbacks=_ema_callbacks(checkpoints, val_losses),
               enable_checkpointing=checkpoints is not None, **_VALIDATION).fit(
        model, regression_loader(), regression_loader(num_batches=2, seed=1), ckpt_path=ckpt_path)


def _assert_same(actual: dict, expected: dict, what: str) -> None:
    """Float64 states equal within float64 rounding (another summation order: 1e-11 relative, far below float32's
    resolution, so a value that passed through float32 fails)."""
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, (what, key)
        torch.testing.assert_close(actual[key], value, rtol=1e-11, atol=1e-13, msg=lambda m: f"{what} {key}: {m}")


@pytest.mark.parametrize("stages", [2, 4])
def test_ema_averages_each_stage_at_its_updates_as_one_device_and_resumes_from_its_checkpoint(tmp_path, stages):
    torch.manual_seed(6)
    model = SequentialMLP(lr=0.2).double()  # float64 in the test too: the trained weights come back exactly
    initial = copy.deepcopy(model)
    averaged, plain = copy.deepcopy(model), copy.deepcopy(model)
    _one_device_ema(averaged, tmp_path / "one.txt", checkpoints=tmp_path / "one")
    one_device(max_steps=4, precision="64-true").fit(plain, regression_loader())
    _ema_fit(model, tmp_path / "pipe.txt", stages=stages, checkpoints=tmp_path / "pipe")
    _assert_same(model.state_dict(), averaged.state_dict(), "after fit")
    # validation ran with the averaged weights, as on one device (then trained on with the current ones); the
    # pipeline's logged value passes through float32
    torch.testing.assert_close(_val_losses(tmp_path / "pipe.txt"), _val_losses(tmp_path / "one.txt"), rtol=1e-6,
                               atol=0.0)
    assert len(_val_losses(tmp_path / "one.txt")) == 2
    assert not torch.allclose(averaged.net[0].weight, plain.net[0].weight, atol=1e-3)  # the average is not the last
    # the checkpoint at step 2: Lightning's layout, one device's averaged and current weights and averaging state
    saved = torch.load(tmp_path / "pipe" / "epoch=0-step=2.ckpt", weights_only=False)
    reference = torch.load(tmp_path / "one" / "epoch=0-step=2.ckpt", weights_only=False)
    for key in ("state_dict", "current_model_state", "averaging_state"):
        _assert_same(saved[key], reference[key], key)
    # resumed from it: what one device resumed from the same file ends with
    resumed, one_resumed = copy.deepcopy(initial), copy.deepcopy(initial)
    _ema_fit(resumed, tmp_path / "resumed.txt", stages=stages, ckpt_path=str(tmp_path / "pipe" / "epoch=0-step=2.ckpt"))
    _one_device_ema(one_resumed, tmp_path / "one_resumed.txt", ckpt_path=str(tmp_path / "pipe" / "epoch=0-step=2.ckpt"))
    _assert_same(resumed.state_dict(), one_resumed.state_dict(), "resumed")


def test_ema_trains_under_paci_and_validates_with_the_averaged_weights(tmp_path):
    torch.manual_seed(7)
    model = SequentialMLP(lr=0.2)
    initial = copy.deepcopy(model)
    _ema_fit(model, tmp_path / "val.txt", schedule="paci")
    losses = _val_losses(tmp_path / "val.txt")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    for key, value in model.state_dict().items():
        assert torch.isfinite(value).all() and not torch.equal(value, initial.state_dict()[key].to(value.dtype))


@pytest.mark.parametrize("stages", [2, 4])
def test_ema_under_paci_equals_the_reference_executor_averaging_each_stage_at_its_updates(stages):
    """Under "paci" (m = a = stages, the default compensation) each stage's average is updated after each of its
    own updates from the weights that update left: the reference executor of the same lists, with one
    ``AveragedModel`` per carved stage updated by its runtime's update hook, ends with the same averaged weights
    in float64 within a few units in the last place (2e-16 relative measured: the weight prediction's way back is
    exact to one unit in the last place, [Note: weight prediction]) -- and they are not the trained weights."""
    torch.manual_seed(8)
    model = SequentialMLP(depth=4, lr=0.2).double()
    initial = copy.deepcopy(model)
    steps, decay = 4, 0.5
    loader = regression_loader(num_batches=steps)
    fit(model, loader, devices=stages, max_steps=steps, schedule="paci", microbatches=stages, partition="parameters",
        callbacks=[EMAWeightAveraging(decay=decay)], trainer_kwargs={"precision": "64-true"})
    reference = ReferencePipeline(copy.deepcopy(initial), plan_partition(initial, stages, partition="parameters"))
    averages = [AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
                for module in reference.modules]
    for runtime, average, module in zip(reference.runtimes, averages, reference.modules, strict=True):
        runtime.update_hooks.append(lambda version, average=average, module=module: average.update_parameters(module))
    reference.run(build_schedule("paci", stages, stages, stages, steps), [tuple(b.double() for b in batch)
                                                                             for batch in loader])
    trained = {k: v.clone() for k, v in reference.state_dict().items()}
    for average, module in zip(averages, reference.modules, strict=True):
        assert int(average.n_averaged) == steps  # every stage averaged after each of its updates
        module.load_state_dict(average.module.state_dict())
    _assert_same(model.state_dict(), reference.state_dict(), "averaged under paci")
    assert not all(torch.equal(trained[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("callback", "options", "message"), [
    (lambda: EMAWeightAveraging(), {"virtual_stages": 2, "schedule": "interleaved", "microbatches": 2},
     r"`EMAWeightAveraging` under `PACIStrategy` needs one stage per process and consolidated checkpoints"),
    (lambda: EMAWeightAveraging(), {"checkpoint_layout": "sharded"},
     r"`EMAWeightAveraging` under `PACIStrategy` needs one stage per process and consolidated checkpoints"),
    (lambda: EMAWeightAveraging(device="meta"), {},
     r"`EMAWeightAveraging\(device=device\(type='meta'\)\)` is not supported by `PACIStrategy`: each stage keeps its "
     r"averaged copy"),
])
def test_weight_averaging_refusals_name_the_option(callback, options, message):
    """support.md's EMA row: what is refused, each with its own message, at setup."""
    with pytest.raises(ProcessRaisedException, match=rf"ValueError: {message}"):
        fit(SequentialMLP(), regression_loader(), devices=2, max_steps=1, callbacks=[callback()], **options)
