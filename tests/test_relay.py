"""Values relayed past stage boundaries, outside modules placed where they run, placeholders that answer: in one
process, with the reference executor, against one device."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch import nn

from lightning_paci.integration.stage.reference_pipeline import ReferencePipeline
from lightning_paci.partition import carve_stage, plan_partition
from lightning_paci.partition.carve import CrossingError
from lightning_paci.partition.plan import CallTrace, call_order
from lightning_paci.schedules import build_schedule

from helpers import fit, one_device
from models import (
    CrossingForms,
    LongSkip,
    ReusedEmbedding,
    ReusedOnBlocks,
    SequentialMLP,
    reference_accumulation,
    regression_loader,
    sequence_loader,
)


def _batches(count: int = 3):
    return list(regression_loader(num_batches=count))


def test_a_long_skip_travels_through_every_stage_between_and_trains_as_on_one_device():
    # 4 stages: the embedding's output is made on stage 0 and read on stage 3, so stages 1 and 2 pass it on (and
    # pass its gradient back, added to nothing of their own)
    torch.manual_seed(50)
    model = LongSkip()
    expected = reference_accumulation(copy.deepcopy(model), _batches(), num_microbatches=2, num_steps=3)
    pipeline = ReferencePipeline(model, plan_partition(model, 4, partition="parameters"))
    pipeline.run(build_schedule("1f1b", 4, 2, 2, 3), _batches())
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(pipeline.state_dict()[key], value, msg=lambda m: f"{key}: {m}")
    (relay,) = pipeline.relays.relays
    assert (relay.key, relay.owner, relay.last) == ("embed#0#0", 0, 3)
    assert relay.nbytes == 4 * 16 * 4  # a micro-batch of 4 rows of 16 float32
    assert [pipeline.relays.bytes_sent(s) for s in range(4)] == [256, 256, 256, 0]
    assert "embed (call 0, tensor 0, (4, 16) float32, 256 B) stage 0 -> 3" in pipeline.relays.describe()


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_module_called_again_on_the_batch_is_made_late_by_its_owner_and_trains_as_on_one_device(num_stages):
    torch.manual_seed(51)
    model = ReusedEmbedding()
    expected = reference_accumulation(copy.deepcopy(model), _batches(), num_microbatches=2, num_steps=3)
    pipeline = ReferencePipeline(model, plan_partition(model, num_stages, partition="parameters"))
    pipeline.run(build_schedule("1f1b", num_stages, 2, 2, 3), _batches())
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(pipeline.state_dict()[key], value, msg=lambda m: f"{key}: {m}")
    (relay,) = pipeline.relays.relays
    assert (relay.key, relay.owner, relay.last, relay.late) == ("embed#1#0", 0, num_stages - 1, True)
    assert "made late" in pipeline.relays.describe()


def test_a_module_called_again_on_another_stages_values_is_refused_at_setup_naming_it():
    model = ReusedOnBlocks()
    pipeline = ReferencePipeline(model, plan_partition(model, 2, partition="parameters"))
    with pytest.raises(CrossingError, match=r"Stage 1 reads call 1 of `embed`.*lives on stage 0, which ends after 1 "
                                            r"call\(s\) of it"):
        pipeline.run(build_schedule("1f1b", 2, 2, 2, 1), _batches(1))


class _HeadRegisteredFirst(SequentialMLP):
    """LitGPT's order: the head is registered before the blocks it runs after."""

    def __init__(self) -> None:
        super().__init__()
        del self.net
        self.head = nn.Linear(16, 4)
        self.embed = nn.Linear(8, 16)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def forward(self, x):
        return self.head(self.net(self.embed(x)))


def test_outside_modules_go_to_the_stage_where_they_run_not_where_they_were_registered():
    model = _HeadRegisteredFirst()
    x, _ = _batches(1)[0]
    with torch.no_grad():
        trace = call_order(model, lambda: model(x))
    assert trace.order.index("head") > trace.order.index("net.3")
    plan = plan_partition(model, 2, partition="parameters", trace=trace)
    assert (plan.before, plan.after) == (("embed",), ("head",))
    assert "stage 1: net[2:4] + head" in plan.describe()
    # without a step to run (a model built on the meta device): registration order
    assert plan_partition(model, 2, partition="parameters").before == ("head", "embed")


def test_a_placeholder_answers_attribute_reads_and_follows_the_models_dtype():
    # torch's TransformerDecoder reads `self.layers[0].self_attn.batch_first` on every stage; `precision="64-true"`
    # converts the module after carving, and the zeros a placeholder returns must have the real module's dtype
    model = nn.Sequential(nn.Linear(8, 16), nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                          nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), nn.Linear(16, 4))
    plan = plan_partition(model, 2, container="", partition=[2])
    carve = carve_stage(model, plan, 1)
    placeholder = model[1]
    assert type(placeholder).__name__ == "Placeholder"
    assert placeholder.self_attn.batch_first is True
    assert placeholder.linear1.weight.shape == (32, 16) and placeholder.linear1.weight.is_meta
    assert not list(placeholder.parameters())  # the structure answers, the state dict stays the stage's own
    model.double()
    out = model[0](torch.randn(3, 8, dtype=torch.float64))  # stage 0's embedding, a placeholder here
    assert out.dtype == torch.float64 and out.shape == (3, 16)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        placeholder.no_such_attribute  # noqa: B018
    carve.restore(model)


class _KeepForms(L.Callback):
    """Stage 1 writes what its blocks received in its training forward."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy.stage_index == 1:
            self.path.write_text(json.dumps(pl_module.forms[-2:]))  # (the setup's sample steps came first)


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "bf16-true"])
def test_every_crossing_tensor_keeps_its_dtype_shape_and_requires_grad(tmp_path, precision):
    # block 2 (stage 1's first) gets what stage 0 sent; block 3 gets values stage 1 made itself, some from the form
    # of a placeholder's output: under bf16-mixed the embedding's output is bfloat16 on one device (autocast)
    expected = CrossingForms()
    one_device(1, precision=precision, max_steps=1).fit(expected, sequence_loader())
    model = CrossingForms()
    fit(model, sequence_loader(), devices=2, max_steps=1, microbatches=1, partition=[2],
        callbacks=[_KeepForms(tmp_path / "forms.json")], trainer_kwargs={"precision": precision})
    received = [[(dtype, tuple(shape), grad) for dtype, shape, grad in block]
                for block in json.loads((tmp_path / "forms.json").read_text())]
    assert received == expected.forms


def test_a_block_run_twice_per_step_is_refused_also_in_a_root_container():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    looped = CallTrace(("0", "1", "2"), {"0": 1, "1": 2, "2": 1})  # block 1 run twice, as a looped model does
    with pytest.raises(ValueError, match="Block `1` of `` runs 2 times in one step"):
        plan_partition(model, 2, container="", partition="parameters", trace=looped)


class _WeightReadHead(LongSkip):
    """A tied head written as `x @ self.embed.weight.T` (GPT-2 style, without calling the embedding): the last stage
    reads stage 0's weight through a view of it."""

    def forward(self, x):
        h = self.net(self.embed(x))
        return self.head(h[..., :8] @ self.embed.weight.T)  # (rows, 8) @ (8, 16)


def test_a_weight_read_through_a_view_on_another_stage_is_refused_at_setup_naming_it():
    model = _WeightReadHead()
    pipeline = ReferencePipeline(model, plan_partition(model, 2, partition="parameters"))
    with pytest.raises(CrossingError, match=r"Stage 1 computes with `embed.weight` \(in `matmul`"):
        pipeline.run(build_schedule("1f1b", 2, 2, 2, 1), _batches(1))
