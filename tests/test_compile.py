"""``compile="blocks"``: each owned block's forward through ``torch.compile``, the rest of the pipeline unchanged.

Compiled against eager: the nanoGPT-style model under "1f1b" equals one device after 5 steps within fp32
tolerance, with inductor (generated kernels); a tied transformers GPT-2 under "paci" with the weight prediction on
equals the run without compilation, and a checkpoint of compiled blocks resumes. The quicker backends run where what
is checked is the pipeline around the compiled region, not the kernels: ``aot_eager`` (forward and backward traced
by AOTAutograd as inductor's are, no code generated) where the weight prediction moves weights that a compiled
forward and its backward read; ``eager`` (Dynamo's captured graph run as it is) where what matters is the compiled
blocks' names, hooks and checkpoints.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition
from lightning_paci.engine.blocks.block_compile import BlockCompile

from helpers import assert_same_weights, fit, one_device
from models import HFCausalLM, LoopTransformer, token_loader

AOT = {"compile": "blocks", "compile_backend": "aot_eager"}
CAPTURED = {"compile": "blocks", "compile_backend": "eager"}


def test_the_compiled_blocks_keep_their_names_hooks_outside_and_come_back_eager():
    model = LoopTransformer()
    names = [n for n, _ in model.named_parameters()]
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append("hook"))
    compiled = BlockCompile(list(model.blocks), backend="eager")
    assert all("forward" in vars(b) for b in model.blocks)
    idx = next(iter(token_loader(num_batches=1)))[0]
    with torch.no_grad():
        out = model(idx[:, :-1])
    assert calls == ["hook"] and [n for n, _ in model.named_parameters()] == names
    compiled.remove()
    assert not any("forward" in vars(b) for b in model.blocks)
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, :-1]), out, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()  # this process forks the later tests' ranks: leave no compiler state behind


class _SGDLoopTransformer(LoopTransformer):
    """SGD with momentum: generated kernels round differently from eager ones, and Adam's normalization would blow
    a 1e-7 difference in a near-zero gradient up to a whole step."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_nanogpt_blocks_compiled_with_inductor_equal_one_device_under_1f1b():
    torch.manual_seed(0)
    expected = _SGDLoopTransformer()
    model = copy.deepcopy(expected)
    one_device(1, max_steps=5).fit(expected, token_loader(num_batches=5))
    fit(model, token_loader(num_batches=5), devices=2, max_steps=5, schedule="1f1b", microbatches=2,
        partition="parameters", compile="blocks")
    assert_same_weights(model, expected)


def _trainer(directory, epochs, **strategy):
    return L.Trainer(
        strategy=PACIStrategy(start_method="fork", schedule="paci", microbatches=2, partition="parameters",
                              compensation="predict", timeout=timedelta(seconds=60), **strategy),
        accelerator="cpu", devices=2, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")])


def test_a_tied_gpt2_compiled_under_paci_with_the_prediction_equals_the_eager_reference_executor(tmp_path):
    loader = token_loader(num_batches=3, vocab=64)
    torch.manual_seed(1)
    compiled = HFCausalLM("gpt2", layers=2, tied=True)
    eager = copy.deepcopy(compiled)
    _trainer(tmp_path, 1, **AOT).fit(compiled, loader)
    # eager: the one-process reference executor, the same lists and the same weight prediction
    reference = ReferencePipeline(eager, plan_partition(eager, 2, partition="parameters"), compensation="predict")
    reference.run(build_schedule("paci", 2, 2, 2, 3, tied=True), list(loader))
    assert_same_weights(compiled, reference)  # the prediction moved the compiled blocks' weights as eager ones


def test_compiled_blocks_resume_from_a_checkpoint_as_the_uninterrupted_eager_run(tmp_path):
    loader = token_loader(num_batches=3)
    torch.manual_seed(2)
    full = _SGDLoopTransformer()
    first = copy.deepcopy(full)
    _trainer(tmp_path / "full", 2).fit(full, loader)  # eager, uninterrupted
    _trainer(tmp_path / "part", 1, **CAPTURED).fit(first, loader)
    resumed = copy.deepcopy(first)
    _trainer(tmp_path / "part", 2, **CAPTURED).fit(resumed, loader, ckpt_path=str(tmp_path / "part" / "epoch=0.ckpt"))
    assert_same_weights(resumed, full)


def test_an_unknown_backend_is_refused_at_construction_naming_it():
    with pytest.raises(ValueError, match=r"`compile_backend='tpu_magic'` is not a torch.compile backend; known here: "
                                         r".*aot_eager.*inductor"):
        PACIStrategy(compile="blocks", compile_backend="tpu_magic")
    with pytest.raises(ValueError, match=r"`compile` must be one of 'off', 'blocks', got 'model'"):
        PACIStrategy(compile="model")
