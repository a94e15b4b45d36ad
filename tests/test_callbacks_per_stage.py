"""Lightning's ``StochasticWeightAveraging``, fine-tuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``)
and ``ModelPruning`` run per stage: under ``"1f1b"`` in float64 with SGD the weights after ``fit``, the
checkpoints' weights, callback and optimizer states and a resumed run equal one device's; under ``"paci"`` they
train."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from torch import nn
from torch.multiprocessing import ProcessRaisedException

from lightning_paci import DriftMonitor

from helpers import fit, one_device
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed

EPOCHS = 3  # 6 batches each: SWA averages at the starts of epochs 1 and 2, fine-tuning unfreezes at epoch 1,
# pruning prunes at the ends of epochs 0, 1 and 2


def _assert_same(actual: dict, expected: dict, what: str) -> None:
    """Float64 states equal within float64 rounding (another summation order), far below float32's resolution."""
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, (what, key)
        torch.testing.assert_close(actual[key], value, rtol=1e-11, atol=1e-13, msg=lambda m: f"{what} {key}: {m}")


def _one_device(model, callbacks, *, checkpoints: Path | None = None, ckpt_path: str | None = None) -> None:
    extra = [ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_top_k=-1)] if checkpoints else []
    one_device(max_epochs=EPOCHS, precision="64-true", callbacks=callbacks + extra,
               enable_checkpointing=checkpoints is not None).fit(model, regression_loader(), ckpt_path=ckpt_path)


def _pipeline(model, callbacks, *, stages: int = 2, schedule: str = "1f1b", checkpoints: Path | None = None,
              ckpt_path: str | None = None, log_dir: Path | None = None) -> None:
    extra = [ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_top_k=-1)] if checkpoints else []
    fit(model, regression_loader(), devices=stages, max_steps=-1, schedule=schedule, microbatches=2,
        partition="parameters", callbacks=callbacks + extra, ckpt_path=ckpt_path,
        trainer_kwargs={"precision": "64-true", "max_epochs": EPOCHS, "enable_checkpointing": checkpoints is not None,
                        **({"default_root_dir": log_dir, "log_every_n_steps": 1} if log_dir else {})})


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


# -- StochasticWeightAveraging -------------------------------------------------------------------------------------

def _swa() -> list[L.Callback]:
    # from epoch 1 (0-based) on: SWALR anneals the learning rate to 0.02 over 2 epochs, the average takes epochs 1, 2
    return [StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=2)]


@pytest.mark.parametrize("stages", [2, 4])
def test_swa_averages_each_stage_and_switches_its_learning_rate_as_one_device(tmp_path, stages):
    torch.manual_seed(11)
    model = SequentialMLP(lr=0.2).double()
    averaged, plain = copy.deepcopy(model), copy.deepcopy(model)
    _one_device(averaged, _swa(), checkpoints=tmp_path / "one")
    _one_device(plain, [])
    _pipeline(model, _swa(), stages=stages, checkpoints=tmp_path / "pipe")
    _assert_same(model.state_dict(), averaged.state_dict(), "after fit")
    assert not torch.allclose(averaged.net[0].weight, plain.net[0].weight, atol=1e-3)  # SWA changed the result
    # the checkpoint after epoch 1: the callback's averaged whole model, its count and the SWA learning rate
    saved, reference = (_load(tmp_path / d / "epoch=1-step=12.ckpt") for d in ("pipe", "one"))
    key = next(k for k in reference["callbacks"] if "StochasticWeightAveraging" in k)
    mine, theirs = saved["callbacks"][key], reference["callbacks"][key]
    _assert_same(mine["average_model_state"], theirs["average_model_state"], "average_model_state")
    assert (mine["n_averaged"], mine["latest_update_epoch"]) == (theirs["n_averaged"], theirs["latest_update_epoch"])
    assert mine["scheduler_state"]["_last_lr"] == theirs["scheduler_state"]["_last_lr"]
    lrs = [g["lr"] for g in reference["optimizer_states"][0]["param_groups"]]
    assert [g["lr"] for g in saved["optimizer_states"][0]["param_groups"]] == lrs and lrs != [0.2]


