"""An unchanged module trains as on one device, or is refused at setup.

Each test is written as an ordinary single-device module would be, and compares the pipelined run with
``Trainer(devices=1)`` or the one-process reference executor.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelSummary
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from helpers import (
    KeepMetrics,
    Momentum,
    RecordSetupWarnings,
    assert_same_weights,
    fit,
    one_device,
    reference_run,
)
from models import HFCausalLM, LoopTransformer, SequentialMLP, _loss, regression_loader, token_loader


class _BatchNormMLP(SequentialMLP):
    """BatchNorm inside the blocks: running statistics are buffers a profiling step would advance."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def test_balanced_profiling_leaves_buffers_and_rng_as_they_were():
    torch.manual_seed(21)
    model = _BatchNormMLP()
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=3)
    # "balanced" runs a profiling step on rank 0 before carving; 1f1b's result does not depend on the split
    fit(model, loader, devices=2, max_steps=3, schedule="1f1b", microbatches=2, partition="balanced")
    expected = reference_run(initial, "1f1b", 2, 2, 2, list(loader)).state_dict()
    assert expected["net.1.num_batches_tracked"] == 6  # 3 batches x 2 micro-batches, none from profiling
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")


class _WriteSummary(ModelSummary):
    """An ordinary ModelSummary whose table goes to a file (the forked rank 0 cannot return it)."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, path=None, **kwargs) -> None:
        path.write_text(json.dumps({"total": total_parameters, "trainable": trainable_parameters,
                                    "modes": total_training_modes, "flops": total_flops}))


def test_the_model_summary_reports_the_whole_model(tmp_path):
    model = LoopTransformer(layers=4)
    expected = sum(p.numel() for p in model.parameters())
    counter = FlopCounterMode(display=False)  # the step's forward on the first batch (no example_input_array)
    with counter, torch.no_grad():
        _loss(model, next(iter(token_loader(num_batches=2))))
    fit(model, token_loader(num_batches=2), devices=2, max_steps=1, partition="parameters",
        trainer_kwargs={"enable_model_summary": True},
        callbacks=[_WriteSummary(max_depth=2, path=tmp_path / "summary.json")])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["total"] == summary["trainable"] == expected  # before: stage 0's part only
    assert summary["flops"] == counter.get_total_flops() > 0
    modes = {k: v for k, v in summary["modes"].items() if v}
    assert modes == {"train": sum(1 for _ in model.modules()) - 1}


class _SyncedEpochMetrics(SequentialMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("samples", float(len(batch[0])), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        return loss


def test_sync_dist_is_a_no_op_over_one_replica_and_does_not_warn(tmp_path):
    torch.manual_seed(5)
    single = tmp_path / "single.json"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        one_device(callbacks=[KeepMetrics(single)]).fit(_SyncedEpochMetrics(), regression_loader())
    torch.manual_seed(5)
    piped = tmp_path / "piped.json"
    fit(_SyncedEpochMetrics(), regression_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=2,
        partition="parameters", trainer_kwargs={"max_epochs": 1}, callbacks=[KeepMetrics(piped), _NoSyncWarning()])
    expected, got = json.loads(single.read_text()), json.loads(piped.read_text())
    assert got["samples"] == expected["samples"] == 48  # summed over 6 batches, not also over the 2 stages
    assert got["epoch_loss"] == pytest.approx(expected["epoch_loss"], rel=1e-5)
    assert not [w for w in seen if "sync_dist" in str(w.message)]


class _NoSyncWarning(L.Callback):
    """Fails the run if Lightning recommends `sync_dist=True` for a metric that passes it."""

    def on_train_start(self, trainer, pl_module) -> None:
        warnings.simplefilter("always")
        self._original = warnings.showwarning

        def check(message, *args, **kwargs):
            assert "sync_dist" not in str(message), message
            self._original(message, *args, **kwargs)

        warnings.showwarning = check


def test_save_checkpoint_after_fit_resumes_under_the_pipeline_and_on_one_device(tmp_path):
    loader = regression_loader(num_batches=3)
    torch.manual_seed(41)
    model = Momentum()
    expected = copy.deepcopy(model)
    one_device(2).fit(expected, loader)  # one device, 2 epochs straight
    # 1 epoch under the pipeline (1f1b: single-device accumulation), then Lightning's documented pattern
    trainer = fit(model, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
                  trainer_kwargs={"max_epochs": 1})
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["paci"]["num_stages"] == 2
    assert len(saved["optimizer_states"][0]["state"]) == len(list(model.parameters()))  # every stage's momentum
    # ... resumes under the pipeline (before: "it was not written by PACIStrategy") ...
    piped = Momentum()
    fit(piped, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_weights(piped, expected)
    # ... and on one device (before: a bare KeyError: 'param_groups')
    single = Momentum()
    one_device(2).fit(single, loader, ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_weights(single, expected)


def _claim_device(path, device: str, monkeypatch) -> None:
    """Write ``path`` again with every storage tagged as saved from ``device``, as a checkpoint written on a GPU
    is (torch records each storage's device and, without ``map_location``, loads it back there)."""
    checkpoint = torch.load(path, weights_only=False)
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: device)
        torch.save(checkpoint, path)


