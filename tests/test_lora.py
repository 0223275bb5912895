"""MoE LoRA with many adapters in one batch (``moerunner.lora``), through the hooks.

The float64 reference never uses the hooks: for each adapter it merges ``W + s B A`` per
expert in float64 and runs ``reference_moe`` on that adapter's tokens (tokens without an
adapter on the plain weights). fp32 bound: ``DTYPE_BOUND`` (the deltas are fp32 GEMMs of
rank r added to fp32 GEMM outputs, the same order of rounding as the base GEMMs).
"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import MoeInputError, MoeRunner
from moerunner.api import run_experts
from moerunner.config import Activation
from moerunner.lora import MoeLoraWeights, _gathered, lora_delta, lora_hooks
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights

T, E, H, I, K, L = 9, 4, 32, 16, 2, 3
BACKENDS = ["torch", "triton"]


def _case(rank=8, act="silu", seed=0, scaling=None):
    act = Activation.of(act)
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if act.gated else I
    w13 = torch.randn(E, rows, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    lora = MoeLoraWeights(
        torch.randn(L, E, rank, H, generator=g) * H**-0.5,
        torch.randn(L, E, rows, rank, generator=g) * rank**-0.5,
        torch.randn(L, E, rank, I, generator=g) * I**-0.5,
        torch.randn(L, E, H, rank, generator=g) * rank**-0.5,
        torch.tensor([0.5, 1.0, 2.0]) if scaling is None else scaling,
    )
    x = torch.randn(T, H, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    adapters = torch.tensor([0, 1, 2, -1, 0, 2, 1, -1, 0])
    return x, ExpertWeights(w13, w2), lora, topk, adapters, act


def _reference(x, weights, lora, topk, adapters, act):
    """float64: per adapter, the merged weights on its tokens."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = (w.double() for w in (weights.w13, weights.w2))
    for a in [-1, *range(L)]:
        tok = (adapters == a).nonzero().flatten()
        if a < 0:
            merged = ExpertWeights(w13, w2)
        else:
            s = lora.scaling[a].item() if isinstance(lora.scaling, torch.Tensor) else lora.scaling
            d13 = lora.w13_b[a].double() @ lora.w13_a[a].double()
            d2 = lora.w2_b[a].double() @ lora.w2_a[a].double()
            merged = ExpertWeights(w13 + s * d13, w2 + s * d2)
        out[tok] = moerunner.reference_moe(
            x[tok].double(), merged, topk.weights[tok], topk.ids[tok], act
        )
    return out


