"""LightningCLI: ``--trainer.strategy paci`` (the registered name, launched like ``ddp``) and the class form with
its options as ``--trainer.strategy.<option>``, on an unchanged module (tests/scripts/cli_script.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

SCRIPT = Path(__file__).parent / "scripts" / "cli_script.py"
QUIET = ["--trainer.accelerator", "cpu", "--trainer.max_steps", "3", "--trainer.logger", "false",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false"]


@pytest.mark.timeout(150)
def test_lightning_cli_launches_the_registered_strategy_name_and_rank_zero_ends_with_everything(tmp_path):
    # the default launcher re-runs the script for rank 1, as for a user's script; after fit, Lightning's documented
    # patterns: a checkpoint holding every stage's optimizer state, and predictions on rank 0 in batch order
    result = tmp_path / "result.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "fit", "--trainer.strategy", "paci", "--trainer.devices", "2",
                          *QUIET], capture_output=True, text=True, timeout=140, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PACI_CLI_RESULT=str(result),
                                  PACI_CLI_CHECKPOINT=str(tmp_path / "last.ckpt")))
    assert out.returncode == 0, out.stderr[-3000:]
    ran = json.loads(result.read_text())
    assert (ran["strategy"], ran["stages"], ran["schedule"], ran["steps"]) == ("PACIStrategy", 2, "paci", 3)
    assert math.isfinite(ran["loss"])
    assert ran["keys"] == sorted(f"net.{i}.{p}" for i in (0, 2, 4, 6) for p in ("weight", "bias"))
    assert ran["saved"] == [2, 8, [8]] and ran["predictions"] == 3


def test_lightning_cli_takes_the_strategy_class_with_its_options(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("cli_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = tmp_path / "result.json"
    monkeypatch.setenv("PACI_CLI_RESULT", str(result))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "fit", "--trainer.strategy", "lightning_paci.PACIStrategy",
                                      "--trainer.strategy.schedule", "1f1b", "--trainer.strategy.microbatches", "4",
                                      "--trainer.strategy.start_method", "fork", "--trainer.devices", "2", *QUIET])
    script.main()
    ran = json.loads(result.read_text())
    assert (ran["strategy"], ran["stages"], ran["schedule"], ran["microbatches"], ran["steps"]) == (
        "PACIStrategy", 2, "1f1b", 4, 3)
