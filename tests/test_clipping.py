"""Gradient clipping by norm ([Note: global-norm clipping] in integration/trainer/clipping.py): under the flush
schedules the norm over every stage's parameters, as one device clips; under "paci" the norm over every stage's
latest squared norms that the messages carry ([Note: norm table] in engine/runtime/norm_table.py), as the reference
executor computes it; with virtual stages each stage's own, said at setup. SGD in float64: Adam would hide a clipping
scale."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.runtime.norm_table import NormTable, carried, merged
from lightning_paci.engine.transport.wire import HeaderReader, HeaderWriter, frame
from lightning_paci.integration.trainer.clipping import per_stage_clipping

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
    model = _SGDGPT2("gpt2", layers=4, tied=True).double()  # float64 here too: the weights come back unrounded
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
        assert model.state_dict()[key].dtype == torch.float64, key
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-11, atol=1e-13, msg=lambda m: f"{key}: {m}")


def test_the_one_device_reference_clips():
    """The clipping is active in the runs above: the gradient's norm at the first step is far above ``CLIP``, so a
    per-stage norm would give other weights."""
    torch.manual_seed(0)
    model = _SGDGPT2("gpt2", layers=4, tied=True).double()
    (ids,) = next(iter(token_loader(num_batches=1, batch_size=4, vocab=64)))
    model.model(input_ids=ids, labels=ids).loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert total > 10 * CLIP


class _SaveStageWeights(L.Callback):
    """Every stage of every replica saves its own weights at the end of training, in the run's float64 (``fit``
    hands them back to the test's module in its float32)."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        strategy = trainer.strategy
        torch.save(weights, self.directory / f"stage{strategy.stage_index}_replica{strategy.replica_index}.pt")


def _paci_reference(initial: L.LightningModule, stages: int, batches: list, *, per_stage: bool = False,
                    clip: float | None = CLIP, replicas: int = 1) -> ReferencePipeline:
    """The reference executor of the "paci" lists (m = a = ``stages``, tied) in float64, clipping by its norm tables
    (``batches``: replica r's at ``batches[r]`` with replicas); ``per_stage``: the tables never merge what the
    messages carry, so each stage clips by its own norm."""
    model = copy.deepcopy(initial).double()
    reference = ReferencePipeline(model, plan_partition(model, stages, partition="parameters"), gradient_clip_val=clip,
                                  replicas=replicas)
    if per_stage:
        for runtime in reference.runtimes:
            runtime.norms.merge = lambda entries: None
    steps = len(batches) if replicas == 1 else len(batches[0])
    reference.run(build_schedule("paci", stages, stages, stages, steps, tied=True), batches)
    return reference


def _relative_difference(actual: dict, expected: dict) -> float:
    return max(float((actual[k] - v).abs().max() / v.abs().max()) for k, v in expected.items() if v.abs().max() > 0)


@pytest.mark.distributed
@pytest.mark.parametrize(("stages", "replicas"), [(2, 1), (4, 1), (2, 2)])
def test_clipping_by_norm_under_paci_equals_the_reference_executors_norm_tables(tmp_path, stages, replicas):
    """Under "paci" each stage clips by the norm over every stage's latest squared norms, carried by the pipeline's
    messages (each replica's pipeline its own, the gradients averaged first): what
    ``ReferencePipeline(gradient_clip_val=...)`` computes from the same lists, and no setup warning says "per stage"
    any more."""
    torch.manual_seed(0)
    model = _SGDGPT2("gpt2", layers=4, tied=True)
    initial = copy.deepcopy(model)
    steps = 4
    loader = token_loader(num_batches=steps * replicas, batch_size=4, vocab=64)
    fit(model, loader, devices=stages * replicas, max_steps=steps, schedule="paci", microbatches=stages,
        partition="parameters", data_parallel_size=replicas,
        callbacks=[RecordSetupWarnings(tmp_path / "w.json"), _SaveStageWeights(tmp_path), _RecordBatches(tmp_path)],
        trainer_kwargs={"precision": "64-true", "gradient_clip_val": CLIP, "use_distributed_sampler": replicas > 1})
    seen = json.loads((tmp_path / "w.json").read_text())
    assert not any("each stage clips by the norm of its own gradients" in w for w in seen), seen
    actual: dict[str, torch.Tensor] = {}
    for stage in reversed(range(stages)):  # a tied weight from stage 0, its owner, as the reference's state_dict
        actual.update(torch.load(tmp_path / f"stage{stage}_replica{replicas - 1}.pt"))
    shards = [[(ids,) for ids in torch.load(tmp_path / f"batches{r}.pt")] for r in range(replicas)]
    expected = _paci_reference(initial, stages, shards[0] if replicas == 1 else shards, replicas=replicas)
    assert actual.keys() == expected.state_dict().keys()
    for key, value in expected.state_dict().items():  # bit for bit, in float64
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("stages", [2, 4])
def test_the_norm_tables_clip_and_differ_from_per_stage_clipping(stages):
    """The tests above can fail: the tables' clipping is active (far from no clipping) and not the per-stage rule
    (far from each stage clipping by its own norm), and at the end each stage holds every other stage's norm."""
    torch.manual_seed(0)
    initial = _SGDGPT2("gpt2", layers=4, tied=True)
    batches = list(token_loader(num_batches=4, batch_size=4, vocab=64))
    tables = _paci_reference(initial, stages, batches)
    per_stage = _paci_reference(initial, stages, batches, per_stage=True).state_dict()
    unclipped = _paci_reference(initial, stages, batches, clip=None).state_dict()
    assert _relative_difference(tables.state_dict(), per_stage) > 0.1
    assert _relative_difference(tables.state_dict(), unclipped) > 0.1
    for runtime in tables.runtimes:  # 4 updates; the others' at most one update old (N = m = a: drift <= 1)
        assert runtime.norms.updates[runtime.stage] == 4 and min(runtime.norms.updates) >= 3
        assert bool((runtime.norms.squares > 0).all())


