"""A loss that couples the samples of a batch, found at setup ([Note: a loss that couples a batch's samples]).

A two-tower contrastive model (transformers' CLIP: in-batch negatives) is named, with both figures; causal LMs of
the zoo, encoder-decoders, an encoder and a vision transformer, whose losses are means over samples, are not.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from zoo import SKIP, causal_lm_families
from zoo import build as build_family

from lightning_paci.integration.setup.batch_coupling import TOLERANCE, batch_coupling, coupling_warning

from helpers import fit
from models import HFModel, dict_loader, tiny_clip


def _clip(batch_size: int = 8) -> tuple[HFModel, dict[str, Any]]:
    return tiny_clip(layers=2, batch_size=batch_size)


def _check(module: HFModel, batch: Any, m: int = 2) -> str | None:
    return coupling_warning(module, batch, m, context=_no_context, cuda_devices=[])


def _no_context() -> Any:
    return contextlib.nullcontext()


def test_a_contrastive_loss_over_in_batch_negatives_is_named_with_both_figures():
    module, batch = _clip()
    whole, mean = batch_coupling(module, batch, 2, context=_no_context, cuda_devices=[])
    assert abs(whole - mean) / whole > 0.05  # 8 negatives per sample against 4
    message = _check(module, batch)
    assert message is not None and "couples the samples of a batch" in message
    assert f"{whole:.6g}" in message and f"{mean:.6g}" in message and "2 micro-batches" in message
    assert "`PACIStrategy(microbatches=...)`" in message
    assert _check(module, batch, m=1) is None  # one micro-batch: the whole batch


def _zoo() -> list[tuple[str, HFModel, dict[str, Any]]]:
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertForMaskedLM,
        ViTConfig,
        ViTForImageClassification,
    )

    families = [f for f in causal_lm_families() if f not in SKIP][:16]
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (8, 8))
    models = [(f, HFModel(build_family(f, layers=2 if f not in ("gemma3n_text", "olmo_hybrid", "zamba") else 4)),
               {"input_ids": ids, "labels": ids}) for f in families]
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64))
    vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, intermediate_size=64, num_labels=5))
    labels = torch.randint(3, 64, (8, 6))
    models += [("bart", HFModel(bart.double()), {"input_ids": ids, "labels": labels}),
               ("bert", HFModel(bert.double()), {"input_ids": ids, "labels": ids}),
               ("vit", HFModel(vit.double()), {"pixel_values": torch.randn(8, 3, 32, 32, dtype=torch.float64),
                                               "labels": torch.randint(0, 5, (8,))}),
               ("bart-float32", HFModel(bart.float()), {"input_ids": ids, "labels": labels})]
    return models


def test_twenty_models_whose_loss_is_a_mean_over_samples_are_not_named():
    # dropout is on in several of them (bart, bert, vit by default): the check runs in eval mode
    models = _zoo()
    assert len(models) == 20
    for name, module, batch in models:
        whole, mean = batch_coupling(module, batch, 4, context=_no_context, cuda_devices=[])
        assert abs(whole - mean) <= TOLERANCE * abs(whole), (name, whole, mean)
        assert module.training  # left as it was
        assert _check(module, batch, m=4) is None, name


class _Warnings(L.Callback):
    """Every warning of the rank from the callbacks' setup (before the strategy's) to the start of training."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._record = warnings.catch_warnings(record=True)
        self.log = self._record.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record.__exit__(None, None, None)
        lines = [str(w.message) for w in self.log if "couples the samples" in str(w.message)]
        (self.directory / f"warnings{trainer.global_rank}.json").write_text(json.dumps(lines))


@pytest.mark.distributed
def test_a_two_stage_clip_run_warns_once_on_rank_zero(tmp_path):
    module, batch = _clip(batch_size=16)
    fit(module, dict_loader([batch]), devices=2, max_steps=1, microbatches=2, partition="parameters",
        callbacks=[_Warnings(tmp_path)])
    shown = json.loads((tmp_path / "warnings0.json").read_text())
    assert len(shown) == 1 and "2 micro-batches" in shown[0]
    assert json.loads((tmp_path / "warnings1.json").read_text()) == []
