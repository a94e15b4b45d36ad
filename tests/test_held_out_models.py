"""Models with structures the zoo's plain step does not reach through the Trainer's setup.

A state-space language model (transformers' Mamba) passes views of its convolution weight, made without
gradients, into its modules: the setup's FLOP count for the model summary followed every module's gradients and
failed inside torch (``AssertionError: Expected gradient function to be set``). Through the Trainer it now trains as
one device's plain step does (float64, SGD, ``"1f1b"``).
"""

from __future__ import annotations

import copy

import pytest
import torch
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
