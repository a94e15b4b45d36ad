"""Issue 13's remaining items: an unchanged module trains as on one device, or is refused at setup.

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
from lightning.pytorch.callbacks import ModelSummary
from torch import nn
from torch.multiprocessing import ProcessRaisedException

from lightning_paci import ReferencePipeline, build, plan_partition

from helpers import fit
from models import HFCausalLM, LoopTransformer, SequentialMLP, regression_loader, token_loader


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
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"))
    reference.run(build("1f1b", 2, 2, 2, 3), list(loader))
    expected = reference.state_dict()
    assert expected["net.1.num_batches_tracked"] == 6  # 3 batches x 2 micro-batches, none from profiling
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")


class _WriteSummary(ModelSummary):
    """An ordinary ModelSummary whose table goes to a file (the forked rank 0 cannot return it)."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, path=None, **kwargs) -> None:
        path.write_text(json.dumps({"total": total_parameters, "trainable": trainable_parameters,
                                    "modes": total_training_modes}))


def test_the_model_summary_reports_the_whole_model(tmp_path):
    model = LoopTransformer(layers=4)
    expected = sum(p.numel() for p in model.parameters())
    fit(model, token_loader(num_batches=2), devices=2, max_steps=1, partition="parameters",
        trainer_kwargs={"enable_model_summary": True},
        callbacks=[_WriteSummary(max_depth=2, path=tmp_path / "summary.json")])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["total"] == summary["trainable"] == expected  # before: stage 0's part only
    modes = {k: v for k, v in summary["modes"].items() if v}
    assert modes == {"train": sum(1 for _ in model.modules()) - 1}


class _SyncedEpochMetrics(SequentialMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("samples", float(len(batch[0])), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        return loss


class _KeepMetrics(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({k: float(v) for k, v in trainer.callback_metrics.items()}))


def test_sync_dist_is_a_no_op_over_one_replica_and_does_not_warn(tmp_path):
    torch.manual_seed(5)
    single = tmp_path / "single.json"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[_KeepMetrics(single)]).fit(_SyncedEpochMetrics(), regression_loader())
    torch.manual_seed(5)
    piped = tmp_path / "piped.json"
    fit(_SyncedEpochMetrics(), regression_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=2,
        partition="parameters", trainer_kwargs={"max_epochs": 1}, callbacks=[_KeepMetrics(piped), _NoSyncWarning()])
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


class _Momentum(SequentialMLP):
    """SGD with momentum: a lost optimizer state changes every later update."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _one_device(max_epochs: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _assert_same_weights(actual, expected) -> None:
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(actual.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_save_checkpoint_after_fit_resumes_under_the_pipeline_and_on_one_device(tmp_path):
    loader = regression_loader(num_batches=3)
    torch.manual_seed(41)
    model = _Momentum()
    expected = copy.deepcopy(model)
    _one_device(2).fit(expected, loader)  # one device, 2 epochs straight
    # 1 epoch under the pipeline (1f1b: single-device accumulation), then Lightning's documented pattern
    trainer = fit(model, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
                  trainer_kwargs={"max_epochs": 1})
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["paci"]["num_stages"] == 2
    assert len(saved["optimizer_states"][0]["state"]) == len(list(model.parameters()))  # every stage's momentum
    # ... resumes under the pipeline (before: "it was not written by PACIStrategy") ...
    piped = _Momentum()
    fit(piped, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, ckpt_path=str(tmp_path / "last.ckpt"))
    _assert_same_weights(piped, expected)
    # ... and on one device (before: a bare KeyError: 'param_groups')
    single = _Momentum()
    _one_device(2).fit(single, loader, ckpt_path=str(tmp_path / "last.ckpt"))
    _assert_same_weights(single, expected)


def test_a_one_device_checkpoint_resumes_under_the_pipeline(tmp_path):
    loader = regression_loader(num_batches=3)
    torch.manual_seed(42)
    model = _Momentum()
    expected = copy.deepcopy(model)
    _one_device(2).fit(expected, loader)
    trainer = _one_device(1)
    trainer.fit(model, loader)
    trainer.save_checkpoint(tmp_path / "single.ckpt")
    piped = _Momentum()
    fit(piped, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, ckpt_path=str(tmp_path / "single.ckpt"))
    _assert_same_weights(piped, expected)


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
    expected = _Momentum()
    model = copy.deepcopy(expected)
    L.seed_everything(7, workers=True)
    _one_device(1).fit(expected, _worker_loader())
    L.seed_everything(7, workers=True)
    fit(model, _worker_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 1})
    _assert_same_weights(model, expected)  # before: stage 1's workers were seeded by global rank 1


class _ProcessDependentCollate:
    """A collate that depends on the process: every rank builds other batches."""

    def __call__(self, samples):
        x, y = torch.utils.data.default_collate(samples)
        return x + (os.getpid() % 13) * 0.01, y


def test_a_stage_that_trained_on_other_batches_fails_naming_the_cause():
    loader = regression_loader(num_batches=4)
    loader = torch.utils.data.DataLoader(loader.dataset, batch_size=8, collate_fn=_ProcessDependentCollate())
    with pytest.raises(ProcessRaisedException, match="stage 1 trained on other batches than stage 0"):
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
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"))
    reference.run(build(schedule, 2, 2, 2, 3, tied=True), batches)  # the same seed: the same dropout masks
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
    _assert_same_weights(model, expected)


def _odd_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(regression_loader(num_batches=1, batch_size=17).dataset, batch_size=7)


def test_a_short_last_batch_and_uneven_microbatches_train_as_on_one_device(tmp_path):
    # 17 samples in batches of 7, 7, 3 and 4 micro-batches: parts of 2, 2, 2, 1 samples, then a last batch with
    # fewer samples than micro-batches (before: an error at the epoch's end)
    torch.manual_seed(43)
    model = SequentialMLP()
    expected = copy.deepcopy(model)
    single = tmp_path / "single.json"
    _one_device(2).fit(expected, _odd_loader())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[_KeepMetrics(single)])
    trainer.fit(copy.deepcopy(model), _odd_loader())
    piped = tmp_path / "piped.json"
    fit(model, _odd_loader(), devices=2, max_steps=-1, schedule="1f1b", microbatches=4, partition="parameters",
        trainer_kwargs={"max_epochs": 2}, callbacks=[_KeepMetrics(piped), _KeepEpochOne(piped)])
    _assert_same_weights(model, expected)
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
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"))
    reference.run(build("paci", 2, 4, 2, 3), list(_odd_loader()))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


class _LongSkip(SequentialMLP):
    """`head(blocks(h) + h)`: the embedding's output is used after the block container."""

    def __init__(self) -> None:
        super().__init__()
        del self.net  # registered in forward order: embedding, blocks, head
        self.embed = nn.Linear(8, 16)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.net(h) + h)