def test_a_norm_table_takes_the_newer_entry_of_every_other_stage_and_keeps_its_own():
    table = NormTable(1, 4, dtype=torch.float64)
    table.record(torch.tensor(9.0, dtype=torch.float64))  # stage 1's first update
    assert table.updates == [0, 1, 0, 0] and table.squares.tolist() == [0.0, 9.0, 0.0, 0.0]
    sent = table.squares
    table.merge((torch.tensor([1.0, 7.0, 3.0, 4.0]), [2.0, 5.0, 1.0, 0.0]))
    # stage 0 and 2 newer: taken; stage 1 is this stage's own, whatever the message says; stage 3: nothing known
    assert table.updates == [2, 1, 1, 0] and table.squares.tolist() == [1.0, 9.0, 3.0, 0.0]
    table.merge((torch.tensor([5.0, 5.0, 6.0, 8.0]), [1.0, 3.0, 2.0, 1.0]))
    # stage 0 older (kept), stage 2 and 3 newer (taken)
    assert table.updates == [2, 1, 2, 1] and table.squares.tolist() == [1.0, 9.0, 6.0, 8.0]
    assert sent.tolist() == [0.0, 9.0, 0.0, 0.0]  # a table already sent is never changed in place
    grads = [torch.full((2,), 3.0, dtype=torch.float64), torch.full((1,), 4.0, dtype=torch.float64)]
    params = [torch.zeros_like(g).requires_grad_() for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    table.clip(params, 0.5)  # own squared norm 9 + 9 + 16 = 34: total sqrt(1 + 34 + 6 + 8) = 7
    assert table.updates == [2, 2, 2, 1] and table.squares.tolist() == [1.0, 34.0, 6.0, 8.0]
    torch.testing.assert_close(params[1].grad, torch.tensor([4.0 * 0.5 / (7.0 + 1e-6)], dtype=torch.float64))


@pytest.mark.parametrize("tensors", [3, 40])
def test_a_norm_tables_merge_and_clip_read_nothing_back_and_launch_a_fixed_number_of_kernels(tensors):
    """[Note: norm table]: on a device the merge is one concatenation and the clip a dozen launches whatever the
    stage's number of tensors (one multi-tensor norm, one multi-tensor scale), and neither reads the device."""
    from device_meter import KernelMeter

    params = [torch.zeros(5, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones(5)
    table, received = NormTable(1, 4), (torch.ones(4), [1.0, 1.0, 1.0, 0.0])
    meter = KernelMeter()
    with meter:
        with meter.phase("merge"):
            table.merge(received)
        with meter.phase("clip"):
            table.clip(params, CLIP)
    assert meter.launches["merge"] == 1 and meter.launches["clip"] <= 12, dict(meter.launches)
    assert sum(meter.host_reads.values()) == 0
    assert table.updates == [1, 1, 1, 0]


def test_a_carried_table_keeps_the_links_header_and_nothing_is_carried_without_one():
    """[Note: header reuse]: the table is a tensor of fixed shape and its update numbers floats, so a link's header
    repeats while the numbers change; without a table the message is the message."""
    message = (torch.ones(2, 3), [])
    assert carried(None, message) is message and merged(None, message) is message
    sender, receiver = NormTable(0, 2), NormTable(1, 2)
    writer, reader = HeaderWriter(), HeaderReader()
    for update in range(3):
        sender.record(torch.tensor(float(update + 1)))
        skeleton, _, _, floats, form = frame(carried(sender, message))
        blob, header_id = writer.header((0, 1), skeleton, form, 0)
        assert (blob == b"") == (update > 0) and floats == [float(update + 1), 0.0]
        reader.read((0, 1), header_id, blob, 1)
        merged(receiver, (message, (sender.squares.clone(), floats)))
        assert receiver.updates == [update + 1, 0] and receiver.squares.tolist() == [float(update + 1), 0.0]
    assert writer.reused == 2


def test_the_reference_refuses_norm_tables_with_virtual_stages_where_the_trainer_clips_per_stage():
    torch.manual_seed(0)
    model = SequentialMLP()
    reference = ReferencePipeline(model, plan_partition(model, 4), gradient_clip_val=CLIP)
    with pytest.raises(ValueError, match=r"`virtual_stages=2`, where the Trainer clips each stage by its own norm"):
        reference.run(build_schedule("paci", 2, 4, 4, 1, virtual_stages=2), list(regression_loader(num_batches=1)))


def test_only_virtual_stages_keep_clipping_by_norm_per_stage():
    class Clipping:
        gradient_clip_val, gradient_clip_algorithm = CLIP, "norm"

    for schedule in ("paci", "1f1b", "gpipe", "layered"):
        assert per_stage_clipping(Clipping(), schedule, 1) is None
    warning = per_stage_clipping(Clipping(), "paci", 2)
    assert warning is not None and "virtual_stages=2" in warning
    assert "each stage clips by the norm of its own gradients" in warning