def test_swa_resumes_from_its_checkpoint_as_one_device(tmp_path):
    torch.manual_seed(12)
    model = SequentialMLP(lr=0.2).double()
    initial = copy.deepcopy(model)
    _pipeline(model, _swa(), checkpoints=tmp_path / "pipe")
    path = str(tmp_path / "pipe" / "epoch=1-step=12.ckpt")
    resumed, one_resumed = copy.deepcopy(initial), copy.deepcopy(initial)
    _pipeline(resumed, _swa(), ckpt_path=path)
    _one_device(one_resumed, _swa(), ckpt_path=path)
    _assert_same(resumed.state_dict(), one_resumed.state_dict(), "resumed")
    _assert_same(resumed.state_dict(), model.state_dict(), "resumed against uninterrupted")


def test_swa_trains_under_paci(tmp_path):
    torch.manual_seed(13)
    model = SequentialMLP(lr=0.2)
    initial = copy.deepcopy(model)
    _pipeline(model, _swa(), schedule="paci")
    for key, value in model.state_dict().items():
        assert torch.isfinite(value).all() and not torch.equal(value, initial.state_dict()[key].to(value.dtype))


class WithBatchNorm(SequentialMLP):
    def __init__(self) -> None:
        super().__init__()
        self.net[1] = nn.BatchNorm1d(16)


def test_swa_with_batch_normalization_is_refused_naming_the_extra_epoch():
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `StochasticWeightAveraging` with batch "
                                                     r"normalization is not supported .* extra epoch"):
        fit(WithBatchNorm(), regression_loader(), devices=2, callbacks=_swa())


# -- fine-tuning ---------------------------------------------------------------------------------------------------

class FrozenStart(SequentialMLP):
    """Optimizes only what is trainable when ``fit`` starts, as fine-tuning recipes do."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class UnfreezeFirst(BaseFinetuning):
    """The first layer frozen, then a param group of its own at a tenth of the learning rate from epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer)


class Backboned(FrozenStart):
    """A ``backbone`` and a ``head``, cut after the head's first layer (stage 0 keeps a trainable layer besides the
    frozen backbone): ``BackboneFinetuning`` sets ``param_groups[-1]``'s learning rate each epoch, the backbone's
    group, empty on stage 1."""

    def __init__(self) -> None:
        super().__init__(lr=0.2)
        del self.net
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return self.head(self.backbone(x))


def _backbone() -> list[L.Callback]:
    return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.25, should_align=False)]


def test_an_unfrozen_param_group_reaches_only_its_stage_as_on_one_device(tmp_path):
    torch.manual_seed(14)
    model = FrozenStart(lr=0.2).double()
    initial = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    _one_device(reference, [UnfreezeFirst()], checkpoints=tmp_path / "one")
    _pipeline(model, [UnfreezeFirst()], checkpoints=tmp_path / "pipe")
    _assert_same(model.state_dict(), reference.state_dict(), "after fit")
    assert not torch.equal(model.net[0].weight, initial.net[0].weight)  # trained after epoch 0
    # the checkpoint after epoch 1: one device's callback metadata (every group's names) and optimizer groups
    saved, expected = (_load(tmp_path / d / "epoch=1-step=12.ckpt") for d in ("pipe", "one"))
    key = next(k for k in expected["callbacks"] if "UnfreezeFirst" in k)
    assert saved["callbacks"][key] == expected["callbacks"][key]
    assert saved["optimizer_states"][0]["param_groups"] == expected["optimizer_states"][0]["param_groups"]
    # resumed from it (the group added again by name): what one device resumed from the same file ends with
    resumed, one_resumed = copy.deepcopy(initial), copy.deepcopy(initial)
    path = str(tmp_path / "pipe" / "epoch=1-step=12.ckpt")
    _pipeline(resumed, [UnfreezeFirst()], ckpt_path=path)
    _one_device(one_resumed, [UnfreezeFirst()], ckpt_path=path)
    _assert_same(resumed.state_dict(), one_resumed.state_dict(), "resumed")


