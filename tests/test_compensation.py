"""Staleness compensation (optim/weight_prediction.py): the weight prediction predicts the optimizer's own next
update, undoes it bit for bit, touches no autograd version counter, is chosen and refused at setup as documented,
and the runtime's count of crossed updates is the list's."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch import nn

from lightning_paci import ReferencePipeline, plan_partition
from lightning_paci.engine.streams.driver import _crossings
from lightning_paci.optim.prediction_quality import costly_regime
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.optim.weight_prediction import (
    WeightPrediction,
    prediction_unsupported,
    weight_prediction_for,
)
from lightning_paci.schedules import OPT, B, F, build_schedule, static_drift

from helpers import RecordSetupWarnings, fit
from models import MisledLinear, SequentialMLP, misled_loader, regression_loader

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_nesterov_decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, maximize=True),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, maximize=True, weight_decay=0.0),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.9)),
}


def _stepped(name: str, steps: int = 3, seed: int = 0) -> tuple[list[nn.Parameter], StageOptimizer]:
    """Parameters (some elements tiny, so rounding loses information somewhere) and their stage optimizer after
    ``steps`` updates with random gradients."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(64, 32, generator=gen)), nn.Parameter(torch.randn(32, generator=gen) * 1e-6)]
    optimizer = StageOptimizer(OPTIMIZERS[name](params), params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return params, optimizer


def _next_update(params: list[nn.Parameter], optimizer: StageOptimizer,
                 grads: list[torch.Tensor]) -> list[torch.Tensor]:
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()
    return [p.detach() - b for p, b in zip(params, before)]


def _within_one_ulp(after: torch.Tensor, before: torch.Tensor, moved: torch.Tensor) -> bool:
    """Whether every element of ``after`` is within one unit in the last place of the larger of ``|before|`` and
    ``|moved|`` from ``before`` ([Note: weight prediction])."""
    larger = torch.maximum(before.abs(), moved.abs())
    ulp = torch.nextafter(larger, torch.full_like(larger, float("inf"))) - larger
    return bool(((after - before).abs() <= ulp).all())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("k", "rest", "bin_bytes"), [(1, 1.0, None), (1, 0.375, 400), (2, 0.0, None)])
def test_undo_is_within_one_ulp_and_leaves_version_counters_alone(name: str, k: int, rest: float,
                                                                  bin_bytes: int | None) -> None:
    params, optimizer = _stepped(name)
    gen = torch.Generator().manual_seed(1)
    for p in params:  # part of the next window's gradient already accumulated
        p.grad = torch.randn(p.shape, generator=gen)
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    whole = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    start = [p.detach().clone() for p in params]
    with whole.moved(k, rest):
        expected = [p.detach().clone() for p in params]  # one bin per tensor
    assert all(_within_one_ulp(p.detach(), s, e) for p, s, e in zip(params, start, expected))
    for p, s in zip(params, start):
        p.data.copy_(s)
    prediction.bin_bytes = bin_bytes or prediction.bin_bytes  # 400: many slices per tensor, the last one short
    versions = [p._version for p in params]
    x = torch.randn(5, 32, generator=gen)
    with prediction.moved(k, rest):
        moved = [p.detach().clone() for p in params]
        out = (x @ params[0].t() + params[1].sum()).square().sum()  # a graph saving the parameters
    assert all(not torch.equal(m, b) for m, b in zip(moved, start))
    assert all(torch.equal(m, e) for m, e in zip(moved, expected))  # the same bits however the tensors are cut
    for p, b, m in zip(params, start, moved):
        assert _within_one_ulp(p.detach(), b, m), "the way back must land within one ulp"
    assert [p._version for p in params] == versions
    out.backward()  # the saved parameters were not modified "in place" as far as autograd knows
    assert prediction.moves == 1
    assert prediction.peak_extra_bytes <= max(p.numel() * p.element_size() for p in params)  # SGD ahead: none


def test_where_rounding_lost_bits_the_way_back_is_one_ulp_off_at_most() -> None:
    """Where the move reaches a larger binade (or a tie) the subtraction cannot recover the lost low bits: those
    elements come back within one ulp of the larger value, the others exactly."""
    params, optimizer = _stepped("adamw")
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    before = [p.detach().clone() for p in params]
    bins = prediction.apply(1)
    moved = [p.detach().clone() for p in params]
    prediction.revert(bins)
    assert all(_within_one_ulp(p.detach(), b, m) for p, b, m in zip(params, before, moved))
    off = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
    assert 0 < off < sum(p.numel() for p in params) // 20  # weights ~1 moved by ~0.025: a few percent


