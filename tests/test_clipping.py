"""Gradient clipping by norm ([Note: global-norm clipping] in integration/clipping.py): under the flush schedules the
norm over every stage's parameters, as one device clips; under "paci" and with virtual stages each stage's own, said
at setup. SGD in float64: Adam would hide a clipping scale."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from helpers import RecordSetupWarnings, fit
from models import HFCausalLM, SequentialMLP, regression_loader, token_loader

CLIP = 0.05


class _SGDGPT2(HFCausalLM):
    """A tied transformers GPT-2 trained with SGD (the clipping's scale reaches the update unchanged)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _one_device(model: L.LightningModule, loader, steps: int) -> L.LightningModule:
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="64-true", gradient_clip_val=CLIP,
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(model, loader)
    return model


class _RecordBatches(L.Callback):
    """Stage 0 of every replica saves the batches it trained on (the distributed sampler's shard)."""

    def __init__(self, directory) -> None:
        self.directory, self.seen = directory, []

    def on_train_batch_start(self, trainer, pl_module, batch, index) -> None:
        if trainer.strategy.stage_index == 0:
            self.seen.append(batch[0].clone())

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy.stage_index == 0:
            torch.save(self.seen, self.directory / f"batches{trainer.strategy.replica_index}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize(("schedule", "devices", "replicas"), [("1f1b", 2, 1), ("1f1b", 4, 1), ("gpipe", 2, 1),
                                                               ("gpipe", 4, 1), ("1f1b", 4, 2)])
def test_clipping_by_norm_under_a_flush_schedule_equals_one_device(tmp_path, schedule, devices, replicas):
    torch.manual_seed(0)
    model = _SGDGPT2("gpt2", layers=4, tied=True)
    reference = copy.deepcopy(model)
    steps = 3
    fit(model, token_loader(num_batches=steps * replicas, batch_size=4, vocab=64), devices=devices,
        max_steps=steps, schedule=schedule, microbatches=2, partition="parameters", data_parallel_size=replicas,
        callbacks=[_RecordBatches(tmp_path)],
        trainer_kwargs={"precision": "64-true", "gradient_clip_val": CLIP, "use_distributed_sampler": replicas > 1})
    # one device, each step on every replica's samples of that step
    shards = [torch.load(tmp_path / f"batches{r}.pt") for r in range(replicas)]
    union = [(torch.cat([shard[k] for shard in shards]),) for k in range(steps)]
    _one_device(reference, DataLoader(union, batch_size=None), steps)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key].double(), value, msg=lambda m: f"{key}: {m}")


def test_the_one_device_reference_clips():
    """The clipping is active in the runs above: the gradient's norm at the first step is far above ``CLIP``, so a
    per-stage norm would give other weights."""
    torch.manual_seed(0)
    model = _SGDGPT2("gpt2", layers=4, tied=True).double()
    (ids,) = next(iter(token_loader(num_batches=1, batch_size=4, vocab=64)))
    model.model(input_ids=ids, labels=ids).loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert total > 10 * CLIP


@pytest.mark.distributed
def test_clipping_by_norm_stays_per_stage_under_paci_and_says_so(tmp_path):
    """Under "paci" each stage clips by its own gradients' norm: what a per-stage reference computes (1 update per
    batch at a = m, and the first update has no drift: compare after one step), and a setup warning says so."""
    torch.manual_seed(8)
    model = SequentialMLP(lr=0.5)
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=2)
    fit(model, loader, devices=2, max_steps=1, schedule="paci", microbatches=4, partition="parameters",
        trainer_kwargs={"gradient_clip_val": CLIP}, callbacks=[RecordSetupWarnings(tmp_path / "w.json")])
    seen = json.loads((tmp_path / "w.json").read_text())
    assert any("under schedule='paci': the stages update at different times" in w and "each stage clips by the "
               "norm of its own gradients" in w for w in seen), seen
    from lightning_paci import plan_partition

    plan = plan_partition(copy.deepcopy(reference), 2, partition="parameters")
    stage_params = [[p for i in plan.blocks(s) for p in reference.net[i].parameters()] for s in range(2)]
    optimizer = reference.configure_optimizers()
    x, y = next(iter(loader))
    for part_x, part_y in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
        (torch.nn.functional.mse_loss(reference(part_x), part_y) / 4).backward()
    norms = [torch.nn.utils.clip_grad_norm_(params, CLIP) for params in stage_params]  # one norm per stage
    assert all(n > CLIP for n in norms)
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