def test_backbone_finetuning_sets_the_backbone_groups_learning_rate_on_every_stage_as_one_device():
    torch.manual_seed(15)
    model = Backboned().double()
    reference = copy.deepcopy(model)
    _one_device(reference, _backbone())
    _pipeline(model, _backbone())
    _assert_same(model.state_dict(), reference.state_dict(), "after fit")


def test_finetuning_trains_under_paci_with_the_drift_monitor_measuring_every_update(tmp_path):
    torch.manual_seed(16)
    model = Backboned()
    initial = copy.deepcopy(model)
    # the monitor's per-tensor update norms, pending across the epoch where the group (one more tensor) is added
    _pipeline(model, _backbone() + [DriftMonitor(logging_interval=5)], schedule="paci", log_dir=tmp_path)
    for key, value in model.state_dict().items():
        assert torch.isfinite(value).all() and not torch.equal(value, initial.state_dict()[key].to(value.dtype))
    assert math.isfinite(float(model.backbone[0].weight.sum()))


# -- ModelPruning --------------------------------------------------------------------------------------------------

class MomentumMLP(SequentialMLP):
    """SGD with momentum: a checkpoint's optimizer state lost or misnamed changes every later update."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _pruning(**kwargs) -> list[L.Callback]:
    # Lightning's defaults otherwise: one global amount over the whole model (20% of what is still kept, at each
    # epoch's end), the survivors reset to their initial values (lottery ticket), the pruning made permanent
    return [ModelPruning("l1_unstructured", amount=0.2, **kwargs)]


# 756 weights and biases (8x16+16, 2 x (16x16+16), 16x4+4) pruned 3 times by 20% of what is left: 151 (of 756), 121
# (of 605), 97 (round(96.8), of 484), each time the smallest magnitudes of both stages together
PRUNED = 151 + 121 + 97


def _zeros(state: dict) -> dict:
    return {key: value == 0 for key, value in state.items()}


def test_pruning_prunes_each_stage_as_one_device_and_checkpoints_its_permanent_weights(tmp_path):
    torch.manual_seed(17)
    model = MomentumMLP(lr=0.1).double()
    reference = copy.deepcopy(model)
    _one_device(reference, _pruning(), checkpoints=tmp_path / "one")
    _pipeline(model, _pruning(), checkpoints=tmp_path / "pipe")
    _assert_same(model.state_dict(), reference.state_dict(), "after fit")
    zeros = _zeros(reference.state_dict())
    assert sum(int(z.sum()) for z in zeros.values()) == PRUNED
    assert _zeros(model.state_dict()).keys() == zeros.keys()
    for key, pruned in _zeros(model.state_dict()).items():
        assert torch.equal(pruned, zeros[key]), key
    # the checkpoint after epoch 1: one device's permanent weights (`weight`, no masks) and its optimizer state,
    # the momentum of each pruned weight under its index in one device's optimizer
    saved, expected = (_load(tmp_path / d / "epoch=1-step=12.ckpt") for d in ("pipe", "one"))
    _assert_same(saved["state_dict"], expected["state_dict"], "state_dict")
    mine, theirs = saved["optimizer_states"][0], expected["optimizer_states"][0]
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys() and len(theirs["state"]) == 8
    for index, state in theirs["state"].items():
        _assert_same(mine["state"][index], state, f"optimizer state {index}")


def test_pruning_resumes_from_its_checkpoint_as_one_device_from_its_own(tmp_path):
    torch.manual_seed(18)
    model = MomentumMLP(lr=0.1).double()
    initial = copy.deepcopy(model)
    _one_device(copy.deepcopy(initial), _pruning(), checkpoints=tmp_path / "one")
    _pipeline(model, _pruning(), checkpoints=tmp_path / "pipe")
    # the masks are not saved (on one device either): the resumed runs train the zeros until the next pruning
    resumed, one_resumed, one_from_ours = (copy.deepcopy(initial) for _ in range(3))
    _pipeline(resumed, _pruning(), ckpt_path=str(tmp_path / "pipe" / "epoch=0-step=6.ckpt"))
    _one_device(one_resumed, _pruning(), ckpt_path=str(tmp_path / "one" / "epoch=0-step=6.ckpt"))
    _one_device(one_from_ours, _pruning(), ckpt_path=str(tmp_path / "pipe" / "epoch=0-step=6.ckpt"))
    _assert_same(resumed.state_dict(), one_resumed.state_dict(), "resumed")
    _assert_same(one_from_ours.state_dict(), one_resumed.state_dict(), "one device from the pipeline's checkpoint")
    assert not torch.equal(resumed.net[0].weight, model.net[0].weight)  # the uninterrupted run kept its masks


def test_pruning_equal_magnitudes_takes_one_devices_count_over_the_stages():
    # every weight and bias of magnitude 0.25 and a learning rate of 0: all of them tie at every pruning, and the
    # stages share each pruning's count (which of the equal ones go is unspecified, torch.topk's choice on one device)
    model = MomentumMLP(lr=0.0).double()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.25 * torch.where(torch.arange(param.numel()) % 3 == 0, -1.0, 1.0).view_as(param))
    reference = copy.deepcopy(model)
    _one_device(reference, _pruning())
    _pipeline(model, _pruning())
    for state in (reference.state_dict(), model.state_dict()):
        assert sum(int(z.sum()) for z in _zeros(state).values()) == PRUNED


def test_pruning_each_layer_by_its_own_amount_on_its_stage_equals_one_device():
    torch.manual_seed(19)
    model = MomentumMLP(lr=0.1).double()
    reference = copy.deepcopy(model)
    per_layer = dict(use_global_unstructured=False, use_lottery_ticket_hypothesis=False, parameter_names=["weight"])
    _one_device(reference, _pruning(**per_layer))
    _pipeline(model, _pruning(**per_layer))
    _assert_same(model.state_dict(), reference.state_dict(), "after fit")
    for key, pruned in _zeros(model.state_dict()).items():
        assert torch.equal(pruned, _zeros(reference.state_dict())[key]), key
    # each weight by itself: 20% of what is left, 3 times; the biases untouched
    assert int((model.net[2].weight == 0).sum()) == 51 + 41 + 33 and not (model.net[2].bias == 0).any()


def test_pruning_trains_under_paci():
    torch.manual_seed(20)
    model = MomentumMLP(lr=0.1)
    initial = copy.deepcopy(model)
    _pipeline(model, _pruning(), schedule="paci")
    state = model.state_dict()
    assert sum(int(z.sum()) for z in _zeros(state).values()) == PRUNED
    for key, value in state.items():
        assert torch.isfinite(value).all() and not torch.equal(value, initial.state_dict()[key]), key


class _StepScheduled(SequentialMLP):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize(("model", "callbacks", "options", "message"), [
    (_StepScheduled, _swa, {},
     r"`StochasticWeightAveraging` with a step-interval learning-rate scheduler is not supported by `PACIStrategy`"),
    (SequentialMLP, _swa, {"virtual_stages": 2, "schedule": "interleaved"},
     r"`StochasticWeightAveraging` under `PACIStrategy` needs one stage per process and consolidated checkpoints"),
    (FrozenStart, lambda: [UnfreezeFirst()], {"virtual_stages": 2, "schedule": "interleaved"},
     r"`UnfreezeFirst` under `PACIStrategy` needs one stage per process, no data-parallel replicas"),
], ids=["swa-step-scheduler", "swa-virtual", "finetuning-virtual"])
def test_averaging_and_finetuning_refusals_name_the_setting(model, callbacks, options, message):
    """support.md's SWA and fine-tuning rows: each refusal at setup, with its own message."""
    with pytest.raises(ProcessRaisedException, match=rf"ValueError: {message}"):
        fit(model(), regression_loader(), devices=2, max_steps=1, microbatches=2, callbacks=callbacks(), **options)
