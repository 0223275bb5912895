"""Test-session edge: choose how Triton runs before anything imports it.

Without a CUDA GPU, Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``
must be set before ``triton`` is imported). This is the test harness's configuration edge;
the library itself never reads the environment.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly (and visibly) without CUDA."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def prepares(monkeypatch):
    """Every preparation of weights for a backend (``runner.prepare_for_backend``) from here
    on: one entry per call, whether grad mode was on while it ran."""
    import torch

    import moerunner.runner

    calls: list[bool] = []
    original = moerunner.runner.prepare_for_backend

    def spy(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(moerunner.runner, "prepare_for_backend", spy)
    return calls


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A user cache folder of the test's own (``XDG_CACHE_HOME``); the default backend
    table's memo is cleared around it. Yields the user backend-table folder."""
    from moerunner import backend_table as bt

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bt.default_table.cache_clear()
    yield bt.user_table_dir()
    bt.default_table.cache_clear()
