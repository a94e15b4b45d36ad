"""A SIGTERM to every process of a fit (a scheduler's preemption): every stage stops before one agreed batch, the
checkpoint ``OnExceptionCheckpoint`` writes then is one step of the whole pipeline, and a resume from it ends
where the run that was not interrupted ends ([Note: a preemption's stop] in engine/supervision/preemption.py)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_paci.engine.supervision.lost_peers import running_here
from lightning_paci.engine.supervision.preemption import StopAgreement

STEPS = 8


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    script = Path(__file__).parent / "scripts" / "preempt_script.py"
    return subprocess.run([sys.executable, str(script), str(out), *args], capture_output=True, text=True,
                          timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=out)


@pytest.mark.distributed
@pytest.mark.heavy
def test_a_sigterm_to_every_rank_stops_all_before_one_batch_and_the_resume_equals_the_uninterrupted_run(tmp_path):
    at = random.Random(os.getpid()).randrange(1, 6)  # a step chosen at random: the stop must not depend on it
    stopped = _run(tmp_path, "stop", str(at))
    said = [line for line in stopped.stderr.splitlines() if line.startswith("lightning_paci: global rank")]
    assert len(said) == 2, stopped.stderr[-3000:]  # one line per rank, naming one batch for both
    batches = {re.search(r"before training batch (\d+)", line).group(1) for line in said}  # type: ignore[union-attr]
    assert len(batches) == 1, said
    assert "Traceback" not in stopped.stderr and "frame #" not in stopped.stderr, stopped.stderr[-3000:]
    pids = [int(p.read_text()) for p in tmp_path.glob("stop-pid*")]
    assert len(pids) == 2 and not _none_left(pids)  # every rank ended (the script returns after the last)
    checkpoint = torch.load(tmp_path / "stop-ckpt" / "on_exception.ckpt", weights_only=False)
    assert checkpoint["global_step"] == int(batches.pop()) and at <= checkpoint["global_step"] < STEPS
    full = _run(tmp_path, "full")
    resumed = _run(tmp_path, "resume")
    assert full.returncode == 0 and resumed.returncode == 0, (full.stderr + resumed.stderr)[-3000:]
    expected, found = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resume.pt")
    for key, value in expected.items():
        assert torch.equal(found[key], value), key  # "1f1b": bit for bit the run that was not interrupted


def _none_left(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if running_here(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_the_stop_batch_is_the_largest_next_batch_once_every_process_said_it():
    store: dict[str, str] = {}
    agreements = [StopAgreement(lambda k: store.get(k, ""), store.__setitem__, 3, me) for me in range(3)]
    for me, agreement in enumerate(agreements):
        assert not agreement.before_batch(4 + me, timeout=1.0)  # each may start its batch: 5, 6, 7 next
    agreements[1].request()  # process 1 got the signal
    agreements[1].poll()
    assert agreements[1].pending and agreements[1].stop_batch is None  # the others have not said theirs
    agreements[0].poll()
    agreements[2].poll()
    for agreement in agreements:
        agreement.poll()
    assert [a.stop_batch for a in agreements] == [7, 7, 7]  # none has started batch 7
    assert [a.before_batch(b, timeout=1.0) for a, b in zip(agreements, (5, 6, 7))] == [False, False, True]
    with pytest.raises(RuntimeError, match="not every stage has said which batch it reached"):
        lone = StopAgreement(lambda k: store.get(k, "") if k == "preempt" else "", lambda k, v: None, 2, 0)
        lone.poll()
        lone.before_batch(0, timeout=0.05)
