"""Every cut of a model with two block containers equals one device's plain step (float64, SGD).

An encoder-decoder (BART, 3 + 3 layers, the shared embedding tied to the head) and a two-tower model (3 + 3
blocks, the first tower's output read by the loss after the second tower) are cut at every boundary position
into 4 stages: one stage per process, and 2 processes x 2 chunks in a V and (the two-tower model, no tied weight)
in a loop. Each process's chunks are carved into one copy as the strategy carves a device
(``ReferencePipeline(device_stages=...)``, [Note: chunks of one device] in partition/chunks.py), so what a sibling
chunk's placeholders return is checked too. The reference is one device's plain step on the whole batch (both
losses are means over samples), not an accumulation of the pipeline's micro-batches.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import transformers as tr
from lightning.pytorch import LightningModule

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.partition.plan import call_order

from models import HFModel, TwoTower, two_tower_batch

BLOCKS, STAGES = 6, 4
CUTS = [list(c) for c in itertools.combinations(range(1, BLOCKS), STAGES - 1)]  # 10 cuts


def _bart() -> tuple[LightningModule, dict[str, torch.Tensor]]:
    torch.manual_seed(60)
    config = tr.BartConfig(d_model=16, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                           use_cache=False, vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           max_position_embeddings=16, decoder_start_token_id=2)
    batch = {"input_ids": torch.randint(3, 32, (4, 6)), "labels": torch.randint(3, 32, (4, 5))}
    return HFModel(tr.BartForConditionalGeneration(config)).double(), batch


def _two_tower() -> tuple[LightningModule, Any]:
    torch.manual_seed(61)
    return TwoTower().double(), two_tower_batch()


def _half(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: v[:2] for k, v in batch.items()}
    return tuple(t[:2] for t in batch)


def _one_device_step(module: LightningModule, batch: Any) -> dict[str, torch.Tensor]:
    """One device: the module's own step on the whole batch, then SGD."""
    optimizer = module.configure_optimizers()
    with recording_logs(module, [], 4, "training_step"):
        module.training_step(batch, 0).backward()
    optimizer.step()
    return module.state_dict()


_MODELS = {"bart": _bart, "two_tower": _two_tower}
_ONE_DEVICE: dict[str, dict[str, torch.Tensor]] = {}


def _expected(kind: str) -> dict[str, torch.Tensor]:
    if kind not in _ONE_DEVICE:
        module, batch = _MODELS[kind]()
        _ONE_DEVICE[kind] = _one_device_step(module, batch)
    return _ONE_DEVICE[kind]


@pytest.mark.parametrize(("kind", "layout"), [("bart", "stages"), ("bart", "v"), ("two_tower", "stages"),
                                              ("two_tower", "v"), ("two_tower", "loop")])
def test_every_cut_equals_one_devices_step(kind: str, layout: str) -> None:
    module, batch = _MODELS[kind]()
    with torch.no_grad(), recording_logs(module, [], 1, "training_step"):
        trace = call_order(module, lambda: module.training_step(_half(batch), 0))
    expected = _expected(kind)
    tied = kind == "bart"
    if layout == "stages":
        schedule = build_schedule("1f1b", STAGES, 2, 2, 1, tied=tied)
    else:
        schedule = build_schedule("bfs" if layout == "v" else "interleaved", STAGES // 2, 2, 2, 1, tied=tied,
                                  virtual_stages=2, placement=layout)
    devices = None if layout == "stages" else [[s for s in range(STAGES) if schedule.devices[s] == d]
                                               for d in range(schedule.num_devices)]
    failures = []
    for cut in CUTS:
        plan = plan_partition(module, STAGES, partition=cut, trace=trace)
        assert [plan.blocks(s).start for s in range(1, STAGES)] == cut
        pipeline = ReferencePipeline(copy.deepcopy(module), plan, compensation="none", device_stages=devices)
        pipeline.run(schedule, [batch])
        state = pipeline.state_dict()
        assert state.keys() == expected.keys()
        worst = max(expected, key=lambda k: float((state[k] - expected[k]).abs().max()))
        error = float((state[worst] - expected[worst]).abs().max())
        if not all(state[k].dtype == torch.float64 for k in state) or error > 1e-12:
            failures.append(f"cut {cut}: {worst} off by {error:.3g}")
    assert not failures, "\n".join(failures)
