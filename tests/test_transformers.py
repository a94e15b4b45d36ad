"""Real models, unchanged: transformers GPT-2 and Llama through the Trainer, against single-device references."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers import DumpStageRecords, RecordLosses, fit, read_stage_records
from models import HFCausalLM, HFModel, dict_loader, hf_model_reference, hf_reference_accumulation, token_loader

pytestmark = pytest.mark.distributed


def _close(model, reference, rtol, atol=1e-6):
    expected = reference.state_dict()
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("devices", [2, 4])
def test_hf_model_under_1f1b_equals_single_device_accumulation(kind, devices):
    torch.manual_seed(10)
    model = HFCausalLM(kind, layers=4)
    reference = copy.deepcopy(model)
    loader = token_loader(num_batches=6, vocab=64, seq=12)
    fit(model, loader, devices=devices, schedule="1f1b", microbatches=4)
    hf_reference_accumulation(reference, list(loader)[:5], num_microbatches=4)
    _close(model, reference, rtol=1e-4)


@pytest.mark.parametrize("kind,tied", [("gpt2", False), ("gpt2", True), ("llama", False)])
@pytest.mark.parametrize("devices", [4])  # 2 stages: covered by the equality tests above and below
def test_hf_model_trains_under_paci_with_decreasing_loss(tmp_path, kind, tied, devices):
    torch.manual_seed(11)
    model = HFCausalLM(kind, layers=4, lr=1e-2, tied=tied)
    losses = RecordLosses(tmp_path)
    fit(model, token_loader(num_batches=8, vocab=64, seq=12), devices=devices, max_steps=-1,
        trainer_kwargs={"max_epochs": 4}, callbacks=[losses], schedule="paci", microbatches=4)
    values = losses.values()
    assert len(values) >= 8
    assert values[-1] < 0.8 * values[0]


def test_variable_sequence_lengths_and_a_ragged_last_batch_over_two_epochs():
    # every batch has its own sequence length; 22 samples in batches of 8 -> the last batch has 6 (micro-batches
    # of 2, 2, 1, 1, their losses weighted by their share of the samples); two epochs; under "1f1b" the run equals
    # one device training on the whole batches
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(12)
    ids = torch.randint(0, 64, (22, 16))

    def collate(rows):  # the length from the batch's place in the epoch (its first row's index): no state
        batch = torch.stack([r[0] for r in rows])
        length = 6 + 3 * (int(rows[0][1]) // 8 % 3)
        return (batch[:, :length],)

    loader = DataLoader(TensorDataset(ids, torch.arange(22)), batch_size=8, shuffle=False, collate_fn=collate)
    batches = list(loader)
    assert {b[0].shape[1] for b in batches} == {6, 9, 12} and batches[-1][0].shape[0] == 6
    class SGDCausalLM(HFCausalLM):  # SGD: a weighting error shows at its scale (AdamW would normalise it away)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    model = SGDCausalLM("gpt2", layers=4)
    reference = copy.deepcopy(model)
    fit(model, loader, devices=2, max_steps=-1, trainer_kwargs={"max_epochs": 2}, schedule="1f1b", microbatches=4,
        partition="parameters")
    hf_reference_accumulation(reference, batches + batches, num_microbatches=1)
    _close(model, reference, rtol=1e-5, atol=1e-6)


def test_predict_gives_single_device_predictions_on_rank_zero_in_order(tmp_path):
    # forked ranks cannot return predictions to the test (Lightning refuses return_predictions with fork/spawn),
    # so rank 0 writes what its predict_step returned; tests/test_launch.py checks trainer.predict's return value
    import lightning as L
    from lightning.pytorch.callbacks import BasePredictionWriter

    from lightning_paci import PACIStrategy

    class Writer(BasePredictionWriter):
        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            if trainer.is_global_zero:
                torch.save(prediction, tmp_path / f"pred{batch_idx}.pt")

    torch.manual_seed(13)
    model = HFCausalLM("llama", layers=4)
    loader = token_loader(num_batches=3, vocab=64, seq=10)
    with torch.no_grad():
        expected = [model.model(input_ids=ids).logits for (ids,) in loader]
    trainer = L.Trainer(strategy=PACIStrategy(start_method="fork", microbatches=4), accelerator="cpu", devices=4,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[Writer("batch")])
    trainer.predict(model, loader, return_predictions=False)
    for k, want in enumerate(expected):
        torch.testing.assert_close(torch.load(tmp_path / f"pred{k}.pt"), want, rtol=1e-4, atol=1e-5)


def test_model_checkpoint_and_early_stopping_on_val_loss_behave_as_on_one_device(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from lightning_paci import PACIStrategy

    train = token_loader(num_batches=4, vocab=64, seq=12)
    val = token_loader(num_batches=2, vocab=64, seq=12, seed=1)

    val_losses: list[float] = []

    class ValLosses(L.Callback):  # one device's validation losses, epoch by epoch (in this process)
        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def run(strategy, devices, directory, threshold=None):
        torch.manual_seed(14)
        model = HFCausalLM("gpt2", layers=4, lr=1e-2).double()  # float64: the decisions compare equal values
        callbacks = [ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1, filename="best")]
        if strategy == "auto" and threshold is None:
            callbacks.append(ValLosses())
        if threshold is not None:
            callbacks.append(EarlyStopping(monitor="val_loss", stopping_threshold=threshold, patience=100))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=6, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            num_sanity_val_steps=0, callbacks=callbacks, precision="64-true")
        trainer.fit(model, train, val)
        return torch.load(directory / "best.ckpt", weights_only=False)

    single = run("auto", 1, tmp_path / "single")
    scores = single["callbacks"]
    history_score = next(v["best_model_score"] for k, v in scores.items() if k.startswith("ModelCheckpoint"))
    assert math.isfinite(float(history_score)) and float(history_score) > 0  # a real validation loss was tracked
    # stop once val_loss falls below a value one device reaches mid-run: between epoch 2's and epoch 3's
    assert len(val_losses) == 6 and val_losses[3] < val_losses[2], val_losses
    threshold = (val_losses[2] + val_losses[3]) / 2
    single = run("auto", 1, tmp_path / "single_es", threshold)
    piped = run(PACIStrategy(start_method="fork", schedule="1f1b", microbatches=4), 2, tmp_path / "piped", threshold)
    assert single["epoch"] == 3  # early stopping fired mid-run, after epoch 3's validation
    assert piped["epoch"] == single["epoch"]  # and after the same epoch under the pipeline
    s_cb = next(v for k, v in single["callbacks"].items() if k.startswith("ModelCheckpoint"))
    p_cb = next(v for k, v in piped["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert float(p_cb["best_model_score"]) == pytest.approx(float(s_cb["best_model_score"]), rel=1e-10)
    assert piped["state_dict"].keys() == single["state_dict"].keys()  # a consolidated, complete checkpoint
    # one device takes the mean over the whole batch, the pipeline the mean of 4 micro-batch means: equal in exact
    # arithmetic, float64 rounding apart; AdamW divides by the gradients' root mean square, which near-zero
    # gradients' last bits move (3.3e-7 relative measured at worst, on 2% of one matrix)
    for key, value in single["state_dict"].items():
        assert piped["state_dict"][key].dtype == torch.float64, key
        torch.testing.assert_close(piped["state_dict"][key], value, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("devices", [2, 4])
def test_tied_embedding_under_1f1b_equals_single_device_accumulation(kind, devices):
    torch.manual_seed(15)
    model = HFCausalLM(kind, layers=4, tied=True)
    reference = copy.deepcopy(model)
    loader = token_loader(num_batches=6, vocab=64, seq=12)
    fit(model, loader, devices=devices, schedule="1f1b", microbatches=4)
    hf_reference_accumulation(reference, list(loader)[:5], num_microbatches=4)
    # the tied gradient is summed in another order (stage 0's window + the last stage's window instead of use by
    # use), and AdamW magnifies last-bit differences on near-zero entries: hence the absolute tolerance
    _close(model, reference, rtol=1e-4, atol=1e-5)
    # after fit the module is tied again: one Parameter under both names
    assert model.model.get_output_embeddings().weight is model.model.get_input_embeddings().weight


def test_tied_copies_go_through_identical_versions_under_paci(tmp_path):
    from lightning_paci import ReferencePipeline, build_schedule, plan_partition
    from lightning_paci.schedules import static_tied_lags

    from helpers import DumpStageRecords, read_stage_records

    torch.manual_seed(16)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    initial = copy.deepcopy(model)
    loader = token_loader(num_batches=7, vocab=64, seq=12)
    fit(model, loader, devices=4, max_steps=6, schedule="paci", microbatches=4, partition="parameters",
        callbacks=[DumpStageRecords(tmp_path)])
    first, *_, last = read_stage_records(tmp_path, 4)
    # after every local update stage 0's wte and, once installed, the last stage's lm_head hold the same bytes
    assert len(first["tied_fingerprints"]) == 6
    assert last["tied_fingerprints"] == first["tied_fingerprints"]
    # the replica's staleness is what the last stage's list says (here at most 1 update: N = m = a = 4)
    expected_lags = static_tied_lags(build_schedule("paci", 4, 4, 4, 6, tied=True).actions[3])
    assert {int(k): v for k, v in last["tied_lags"].items()} == expected_lags and max(expected_lags.values()) == 1
    # the multi-process run equals the reference executor of the same (tied) action lists
    reference = ReferencePipeline(initial, plan_partition(initial, 4, partition="parameters"))
    reference.run(build_schedule("paci", 4, 4, 4, 6, tied=True), list(loader)[:6])
    expected = reference.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("schedule, accumulation, bound", [("paci", 1, 4), ("1f1b", 1, 1), ("1f1b", 2, 0)])
def test_the_tied_replica_lag_is_read_from_the_lists(schedule, accumulation, bound):
    # N = 4, m = 2: the last stage's forwards use tied weights as many updates old as its list says; a flush
    # schedule is current at every mini-batch start only when the window is the whole mini-batch (a = m)
    from lightning_paci import ReferencePipeline, build_schedule, plan_partition
    from lightning_paci.schedules import static_tied_lags

    torch.manual_seed(17)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    reference = ReferencePipeline(model, plan_partition(model, 4, partition="parameters"))
    schedule_lists = build_schedule(schedule, 4, 2, accumulation, 6, tied=True)
    reference.run(schedule_lists, list(token_loader(num_batches=6, batch_size=4, vocab=64, seq=12)))
    recorded = dict(reference.runtimes[-1].records.tied_lags)
    assert recorded == static_tied_lags(schedule_lists.actions[3])
    assert max(recorded.values()) == bound


def test_an_encoder_decoder_at_four_stages_relays_the_encoders_output_and_equals_one_device(tmp_path):
    # T5: the encoder's blocks on stages 0-1, the decoder's on stages 2-3 (one row, [Note: several containers]);
    # every decoder block reads the encoder's output (its final norm, on stage 1): stage 1 sends it with the
    # activations, stage 2 reads it and passes it to stage 3. The decoder's input embedding is tied to the encoder's:
    # stage 0 makes it after its own part ([Note: late relays]) and relays it to stage 1, which feeds the decoder's
    # first block with it. The LM head's weight is tied between stage 0 and stage 3. float64, SGD.
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(13)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, dropout_rate=0.0,
                      use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    model = HFModel(T5ForConditionalGeneration(config)).double()  # float64 here too: weights come back unrounded
    reference = copy.deepcopy(model)
    batches = [{"input_ids": torch.randint(1, 64, (4, 10)), "labels": torch.randint(1, 64, (4, 7))} for _ in range(3)]
    fit(model, dict_loader(batches), devices=4, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        callbacks=[DumpStageRecords(tmp_path, activation_bytes=True)],
        trainer_kwargs={"max_epochs": 1, "precision": "64-true"})
    hf_model_reference(reference, batches, num_microbatches=2)  # T5's loss: a mean over equal token counts
    assert all(v.dtype == torch.float64 for v in model.state_dict().values())
    _close(model, reference, rtol=1e-10, atol=1e-12)
    records = read_stage_records(tmp_path, 4)
    assert ("model.decoder.embed_tokens (call 0, tensor 0, (2, 7, 32) float64, 3,584 B, made late) stage 0 -> 1"
            in records[0]["relays"])
    assert ("model.encoder.final_layer_norm (call 0, tensor 0, (2, 10, 32) float64, 5,120 B) stage 1 -> 3"
            in records[0]["relays"])
    assert [r["peak_relayed_bytes"] for r in records] == [2 * 7 * 32 * 8, 2 * 10 * 32 * 8, 2 * 10 * 32 * 8, 0]


def test_bloom_under_64_true_keeps_every_crossing_tensor_in_float64():
    # the ALiBi bias is made on every stage from the dtype of the embedding's output, which a placeholder gives on
    # the stages that do not own it: it must follow the module's conversion to float64 after carving
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(14)
    config = BloomConfig(vocab_size=64, hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0,
                         attention_dropout=0.0, use_cache=False)
    model = HFModel(BloomForCausalLM(config)).double()  # float64 here too: weights come back unrounded
    reference = copy.deepcopy(model)
    ids = [torch.randint(0, 64, (4, 12)) for _ in range(3)]
    batches = [{"input_ids": i, "labels": i} for i in ids]
    fit(model, dict_loader(batches), devices=2, max_steps=-1, schedule="1f1b", microbatches=2, partition="parameters",
        trainer_kwargs={"max_epochs": 1, "precision": "64-true"})
    hf_model_reference(reference, batches, num_microbatches=2)
    # a bias or activation crossing in float32 would leave errors near 1e-7: the tolerance sees float64 throughout
    assert all(v.dtype == torch.float64 for v in model.state_dict().values())
    _close(model, reference, rtol=1e-10, atol=1e-12)
