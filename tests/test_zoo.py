"""Models nobody here wrote, as users wrap them: every causal-LM family of the installed transformers (from its own
auto-model registry, tests/zoo.py), an encoder-only, two encoder-decoders, a vision transformer, Lightning's demo
transformer and LitGPT (when installed). Each trains on two stages under "1f1b" exactly as on one device (float64,
SGD) and trains under "paci" (its loss falls), or is refused with the error that names what to change. In one
process, with the reference executor: the same stage runtime a multi-process run uses (test_transformers.py runs real
encoder-decoder and float64 models through the Trainer).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from zoo import SKIP, causal_lm_families
from zoo import build as build_family

from lightning_paci.engine.transport.pickle_guard import TensorPickleError
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.integration.stage.reference_pipeline import ReferencePipeline
from lightning_paci.partition import plan_partition
from lightning_paci.partition.carve import CrossingError
from lightning_paci.partition.plan import call_order
from lightning_paci.schedules import build_schedule

from models import HFModel

# families the tiny config cannot build with 2 layers (a per-layer pattern needs more): built with 4
LAYERS = {"gemma3n_text": 4, "olmo_hybrid": 4, "zamba": 4}

# families refused, each with the error a user gets and why (what the pipeline cannot split)
REFUSED: dict[str, tuple[type[Exception], str, str]] = {
    "blt": (CrossingError, "`model.model.local_encoder.cross_attn_layers` (ModuleList) lives on stage 0",
            "its local encoder's layers are a container cut with the rest, and its cross-attention layers, one "
            "ModuleList indexed next to them, run on every stage (its byte patcher, deciding patch boundaries with "
            "`.item()`, could not run on the meta device either)"),
    "dory": (ValueError, "runs 2 times in one step",
             "a recurrent-depth model: its middle blocks run several times per step"),
    "gemma3n_text": (CrossingError, "`model.model.altup_projections` (ModuleList) lives on stage 0",
                     "one ModuleList of projections indexed by position next to the blocks (AltUp)"),
    "gemma4_text": (TensorPickleError, "is a tensor of shape",
                    "later layers read earlier layers' keys and values from a shared dict object (KV sharing), "
                    "which a message cannot carry"),
    "gemma4_unified_text": (TensorPickleError, "is a tensor of shape", "KV sharing, as gemma4_text"),
    "hrm_text": (ValueError, "runs 6 times in one step",
                 "a hierarchical recurrent model: its blocks run several times per step"),
    "prophetnet": (CrossingError, "computes with `model.prophetnet.decoder.position_embeddings.weight`",
                   "the decoder reads the weights of its position embedding (`_forward`) rather than calling it"),
    "reformer": (CrossingError, "runs without gradients although the step began with them",
                 "reversible residual layers run inside one autograd Function"),
    "xlm": (CrossingError, "code on another stage indexes it",
            "one ModuleList per kind of sub-layer, indexed inside the loop over the layers"),
    "zaya": (CrossingError, "Stage 1 computes with `model.model.input_hidden_states_bias`",
             "parameters held by the model on the path to its blocks, read by every block's call"),
}


def _plan(module: nn.Module, sample, stages: int = 2):
    with torch.no_grad(), recording_logs(module, [], 1, "training_step"):
        trace = call_order(module, lambda: module.training_step(sample, 0))
    return plan_partition(module, stages, partition="parameters", trace=trace)


def _trains_like_one_device(module: nn.Module, batch: dict[str, torch.Tensor], *, stages: int = 2) -> None:
    """"1f1b" on one batch of two micro-batches equals one device's plain step on the whole batch; then "paci" on four
    more lowers the loss."""
    reference = copy.deepcopy(module)
    plan = _plan(module, {k: v[: len(v) // 2] for k, v in batch.items()}, stages)
    pipeline = ReferencePipeline(module, plan)
    pipeline.run(build_schedule("1f1b", stages, 2, 2, 1, tied=bool(plan.tied)), [batch])
    optimizer = reference.configure_optimizers()
    reference.training_step(batch, 0).backward()  # one device's plain step on the whole batch
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pipeline.state_dict()[key], value, rtol=1e-6, atol=1e-9,
                                   msg=lambda m: f"{key}: {m}")
    pipeline.run(build_schedule("paci", stages, 2, 2, 4, tied=bool(plan.tied)), [batch] * 4)
    losses = pipeline.runtimes[-1].records.losses
    assert losses[max(losses)] < losses[min(losses)], losses


FAMILIES = [f for f in causal_lm_families() if f not in SKIP]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_causal_lm_family_trains_as_on_one_device_or_is_refused_naming_the_cause(family):
    torch.manual_seed(0)
    module = HFModel(build_family(family, layers=LAYERS.get(family, 2)))
    ids = torch.randint(0, 64, (4, 8))
    batch = {"input_ids": ids, "labels": ids}
    if family in REFUSED:
        error, message, _ = REFUSED[family]
        with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            _trains_like_one_device(module, batch)
        return
    _trains_like_one_device(module, batch)


def test_the_zoo_counts_what_the_readme_states():
    assert len(causal_lm_families()) == 200  # transformers 5.25.0's registry (the test extra pins it)
    assert (len(FAMILIES) - len(REFUSED), len(FAMILIES)) == (175, 185)


def _seq2seq(kind: str) -> nn.Module:
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertForMaskedLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    if kind == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, dropout_rate=0.0, use_cache=False,
                                                   decoder_start_token_id=0, pad_token_id=0))
    if kind == "bart":
        return BartForConditionalGeneration(BartConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False))
    return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("kind", ["t5", "bart", "bert"])
def test_encoder_decoders_and_an_encoder_train_as_on_one_device(kind):
    torch.manual_seed(1)
    module = HFModel(_seq2seq(kind).double())
    ids = torch.randint(1, 64, (4, 10))
    labels = torch.randint(1, 64, (4, 7)) if kind != "bert" else ids
    _trains_like_one_device(module, {"input_ids": ids, "labels": labels})


def test_a_vision_transformer_trains_as_on_one_device():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(2)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    module = HFModel(ViTForImageClassification(config).double())
    batch = {"pixel_values": torch.randn(4, 3, 32, 32, dtype=torch.float64), "labels": torch.randint(0, 5, (4,))}
    _trains_like_one_device(module, batch)


class _DemoTransformer(HFModel):
    """Lightning's own demo (``lightning.pytorch.demos.transformer``): ``nn.Transformer``, whose decoder reads
    ``self.layers[0].self_attn.batch_first`` on every stage and whose every decoder layer reads the encoder's
    output. Its step as the demo writes it, on a dict batch."""

    def __init__(self) -> None:
        from lightning.pytorch.demos.transformer import Transformer

        super().__init__(Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=4, dropout=0.0))

    def training_step(self, batch, batch_idx):
        output = self.model(batch["input_ids"], batch["labels"])
        return nn.functional.nll_loss(output, batch["labels"].view(-1))


def test_lightnings_demo_transformer_trains_as_on_one_device_at_four_stages():
    torch.manual_seed(3)
    module = _DemoTransformer().double()
    reference = copy.deepcopy(module)
    batch = {"input_ids": torch.randint(0, 64, (4, 10)), "labels": torch.randint(0, 64, (4, 10))}
    plan = _plan(module, {k: v[:2] for k, v in batch.items()}, 4)
    pipeline = ReferencePipeline(module, plan)
    pipeline.run(build_schedule("1f1b", 4, 2, 2, 1), [batch])
    optimizer = reference.configure_optimizers()
    reference.training_step(batch, 0).backward()  # one device's plain step on the whole batch
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pipeline.state_dict()[key], value, msg=lambda m: f"{key}: {m}")
    # the encoder's layers and the decoder's are cut as one row; the encoder's output (its final norm) and the
    # decoder's input embedding (the demo embeds source and target first, on stage 0) are relayed
    assert plan.containers == ("model.transformer.encoder.layers", "model.transformer.decoder.layers")
    assert {(r.module, r.call, r.late) for r in pipeline.relays.relays} == {
        ("model.embedding", 1, False), ("model.transformer.encoder.norm", 0, False)}
    pipeline.run(build_schedule("paci", 4, 2, 2, 4), [batch] * 4)
    losses = pipeline.runtimes[-1].records.losses
    assert losses[max(losses)] < losses[min(losses)]


def test_litgpt_trains_as_on_one_device():
    litgpt = pytest.importorskip("litgpt.model")
    from litgpt.config import Config

    class LitGPTModule(HFModel):  # LitGPT registers lm_head before transformer: placed by where it runs
        def training_step(self, batch, batch_idx):
            logits = self.model(batch["input_ids"][:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                               batch["input_ids"][:, 1:].reshape(-1))

    torch.manual_seed(4)
    config = Config(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=64, padded_vocab_size=64, bias=False)
    module = LitGPTModule(litgpt.GPT(config)).double()
    reference = copy.deepcopy(module)
    batch = {"input_ids": torch.randint(0, 64, (4, 12))}
    plan = _plan(module, {"input_ids": batch["input_ids"][:2]})
    assert plan.after == ("model.lm_head", "model.transformer.ln_f")
    pipeline = ReferencePipeline(module, plan)
    pipeline.run(build_schedule("1f1b", 2, 2, 2, 1), [batch])
    optimizer = reference.configure_optimizers()
    for part in torch.tensor_split(batch["input_ids"], 2):
        (reference.training_step({"input_ids": part}, 0) / 2).backward()
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pipeline.state_dict()[key], value, msg=lambda m: f"{key}: {m}")
