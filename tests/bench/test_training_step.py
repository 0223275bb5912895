"""benchmarks/training_step.py: every implementation's step is checked against float64
autograd before it is timed; run tiny on the CPU and, with the ``gpu`` marker, on CUDA
(its first GPU run failed: the routing was drawn with a CUDA generator)."""

from __future__ import annotations

import json

import pytest
import torch

from moerunner.testing import DTYPE_BOUND

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
def test_tiny_training_step_checks_and_times_every_implementation(
    load_benchmark, tmp_path, capsys, device
):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bench = load_benchmark("training_step.py")
    argv = ["--device", device, "--scale", "64", "--presets", "qwen3-30b-a3b"]
    argv += ["--tokens", "16", "--dtypes", "fp32", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    (path,) = tmp_path.glob("*-training-step-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["impl"] for r in rows] == list(bench.IMPLS)
    for r in rows:
        assert r["H"] == 2048 // 64 and r["T"] == 16 and 0 < r["min_ms"] <= r["ms"] <= r["max_ms"]
        bound = DTYPE_BOUND[torch.float32]  # (the benchmark refuses to time a step past it)
        assert r["max_rel_err"]["out"] <= bound and r["max_rel_err"]["dx"] <= bound
        if device == "cuda":  # steps queued back to back too
            assert 0 < r["queued_min_ms"] <= r["queued_ms"] <= r["queued_max_ms"]
        else:
            assert "queued_ms" not in r
    assert "moerunner-per-expert" in capsys.readouterr().out
