"""The rows of docs/support.md not shown elsewhere: Lightning features under ``strategy="paci"`` that work (and
give one device's result), and those refused with a clear error, here Lightning's or Fabric's own."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from helpers import RecordLosses, fit, one_device
from models import HFCausalLM, SequentialMLP, hf_reference_accumulation, regression_loader, token_loader

pytestmark = pytest.mark.distributed


class _Tested(SequentialMLP):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))


def test_fast_dev_run_trains_one_batch(tmp_path):
    record = RecordLosses(tmp_path)
    fit(SequentialMLP(), regression_loader(num_batches=4), devices=2, max_steps=-1, partition="parameters",
        callbacks=[record], trainer_kwargs={"fast_dev_run": True})
    assert len(record.values()) == 1


def test_the_simple_profiler_times_the_strategys_steps(tmp_path):
    fit(SequentialMLP(), regression_loader(num_batches=3), devices=2, max_steps=3, partition="parameters",
        trainer_kwargs={"profiler": L.pytorch.profilers.SimpleProfiler(dirpath=tmp_path, filename="profile")})
    reports = sorted(tmp_path.glob("*profile*.txt"))
    assert len(reports) == 2, list(tmp_path.iterdir())  # one per rank: every stage's hooks timed
    assert all("[Strategy]PACIStrategy.training_step" in report.read_text() for report in reports)


def test_trainer_test_gives_one_devices_result():
    torch.manual_seed(5)
    model = _Tested()
    expected = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False).test(copy.deepcopy(model), regression_loader(num_batches=3),
                                                          verbose=False)
    trainer = fit(model, regression_loader(num_batches=2), devices=2, max_steps=0, partition="parameters")
    got = trainer.test(model, regression_loader(num_batches=3), verbose=False)
    torch.testing.assert_close(got[0]["test_loss"], expected[0]["test_loss"])


def test_a_compiled_module_is_refused_naming_the_strategy():
    with pytest.raises(RuntimeError, match=r"compiled model is incompatible with the current strategy: `PACIStrategy`"):
        fit(torch.compile(SequentialMLP()), regression_loader(num_batches=2), devices=2, max_steps=1,
            partition="parameters")


def test_fabric_refuses_the_strategy_name():
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='paci'`"):
        Fabric(strategy="paci", devices=2, accelerator="cpu")


class _FrozenFirstLayer(SequentialMLP):
    """A frozen first layer (as a frozen embedding, or the base weights under an adapter): no gradient, no update."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


def test_frozen_parameters_stay_and_the_rest_trains_as_on_one_device():
    torch.manual_seed(11)
    model = _FrozenFirstLayer()
    expected, frozen = copy.deepcopy(model), copy.deepcopy(model.net[0].state_dict())
    loader = regression_loader(num_batches=4)
    one_device().fit(expected, loader)
    fit(model, loader, devices=2, max_steps=4, schedule="1f1b", microbatches=2, partition="parameters")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected.state_dict()[key], rtol=1e-5, atol=1e-7)
    for key, value in model.net[0].state_dict().items():
        assert torch.equal(value, frozen[key])


class _LoRACausalLM(HFCausalLM):
    """GPT-2 under peft's LoRA, wrapped as a user wraps it: the base weights frozen, adapters in every attention
    projection; SGD over the trainable parameters (an error in the adapters' gradients shows at SGD's scale)."""

    def __init__(self) -> None:
        super().__init__("gpt2", layers=4)
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                           fan_in_fan_out=True, lora_dropout=0.0))
        for name, param in self.model.named_parameters():  # B starts at zero: give the adapters a gradient in A
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def test_peft_lora_adapters_train_as_on_one_device_and_the_base_weights_stay():
    pytest.importorskip("peft")
    torch.manual_seed(10)
    model = _LoRACausalLM()
    reference = copy.deepcopy(model)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    loader = token_loader(num_batches=6, vocab=64, seq=12)
    fit(model, loader, devices=2, schedule="1f1b", microbatches=4)
    hf_reference_accumulation(reference, list(loader)[:5], num_microbatches=4)
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
        if key in frozen:
            assert torch.equal(value, frozen[key]), key
    assert len(adapters) == 8 and all(not torch.equal(model.state_dict()[k], v) for k, v in adapters.items())


def test_scale_batch_size_is_refused_by_lightning_for_the_distributed_strategy(tmp_path):
    from lightning.pytorch.tuner import Tuner

    from lightning_paci import PACIStrategy

    trainer = L.Trainer(strategy=PACIStrategy(start_method="fork", partition="parameters"), accelerator="cpu",
                        devices=2, max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"Tuning the batch size is currently not supported with distributed"):
        Tuner(trainer).scale_batch_size(SequentialMLP(), mode="power", max_trials=2)


def test_the_tuner_under_a_fork_launcher_is_refused_naming_the_default_launcher(tmp_path):
    from lightning.pytorch.tuner import Tuner
    from torch.multiprocessing import ProcessRaisedException

    from lightning_paci import PACIStrategy

    trainer = L.Trainer(strategy=PACIStrategy(start_method="fork", partition="parameters"), accelerator="cpu",
                        devices=2, max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(ProcessRaisedException, match=r"`LearningRateFinder` .*Use the default launcher"):
        Tuner(trainer).lr_find(SequentialMLP(), regression_loader(num_batches=4), num_training=4)
