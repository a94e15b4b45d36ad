"""The user's step on one stage, and Lightning's backward and optimizer hooks run at each stage's local backward
and update, with that stage's gradients."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch

from helpers import fit
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


class Hooked(SequentialMLP):
    """An ordinary module using every backward/optimizer hook; its clipping freezes the first layer's bias."""

    def __init__(self, directory=None) -> None:
        super().__init__(lr=0.2)
        self.directory = directory
        self.calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}
        self.grads_at_step: list[bool] = []

    def on_before_backward(self, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self):
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, optimizer):
        self.calls["on_before_optimizer_step"] += 1
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.grads_at_step.append(all(p.grad is not None for p in params))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        bias = dict(self.named_parameters()).get("net.0.bias")  # only on the stage that holds it
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            if bias is not None and p.grad is not None and p.data_ptr() == bias.data_ptr():
                p.grad.zero_()  # freeze the first layer's bias
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_end(self):
        if self.directory is not None:
            stage = self.trainer.strategy.stage_index if hasattr(self.trainer.strategy, "stage_index") else 0
            record = {"calls": self.calls, "grads_at_step": self.grads_at_step}
            (self.directory / f"hooks{stage}.json").write_text(json.dumps(record))


def test_backward_and_optimizer_hooks_run_per_stage_and_training_equals_one_device(tmp_path):
    # value clipping acts element-wise, so clipping each stage's gradients equals clipping all of them (a norm
    # would not: the pipeline has no global norm)
    torch.manual_seed(70)
    model = Hooked(tmp_path)
    single = copy.deepcopy(model)
    first_bias = model.net[0].bias.detach().clone()
    loader = regression_loader(num_batches=3)
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.05,
              gradient_clip_algorithm="value").fit(single, loader)
    fit(model, loader, devices=2, max_steps=3, schedule="1f1b", microbatches=4, partition="parameters",
        trainer_kwargs={"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"})
    stages = [json.loads((tmp_path / f"hooks{s}.json").read_text()) for s in range(2)]
    # 3 batches of 4 micro-batches: each stage backwards 12 micro-batches and updates 3 times; the loss is on stage 1
    assert stages[0]["calls"] == {"on_before_backward": 0, "on_after_backward": 12, "on_before_optimizer_step": 3}
    assert stages[1]["calls"] == {"on_before_backward": 12, "on_after_backward": 12, "on_before_optimizer_step": 3}
    assert all(stages[0]["grads_at_step"]) and all(stages[1]["grads_at_step"])  # the optimizer holds the gradients
    torch.testing.assert_close(model.net[0].bias, first_bias, rtol=0, atol=0)  # frozen by the custom clipping
    for key, value in single.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
