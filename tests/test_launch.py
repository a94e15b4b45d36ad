"""The default launcher: `strategy="paci"` re-executes the user's script per rank (as `ddp` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


def test_paci_strategy_string_launches_a_script_and_rank_zero_ends_with_full_weights(tmp_path):
    script = Path(__file__).parent / "scripts" / "fit_paci_script.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PACI_TEST_CHECKPOINT=str(tmp_path / "last.ckpt"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK rank0 keys=8" in out.stdout
    assert "OK predict" in out.stdout
    assert "OK save after fit" in out.stdout
