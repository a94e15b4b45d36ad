from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _no_seed_leaks(monkeypatch):
    """`seed_everything` sets PL_GLOBAL_SEED / PL_SEED_WORKERS in the environment, which every later Trainer's ranks
    would re-seed from: each test starts and ends without them."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    yield
