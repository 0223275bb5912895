"""Helpers of the benchmark-script tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def load_benchmark():
    """``load_benchmark("host_cost.py")``: a script of ``benchmarks/`` loaded as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(Path(name).stem, BENCHMARKS / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