def test_a_long_skip_across_the_container_is_refused_naming_the_module():
    with pytest.raises(ProcessRaisedException, match=r"Stage 1 would compute with zeros.*computed by `embed`, which "
                                                     r"stage 0 runs.*long skip"):
        fit(_LongSkip(), regression_loader(), devices=2, max_steps=1, partition="parameters")


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
    reference = ReferencePipeline(initial, plan_partition(initial, 2, partition="parameters"))
    reference.run(build("1f1b", 2, 2, 2, 3), list(loader))
    expected = reference.state_dict()
    assert expected["norm.running_var"].ne(1).all()  # stage 0's statistics, not zeros' (before: the last stage's)
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


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
    reference = ReferencePipeline(initial, plan_partition(initial, 4, partition="parameters"))
    reference.run(build("paci", 4, 2, 2, 6), list(loader))
    losses = reference.runtimes[-1].records.losses
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


class _RecordSetupWarnings(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage) -> None:  # before the strategy's setup
        self._catcher = warnings.catch_warnings(record=True)
        self.seen = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module) -> None:
        self._catcher.__exit__(None, None, None)
        if trainer.is_global_zero:
            self.path.write_text(json.dumps([str(w.message) for w in self.seen]))


def test_an_overridden_optimizer_step_is_named_at_setup(tmp_path):
    fit(_WarmUp(), regression_loader(num_batches=2), devices=2, max_steps=1, partition="parameters",
        callbacks=[_RecordSetupWarnings(tmp_path / "warnings.json")])
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
    _one_device_norms = _KeepGradNorms(tmp_path / "single.json")
    L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, callbacks=[_one_device_norms]).fit(single, loader)
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
    # a window of one batch); before, the pipeline carried that batch's gradient into the next epoch's window
    torch.manual_seed(48)
    if tied:
        model, loader = _SGDCausalLM("gpt2", layers=4, tied=True), token_loader(num_batches=3, vocab=64)
    else:
        model, loader = _Momentum(), regression_loader(num_batches=3)
    expected = copy.deepcopy(model)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(expected, loader)
    fit(model, loader, devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 2, "accumulate_grad_batches": 2})
    _assert_same_weights(model, expected)
