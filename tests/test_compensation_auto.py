"""``compensation="auto"`` decides from the weight prediction's measured quality ([Note: the prediction's quality] in
optim/prediction_quality.py): the figure is the one computed here from weight copies, a stage whose prediction
misleads switches it off and says so once, a stage whose prediction helps keeps it and trains bit for bit as
``"predict"``, and measuring reads nothing from the device but in the update check that decides. (Processes against
the reference executor, and the figure in TensorBoard: tests/test_compensation.py.)"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_host_reads import HostReads
from torch import nn

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.optim.prediction_quality import QUALITY_MIN, PredictionQuality, sampled
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.optim.weight_prediction import WeightPrediction

from models import HFCausalLM, MisledLinear, SequentialMLP, misled_loader, regression_loader, token_loader


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("rest_of_window, limit", [(0.5, None), (-1.5, None), (None, 100)])
def test_the_figure_is_one_minus_the_relative_distance_to_the_weights_the_backward_uses(rest_of_window, limit):
    """A forward crossing one update with half its window known: ``0.5`` completes the window with the same
    gradient (the prediction is the update: figure 1), ``-1.5`` turns the window's gradient around (the update goes
    the other way: below 0), ``None`` a random second half, compared on a strided sample of 100 of the 2080
    elements. The expected figure is computed from copies of the weights."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 32, generator=gen)), nn.Parameter(torch.randn(32, generator=gen))]
    optimizer = StageOptimizer(torch.optim.AdamW(params, lr=0.05, weight_decay=0.0), params)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    quality = PredictionQuality(params, window=1, limit=limit or 1 << 18)
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    prediction.quality = quality
    window = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g in zip(params, window):
        p.grad = 0.5 * g  # the known half
    before = _flat([p.detach().clone() for p in params])
    with prediction.moved(1, rest=0.5):
        moved = _flat([p.detach().clone() for p in params])
    for p, g in zip(params, window):  # the rest of the window arrives
        p.grad += rest_of_window * g if rest_of_window is not None else torch.randn(p.shape, generator=gen)
    assert quality.before_update() == []  # the micro-batch is still in flight
    quality.after_update(optimizer.step(values=[]).values)
    after = _flat([p.detach().clone() for p in params])  # what its backward uses
    figures = quality.before_update()  # completes it; the window is over: read with the next check
    assert len(figures) == 2 and all(f.dim() == 0 for f in figures)
    step = optimizer.step(values=figures)  # no gradient: no update, the check reads the figures
    quality.after_update(step.values)
    stride = sampled(params, limit or 1 << 18)[0][2]
    assert stride == (21 if limit else 1)
    index = torch.arange(0, before.numel(), stride)
    predicted, actual = (moved - before)[index], (after - before)[index]
    expected = 1 - float((predicted - actual).norm() / actual.norm())
    assert quality.decided and quality.measured == 1
    assert quality.value == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if rest_of_window == 0.5:
        assert quality.value > 0.999 and quality.keep
    if rest_of_window == -1.5:
        assert quality.value < 0 and not quality.keep
    assert quality.verdict() == (quality.value, quality.keep) and quality.verdict() is None  # said once
    assert not quality.measuring and quality.before_update() == []  # nothing more is measured


def _run(model, stages: int, batches: list, compensation: str, streams: int = 1) -> ReferencePipeline:
    pipeline = ReferencePipeline(copy.deepcopy(model), plan_partition(model, stages, partition="parameters"),
                                 compensation=compensation)
    for _ in range(streams):
        pipeline.run(build_schedule("paci", stages, 2 if stages == 2 else 4, 2 if stages == 2 else 4,
                                    len(batches)), batches)
    return pipeline


def test_auto_switches_off_a_stage_whose_prediction_misleads_and_says_so_once():
    torch.manual_seed(0)
    model, batches = MisledLinear(), list(misled_loader(12))
    said_so = (r"stage 0: the weight prediction's quality is -\d\.\d{3} \(1 - \|\|predicted - actual\|\| / "
               r"\|\|actual\|\| over the weight changes of its first 7 compensated forwards\), below 0\.1: .* "
               r"compensation is off on this stage after optimizer step 9\.")
    with pytest.warns(UserWarning, match=said_so) as said:
        auto = _run(model, 2, batches, "auto", streams=2)  # a second stream: nothing more to say
    assert sum("weight prediction's quality" in str(w.message) for w in said) == 1
    assert auto.runtimes[0].prediction is None and auto.runtimes[0].records.prediction_quality < 0
    assert auto.runtimes[1].records.prediction_quality is None  # the last stage's forwards cross no update
    predict = _run(model, 2, batches, "predict", streams=2)
    assert predict.runtimes[0].prediction is not None
    assert any(not torch.equal(v, predict.state_dict()[k]) for k, v in auto.state_dict().items())


def test_auto_keeps_the_prediction_where_it_helps_and_then_trains_as_predict_bit_for_bit():
    class AdamMLP(SequentialMLP):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.02, betas=(0.9, 0.95))

    torch.manual_seed(1)
    batches = list(regression_loader(num_batches=12))
    for model, stages, data in [(AdamMLP(depth=4), 4, batches), (MisledLinear((0.9, 0.99)), 2,
                                                                  list(misled_loader(12)))]:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*weight prediction's quality")
            auto = _run(model, stages, data, "auto")
        predict = _run(model, stages, data, "predict")
        figures = [r.records.prediction_quality for r in auto.runtimes]
        assert all(f is not None and QUALITY_MIN <= f <= 1 for f in figures[:-1]) and figures[-1] is None, figures
        assert all(r.prediction is not None for r in auto.runtimes)
        assert [r.prediction.moves for r in auto.runtimes] == [r.prediction.moves for r in predict.runtimes]
        for key, value in predict.state_dict().items():  # measuring moves no weight
            assert torch.equal(auto.state_dict()[key], value), key


def test_measuring_reads_nothing_per_microbatch_and_the_figures_come_with_the_update_check():
    """A tied GPT-2 on 4 stages, the device forms forced: a first stream of 4 updates, then one of 8 in which every
    stage with crossing forwards decides (at its 9th update check); reads counted in the second."""
    torch.manual_seed(0)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    pipeline = ReferencePipeline(model, plan_partition(model, num_stages=4, partition="parameters"))  # "auto"
    for runtime in pipeline.runtimes:
        runtime.device_losses, runtime.program.device_logs = True, True
    batches = list(token_loader(num_batches=12, batch_size=8, vocab=64))
    pipeline.run(build_schedule("paci", 4, 4, 4, 4, tied=True), batches[:4])
    assert all(r.records.prediction_quality is None for r in pipeline.runtimes)
    mode = HostReads()
    for runtime in pipeline.runtimes:
        def counted(action, execute=runtime.execute):
            mode.phase = "update" if action.kind.name == "OPT" else "microbatch"
            try:
                execute(action)
            finally:
                mode.phase = "other"
        runtime.execute = counted
    with mode:
        pipeline.run(build_schedule("paci", 4, 4, 4, 8, tied=True), batches[4:])
    assert mode.counts["microbatch"] == 0 and mode.counts["other"] == 0, mode.sites
    assert mode.counts["update"] <= 8 * 4, mode.sites  # the one check per update, the figures in it
    figures = [r.records.prediction_quality for r in pipeline.runtimes]
    assert all(f is not None for f in figures[:3]) and figures[3] is None, figures
