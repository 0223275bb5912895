"""flashinfer backend on an SM90 GPU: each claimed format against the float64 reference and
against the triton backend on the same inputs, T = 0, ids of -1, CUDA-graph replay, and the
CPU-written layouts against FlashInfer's own layout functions (bit-exact).

Skipped without CUDA (marker ``gpu``) and where the backend is unavailable (no flashinfer
package, or not an SM90 GPU). The conformance matrix (tests/test_conformance.py) also runs it
from the registry.
"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.routing import TopK
from moerunner.testing import assert_close, error_bound
from moerunner.weights import ExpertWeights

pytestmark = pytest.mark.gpu

NAME = "flashinfer"


def _backend_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    backend = moerunner.default_registry().backends[NAME]
    ok, reason = backend.available()
    if not ok:
        pytest.skip(f"flashinfer backend unavailable: {reason}")
    return backend


def _run(backend, x, weights, act, wts, ids):
    runner = moerunner.MoeRunner(backend)
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(StandardDispatchOutput(x, TopK(wts, ids)), prepared)


def _case(scheme, activation, *, T=33, H=256, I=256, E=8, k=2, bias=False, interleaved=False):
    """Random bf16 inputs and weights of ``scheme`` on the GPU (routing with renormalize)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    act = moerunner.Activation(activation)
    n13 = 2 * I if act.gated else I
    w13 = torch.randn(E, n13, H, device=dev, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, generator=gen) / I**0.5
    if scheme == "bf16":
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    else:
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    b13 = torch.randn(E, n13, device=dev, generator=gen) * 0.1 if bias else None
    b2 = torch.randn(E, H, device=dev, generator=gen) * 0.1 if bias else None
    weights = ExpertWeights(w13, w2, b13, b2, interleaved)
    x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
    logits = torch.randn(T, E, device=dev, generator=gen)
    topk = moerunner.select_experts(logits, k, renormalize=True)
    return x, weights, act, topk.weights, topk.ids


# (scheme, activation, keyword arguments of _case): bf16, GPT-OSS MXFP4 W4A16 (clamped SwiGLU,
# biases, interleaved rows, H and I not multiples of 128), DeepSeek-V3 block fp8.
ROWS = [
    ("bf16", "silu", {}),
    ("bf16", "swiglu_oai", {"bias": True, "interleaved": True}),
    ("bf16", "gelu", {}),
    ("bf16", "gelu_tanh", {}),
    ("bf16", "relu2", {}),
    ("bf16", "silu", {"T": 1, "I": 192}),
    ("mxfp4", "swiglu_oai", {"bias": True, "interleaved": True}),
    ("mxfp4", "swiglu_oai", {"bias": True, "interleaved": True, "H": 320, "I": 160}),
    ("mxfp4", "silu", {"T": 300}),
    ("fp8_block", "silu", {}),
    ("fp8_block", "silu", {"T": 300, "E": 16, "k": 4}),
]


