"""Several block containers cut as one row: encoder-decoders, two towers, a U-shaped network.

Each model is cut along every container its step runs ([Note: several containers] in partition/blocks.py), the
modules between and after them go to the stage running them, a learned temperature held by the top module to the
stage that uses it, and the values read past the next stage (an encoder's output, the skips of a UNet) are
relayed. Every case trains as one device does ("1f1b", float64, SGD), and under "paci" its loss goes down.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tr
from torch import nn

from lightning_paci.errors import CrossingError
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.integration.stage.reference_pipeline import ReferencePipeline
from lightning_paci.partition.plan import call_order, plan_partition
from lightning_paci.schedules import build_schedule

from helpers import fit
from models import DiffusionUNet, HFModel, LongSkip, dict_loader, hf_model_reference, regression_loader, tiny_clip


def _trace(module: nn.Module, half):
    with torch.no_grad(), recording_logs(module, [], 1, "training_step"):
        return call_order(module, lambda: module.training_step(half, 0))


def _halves(batch):
    if isinstance(batch, dict):
        return [{k: v[i * 2: i * 2 + 2] if torch.is_tensor(v) else v for k, v in batch.items()} for i in range(2)]
    return [tuple(t[i * 2: i * 2 + 2] for t in batch) for i in range(2)]


def _one_device(module, batch):
    """One device's plain step on the whole batch."""
    optimizer = module.configure_optimizers()
    module.training_step(batch, 0).backward()
    optimizer.step()
    return module


def _accumulated(module, batch):
    """One device accumulating the pipeline's two micro-batches: the reference for a loss that couples the batch's
    samples ([Note: a loss that couples a batch's samples]), which one device's plain step is not."""
    optimizer = module.configure_optimizers()
    for half in _halves(batch):
        (module.training_step(half, 0) / 2).backward()
    optimizer.step()
    return module


def _pipeline_equals_one_device(module, batch, stages, reference_step=_one_device):
    """The plan (from a traced step), the pipeline after one "1f1b" step equal to ``reference_step`` (one device's
    plain step on the whole batch), then four "paci" steps lowering the loss."""
    reference = copy.deepcopy(module)
    plan = plan_partition(module, stages, trace=_trace(module, _halves(batch)[0]))
    pipeline = ReferencePipeline(module, plan)
    pipeline.run(build_schedule("1f1b", stages, 2, 2, 1, tied=bool(plan.tied)), [batch])
    with recording_logs(reference, [], 2, "training_step"):
        reference_step(reference, batch)
    state = pipeline.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-7, atol=1e-9, msg=lambda m: f"{key}: {m}")
    pipeline.run(build_schedule("paci", stages, 2, 2, 4, tied=bool(plan.tied)), [batch] * 4)
    losses = [loss for _, loss in sorted(pipeline.runtimes[-1].records.losses.items())]
    assert sum(losses[-4:]) < sum(losses[:4]), losses  # the last four micro-batches against the first four
    return plan, pipeline


def _seq2seq(kind: str):
    torch.manual_seed(60)
    sizes = dict(d_model=32, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, use_cache=False,
                 vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    labels = torch.randint(3, 64, (4, 7))
    if kind == "t5":
        config = tr.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, dropout_rate=0.0,
                             use_cache=False, decoder_start_token_id=0, pad_token_id=0)
        return tr.T5ForConditionalGeneration(config), {"input_ids": torch.randint(1, 64, (4, 10)), "labels": labels}
    if kind == "bart":
        config = tr.BartConfig(max_position_embeddings=32, decoder_start_token_id=2, **sizes)
        return tr.BartForConditionalGeneration(config), {"input_ids": torch.randint(3, 64, (4, 10)), "labels": labels}
    # a speech encoder (convolutions over mel features) and a text decoder whose embedding is tied to its head
    config = tr.WhisperConfig(num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                              decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None, **sizes)
    features = torch.randn(4, 8, 32, dtype=torch.float64)
    return tr.WhisperForConditionalGeneration(config), {"input_features": features, "labels": labels}


@pytest.mark.parametrize("kind", ["t5", "bart", "whisper"])
def test_an_encoder_decoder_at_four_stages_puts_its_encoders_layers_first_and_equals_one_device(kind):
    model, batch = _seq2seq(kind)
    module = HFModel(model).double()
    plan, pipeline = _pipeline_equals_one_device(module, batch, 4)
    encoder, decoder = plan.containers
    assert ".encoder." in encoder and ".decoder." in decoder
    assert [plan.block_names[plan.blocks(s).start].startswith(encoder) for s in range(4)] == [True, True, False, False]
    mean = sum(plan.stage_params) / 4
    assert max(plan.stage_params) <= 1.12 * mean, plan.describe()  # README: within 1.12x of the mean
    # the decoder's input embedding is stage 0's (it is tied there), made after its own part and relayed
    late = [r for r in pipeline.relays.relays if r.late]
    assert [(r.owner, r.module.endswith(("decoder.embed_tokens", "shared"))) for r in late] == [(0, True)]
    assert all(pipeline.relays.bytes_sent(s) > 0 for s in range(3))


def _clip():
    return tiny_clip()


