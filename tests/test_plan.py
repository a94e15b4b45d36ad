"""``plan="auto"``: the search's rules on hand-made costs, and the strategy's choice through the Trainer -- the
activation bytes predicted for each stage against the runtime's meter, a memory budget that rules out the default
plan, the same result as one device under ``"1f1b"``, the measured costs read back from their cache."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_paci.integration.setup.auto_plan import PlanCheck
from lightning_paci.planner import Fit, Layout, ModelCosts, Region, Space, search_plans
from lightning_paci.schedules import build_schedule, chunk_drift_bounds

from helpers import fit
from models import HFCausalLM, SequentialMLP, reference_accumulation, regression_loader, token_loader

BYTES = 1000  # activation bytes per sample a hand-made block saves


def _costs(times: list[float], *, fixed: float = 0.0, params: int = 4000) -> ModelCosts:
    """Blocks taking ``times[i]`` seconds per sample forward (twice that backward) plus ``fixed`` per call, each
    saving ``BYTES`` per sample of its own and reading its predecessor's output; profiled at 2 and 1 samples."""

    def storages(i: int, size: int) -> dict[int, int]:
        return {10 * i + 1: BYTES * size}
    regions = [Region(Fit(0.0, 0.0), Fit(0.0, 0.0), 0, ({}, {}), ({}, {}), ({}, {}))]
    for i, t in enumerate(times):
        regions.append(Region(Fit(fixed, t), Fit(2 * fixed, 2 * t), params,
                              tuple(storages(i, s) for s in (2, 1)),
                              tuple(storages(i - 1, s) if i else {} for s in (2, 1)),
                              tuple(storages(i, s) for s in (2, 1))))
    regions.append(Region(Fit(0.0, 0.0), Fit(0.0, 0.0), 0, ({}, {}), ({}, {}), ({}, {})))
    return ModelCosts(tuple(regions), (2, 1), optimizer_factor=0.0)


def _slowest(costs: ModelCosts, bounds: tuple[int, ...], samples: float, recompute: int) -> float:
    stages = len(bounds) - 1
    return max(sum(costs.stage_time(bounds[s], bounds[s + 1], samples, first=s == 0, last=s == stages - 1,
                                    recompute=s < recompute)) for s in range(stages))


def test_each_plan_takes_the_fastest_cut_that_fits_and_none_is_over_the_budget():
    costs = _costs([1e-3, 3e-3, 1e-3, 1e-3, 2e-3, 1e-3, 1e-3, 2e-3], fixed=2e-3)
    free = search_plans(costs, Space(schedule="1f1b", batch_size=16, layouts=(Layout(4),)))
    naive = next(p for p in free if p.microbatches == 4 and p.recompute_stages == 0)
    budget = 0.8 * naive.peak_memory
    plans = search_plans(costs, Space(schedule="1f1b", batch_size=16, layouts=(Layout(4),), memory_budget=budget))
    assert plans[0].fits and plans[0].peak_memory <= budget
    assert [p.samples_per_s for p in plans if p.fits] == sorted((p.samples_per_s for p in plans if p.fits),
                                                                reverse=True)
    for plan in plans:
        assert plan.fits == (plan.peak_memory <= budget)
        samples = 16 / plan.microbatches  # on average; memory is held by the larger first micro-batches
        # every cut of the 8 blocks into 4 stages, by brute force: the plan's is the fastest of those that fit
        fitting = []
        for starts in itertools.combinations(range(1, 8), 3):
            bounds = (0, *starts, 8)
            memory = [costs.stage_param_bytes(bounds[s], bounds[s + 1], first=s == 0, last=s == 3) * 2
                      + plan.inflight[s] * costs.activation_bytes(bounds[s], bounds[s + 1], math.ceil(samples),
                                                                  first=s == 0,
                                                                  last=s == 3, recompute=s < plan.recompute_stages)
                      for s in range(4)]
            if max(memory) <= budget:
                fitting.append(_slowest(costs, bounds, samples, plan.recompute_stages))
        if plan.fits:
            assert _slowest(costs, plan.bounds, samples, plan.recompute_stages) == pytest.approx(min(fitting))
        else:
            assert not fitting


