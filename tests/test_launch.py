"""The default launcher: `strategy="paci"` re-executes the user's script per rank (as `ddp` does)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed


TORCHRUN_SCRIPT = Path(__file__).parent / "scripts" / "torchrun_script.py"


def _two_torchrun_nodes(out: Path, *args: str) -> tuple[list[subprocess.CompletedProcess], float]:
    """The two commands of docs/launching.md, one per "node", on this machine: c10d rendezvous on
    localhost at a free port, 2 processes each."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", str(TORCHRUN_SCRIPT), str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    done = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=150)
        done.append(subprocess.CompletedProcess(command, node.returncode, stdout, stderr))
    return done, time.monotonic() - start


def test_two_torchrun_nodes_train_checkpoint_and_resume_as_pp2_dp2_and_pp4_dp1(tmp_path):
    nodes, _ = _two_torchrun_nodes(tmp_path)
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    said = "".join(node.stdout for node in nodes)
    for rank in range(4):
        assert f"OK rank {rank}: pipeline 2 x data 2 and pipeline 4 x data 1 trained, saved, resumed" in said
    suggestions = {float(tmp_path.joinpath(f"lr{rank}").read_text()) for rank in range(4)}
    assert len(suggestions) == 1 and 1e-3 < suggestions.pop() < 1.0  # lr_find: one learning rate on every rank


def test_sigkill_of_one_rank_under_torchrun_brings_every_rank_down_naming_it(tmp_path):
    nodes, seconds = _two_torchrun_nodes(tmp_path, "kill")
    assert seconds < 60
    assert all(node.returncode != 0 for node in nodes)
    said = "".join(node.stderr for node in nodes)
    assert "stage 1 (replica 1)" in said  # the killed rank, named by the others
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 4
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_refused_crossing_leaves_the_failing_stages_traceback_last_and_one_line_per_other_stage(tmp_path):
    script = Path(__file__).parent / "scripts" / "in_place_skip_script.py"
    out = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=150,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert out.returncode != 0
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr[-4000:]  # the cause's only
    cause = out.stderr[out.stderr.index("Traceback (most recent call last)"):]
    assert "CrossingError: Stage 0: the output of `embed` that a later stage reads was modified in place" in cause
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in out.stderr.splitlines()]  # torch's rank prefix
    others = [line for line in lines if line.startswith("lightning_paci: stage") and "stage 0 failed" in line]
    assert others and all("stage 1" in line for line in others)  # stage 1 says in one line who failed
