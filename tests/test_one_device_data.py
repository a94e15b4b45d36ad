"""What every stage trains on is what one device trains on: the samples (workers, collate, fingerprint), a short or
uneven batch, and values that cross the block container from modules a stage does not run.

Each test is written as an ordinary single-device module would be, and compares the pipelined run with
``Trainer(devices=1)`` or the one-process reference executor, or asserts the refusal's text.
"""

from __future__ import annotations

import copy
import json
import os

import lightning as L
import pytest
import torch
from torch import nn
from torch.multiprocessing import ProcessRaisedException

from helpers import KeepMetrics, Momentum, assert_same_weights, fit, one_device, reference_run
from models import LongSkip, SequentialMLP, regression_loader, token_loader


class _NoisyPairs(torch.utils.data.Dataset):
    """Random augmentation in ``__getitem__`` (run in the dataloader's workers): noise on the inputs, labels from the
    noisy inputs -- a stage whose workers draw other noise pairs stage 0's inputs with other labels."""

    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.w = torch.randn(n, 8, generator=g), torch.randn(8, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.5 * torch.randn(8)
        return x, torch.tanh(x @ self.w)


def _worker_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_NoisyPairs(), batch_size=8, num_workers=2)


def test_random_augmentation_in_seeded_workers_gives_every_stage_the_batches_of_one_device():
    expected = Momentum()
    model = copy.deepcopy(expected)
    L.seed_everything(7, workers=True)
    one_device(1).fit(expected, _worker_loader())
    L.seed_everything(7, workers=True)
    fit(model, _worker_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 1})
    assert_same_weights(model, expected)  # before: stage 1's workers were seeded by global rank 1


class _ProcessDependentCollate:
    """A collate that depends on the process: every rank builds other batches."""

    def __call__(self, samples):
        x, y = torch.utils.data.default_collate(samples)
        return x + (os.getpid() % 13) * 0.01, y


def test_a_stage_that_loads_other_batches_fails_at_the_first_batch_naming_the_cause():
    loader = regression_loader(num_batches=4)
    loader = torch.utils.data.DataLoader(loader.dataset, batch_size=8, collate_fn=_ProcessDependentCollate())
    with pytest.raises(ProcessRaisedException, match=r"stage 1's first batch differs from stage 0's .* before any "
                                                     r"stage computed with it: .* seed before building it"):
        fit(SequentialMLP(), loader, devices=2, max_steps=-1, schedule="paci", microbatches=2,
            partition="parameters", trainer_kwargs={"max_epochs": 1})


class _MaskedGPT2(L.LightningModule):
    """A transformers GPT-2 with its default dropout (0.1), trained on randomly masked tokens."""

    def __init__(self, dropout: float | None = None) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        drop = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=_VOCAB + 1, n_positions=16, n_embd=32, n_layer=4,
                                                n_head=2, **drop))

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


_VOCAB = 31  # token id 31 is the mask


def _mask_tokens(samples):
    """MLM-style collate (runs in the workers): 30% of the tokens, drawn at random, become the mask token; the
    labels keep the original ids there and -100 (ignored) elsewhere."""
    ids = torch.stack([s[0] for s in samples])  # (B, T)
    chosen = torch.rand(ids.shape) < 0.3
    return {"input_ids": ids.masked_fill(chosen, _VOCAB), "labels": ids.masked_fill(~chosen, -100)}


def _masked_loader():
    return torch.utils.data.DataLoader(token_loader(num_batches=3, vocab=_VOCAB).dataset, batch_size=8, num_workers=2,
                                       collate_fn=_mask_tokens)


class _KeepBatches(L.Callback):
    """Rank 0 writes every training batch it was given (the test feeds the same ones to the references)."""

    def __init__(self, path) -> None:
        self.path, self.batches = path, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append({k: v.clone() for k, v in batch.items()})

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            torch.save(self.batches, self.path)


