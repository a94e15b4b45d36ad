"""The user's step on one stage, and Lightning's backward and optimizer hooks run at each stage's local backward
and update, with that stage's gradients."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch

from helpers import KeepMetrics, fit
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
    single, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    first_bias = model.net[0].bias.detach().clone()
    loader = regression_loader(num_batches=3)
    for one, clip in ((single, 0.05), (unclipped, None)):
        L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                  gradient_clip_algorithm="value").fit(one, loader)
    # the value clipping is active: without it one device ends elsewhere (far beyond the tolerance below)
    assert max(float((a - b).abs().max()) for a, b in zip(single.parameters(), unclipped.parameters())) > 1e-3
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


class WindowProbe(SequentialMLP):
    """Records, at each ``on_after_backward``, how many backwards of the current accumulation window the stage has
    run and how many updates it made: the hook must see exactly the backward it follows."""

    def __init__(self, directory) -> None:
        super().__init__(lr=0.1)
        self.directory = directory
        self.seen: list[list[int]] = []

    def on_after_backward(self):
        runtime = self.trainer.strategy.runtime
        self.seen.append([runtime.window_backwards, runtime.version])

    def on_train_end(self):
        (self.directory / f"seen{self.trainer.strategy.stage_index}.json").write_text(json.dumps(self.seen))


@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_after_backward_hooks_see_their_own_backward_although_they_run_after_its_send(tmp_path, schedule):
    # [Note: after the send]: the hooks of a backward run once its gradient message is sent, still before the next
    # backward and the next update: micro-batch k of a window is seen as backward k of that window
    torch.manual_seed(71)
    fit(WindowProbe(tmp_path), regression_loader(num_batches=3), devices=3, max_steps=3, schedule=schedule,
        microbatches=4, partition="parameters")
    for stage in range(3):
        seen = json.loads((tmp_path / f"seen{stage}.json").read_text())
        assert seen == [[k, update] for update in range(3) for k in range(1, 5)], (stage, seen)


class DeviceLosses(L.Callback):
    """Every stage keeps its losses in the device form ([Note: no host sync per micro-batch]), here on the CPU."""

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.strategy.runtime.device_losses = True


def test_losses_kept_on_the_device_log_and_train_as_losses_read_at_once(tmp_path):
    # the losses travel upstream as tensors inside the gradient messages and are combined per batch when the logs
    # are replayed: the same weights and the same logged values as the host form
    results = []
    for name, callbacks in (("host", []), ("device", [DeviceLosses()])):
        torch.manual_seed(72)
        model = SequentialMLP()
        fit(model, regression_loader(num_batches=4), devices=3, max_steps=4, microbatches=4, partition="parameters",
            callbacks=[*callbacks, KeepMetrics(tmp_path / f"{name}.json")])
        results.append((model, json.loads((tmp_path / f"{name}.json").read_text())))
    (host, host_metrics), (device, device_metrics) = results
    assert device_metrics == host_metrics and "train_loss" in host_metrics
    for key, value in host.state_dict().items():
        torch.testing.assert_close(device.state_dict()[key], value, rtol=0, atol=0)


def test_received_log_values_do_not_keep_their_receive_buffers():
    # on an accelerator a received tensor is a view of the message's receive buffer (point_to_point.py's device path);
    # a log value waits for its batch's replay and must not keep the whole buffer alive until then
    from lightning_paci.engine.runtime.program import LogRecord, own_values

    buffer = torch.zeros(16384, dtype=torch.uint8)
    view = buffer[64:68].view(torch.float32).reshape(())
    records = own_values([LogRecord("loss", view, 4, ()), LogRecord("acc", 0.5, 4, ())])
    assert view.untyped_storage().nbytes() == 16384
    assert records[0].value.untyped_storage().nbytes() == 4 and records[0].value._base is None
    assert torch.equal(records[0].value, view) and records[1] == LogRecord("acc", 0.5, 4, ())
