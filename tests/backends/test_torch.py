"""The ``torch`` backend's grouped-GEMM path and the standard combine, on CPU.

Each case runs one MoE call through ``MoeRunner("torch")`` and compares it with the float64
reference (``moerunner.reference_moe``) within the library's per-dtype bound
(``moerunner.testing.DTYPE_BOUND``: fp32 2e-5, bf16 3e-2, set by the GEMM input and
intermediate roundings). The cases choose sizes that reach each branch: the two GEMM
orientations, several activation and combine blocks, -1 ids (some and all), biases, rows that
are not 16-byte aligned. The decode path must not read device data on the host (CUDA graphs):
on CPU that is checked by making every host-read method raise during the call.
"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner.backends import torch_native
from moerunner.backends.base import MoeProblem
from moerunner.dispatch import permute
from moerunner.dispatch.formats import STANDARD, StandardDispatchOutput
from moerunner.routing import TopK
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights


def _case(tokens, experts, hidden, inter, top_k, dtype, *, bias=False, skips="none", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = rand(tokens, hidden)
    weights = ExpertWeights(
        rand(experts, 2 * inter, hidden, scale=hidden**-0.5),
        rand(experts, hidden, inter, scale=inter**-0.5),
        rand(experts, 2 * inter, scale=0.1) if bias else None,
        rand(experts, hidden, scale=0.1) if bias else None,
    )
    topk = moerunner.select_experts(torch.randn(tokens, experts, generator=gen), top_k)
    ids = topk.ids.clone()
    if skips == "some":
        ids[::2, 0] = -1
    elif skips == "all":
        ids[:] = -1
    return x, weights, TopK(weights=topk.weights, ids=ids)


def _run(x, weights, topk):
    spec = weights.spec(moerunner.Activation("silu"))
    runner = moerunner.MoeRunner("torch")
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, STANDARD), spec)
    return runner.run(StandardDispatchOutput(x, topk), prepared), prepared


def _check(out, x, weights, topk, what):
    ref = moerunner.reference_moe(x, weights, topk.weights, topk.ids)
    assert_close(out, ref, DTYPE_BOUND[x.dtype], what=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("skips", ["none", "some", "all"])
def test_grouped_path_matches_reference(dtype, tokens, skips):
    # E=8, k=2: fp32 runs W @ x^T for 2 <= M < 64 rows (tokens 1, 5) and x @ W^T at 80.
    x, weights, topk = _case(tokens, 8, 64, 48, 2, dtype, skips=skips)
    out, prepared = _run(x, weights, topk)
    assert torch_native._use_grouped_mm(x, prepared)
    _check(out, x, weights, topk, f"{dtype} T={tokens} skips={skips}")
    if skips == "all":
        assert torch.equal(out, torch.zeros_like(out))


def test_orientations_agree_and_are_both_used():
    x, weights, topk = _case(5, 8, 64, 48, 2, torch.float32)
    spec = weights.spec(moerunner.Activation("silu"))
    rows = torch.zeros(10, 64)
    assert torch_native._transposed(rows, spec.num_experts)
    assert not torch_native._transposed(rows.to(torch.bfloat16), spec.num_experts)
    assert not torch_native._transposed(torch.zeros(80, 64), spec.num_experts)
    assert not torch_native._transposed(rows, 0)  # no local experts (expert parallel)
    out, _ = _run(x, weights, topk)
    _check(out, x, weights, topk, "W @ x^T")


def test_blocks_and_biases(monkeypatch):
    # Tiny blocks: several activation blocks (with per-row biases) and combine blocks.
    monkeypatch.setattr(torch_native, "_ACT_BLOCK_ELEMENTS", 96 * 3)
    monkeypatch.setattr(permute, "_COMBINE_BLOCK_ELEMENTS", 2 * 64 * 2)
    for dtype in (torch.float32, torch.bfloat16):
        x, weights, topk = _case(9, 8, 64, 48, 2, dtype, bias=True, skips="some", seed=1)
        out, _ = _run(x, weights, topk)
        _check(out, x, weights, topk, f"{dtype} blocks + biases")


def test_unaligned_rows_use_the_expert_loop():
    x, weights, topk = _case(6, 4, 30, 18, 2, torch.bfloat16, skips="some")  # 60-byte rows
    out, prepared = _run(x, weights, topk)
    assert not torch_native._use_grouped_mm(x, prepared)
    _check(out, x, weights, topk, "per-expert loop")


def _no_host_reads(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("host read of tensor data on the decode path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, fail)
    monkeypatch.setattr(torch.Tensor, "__index__", fail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 40])
def test_grouped_path_reads_nothing_on_the_host(dtype, tokens, monkeypatch):
    # On CUDA a host read breaks graph capture; CPU runs the same grouped-GEMM code.
    x, weights, topk = _case(tokens, 8, 64, 48, 2, dtype, bias=True, skips="some")
    spec = weights.spec(moerunner.Activation("silu"))
    runner = moerunner.MoeRunner("torch")
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, STANDARD), spec)
    dispatched = StandardDispatchOutput(x, topk)
    with monkeypatch.context() as patched:
        _no_host_reads(patched)
        out = runner.run(dispatched, prepared)
    _check(out, x, weights, topk, f"{dtype} T={tokens} without host reads")