def test_a_one_device_checkpoint_resumes_under_the_pipeline(tmp_path, monkeypatch):
    loader = regression_loader(num_batches=3)
    torch.manual_seed(42)
    model = Momentum()
    expected = copy.deepcopy(model)
    one_device(2).fit(expected, loader)
    trainer = one_device(1)
    trainer.fit(model, loader)
    trainer.save_checkpoint(tmp_path / "single.ckpt")
    # as if saved on a GPU: this machine has none, so anything loaded before the host would fail
    _claim_device(tmp_path / "single.ckpt", "cuda:0", monkeypatch)
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        torch.load(tmp_path / "single.ckpt", weights_only=False)
    piped = Momentum()
    # a CheckpointIO that loads where it is told (torch's own default: where each storage was saved): the strategy
    # tells it the host, then places each stage's part itself
    fit(piped, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, ckpt_path=str(tmp_path / "single.ckpt"), checkpoint_io=_LoadsAsTold())
    assert_same_weights(piped, expected)


class _LoadsAsTold(CheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        torch.save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return torch.load(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path):
        os.remove(path)


class _StepRecords(L.Callback):
    """Every rank writes, per Lightning batch: the logged train_loss (rank 0's logger sees callback_metrics) and
    what training_step handed to on_train_batch_end."""

    def __init__(self, directory) -> None:
        self.directory, self.rows = directory, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        logged = trainer.callback_metrics.get("train_loss")
        self.rows.append({"batch": batch_idx, "logged": None if logged is None else float(logged),
                          "loss": float(outputs["loss"]), "minibatch": outputs["paci_minibatch"]})

    def on_train_end(self, trainer, pl_module) -> None:
        (self.directory / f"steps{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def test_the_value_logged_at_step_k_is_minibatch_ks_under_paci(tmp_path):
    torch.manual_seed(46)
    model = SequentialMLP(depth=8)
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=6)
    fit(model, loader, devices=4, max_steps=6, schedule="paci", microbatches=2, partition="parameters",
        callbacks=[_StepRecords(tmp_path)])
    losses = reference_run(initial, "paci", 4, 2, 2, list(loader)).runtimes[-1].records.losses
    expected = [(losses[2 * k] + losses[2 * k + 1]) / 2 for k in range(6)]
    zero = json.loads((tmp_path / "steps0.json").read_text())
    # rank 0 (the last stage) logs and returns mini-batch k's loss at batch k, also at the draining last batch
    # (before: mini-batch k arrived calls later with the gradients, and the drain merged batches 1-5 into one point)
    assert [row["minibatch"] for row in zero] == list(range(6))
    assert [row["logged"] for row in zero] == pytest.approx(expected, rel=1e-6)
    assert [row["loss"] for row in zero] == pytest.approx(expected, rel=1e-6)
    for rank in range(1, 4):  # earlier stages: a mini-batch that came back with the gradients, never NaN
        rows = json.loads((tmp_path / f"steps{rank}.json").read_text())
        assert all(row["minibatch"] <= row["batch"] for row in rows) and rows[-1]["minibatch"] == 5
        assert all(row["loss"] == (0.0 if row["minibatch"] < 0 else pytest.approx(expected[row["minibatch"]],
                                                                                   rel=1e-6)) for row in rows)


class _WarmUp(SequentialMLP):
    """An ordinary linear warm-up written in `optimizer_step`, as Lightning's docs show."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for group in optimizer.param_groups:
            group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 10)
        optimizer.step(closure=optimizer_closure)


def test_an_overridden_optimizer_step_is_named_at_setup(tmp_path):
    fit(_WarmUp(), regression_loader(num_batches=2), devices=2, max_steps=1, partition="parameters",
        callbacks=[RecordSetupWarnings(tmp_path / "warnings.json")])
    seen = json.loads((tmp_path / "warnings.json").read_text())
    assert any("`_WarmUp.optimizer_step` is overridden" in w and "on_before_optimizer_step" in w for w in seen)


class _GradNorm(SequentialMLP):
    """Gradient-norm logging, as people write it: in `on_before_optimizer_step`, over the module's gradients."""

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


class _KeepGradNorms(L.Callback):
    def __init__(self, path) -> None:
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("grad_norm")})

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.rows))


