"""Models with structures the zoo's plain step does not reach through the Trainer's setup.

A state-space language model (transformers' Mamba) passes views of its convolution weight, made without
gradients, into its modules: the setup's FLOP count for the model summary followed every module's gradients and
failed inside torch (``AssertionError: Expected gradient function to be set``). Through the Trainer it now trains as
one device's plain step does (float64, SGD, ``"1f1b"``). A decoder held as a list of ``[norm, block, residual]``
triplets with a second per-layer list beside it (the layout of a widely used third-party transformer library) is
refused at setup, naming the list and the rule: its lists are not yet cut together.
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset
from zoo import build

from helpers import fit
from models import HFModel, dict_loader


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_a_state_space_language_model_trains_through_the_trainer_as_one_devices_step(family):
    model = build(family, torch.float64, seed=5)
    module = HFModel(model, lr=0.1)
    reference = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 60, (4, 8), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    fit(module, dict_loader([batch]), devices=2, max_steps=1, schedule="1f1b", microbatches=2,
        trainer_kwargs={"precision": "64-true"})
    optimizer = reference.configure_optimizers()
    reference.model(**batch).loss.backward()  # one device's plain step on the whole batch
    optimizer.step()
    state = module.state_dict()
    for key, value in reference.state_dict().items():
        assert state[key].dtype == torch.float64, key
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{key}: {m}")


class _Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class _Triplets(LightningModule):
    """Layers as ``[norm, block, residual]`` triplets (a ModuleList of ModuleLists, never called itself) and a
    list of gates indexed beside them in the same loop."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.ModuleList([nn.LayerNorm(16), nn.Linear(16, 16), _Residual()])
                                    for _ in range(4))
        self.gates = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for (norm, block, residual), gate in zip(self.layers, self.gates):
            h = residual(block(norm(h)), h) * torch.sigmoid(gate(h))
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.distributed
def test_layers_held_as_triplets_beside_a_second_list_are_refused_at_setup_naming_the_list():
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator))
    # rank 0 raises the class the failing stage raised (`except CrossingError` catches it), not a RuntimeError
    with pytest.raises(ProcessRaisedException, match=r"lightning_paci\.errors\.CrossingError: lightning_paci: .*"
                                                     r"CrossingError: `layers\.1` \(ModuleList\) lives on stage 1, "
                                                     r"and code on another stage indexes it"):
        fit(_Triplets(), DataLoader(data, batch_size=8), devices=2, schedule="1f1b", microbatches=2, max_steps=1)