def test_low_precision_weights_are_refused() -> None:
    params = [nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    assert "float32 or float64 weights, and this stage has torch.bfloat16" in prediction_unsupported(optimizer)
    with pytest.raises(ValueError, match="compensation='predict': it needs float32 or float64 weights"):
        WeightPrediction(optimizer, StageOptimizer(optimizer, params).pairs)


@pytest.mark.parametrize("rest", [0.0, 0.75])
@pytest.mark.parametrize("name", ["sgd_momentum", "sgd_nesterov", "sgd_dampening", "adam", "adamw_amsgrad"])
def test_the_prediction_is_the_update_for_the_known_share_scaled_to_the_window(name: str, rest: float) -> None:
    """``rest = 0``: the window's gradient is complete, so the predicted step is the optimizer's step (weight
    decay aside, which the weight prediction leaves out). ``rest = 0.75``: a quarter of the window is accumulated; the
    prediction is the step for four times that (the known micro-batches stand for the rest)."""
    params, optimizer = _stepped(name)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g in zip(params, grads):
        p.grad = g * (1 - rest)  # the known share as the window accumulates it
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    moved = prediction.apply(1, rest=rest)
    predicted = [p.detach().clone() for p in params]
    prediction.revert(moved)
    start = [p.detach().clone() for p in params]
    actual = _next_update(params, optimizer, grads)
    for p0, p1, d in zip(start, predicted, actual):
        torch.testing.assert_close(p1 - p0, d, rtol=1e-4, atol=1e-7)


def test_with_nothing_known_sgd_follows_its_momentum_buffer() -> None:
    """``rest = 1``: SGD's predicted step is ``-lr * buf``, which is its step for the gradient ``(1 - mu) * buf``
    the buffer implies."""
    params, optimizer = _stepped("sgd_momentum")
    buffers = [optimizer.optimizer.state[alias]["momentum_buffer"].clone() for alias, _ in optimizer.pairs]
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    start = [p.detach().clone() for p in params]
    moved = prediction.apply(1)
    predicted = [p.detach() - s for p, s in zip(params, start)]
    prediction.revert(moved)
    actual = _next_update(params, optimizer, [(1 - 0.9) * b for b in buffers])
    for d_pred, d in zip(predicted, actual):
        torch.testing.assert_close(d_pred, d, rtol=1e-5, atol=1e-6)  # differences of weights ~1: ulp 1.2e-7


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw"])
def test_a_param_group_added_while_training_is_moved_as_if_it_had_been_there_from_the_start(name: str) -> None:
    """A fine-tuning schedule's group joins the stage optimizer mid-run (``StageOptimizer.add_param_group``): the
    prediction built at setup moves its parameter from the next move on, by the group's own learning rate, exactly
    as a prediction built after the group joined does."""
    params, optimizer = _stepped(name)
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    with prediction.moved(1):  # the setup's parameters only: the step counts are read for them
        pass
    gen = torch.Generator().manual_seed(3)
    late = nn.Parameter(torch.randn(16, 8, generator=gen))
    optimizer.add_param_group({"lr": 0.02}, [late])
    for _ in range(2):  # the new group gets optimizer state
        for p in [*params, late]:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    everything = [*params, late]
    start = [p.detach().clone() for p in everything]
    fresh = WeightPrediction(optimizer.optimizer, list(optimizer.pairs))
    with fresh.moved(2):
        expected = [p.detach().clone() for p in everything]
    for p, s in zip(everything, start):
        p.data.copy_(s)
    with prediction.moved(2):
        moved = [p.detach().clone() for p in everything]
    assert not torch.equal(moved[-1], start[-1])  # the late parameter moved
    for m, e in zip(moved, expected, strict=True):
        assert torch.equal(m, e)
    assert len(prediction.entries) == 3


def test_no_state_no_move() -> None:
    """Before the first update there is nothing to predict from: the weights stay as they are."""
    params = [nn.Parameter(torch.ones(3))]
    optimizer = StageOptimizer(torch.optim.AdamW(params, lr=0.1), params)
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs)
    with prediction.moved(1):
        assert torch.equal(params[0].detach(), torch.ones(3))


