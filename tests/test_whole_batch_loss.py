"""The whole-batch loss ([Note: the whole-batch loss] in engine/runtime/whole_batch.py): a contrastive loss over
in-batch negatives computed once per batch on the last stage equals one device's plain step.

The reference is ``Trainer(devices=1)`` fitting the same module on the same batches: one loss over the whole batch
per step, not an accumulation of micro-batches. Float64 throughout (module, data, comparison), SGD.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing import ProcessRaisedException

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.runtime.whole_batch import LossCall, joined
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.partition.blocks import call_order
from lightning_paci.schedules import chunk_drift_bounds

from helpers import RecordLosses, fit
from models import dict_loader, tiny_clip


class TwoTowers(L.LightningModule):
    """transformers' CLIP towers with the contrastive loss written in the module, as a user ports a two-tower
    model: the step embeds, ``contrastive_loss`` scores every text against every image of the batch."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.5) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"])
        return self.contrastive_loss(out.text_embeds, out.image_embeds)

    def contrastive_loss(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        logits = self.model.logit_scale.exp() * text @ image.T  # (B, B): each text against every image
        labels = torch.arange(len(text), device=text.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _towers(batch_size: int = 8, batches: int = 3) -> tuple[TwoTowers, list[dict[str, torch.Tensor]]]:
    clip, _ = tiny_clip(layers=2, batch_size=batch_size)
    torch.manual_seed(7)
    data = [{"input_ids": torch.randint(3, 64, (batch_size, 6)),
             "pixel_values": torch.randn(batch_size, 3, 16, 16, dtype=torch.float64)} for _ in range(batches)]
    return TwoTowers(clip.model), data


def _one_device(module: TwoTowers, batches: list[dict[str, torch.Tensor]]) -> tuple[TwoTowers, list[float]]:
    reference = copy.deepcopy(module)
    seen: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            seen.append(float(trainer.callback_metrics["train_loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()])
    trainer.fit(reference, dict_loader(batches))
    return reference, seen


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (4, 4)])
def test_whole_batch_loss_under_1f1b_equals_one_device_in_float64(tmp_path, stages, microbatches):
    module, batches = _towers()
    reference, reference_losses = _one_device(module, batches)
    pipeline = copy.deepcopy(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no coupling warning: the loss is computed whole
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|sampler).*")
        fit(pipeline, dict_loader(batches), devices=stages, max_steps=len(batches), schedule="1f1b",
            microbatches=microbatches, whole_batch_loss="contrastive_loss", callbacks=[RecordLosses(tmp_path)])
    losses = RecordLosses(tmp_path).values()
    assert losses == pytest.approx(reference_losses, rel=1e-12, abs=0)
    for (name, got), want in zip(pipeline.state_dict().items(), reference.state_dict().values(), strict=True):
        assert got.dtype == torch.float64, name
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13, msg=name)
    moved = max(float((a - b).abs().max()) for a, b in zip(reference.parameters(), module.parameters(), strict=True))
    assert moved > 1e-3  # the comparison sees training, not the initial weights


def test_micro_batch_losses_are_not_the_whole_batch_loss():
    """Without the option the same module trains another objective (the comparison above can fail)."""
    module, batches = _towers()
    calls = []
    for part in (dict(zip(batches[0], v)) for v in zip(*(torch.tensor_split(t, 2) for t in batches[0].values()))):
        out = module.model(**part)
        calls.append(LossCall((out.text_embeds, out.image_embeds), {}, 4))
    whole, outgoing, leaves = joined(calls, "contrastive_loss")
    with recording_logs(module, [], 1, "training_step"):
        split = sum(module.contrastive_loss(*c.args) for c in calls) / 2
        assert abs(float(module.contrastive_loss(*whole.args)) - float(split)) > 1e-2
    assert [len(o) for o in outgoing] == [2, 2] and whole.args[0].shape == (8, 16) and whole.samples == 8
    assert all(leaf.is_leaf and leaf.requires_grad for group in leaves for leaf in group)
    # arguments joined position by position: a call whose other arguments differ is refused, naming the method
    odd = [calls[0], LossCall(calls[1].args, {"temperature": 0.5}, 4)]
    with pytest.raises(ValueError, match=r"`contrastive_loss` was called with other arguments by different "
                                         r"micro-batches"):
        joined(odd, "contrastive_loss")


def test_whole_batch_loss_under_paci_equals_the_reference_executor_and_trains(tmp_path):
    """Under "paci" the loss of a batch is computed once, over micro-batches forwarded with weights up to the
    list's bound apart: the multi-process run equals the one-process reference executor built with the same
    option, and the loss goes down."""
    module, batches = _towers(batches=6)
    with torch.no_grad(), recording_logs(module, [], 1, "training_step"):
        trace = call_order(module, lambda: module.training_step(batches[0], 0))
    plan = plan_partition(module, 2, partition="parameters", trace=trace)
    reference = ReferencePipeline(copy.deepcopy(module), plan, compensation="none",
                                  whole_batch_loss="contrastive_loss")
    schedule = build_schedule("paci", 2, 2, 2, len(batches), whole_batch=True)
    assert chunk_drift_bounds(schedule) == (1, 1)  # ceil((N - 2 - s + m) / a)
    reference.run(schedule, batches)
    pipeline = copy.deepcopy(module)
    fit(pipeline, dict_loader(batches), devices=2, max_steps=len(batches), schedule="paci", microbatches=2,
        compensation="none", whole_batch_loss="contrastive_loss", callbacks=[RecordLosses(tmp_path)])
    expected = reference.state_dict()
    assert expected.keys() == pipeline.state_dict().keys()
    for name, got in pipeline.state_dict().items():
        torch.testing.assert_close(got, expected[name], rtol=1e-12, atol=1e-13, msg=name)
    losses = RecordLosses(tmp_path).values()
    assert len(losses) == len(batches) and losses[-1] < losses[0]


def test_the_option_is_refused_where_the_step_does_not_return_the_method_s_loss():
    module, batches = _towers(batches=1)

    class Regularized(TwoTowers):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) + 0.0

    bad = Regularized(module.model)
    # a setup error in a forked rank reaches the test as torch's exception, holding the rank's traceback
    with pytest.raises(ProcessRaisedException, match=r"ValueError: .*returned a loss other than the result of "
                                                     r"`self.contrastive_loss"):
        fit(bad, dict_loader(batches), devices=2, max_steps=1, schedule="1f1b", whole_batch_loss="contrastive_loss")
    with pytest.raises(ProcessRaisedException, match="ValueError: .*TwoTowers has no method 'contrastive'"):
        fit(copy.deepcopy(module), dict_loader(batches), devices=2, max_steps=1, schedule="1f1b",
            whole_batch_loss="contrastive")
    with pytest.raises(ValueError, match="one stage per process, unsharded.*virtual_stages=2: use 1"):
        PACIStrategy(whole_batch_loss="contrastive_loss", virtual_stages=2, schedule="interleaved")
    with pytest.raises(ValueError, match="`whole_batch_loss` names a method"):
        PACIStrategy(whole_batch_loss="self.loss")


def test_a_batch_whose_whole_loss_is_not_finite_is_dropped_whole_under_skip(tmp_path):
    """``nonfinite="skip"``: one NaN image makes the batch's contrastive loss NaN; every micro-batch of that batch
    is dropped (no gradient on any stage), so the run ends where one device trained on the other batches ends."""
    module, batches = _towers()
    poisoned = [batches[0], {**batches[1], "pixel_values": batches[1]["pixel_values"].clone()}, batches[2]]
    poisoned[1]["pixel_values"][5, 0, 0, 0] = float("nan")
    reference, _ = _one_device(module, [batches[0], batches[2]])
    pipeline = copy.deepcopy(module)
    fit(pipeline, dict_loader(poisoned), devices=2, max_steps=3, schedule="1f1b", microbatches=2,
        whole_batch_loss="contrastive_loss", nonfinite="skip")
    expected = reference.state_dict()
    for name, got in pipeline.state_dict().items():
        torch.testing.assert_close(got, expected[name], rtol=1e-12, atol=1e-13, msg=name)
