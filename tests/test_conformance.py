"""Every available backend x path x case x dtype against the float64 reference.

The matrix comes from the registry (``cases.backend_paths``) and the case rows; skips come
from the backend's own ``supports()``.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES, TOLERANCE, Case, backend_paths, supports

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.routing import TopK
from moerunner.testing import assert_close, error_bound

PATHS = backend_paths()
# The matrix runs on the CPU everywhere and again on the GPU: its CUDA rows carry the gpu
# marker, so the GPU suite (``-m gpu``) runs them and they skip visibly without CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def run_path(backend: str, force_permute: bool, x, weights, topk_weights, topk_ids, activation):
    """One call through MoeRunner, on the fused op or the permute path."""
    act = moerunner.Activation(activation)
    runner = moerunner.MoeRunner(backend, force_permute=force_permute)
    spec = weights.spec(act)
    dispatch_output = StandardDispatchOutput(x, TopK(topk_weights.float(), topk_ids.int()))
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(dispatch_output, prepared)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize(
    "path", PATHS, ids=[f"{b}-{'permute' if p else 'fused'}" for b, p in PATHS]
)
def test_backend_matches_reference(path, case: Case, dtype, device):
    backend, force_permute = path
    x, weights, tw, ids = case.build(dtype, device)
    ok, reason = supports(backend, x, weights, case.activation)
    if not ok:
        pytest.skip(f"{backend} does not claim this: {reason}")
    out = run_path(backend, force_permute, x, weights, tw, ids, case.activation)
    assert out.shape == x.shape and out.dtype == dtype
    ref = moerunner.reference_moe(x, weights, tw, ids, case.activation)
    assert_close(out, ref, TOLERANCE[dtype], what=f"{backend} {case.name}")


@pytest.mark.parametrize("case", CASES[1:], ids=[c.name for c in CASES[1:]])
def test_fused_and_permute_paths_agree(case: Case):
    registry = moerunner.default_registry()
    pairs = [name for name, _ in PATHS if registry.has_both_paths("standard", name)]
    if not pairs:
        pytest.skip("no available backend registers both a fused op and a core here")
    for backend in pairs:
        x, weights, tw, ids = case.build(torch.float32)
        ok, reason = supports(backend, x, weights, case.activation)
        if not ok:
            continue
        fused = run_path(backend, False, x, weights, tw, ids, case.activation)
        permuted = run_path(backend, True, x, weights, tw, ids, case.activation)
        ref = moerunner.reference_moe(x, weights, tw, ids, case.activation)
        assert_close(fused, permuted.double(), TOLERANCE[torch.float32], what=backend)
        assert_close(fused, ref, TOLERANCE[torch.float32], what=backend)


def test_public_fused_moe_auto_matches_reference():
    case = Case("auto", tokens=9, bias=True, activation="swiglu_oai", interleaved=True)
    x, weights, tw, ids = case.build(torch.float32)
    out = moerunner.fused_moe(
        x,
        weights.w13,
        weights.w2,
        tw,
        ids,
        activation="swiglu_oai",
        w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias,
        gate_up_interleaved=True,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )
    ref = moerunner.reference_moe(x, weights, tw, ids, "swiglu_oai")
    assert_close(out, ref, TOLERANCE[torch.float32])


def test_swiglu_limit_changes_the_result():
    # Guards against the limit being ignored: a small limit must clamp and change the output.
    case = Case("limit", activation="swiglu_oai", bias=True, interleaved=True)
    x, weights, tw, ids = case.build(torch.float32)
    kw = dict(
        activation="swiglu_oai",
        w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias,
        gate_up_interleaved=True,
    )
    loose = moerunner.fused_moe(x * 20, weights.w13, weights.w2, tw, ids, **kw)
    tight = moerunner.fused_moe(x * 20, weights.w13, weights.w2, tw, ids, swiglu_limit=0.5, **kw)
    assert not torch.allclose(loose, tight)
    ref = moerunner.reference_moe(
        x * 20, weights, tw, ids, moerunner.Activation("swiglu_oai", limit=0.5)
    )
    assert_close(tight, ref, TOLERANCE[torch.float32])


def _quantized_schemes():
    from moerunner.quant import SCHEME_NAMES, get_scheme

    return [name for name in SCHEME_NAMES if get_scheme(name).is_quantized]


SCHEMES = _quantized_schemes()
SCHEME_CASES = [
    Case("q_silu", tokens=6, hidden=128, inter=128, experts=3),
    Case(
        "q_swiglu_bias",
        tokens=5,
        hidden=128,
        inter=128,
        experts=3,
        activation="swiglu_oai",
        bias=True,
        interleaved=True,
    ),
    Case("q_relu2", tokens=4, hidden=128, inter=128, experts=3, activation="relu2"),
    Case("q_silu_no_mul", tokens=4, hidden=128, inter=128, experts=3, activation="silu_no_mul"),
]


def _scheme_tolerance(scheme_name: str) -> float:
    """fp32 bound, plus the activation-quantization allowance (see moerunner.testing)."""
    from moerunner.quant import get_scheme

    return error_bound(torch.float32, get_scheme(scheme_name).activation_format != "none")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", SCHEME_CASES, ids=[c.name for c in SCHEME_CASES])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    "path", PATHS, ids=[f"{b}-{'permute' if p else 'fused'}" for b, p in PATHS]
)
def test_quantized_scheme_matches_reference(path, scheme, case, device):
    backend, force_permute = path
    from moerunner.quant import get_scheme

    x, plain, tw, ids = case.build(torch.float32)
    static = get_scheme(scheme).activation_scales == "static"
    # Static schemes carry a calibrated activation scale; any fixed value defines the function.
    s13, s2 = (torch.full((case.experts,), v) if static else None for v in (0.02, 0.005))
    weights = moerunner.ExpertWeights(
        moerunner.quantize(plain.w13, scheme, input_scale=s13).to(device),
        moerunner.quantize(plain.w2, scheme, input_scale=s2).to(device),
        None if plain.w13_bias is None else plain.w13_bias.to(device),
        None if plain.w2_bias is None else plain.w2_bias.to(device),
        plain.gate_up_interleaved,
    )
    x, tw, ids = x.to(device), tw.to(device), ids.to(device)
    ok, reason = supports(backend, x, weights, case.activation)
    if not ok:
        pytest.skip(f"{backend} does not claim this: {reason}")
    out = run_path(backend, force_permute, x, weights, tw, ids, case.activation)
    ref = moerunner.reference_moe(x, weights, tw, ids, case.activation)
    assert_close(out, ref, _scheme_tolerance(scheme), what=f"{backend} {scheme}")
    # The quantization must matter: the unquantized reference differs for every real scheme.
    plain_ref = moerunner.reference_moe(x, plain, tw, ids, case.activation)
    assert not torch.allclose(ref, plain_ref, rtol=1e-6, atol=0)