def test_what_hooks_log_on_every_stage_reaches_rank_zero_tagged_per_stage(tmp_path):
    torch.manual_seed(47)
    model = _GradNorm(depth=8)
    single = copy.deepcopy(model)
    loader = regression_loader(num_batches=4)
    one_device(max_steps=4, callbacks=[_KeepGradNorms(tmp_path / "single.json")]).fit(single, loader)
    fit(model, loader, devices=4, max_steps=4, schedule="1f1b", microbatches=2, partition="parameters",
        callbacks=[_KeepGradNorms(tmp_path / "piped.json")])
    expected = [row["grad_norm"] for row in json.loads((tmp_path / "single.json").read_text())]
    rows = json.loads((tmp_path / "piped.json").read_text())
    assert set(rows[-1]) == {f"grad_norm/stage_{s}" for s in range(4)}  # before: rank 0's own stage only
    # update k: the last stage logs it in call k, the others' values arrive with the next batch's activations;
    # together they are the whole model's norm, as one device logs it (1f1b: the same gradients)
    for k in range(3):
        parts = [rows[k + 1][f"grad_norm/stage_{s}"] for s in range(3)] + [rows[k]["grad_norm/stage_3"]]
        assert math.sqrt(sum(v * v for v in parts)) == pytest.approx(expected[k], rel=1e-5)


class _SGDCausalLM(HFCausalLM):
    """A tied GPT-2 with SGD (the tied weight's two gradients must meet at every update, the forced one too)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("tied", [False, True])
def test_a_window_left_open_at_the_epoch_end_is_stepped_as_on_one_device(tied):
    # accumulate_grad_batches=2 over epochs of 3 batches: Lightning steps after batches 2 and 3 (the epoch's last,
    # a window of one batch), not carried into the next epoch's window
    torch.manual_seed(48)
    if tied:
        model, loader = _SGDCausalLM("gpt2", layers=4, tied=True), token_loader(num_batches=3, vocab=64)
    else:
        model, loader = Momentum(), regression_loader(num_batches=3)
    expected = copy.deepcopy(model)
    one_device(2, accumulate_grad_batches=2).fit(expected, loader)
    fit(model, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 2, "accumulate_grad_batches": 2})
    assert_same_weights(model, expected)


def test_batch_norm_with_micro_batches_is_warned_about_naming_the_modules_and_the_choices(tmp_path):
    record = RecordSetupWarnings(tmp_path / "warnings.json")
    fit(_BatchNormMLP(), regression_loader(), devices=2, max_steps=1, partition="parameters", callbacks=[record])
    warned = [w for w in json.loads((tmp_path / "warnings.json").read_text()) if "batch statistics" in w]
    assert len(warned) == 1 and "`net.1`, `net.4`" in warned[0] and "2 micro-batches" in warned[0]
    assert "GroupNorm or LayerNorm" in warned[0] and "fewer micro-batches" in warned[0]
    record = RecordSetupWarnings(tmp_path / "none.json")  # one micro-batch per batch: nothing differs
    fit(_BatchNormMLP(), regression_loader(), devices=2, max_steps=1, partition="parameters", microbatches=1,
        callbacks=[record])
    assert not [w for w in json.loads((tmp_path / "none.json").read_text()) if "batch statistics" in w]