def test_choice_and_refusal() -> None:
    params = [nn.Parameter(torch.ones(3))]
    rms = torch.optim.RMSprop(params)
    assert "torch.optim.rmsprop.RMSprop is not one of the optimizers" in prediction_unsupported(rms)
    plain = torch.optim.SGD(params, lr=0.1)
    assert "SGD without momentum" in prediction_unsupported(plain)
    pairs = StageOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), params).pairs
    with pytest.raises(ValueError, match=r"compensation='predict'\)`: torch.optim.rmsprop.RMSprop .* pass "
                                         r"`compensation='none'`"):
        weight_prediction_for("predict", rms, pairs, warn=None)
    warnings: list[str] = []
    assert weight_prediction_for("auto", rms, pairs, warn=warnings.append) is None
    assert len(warnings) == 1 and "no staleness compensation for this run" in warnings[0]
    assert weight_prediction_for("none", rms, pairs, warn=warnings.append) is None
    with pytest.raises(ValueError, match="`compensation` must be one of 'auto', 'predict', 'none', got 'yes'"):
        weight_prediction_for("yes", rms, pairs, warn=None)


class _Counter:
    version = 0


@pytest.mark.parametrize("name", ["paci", "1f1b", "gpipe"])
@pytest.mark.parametrize(("n", "m", "a"), [(4, 4, 4), (4, 4, 2), (3, 6, 4), (5, 3, 3), (4, 8, 1), (2, 2, 3)])
def test_runtime_count_of_crossed_updates_is_the_lists(name: str, n: int, m: int, a: int) -> None:
    """The driver counts the updates a micro-batch crosses from the window arithmetic; the reference executor
    reads them off the list (``static_drift``). Both must agree on every schedule, stage and window offset."""
    for offset in range(a):
        schedule = build_schedule(name, n, m, a, 5, backward_offset=offset)
        for stage, actions in enumerate(schedule.actions):
            expected = static_drift(actions)
            counter = _Counter()
            crossings = _crossings(counter, offset, a)  # type: ignore[arg-type]
            for action in actions:
                if action.kind is F:
                    assert crossings(action.microbatch) == expected[action.microbatch], (name, stage, action)
                elif action.kind is OPT:
                    counter.version += 1
            assert any(action.kind is B for action in actions)


class _AdamMLP(SequentialMLP):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)