@pytest.mark.parametrize("stages", [2, 4])
def test_a_two_tower_contrastive_model_equals_one_device_accumulating_its_micro_batches(stages):
    # its contrastive loss couples the batch's samples: against one device accumulating the same micro-batches
    module, batch = _clip()
    plan, pipeline = _pipeline_equals_one_device(module, batch, stages, reference_step=_accumulated)
    assert plan.containers == ("model.vision_model.encoder.layers", "model.text_model.encoder.layers")
    assert plan.direct == (("model.logit_scale", stages - 1),)  # used by the loss, after both towers
    # the image embedding is made where the vision tower ends and read by the loss on the last stage
    (relay,) = pipeline.relays.relays
    assert (relay.module, relay.last, relay.nbytes) == ("model.visual_projection", stages - 1, 2 * 16 * 8)
    assert "model.visual_projection (call 0, tensor 0, (2, 16) float64, 256 B)" in pipeline.relays.describe()


@pytest.mark.parametrize("stages", [2, 4])
def test_a_diffusion_unet_whose_up_blocks_read_the_down_blocks_outputs_equals_one_device(stages):
    torch.manual_seed(62)
    module = DiffusionUNet().double()
    batch = (torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.rand(4, 1, dtype=torch.float64),
             torch.randn(4, 3, 8, 8, dtype=torch.float64))
    plan, pipeline = _pipeline_equals_one_device(module, batch, stages)
    assert plan.containers == ("down", "up")
    relays = {r.key: (r.owner, r.last) for r in pipeline.relays.relays}
    # the skips of the first two down blocks and the time embedding, read by the up path
    assert set(relays) == {"down.0#0#0", "down.1#0#0", "time_mlp#0#0"}
    sent = [pipeline.relays.bytes_sent(s) for s in range(stages)]
    skips = 2 * 8 * 8 * 8 * 8 + 2 * 16 * 4 * 4 * 8  # float64 (2, 8, 8, 8) and (2, 16, 4, 4)
    assert sent == ([skips + 256, 0] if stages == 2 else [skips + 256, skips + 256, 8 * 8 * 8 * 2 * 8 + 256, 0])


def test_containers_are_taken_in_the_order_the_step_runs_them_and_a_pair_named_out_of_it_is_refused():
    module = DiffusionUNet()
    x = (torch.randn(2, 3, 8, 8), torch.rand(2, 1), torch.randn(2, 3, 8, 8))
    trace = _trace(module, x)
    assert plan_partition(module, 2, container=["up", "down"], trace=trace).containers == ("down", "up")
    assert plan_partition(module, 2, container="up", trace=trace).containers == ("up",)
    assert plan_partition(module, 2).containers == ("up",)  # no traced step: the largest container alone

    class Interleaved(LongSkip):  # two lists indexed in one loop, as XLM's: not one row
        def __init__(self):
            super().__init__()
            self.other = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

        def forward(self, x):
            h = self.embed(x)
            for block, other in zip(self.net, self.other):
                h = other(block(h))
            return self.head(h)

    model = Interleaved()
    batch = next(iter(regression_loader(num_batches=1)))
    trace = _trace(model, tuple(t[:2] for t in batch))
    assert plan_partition(model, 2, trace=trace).containers == ("net",)
    with pytest.raises(ValueError, match=r"do not run one container after the other"):
        plan_partition(model, 2, container=["net", "other"], trace=trace)


def test_a_parameter_read_by_two_stages_is_refused_naming_it():
    class SharedScale(LongSkip):  # a scale held by the model itself, read before the blocks and after them
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.head(self.net(self.embed(x) * self.scale) * self.scale)

    model = SharedScale()
    batch = next(iter(regression_loader(num_batches=1)))
    plan = plan_partition(model, 2, trace=_trace(model, tuple(t[:2] for t in batch)))
    assert plan.direct == (("scale", 0),)
    pipeline = ReferencePipeline(model, plan)
    with pytest.raises(CrossingError, match=r"Stage 1 computes with `scale`"):
        pipeline.run(build_schedule("1f1b", 2, 2, 2, 1), [batch])


def test_a_plan_without_a_traced_step_refuses_parameters_held_on_the_path():
    module, _ = _clip()
    with pytest.raises(ValueError, match=r"holds parameters directly \(model\.logit_scale\)"):
        plan_partition(module, 2)


def test_an_encoder_decoder_on_virtual_stages_equals_one_device(tmp_path):
    # 2 processes x 2 chunks in a V: device 0 holds stages 0 and 3 (the tied head with the shared embedding), and
    # its stage 0 makes the decoder's input embedding after its own part for stage 1 on the other device. The cut
    # puts the decoder's first layer on stage 1: stage 2 reads the encoder's output through placeholders of its
    # sibling chunk's layers, relayed from stage 1 (tests/test_every_cut.py runs every cut in one process)
    model, _ = _seq2seq("bart")
    torch.manual_seed(63)
    batches = [{"input_ids": torch.randint(3, 64, (4, 10)), "labels": torch.randint(3, 64, (4, 7))} for _ in range(2)]
    module = HFModel(model).double()  # float64 here too: the weights come back unrounded
    reference = copy.deepcopy(module)
    fit(module, dict_loader(batches), devices=2, max_steps=-1, schedule="bfs", placement="v", virtual_stages=2,
        microbatches=2, partition=[2, 5, 7], trainer_kwargs={"max_epochs": 1, "precision": "64-true"})
    hf_model_reference(reference, batches, num_microbatches=2)  # BART's loss: a mean over equal token counts
    state = module.state_dict()
    for key, value in reference.state_dict().items():
        assert state[key].dtype == torch.float64, key
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{key}: {m}")