def test_options_given_are_kept_and_no_plan_drifts_more_than_the_default():
    costs = _costs([1e-3] * 8, fixed=1e-3)
    space = Space(schedule="paci", batch_size=16, layouts=(Layout(4),))
    assert {p.drift for p in search_plans(costs, space)} == {1}  # m < 3 would drift 2 or 3 updates on stage 0
    fixed = search_plans(costs, Space(schedule="paci", batch_size=16, layouts=(Layout(4),), microbatches=8,
                                      bounds=(1, 2, 3), recompute_stages=1))
    assert {(p.microbatches, p.bounds, p.recompute_stages) for p in fixed} == {(8, (0, 1, 2, 3, 8), 1)}


def test_no_plan_with_deferred_updates_drifts_more_than_the_default_and_ties_go_to_the_exact_update():
    """With replicas, a deferred update's micro-batches cross one more update: read off the lists as the runtime
    makes them, never above the default plan's bound; where plans tie on speed, the one updating in place wins."""
    costs = _costs([1e-3] * 8, fixed=1e-3)
    plans = search_plans(costs, Space(schedule="paci", batch_size=16, layouts=(Layout(2, replicas=2),)))
    limit = max(chunk_drift_bounds(build_schedule("paci", 2, 2, 2, 4)))  # the default plan (m = stages)
    assert {p.reduce for p in plans} >= {"buckets", "blocking"}
    for plan in plans:
        lists = build_schedule("paci", 2, plan.microbatches, plan.accumulation, 4)
        assert plan.drift == max(chunk_drift_bounds(lists, deferred=plan.reduce == "deferred")) <= limit, plan
    for a, b in zip(plans, plans[1:]):
        if a.fits == b.fits and a.samples_per_s == b.samples_per_s:
            assert (a.drift, a.reduce == "deferred") <= (b.drift, b.reduce == "deferred"), (a, b)


def test_a_launch_bound_block_makes_fewer_larger_microbatches_faster_until_the_budget_says_otherwise():
    costs = _costs([1e-4] * 8, fixed=5e-3)  # the per-call cost dominates: few micro-batches win
    free = search_plans(costs, Space(schedule="1f1b", batch_size=32, layouts=(Layout(4),)))
    assert free[0].microbatches == min(p.microbatches for p in free)
    budget = 0.6 * free[0].peak_memory
    tight = search_plans(costs, Space(schedule="1f1b", batch_size=32, layouts=(Layout(4),), memory_budget=budget))
    assert tight[0].fits and tight[0].peak_memory <= budget < free[0].peak_memory


