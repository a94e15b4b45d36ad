"""What each action of the steady state would cost a GPU, counted on the CPU (tests/device_meter.py): kernel
launches per action against one device's forward and backward, the weight prediction's launches and bytes per
parameter, and the host reads. Budgets, not timings: the counts are the same on a busy machine."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.optim.weight_prediction import WeightPrediction

from device_meter import KernelMeter
from models import HFCausalLM, token_loader

# the weight prediction's launches per parameter tensor per move and way back, and the bytes per parameter element
# it reads and writes then (float32 AdamW with a known gradient: w, g, m, v and its two temporaries; amsgrad: one
# pass more per bin and max_exp_avg_sq, 98 launches for the 12 tensors)
PREDICTION_BUDGETS = {"adamw": (8, 128), "sgd": (8, 128), "adamw_amsgrad": (9, 160)}
PREDICTION_LAUNCHES_PER_TENSOR = PREDICTION_BUDGETS["adamw"][0]
# what the pipeline adds per micro-batch and stage to one device's forward and backward launches, and per update
# beyond the user's optimizer (the one check: a multi-tensor max-norm, the flags)
EXTRA_FORWARD, EXTRA_BACKWARD, EXTRA_UPDATE = 4, 12, 20


def gpt2_small_block(optimizer: str, seed: int = 0) -> tuple[list[nn.Parameter], StageOptimizer]:
    """One transformers GPT2Block at GPT-2 small's width (n_embd 768: 12 tensors, 7.1M parameters), its optimizer
    stepped twice (state, step counts), then half a window of gradient accumulated."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(seed)
    params = list(GPT2Block(GPT2Config(n_embd=768, n_head=12)).parameters())
    make = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
            "adamw_amsgrad": lambda: torch.optim.AdamW(params, lr=1e-3, amsgrad=True),
            "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)}[optimizer]
    stage = StageOptimizer(make(), params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-2
        stage.step()
    for p in params:
        p.grad = torch.randn_like(p) * 5e-3
    return params, stage


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_amsgrad", "sgd"])
@pytest.mark.parametrize("rest", [0.5, 1.0])
def test_the_weight_prediction_of_a_gpt2_small_block_is_a_few_multi_tensor_passes(optimizer: str, rest: float):
    params, stage = gpt2_small_block(optimizer)
    prediction = WeightPrediction(stage.optimizer, stage.pairs, fused=False)  # the fused pass: test_fused_prediction
    with prediction.moved(1, rest):  # the first move reads the step counts once ([Note: step counts on the host])
        pass
    before = [p.detach().clone() for p in params]
    meter = KernelMeter()
    with meter:
        bins = prediction.apply(1, rest)
    assert any(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    with meter:
        prediction.revert(bins)
    launches = meter.launches["other"]
    elements = sum(p.numel() for p in params)
    moved = (meter.read["other"] + meter.written["other"]) / elements
    print(f"\n{optimizer}, rest {rest}: {launches} launches for {len(params)} tensors "
          f"({launches / len(params):.1f} per tensor), {meter.read['other'] / elements:.0f} B read + "
          f"{meter.written['other'] / elements:.0f} B written per parameter, "
          f"temporaries {prediction.peak_extra_bytes / 2**20:.1f} MiB")
    per_tensor, per_element = PREDICTION_BUDGETS[optimizer]
    assert 0 < launches <= per_tensor * len(params), dict(meter.ops["other"])
    assert moved <= per_element
    assert meter.host_reads["other"] == 0
    # transient memory: at most the stage's largest parameter tensor (nothing kept: the way back recomputes)
    assert prediction.peak_extra_bytes <= max(p.numel() * p.element_size() for p in params)


def _metered_pipeline() -> tuple[ReferencePipeline, Any, list[Any], KernelMeter]:
    """A tied transformers GPT-2 (4 blocks) on 4 stages of the reference executor, paci with the weight prediction,
    losses and logs kept on the device; after a first stream (optimizer state), every action of the second is
    metered under ``"<stage>:<action>"``, the user's optimizer step under ``"<stage>:optimizer"`` and the weight
    prediction under ``"<stage>:prediction"``."""
    L.seed_everything(0, verbose=False)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    reference = ReferencePipeline(copy.deepcopy(model), plan_partition(model, num_stages=4, partition="parameters"),
                                  compensation="predict")
    batches = list(token_loader(num_batches=4, batch_size=8, vocab=64))
    lists = build_schedule("paci", 4, 4, 4, num_minibatches=len(batches), tied=True)
    for runtime in reference.runtimes:
        runtime.device_losses, runtime.program.device_logs = True, True
    reference.run(lists, batches)
    meter = KernelMeter()
    for runtime in reference.runtimes:
        _meter_runtime(meter, runtime)
    return reference, lists, batches, meter


def _meter_runtime(meter: KernelMeter, runtime: Any) -> None:
    execute, stage = runtime.execute, runtime.stage

    def metered(action: Any) -> None:
        with meter.phase(f"{stage}:{action.kind.name}"):
            execute(action)

    runtime.execute = metered
    phases: list[str] = []

    def enter(name: str) -> None:
        phases.append(meter.current)
        meter.current = f"{stage}:{name}"

    def leave(*_: Any) -> None:
        meter.current = phases.pop()

    runtime.optimizer.optimizer.register_step_pre_hook(lambda *_: enter("optimizer"))
    runtime.optimizer.optimizer.register_step_post_hook(leave)
    prediction = runtime.prediction
    if prediction is not None:
        apply, revert = prediction.apply, prediction.revert

        def metered_apply(*args: Any) -> Any:
            enter("prediction")
            try:
                return apply(*args)
            finally:
                leave()

        def metered_revert(*args: Any) -> None:
            enter("prediction")
            try:
                revert(*args)
            finally:
                leave()

        prediction.apply, prediction.revert = metered_apply, metered_revert


def _one_device_launches() -> tuple[int, int]:
    """One device's forward (with the loss) and backward launches for one micro-batch of the same model."""
    L.seed_everything(0, verbose=False)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    batch = next(iter(token_loader(num_batches=1, batch_size=2, vocab=64)))
    meter = KernelMeter()
    with meter:
        with meter.phase("F"):
            out = model.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        with meter.phase("B"):
            loss.backward()
    return meter.launches["F"], meter.launches["B"]


def test_each_action_of_the_steady_state_launches_what_one_device_does_plus_a_bounded_few():
    reference, lists, batches, meter = _metered_pipeline()
    first = [r.prediction.moves for r in reference.runtimes]  # forwards run ahead in the first stream
    with meter:
        reference.run(lists, batches)
    one_forward, one_backward = _one_device_launches()
    microbatches, updates, stages = 4 * len(batches), len(batches), 4
    total = {kind: sum(meter.launches[f"{s}:{kind}"] for s in range(stages)) for kind in ("F", "B")}
    forward = total["F"] / microbatches  # the weight prediction's launches are under "<s>:prediction"
    backward = total["B"] / microbatches
    print(f"\nper micro-batch, all stages: F {forward:.1f} (one device {one_forward}), B {backward:.1f} "
          f"(one device {one_backward})")
    assert one_forward < forward <= one_forward + EXTRA_FORWARD * stages
    assert one_backward < backward <= one_backward + EXTRA_BACKWARD * stages
    for s in range(stages):
        ours = meter.launches[f"{s}:OPT"] / updates  # the user's optimizer is under "<s>:optimizer"
        tensors = len(reference.runtimes[s].optimizer.pairs)
        sends = {k: meter.launches[f"{s}:{k}"] for k in ("SEND_F", "SEND_B", "RECV_F", "RECV_B")}
        prediction = meter.launches[f"{s}:prediction"]
        moves = reference.runtimes[s].prediction.moves - first[s]
        print(f"stage {s}: OPT {ours:.0f} per update for {tensors} tensors; messages {sends}; prediction "
              f"{prediction} launches")
        assert 0 < ours <= EXTRA_UPDATE  # whatever the number of tensors
        assert all(count <= 4 * microbatches for count in sends.values())
        if s < stages - 1:
            assert moves > 0 and prediction <= PREDICTION_LAUNCHES_PER_TENSOR * tensors * moves
        per_microbatch = ("F", "B", "SEND_F", "SEND_B", "RECV_F", "RECV_B", "prediction")
        assert all(meter.host_reads[f"{s}:{k}"] == 0 for k in per_microbatch), dict(meter.host_reads)
