"""The monitors' figures reach every logger of the Trainer, not only TensorBoard: global rank 0 (the last stage)
logs each stage's ``paci/<figure>/stage_<s>`` through ``trainer.loggers`` -- here a CSVLogger and an MLFlowLogger on
a local file store -- while each stage's own TensorBoard run stays."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger

from lightning_paci import BubbleMonitor, DriftMonitor

from helpers import fit
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


def _csv_columns(directory: Path) -> dict[str, list[float]]:
    rows = list(csv.DictReader((directory / "metrics.csv").open()))
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in rows[0]}


def _mlflow_metrics(store: Path) -> dict[str, list[float]]:
    runs = [p for p in store.glob("*/*/metrics") if p.is_dir()]
    assert len(runs) == 1, runs
    return {str(f.relative_to(runs[0])): [float(line.split()[1]) for line in f.read_text().splitlines()]
            for f in runs[0].rglob("*") if f.is_file()}


@pytest.mark.parametrize("devices, data_parallel", [(4, 1), (4, 2)])
def test_monitor_figures_of_every_stage_reach_csv_and_mlflow_through_rank_zero(tmp_path, monkeypatch, devices,
                                                                                data_parallel):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store: no server, no database
    stages = devices // data_parallel
    loggers = [CSVLogger(tmp_path, name="csv", version=0),
               MLFlowLogger(experiment_name="paci", tracking_uri=f"file:{tmp_path / 'mlruns'}")]
    fit(SequentialMLP(depth=8), regression_loader(num_batches=6), devices=devices, max_steps=6, microbatches=4,
        data_parallel_size=data_parallel, partition="parameters",
        callbacks=[DriftMonitor(logging_interval=1), BubbleMonitor(logging_interval=1)],
        trainer_kwargs={"logger": loggers, "log_every_n_steps": 1, "default_root_dir": str(tmp_path)})
    columns = _csv_columns(tmp_path / "csv" / "version_0")
    logged = _mlflow_metrics(tmp_path / "mlruns")
    for stage in range(stages):
        for figure in ("drift_max", "drift_bound", "bubble_fraction"):
            tag = f"paci/{figure}/stage_{stage}"
            assert columns.get(tag), f"{tag} missing from the CSV: {sorted(columns)}"
            assert logged.get(tag), f"{tag} missing from MLflow: {sorted(logged)}"
        bound = columns[f"paci/drift_bound/stage_{stage}"]
        assert set(bound) == {float(-(-(stages - 1 - stage) // 4))}  # ceil((N-1-s)/a), a = m = 4
        assert max(columns[f"paci/drift_max/stage_{stage}"]) <= bound[0]
    # each stage's own TensorBoard run is still written
    assert all((tmp_path / "paci_monitors" / f"stage_{s}").is_dir() for s in range(stages))