class _Dump(L.Callback):
    """Each rank's chosen options and its PlanCheck figures, to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        check = next(c for c in trainer.callbacks if isinstance(c, PlanCheck))
        check.on_train_end(trainer, pl_module)  # the check itself runs at the end of a run shorter than its window
        config = trainer.strategy.config
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "stage": trainer.strategy.stage_index, "figures": check.figures, "microbatches": config.microbatches,
            "partition": list(config.partition), "recompute": config.recompute,
            "recompute_stages": config.recompute_stages}))


def _read(directory: Path, world: int) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_predicted_activation_bytes_per_stage_are_the_meters_for_transformers_models_at_four_stages(tmp_path, kind):
    torch.manual_seed(3)
    model = HFCausalLM(kind, layers=4)
    fit(model, token_loader(num_batches=4, vocab=64, seq=12), devices=4, max_steps=3, plan="auto",
        callbacks=[_Dump(tmp_path)], trainer_kwargs={"default_root_dir": tmp_path})
    for rank in _read(tmp_path, 4):
        figures, s = rank["figures"], rank["stage"]
        measured = figures[f"paci/plan/measured_activation_bytes/stage_{s}"]
        predicted = figures[f"paci/plan/predicted_activation_bytes/stage_{s}"]
        assert measured > 0
        assert abs(predicted - measured) <= 0.10 * measured, (s, predicted, measured)


def test_a_budget_below_the_default_plan_is_kept_the_run_equals_one_device_and_the_costs_come_from_the_cache(
        tmp_path):
    torch.manual_seed(0)
    initial = SequentialMLP(width=32, depth=6, lr=0.05).double()
    loader = regression_loader(num_batches=4, batch_size=16)
    loader.dataset.tensors = tuple(t.double() for t in loader.dataset.tensors)
    free, tight = tmp_path / "free", tmp_path / "tight"
    free.mkdir(), tight.mkdir()
    import copy

    fit(copy.deepcopy(initial), loader, devices=2, max_steps=2, schedule="1f1b", plan="auto",
        callbacks=[_Dump(free)], trainer_kwargs={"default_root_dir": tmp_path})
    (cache,) = (tmp_path / "paci_plan").glob("costs-*.json")
    costs = ModelCosts.from_json(json.loads(cache.read_text()))
    space = Space(schedule="1f1b", batch_size=16, layouts=(Layout(2),))
    plans = search_plans(costs, space)
    default = next(p for p in plans if p.microbatches == 2 and p.recompute_stages == 0)
    budget = 0.5 * (default.peak_memory + min(p.peak_memory for p in plans))
    cache.write_text(cache.read_text())  # unchanged: the second run must read it, not measure again
    before = cache.stat().st_mtime_ns

    model = copy.deepcopy(initial)
    fit(model, loader, devices=2, max_steps=2, schedule="1f1b", plan="auto", memory_budget=budget,
        callbacks=[_Dump(tight)], trainer_kwargs={"default_root_dir": tmp_path})
    assert cache.stat().st_mtime_ns == before
    chosen = _read(tight, 2)[0]
    expected = search_plans(costs, Space(schedule="1f1b", batch_size=16, layouts=(Layout(2),), memory_budget=budget))
    assert (chosen["microbatches"], tuple(chosen["partition"])) == (expected[0].microbatches, expected[0].bounds[1:-1])
    assert expected[0].peak_memory <= budget < default.peak_memory
    # one device's plain step on each whole batch (one micro-batch): equal for every m the search may choose, also
    # one that splits the 16 samples unevenly (the micro-batches' losses are weighted by their sizes)
    reference = reference_accumulation(copy.deepcopy(initial), list(loader), 1, 2)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_the_command_prints_the_choice_over_every_layout_and_the_options_that_pin_it(tmp_path, capsys):
    from lightning_paci.plan import main

    costs = tmp_path / "costs.json"
    assert main(["models:planned_mlp", "--devices", "4", "--costs", str(costs)]) == 0
    first = capsys.readouterr().out
    assert costs.is_file() and "chosen" in first and "PACIStrategy(schedule='paci', pipeline_parallel_size=" in first
    measured = ModelCosts.from_json(json.loads(costs.read_text()))
    from lightning_paci.integration.setup.auto_plan import layouts

    best = search_plans(measured, Space(schedule="paci", batch_size=16, layouts=layouts(4)))[0]
    assert f"microbatches={best.microbatches}, partition={list(best.bounds[1:-1])}" in first
    # read back from the file: the same choice, and a budget nothing fits is refused with the smallest peak
    assert main(["models:planned_mlp", "--devices", "4", "--costs", str(costs)]) == 0
    assert capsys.readouterr().out == first
    assert main(["models:planned_mlp", "--devices", "4", "--costs", str(costs), "--memory-budget", "1KiB"]) == 1
    assert "nothing fits --memory-budget 1KiB: the smallest predicted peak is" in capsys.readouterr().err