@pytest.mark.parametrize(
    "scheme,activation,kw", ROWS, ids=[f"{s}-{a}-{i}" for i, (s, a, _) in enumerate(ROWS)]
)
def test_matches_reference_and_triton(scheme, activation, kw):
    _backend_or_skip()
    x, weights, act, wts, ids = _case(scheme, activation, **kw)
    out = _run(NAME, x, weights, act, wts, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = moerunner.reference_moe(x, weights, wts, ids, act)
    quantizes = moerunner.quant.get_scheme(scheme).activation_format != "none"
    bound = error_bound(torch.bfloat16, quantizes)
    assert_close(out, ref, bound, what=f"flashinfer {scheme} {activation}")
    triton = moerunner.default_registry().backends.get("triton")
    problem = MoeProblem.of(x, weights, weights.spec(act), "standard")
    if triton is not None and triton.available()[0] and triton.supports(problem)[0]:
        other = _run("triton", x, weights, act, wts, ids)
        # two bf16 results, each within ``bound`` of the reference
        assert_close(out, other.double().cpu(), 2 * bound, what="flashinfer vs triton")


def test_per_expert_swiglu_parameters():
    _backend_or_skip()
    x, weights, _, wts, ids = _case("mxfp4", "swiglu_oai", bias=True, interleaved=True)
    E = weights.num_experts
    dev = x.device
    act = moerunner.Activation(
        "swiglu_oai",
        alpha=torch.linspace(1.0, 2.0, E, device=dev),
        limit=torch.linspace(0.5, 7.0, E, device=dev),
        beta=torch.linspace(0.0, 1.0, E, device=dev),
    )
    out = _run(NAME, x * 8, weights, act, wts, ids)
    ref = moerunner.reference_moe(x * 8, weights, wts, ids, act)
    assert_close(out, ref, error_bound(torch.bfloat16, False), what="per-expert swiglu")


def test_t0_and_skipped_ids():
    _backend_or_skip()
    x, weights, act, wts, ids = _case("bf16", "silu", T=9)
    empty = _run(NAME, x[:0], weights, act, wts[:0], ids[:0])
    assert empty.shape == (0, x.shape[1])
    ids = ids.clone()
    ids[::2, 0] = -1
    out = _run(NAME, x, weights, act, wts, ids)
    ref = moerunner.reference_moe(x, weights, wts, ids, act)
    assert_close(out, ref, error_bound(torch.bfloat16, False), what="ids of -1")


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4"])
def test_cuda_graph_replay(scheme):
    _backend_or_skip()
    x, weights, act, wts, ids = _case(scheme, "silu", T=16)
    runner = moerunner.MoeRunner(NAME)
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    static_x, static_w, static_ids = x.clone(), wts.clone(), ids.clone()

    def step():
        return runner.run(StandardDispatchOutput(static_x, TopK(static_w, static_ids)), prepared)

    step()  # loads the module and warms the caches outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x2, _, _, w2_, ids2 = _case(scheme, "silu", T=16, E=weights.num_experts)
    static_x.copy_(x2 * 0.5)
    static_w.copy_(w2_)
    static_ids.copy_(ids2.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(captured, eager) or torch.allclose(captured, eager, rtol=1e-2, atol=1e-3)
    ref = moerunner.reference_moe(static_x, weights, static_w, static_ids, act)
    assert_close(captured, ref, error_bound(torch.bfloat16, False), what="graph replay")


def test_layouts_match_flashinfer_functions():
    _backend_or_skip()
    from flashinfer import fused_moe

    from moerunner.backends.flashinfer.layout import fold_scales, interleave_e2m1_sm90

    gen = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (3, 128, 192), dtype=torch.uint8, device="cuda", generator=gen)
    scale = torch.randint(110, 130, (3, 128, 12), dtype=torch.uint8, device="cuda", generator=gen)
    theirs = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(data, "fp4")
    assert torch.equal(interleave_e2m1_sm90(data), theirs)
    assert torch.equal(
        fold_scales(scale), fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(scale)
    )


def test_after_a_call_the_module_is_built_and_both_gemms_were_profiled():
    """What ``auto`` and the benchmarks rely on, on the real FlashInfer: once a call has run,
    its SM90 fused-MoE module counts as built (``ready``: ``auto`` may take the backend), and
    its autotuner holds profiled tactics for both GEMMs (the weights are not marked untuned:
    no fallback tile)."""
    from moerunner.backends.flashinfer import _module_ready

    backend = _backend_or_skip()
    x, weights, act, wts, ids = _case("bf16", "silu", T=64)
    runner = moerunner.MoeRunner(NAME)
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    runner.run(StandardDispatchOutput(x, TopK(wts, ids)), prepared)
    torch.cuda.synchronize()
    assert not prepared.untuned(), prepared.notes
    _module_ready.cache_clear()  # checked afresh: the module now exists
    assert backend.ready() == (True, "")