class _DumpWeightPrediction(L.Callback):
    """Every stage writes how many forwards it ran ahead (None: no prediction left) and its measured quality."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        runtime, stage = trainer.strategy.runtime, trainer.strategy.stage_index
        prediction = runtime.prediction
        (self.directory / f"moves{stage}.json").write_text(json.dumps(None if prediction is None else prediction.moves))
        (self.directory / f"quality{stage}.json").write_text(json.dumps(runtime.records.prediction_quality))


@pytest.mark.parametrize("accumulation, compensation", [(4, "predict"), (2, "predict"), (2, "auto")])
def test_processes_equal_the_reference_executor_bit_for_bit_with_compensation(tmp_path, accumulation, compensation):
    """The weight prediction in forked processes (the driver's count of crossed updates, gloo) computes exactly what
    the one-process reference executor computes from the lists; and it is on: without it the weights differ. Under
    ``"auto"``, on a model whose prediction misleads (2 stages, 12 updates): stage 0 measures the same figure as the
    reference, switches the prediction off after the same update (the weights then differ from ``"predict"``'s too),
    and DriftMonitor writes the figure to TensorBoard ([Note: the prediction's quality])."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_paci import DriftMonitor

    torch.manual_seed(3)
    auto = compensation == "auto"
    num_stages, m, steps = (2, 2, 12) if auto else (4, 4, 5)
    model = MisledLinear() if auto else _AdamMLP(depth=4)
    initial = copy.deepcopy(model)
    loader = misled_loader(steps) if auto else regression_loader(num_batches=steps)
    monitors = [DriftMonitor(weight_drift=False)] if auto else []
    logger = TensorBoardLogger(tmp_path, name="tb", version=0) if auto else False
    fit(model, loader, devices=num_stages, schedule="paci", microbatches=m, accumulation=accumulation,
        max_steps=steps, partition="parameters", compensation=compensation,
        callbacks=[_DumpWeightPrediction(tmp_path), *monitors], trainer_kwargs={"logger": logger,
                                                                                "log_every_n_steps": 1})
    plan = plan_partition(initial, num_stages, partition="parameters")
    schedule = build_schedule("paci", num_stages, m, accumulation, steps)
    expected, runtimes = {}, {}
    for option in (compensation, "none", "predict"):
        reference = ReferencePipeline(copy.deepcopy(initial), plan, compensation=option)
        reference.run(schedule, list(loader))
        expected[option], runtimes[option] = reference.state_dict(), reference.runtimes
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[compensation][key]), key
    assert any(not torch.equal(v, expected["none"][k]) for k, v in model.state_dict().items())
    moves = [None if r.prediction is None else r.prediction.moves for r in runtimes[compensation]]
    for stage in range(num_stages):
        assert json.loads((tmp_path / f"moves{stage}.json").read_text()) == moves[stage]
        quality = json.loads((tmp_path / f"quality{stage}.json").read_text())
        assert quality == runtimes[compensation][stage].records.prediction_quality
    if auto:
        assert moves[0] is None and quality is None  # stage 0 switched off; the last stage measures nothing
        assert any(not torch.equal(v, expected["predict"][k]) for k, v in model.state_dict().items())
        events = EventAccumulator(str(tmp_path / "tb" / "version_0" / "stage_0"))
        events.Reload()
        logged = [e.value for e in events.Scalars("paci/prediction_quality/stage_0")]
        figure = runtimes["auto"][0].records.prediction_quality
        assert figure < 0 and logged and all(v == pytest.approx(figure, rel=1e-6) for v in logged)
        return
    # every forward whose micro-batch crosses an update ran ahead, once the optimizer had state (after update 1)
    for stage in range(num_stages):
        crossing = [mb for mb, k in static_drift(schedule.actions[stage]).items() if k > 0]
        assert 0 < moves[stage] <= len(crossing) if stage < num_stages - 1 else moves[stage] == 0


def test_auto_warns_for_an_optimizer_it_cannot_follow(tmp_path):
    """``compensation="auto"`` (the default) with plain SGD: trained as the paper's PACI, and said so at setup."""
    torch.manual_seed(4)
    model = SequentialMLP(depth=4)  # torch.optim.SGD without momentum
    fit(model, regression_loader(num_batches=2), devices=2, schedule="paci", microbatches=2, max_steps=2,
        partition="parameters", callbacks=[_DumpWeightPrediction(tmp_path), RecordSetupWarnings(tmp_path / "w.json")])
    seen = json.loads((tmp_path / "w.json").read_text())
    assert any("no staleness compensation for this run: SGD without momentum" in w for w in seen)
    assert json.loads((tmp_path / "moves0.json").read_text()) is None


def test_the_costly_regime_is_named_at_setup(tmp_path):
    """Adam/AdamW at a constant lr >= 3e-3 without a scheduler: the regime the weight prediction does not rescue
    (RESULTS.md); said once at setup with the measured figures and the fixes."""
    params = [nn.Parameter(torch.ones(2))]
    said = costly_regime(torch.optim.AdamW(params, lr=3e-3), [])
    assert said is not None and "constant lr=0.003 without a learning-rate scheduler" in said
    assert costly_regime(torch.optim.AdamW(params, lr=1e-3), []) is None
    adam = torch.optim.Adam(params, lr=5e-3)
    assert costly_regime(adam, [torch.optim.lr_scheduler.LambdaLR(adam, lambda step: 1.0)]) is None
    assert costly_regime(torch.optim.SGD(params, lr=0.1, momentum=0.9), []) is None

    class Hot(_AdamMLP):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    fit(Hot(depth=4), regression_loader(num_batches=2), devices=2, schedule="paci", microbatches=2, max_steps=1,
        partition="parameters", callbacks=[RecordSetupWarnings(tmp_path / "w.json")])
    seen = json.loads((tmp_path / "w.json").read_text())
    assert sum("in this regime PACI loses loss per update" in w for w in seen) == 1
