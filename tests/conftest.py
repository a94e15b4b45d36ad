from __future__ import annotations

import gc
import os
import tempfile

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_the_sessions_directory(tmp_path_factory):
    """The tests' temporary files, and those of the ranks and scripts they start, go under the session's pytest
    directory (which pytest prunes to the last three sessions), not loose into the system's: among them torch's
    error file of every rank that fails on purpose (``torch.multiprocessing`` writes the traceback there and never
    removes it) and multiprocessing's ``pymp-*`` directories.

    Inductor's caches stay where torch placed them: its compiled kernels go under ``TORCHINDUCTOR_CACHE_DIR``, fixed
    when ``torch._dynamo`` is first imported (before this fixture), and its precompiled C++ header under the
    temporary directory of the moment its code cache is imported -- imported here, first, so the header (150 MB,
    seconds of CPU to build) is kept with the kernels instead of being built again in every session's directory."""
    import torch._inductor.codecache  # noqa: F401

    directory = str(tmp_path_factory.mktemp("tmp"))
    previous, previous_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = directory
    yield
    tempfile.tempdir = previous
    if previous_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous_env


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``heavy`` first, in their order, then the rest: the workers' last minutes are then short
    tests that the idle worker can take over, so both end together (a heavy test last kept one worker alone for
    up to a minute)."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every object alive once the tests are collected (torch, Lightning, transformers and the test modules:
    ~480k) goes to the collector's permanent generation: a worker's full collections then walk only what the tests
    made since, not the whole imported stack each time (0.15 s each, a dozen per ten distributed tests), and the
    ranks a test forks inherit the frozen heap ([Note: fork with a frozen heap])."""
    gc.collect()
    gc.freeze()
