"""[Note: no cache across stages]: a transformers model left with ``use_cache=True`` (the config's default) trains
and evaluates with the same bytes per message and the same losses as with ``use_cache=False``: its ``Cache`` never
crosses a stage boundary. The runs go under the NCCL emulation ([Note: NCCL emulation]): the GPU path's wire (headers
on the host group, payloads on the device groups) and NCCL's rules; the GPT-2 ties its embedding and LM head, so the
tied-weight exchange is under them too."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from helpers import DumpLastStageLosses, fit
from models import HFCausalLM, token_loader

pytestmark = pytest.mark.distributed


class _Bytes(Callback):
    """Every rank writes the messages and framed bytes its transports sent in training and in validation."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (evaluation,) = trainer.strategy.stage.evaluator.comms.values()  # one stage per process
        train = trainer.strategy.runtime.comm
        record = {"train": (train.sent_messages, train.sent_bytes),
                  "validation": (evaluation.sent_messages, evaluation.sent_bytes)}
        (self.directory / f"bytes{dist.get_rank()}.json").write_text(json.dumps(record))


def _run(tmp_path: Path, kind: str, use_cache: bool) -> tuple[dict[str, object], list[float], dict[str, torch.Tensor]]:
    directory = tmp_path / f"{kind}_{use_cache}"
    directory.mkdir(parents=True)
    torch.manual_seed(0)
    model = HFCausalLM(kind, layers=3, tied=kind == "gpt2", use_cache=use_cache)
    dumped = DumpLastStageLosses(directory / "losses")
    _fit(model, directory, dumped)
    sent = {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("bytes*.json"))}
    return sent, list(dumped.values().values()), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(model: L.LightningModule, directory: Path, dumped: DumpLastStageLosses) -> None:
    fit(model, token_loader(num_batches=4, batch_size=4, vocab=64), devices=3, max_steps=4, microbatches=2,
        accumulation=2, partition="parameters", callbacks=[_Bytes(directory), dumped],
        val_dataloaders=token_loader(num_batches=2, batch_size=4, vocab=64, seed=1),
        trainer_kwargs={"limit_val_batches": 2, "max_epochs": 1})


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_model_with_its_cache_on_sends_what_it_sends_with_the_cache_off(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
    on_bytes, on_losses, on_weights = _run(tmp_path, kind, use_cache=True)
    off_bytes, off_losses, off_weights = _run(tmp_path, kind, use_cache=False)
    assert on_bytes == off_bytes  # every rank: the same messages, byte for byte in size, training and validation
    assert all(record["train"][0] > 0 for record in on_bytes.values())  # every rank sent while training
    assert sorted(record["validation"][0] for record in on_bytes.values()) == [0, 2 * 2, 2 * 2]  # stages 0, 1
    assert on_losses == off_losses and len(on_losses) == 4 * 2
    for key, value in off_weights.items():
        torch.testing.assert_close(on_weights[key], value, rtol=0, atol=0)


def test_a_cache_holding_earlier_positions_is_refused_at_the_first_boundary():
    from transformers import DynamicCache

    from lightning_paci.partition import carve_stage, plan_partition
    from lightning_paci.partition.carve import StageDone

    torch.manual_seed(0)
    model = HFCausalLM("gpt2", layers=2)
    carve = carve_stage(model, plan_partition(model, num_stages=2, partition="parameters"), 0)
    ids = torch.randint(0, 64, (1, 4))
    past = DynamicCache()
    past.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)  # 3 earlier positions in layer 0
    with pytest.raises(ValueError, match=r"stage 0: a transformers DynamicCache with 7 positions reaches the stage "
                                         r"boundary, more than this forward's 4"):
        model.model(input_ids=ids, past_key_values=past)
    with pytest.raises(StageDone):  # without a prefix the forward ends at the boundary, with no cache in it
        model.model(input_ids=ids)
    assert all(not isinstance(v, DynamicCache) for v in (*carve.boundary.outgoing[0],
                                                         *carve.boundary.outgoing[1].values()))
