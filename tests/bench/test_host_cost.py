"""benchmarks/host_cost.py on a CPU: its rows, and the transformers experts call it times
through moerunner and through transformers' grouped_mm computing the same thing."""

from __future__ import annotations

import json

import pytest
import torch

import moerunner


@pytest.fixture(scope="module")
def host_cost(load_benchmark):
    return load_benchmark("host_cost.py")


def test_rows_include_the_transformers_experts_call(host_cost, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    argv = ["--presets", "qwen3-30b-a3b", "--tokens", "1", "3", "--calls", "2", "--repeats", "1"]
    argv += ["--device", "cpu", "--dtype", "fp32", "--shrink", "64", "--json", str(out)]
    assert host_cost.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    ops = {(r["op"], r["tokens"]) for r in rows}
    for t in (1, 3):
        assert ("transformers experts[moerunner auto]", t) in ops
        assert ("transformers experts[grouped_mm]", t) in ops
    assert all(r["host_us"]["min"] > 0 for r in rows)


def test_the_two_experts_calls_compute_the_same(host_cost):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    layer = moerunner.MoE(moerunner.MoeConfig(8, 32, 16, 2))
    experts = host_cost._transformers_experts(layer)
    x = torch.randn(5, 32)
    topk = moerunner.select_experts(torch.randn(5, 8), 2)
    cases = host_cost._transformers_cases(experts, x, topk, "torch")
    with torch.no_grad():
        outs = [fn() for fn in cases.values()]
        ref = moerunner.reference_moe(x, layer.expert_weights(), topk.weights, topk.ids)
    assert len(outs) == 2
    for out in outs:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