@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_gpt2_with_dropout_and_random_masking_in_workers_equals_the_reference_executor(tmp_path, schedule):
    torch.manual_seed(8)
    model = _MaskedGPT2()
    initial = copy.deepcopy(model)
    L.seed_everything(8, workers=True)
    fit(model, _masked_loader(), devices=2, max_steps=3, schedule=schedule, microbatches=2, partition="parameters",
        callbacks=[_KeepBatches(tmp_path / "batches.pt")])
    batches = torch.load(tmp_path / "batches.pt")
    assert len(batches) == 3 and all((b["labels"] != -100).any() for b in batches)
    reference = reference_run(initial, schedule, 2, 2, 2, batches, tied=True)  # the same seed: the same dropout masks
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def test_gpt2_without_dropout_under_1f1b_equals_single_device_accumulation_on_masked_batches(tmp_path):
    torch.manual_seed(9)
    model = _MaskedGPT2(dropout=0.0)
    expected = copy.deepcopy(model)
    L.seed_everything(9, workers=True)
    fit(model, _masked_loader(), devices=2, max_steps=3, schedule="1f1b", microbatches=2, partition="parameters",
        callbacks=[_KeepBatches(tmp_path / "batches.pt")])
    optimizer = expected.configure_optimizers()
    for batch in torch.load(tmp_path / "batches.pt"):
        for ids, labels in zip(torch.tensor_split(batch["input_ids"], 2), torch.tensor_split(batch["labels"], 2)):
            (expected.model(input_ids=ids, labels=labels).loss / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_same_weights(model, expected)


def _odd_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(regression_loader(num_batches=1, batch_size=17).dataset, batch_size=7)


def test_a_short_last_batch_and_uneven_microbatches_train_as_on_one_device(tmp_path):
    # 17 samples in batches of 7, 7, 3 and 4 micro-batches: parts of 2, 2, 2, 1 samples, then a last batch with
    # fewer samples than micro-batches (before: an error at the epoch's end)
    torch.manual_seed(43)
    model = SequentialMLP()
    expected = copy.deepcopy(model)
    single = tmp_path / "single.json"
    one_device(2).fit(expected, _odd_loader())
    one_device(callbacks=[KeepMetrics(single)]).fit(copy.deepcopy(model), _odd_loader())
    piped = tmp_path / "piped.json"
    fit(model, _odd_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=4, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, callbacks=[KeepMetrics(piped), _KeepEpochOne(piped)])
    assert_same_weights(model, expected)
    # the last batch's logged loss is the mean over its 3 samples, as on one device
    first_epoch = json.loads((tmp_path / "piped.json.epoch0").read_text())
    assert first_epoch["train_loss"] == pytest.approx(json.loads(single.read_text())["train_loss"], rel=1e-5)


class _KeepEpochOne(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and trainer.current_epoch == 0:
            with open(f"{self.path}.epoch0", "w") as fh:
                json.dump({k: float(v) for k, v in trainer.callback_metrics.items()}, fh)


def test_a_short_last_batch_under_paci_equals_the_reference_executor():
    torch.manual_seed(44)
    model = SequentialMLP()
    initial = copy.deepcopy(model)
    fit(model, _odd_loader(), devices=2, max_steps=-1, schedule="paci", microbatches=4, accumulation=2,
        partition="parameters", trainer_kwargs={"max_epochs": 1})
    for key, value in reference_run(initial, "paci", 2, 4, 2, list(_odd_loader())).state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def test_a_long_skip_across_the_container_is_relayed_and_trains_as_on_one_device():
    # head(blocks(h) + h): the embedding's output, made on stage 0, is read on stage 1 after its blocks; it travels
    # with the activations and its gradient comes back with theirs
    torch.manual_seed(46)
    model = LongSkip()
    expected = copy.deepcopy(model)
    one_device(1).fit(expected, regression_loader())
    fit(model, regression_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 1})
    assert_same_weights(model, expected)


class _NormAfterEmbedding(SequentialMLP):
    """A parameter-free BatchNorm (buffers only) between the embedding and the blocks: runs on every stage."""

    def __init__(self) -> None:
        super().__init__()
        del self.net  # registered in forward order: embedding, norm, blocks
        self.embed = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16, affine=False)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 4))

    def forward(self, x):
        return self.net(self.norm(self.embed(x)))


def test_buffers_outside_the_container_keep_the_owning_stages_copy():
    torch.manual_seed(45)
    model = _NormAfterEmbedding()
    initial = copy.deepcopy(model)
    loader = regression_loader(num_batches=3)
    fit(model, loader, devices=2, max_steps=3, schedule="1f1b", microbatches=2, partition="parameters")
    expected = reference_run(initial, "1f1b", 2, 2, 2, list(loader)).state_dict()
    assert expected["norm.running_var"].ne(1).all()  # stage 0's statistics, not zeros' (before: the last stage's)
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