def _run(backend, x, weights, lora, topk, adapters, act, force_permute=False):
    runner = MoeRunner(backend, force_permute=force_permute)
    hooks = lora_hooks(lora, adapters)
    return run_experts(runner, weights, x, topk.weights, topk.ids, act, hooks=hooks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("force_permute", [False, True])
@pytest.mark.parametrize("rank", [8, 16])
def test_many_adapters_in_one_batch(backend, force_permute, rank):
    x, weights, lora, topk, adapters, act = _case(rank)
    out = _run(backend, x, weights, lora, topk, adapters, act, force_permute)
    ref = _reference(x, weights, lora, topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=f"{backend} r={rank}")
    plain = _reference(x, weights, lora, topk, torch.full((T,), -1), act)
    assert (ref - plain).abs().max() > 0.1 * ref.abs().max()  # the adapters matter


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_64_non_gated_and_a_float_scaling(backend):
    x, weights, lora, topk, adapters, act = _case(64, "relu2", seed=1, scaling=0.25)
    out = _run(backend, x, weights, lora, topk, adapters, act)
    assert_close(out, _reference(x, weights, lora, topk, adapters, act), DTYPE_BOUND[torch.float32])


def test_gathered_and_grouped_deltas_agree():
    """The CPU grouped form and the off-CPU gathered form (run here on CPU tensors, in
    chunks of 7 rows) against a float64 loop over rows."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, H, generator=g)
    a, b = torch.randn(L, E, 8, H, generator=g), torch.randn(L, E, 2 * I, 8, generator=g)
    adapter = torch.randint(-1, L, (40,), generator=g)
    expert = torch.randint(-1, E + 2, (40,), generator=g)  # past E: shared experts, no delta
    scale = torch.rand(40, generator=g)
    want = torch.zeros(40, 2 * I, dtype=torch.float64)
    for r in range(40):
        if adapter[r] >= 0 and 0 <= expert[r] < E:
            ab = b[adapter[r], expert[r]].double() @ a[adapter[r], expert[r]].double()
            want[r] = scale[r] * (ab @ x[r].double())
    assert want.abs().sum() > 0
    grouped = lora_delta(x, a, b, adapter, expert, scale)
    assert_close(grouped, want, 1e-5)
    valid = (adapter >= 0) & (expert >= 0) & (expert < E)
    key = torch.where(valid, adapter * E + expert, -1)
    gathered = _gathered(x, a, b, key, scale, torch.zeros(40, 2 * I), chunk=7)
    assert_close(gathered, want, 1e-5)


def test_bad_lora_input_is_named():
    x, weights, lora, topk, adapters, act = _case()
    with pytest.raises(TypeError, match="lora must be a MoeLoraWeights"):
        lora_hooks((lora.w13_a,), adapters)
    with pytest.raises(MoeInputError, match="must share"):
        lora_hooks(MoeLoraWeights(lora.w13_a, lora.w13_b[:, :2], lora.w2_a, lora.w2_b), adapters)
    with pytest.raises(MoeInputError, match="ranks differ"):
        lora_hooks(MoeLoraWeights(lora.w13_a, lora.w13_b[..., :4], lora.w2_a, lora.w2_b), adapters)
    with pytest.raises(MoeInputError, match=r"scaling must be a number or a float \[L=3\]"):
        lora_hooks(
            MoeLoraWeights(lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b, torch.ones(2)), adapters
        )
    with pytest.raises(MoeInputError, match="adapter_ids must be a 1-D integer"):
        lora_hooks(lora, adapters.float())
    with pytest.raises(MoeInputError, match="lora adapter_ids"):
        lora_hooks(lora, torch.tensor([0, 3]))  # L = 3: id 3 out of range
    wide = MoeLoraWeights(
        torch.randn(L, E, 8, H + 1), lora.w13_b[..., :8], lora.w2_a[:, :, :8], lora.w2_b[..., :8]
    )
    with pytest.raises(MoeInputError, match="w13_a has 33 where the experts need 32"):
        _run("torch", x, weights, wide, topk, adapters, act)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_call_is_captured_in_a_cuda_graph_and_replays(backend):
    """triton: the hooked sequence and the gathered LoRA deltas have no host read, so the
    call captures; each replay with new inputs matches an eager call (bf16)."""
    if backend == "torch":
        pytest.skip("the torch backend reads expert bounds on the host")
    x, weights, lora, topk, adapters, act = _case(16)
    dev, bf = "cuda", torch.bfloat16
    w = ExpertWeights(weights.w13.to(dev, bf), weights.w2.to(dev, bf))
    lo = MoeLoraWeights(*(t.to(dev, bf) for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)),
                        lora.scaling.to(dev))  # fmt: skip
    xs, tw, ti, ad = x.to(dev, bf), topk.weights.to(dev), topk.ids.to(dev), adapters.to(dev)

    def call():
        hooks = lora_hooks(lo, ad, check_ids=False)
        return moerunner.fused_moe(
            xs, w.w13, w.w2, tw, ti, backend="triton", check_ids=False, hooks=hooks
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(2):
        xs.copy_(torch.randn(T, H, generator=torch.Generator().manual_seed(step)).to(dev, bf))
        graph.replay()
        torch.testing.assert_close(out, call())
    lo32 = MoeLoraWeights(
        *(t.float().cpu() for t in (lo.w13_a, lo.w13_b, lo.w2_a, lo.w2_b)), lora.scaling
    )
    w32 = ExpertWeights(w.w13.float().cpu(), w.w2.float().cpu())
    ref = _reference(xs.float().cpu(), w32, lo32, topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[torch.bfloat16])
