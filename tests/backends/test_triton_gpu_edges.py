"""Triton backend on a CUDA GPU: the edge cases of a MoE call, compiled (not interpreted).

Skipped without CUDA (marker ``gpu``). These cases were the ``check`` part of the kernel
experiment script ``benchmarks/experiments/gpu_triton.py`` (71/71 on H100 and H200, see
``benchmarks/results/README.md``); they live here so that ``pytest -m gpu`` is the one GPU
check. Each case runs the triton backend against the torch backend (which rounds and
quantizes as the kernels do: the dtype's bound) and against the float64 reference (schemes
that quantize activations also carry 8-bit code flips where bf16 rounding crossed a rounding
boundary, hence the looser bound there, at least 1.5x the torch backend's own distance).
"""

from __future__ import annotations

import pytest
import torch
from cases import TRITON_QUANT_SCHEMES

pytest.importorskip("triton")

import moerunner  # noqa: E402
from moerunner.backends.base import MoeProblem  # noqa: E402
from moerunner.dispatch.formats import StandardDispatchOutput  # noqa: E402
from moerunner.reference import reference_moe  # noqa: E402
from moerunner.routing import TopK  # noqa: E402
from moerunner.weights import ExpertWeights  # noqa: E402

pytestmark = pytest.mark.gpu

QUANT_ACT = {"fp8_tensor", "fp8_channel", "fp8_block", "int8", "mxfp8", "mxfp4_mxfp8"}


def _minus_one(ids: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.rand(ids.shape, device=ids.device) < 0.3, -1, ids)


def _one_expert_for_all(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.full_like(ids[:, 0], 3), torch.full_like(ids[:, 0], 5)], 1)


# (case, scheme, activation, options of _check)
CASES = [
    ("T=0", "bf16", "silu", dict(T=0)),
    ("T=1", "bf16", "silu", dict(T=1)),
    ("T=1", "fp8_block", "silu", dict(T=1)),
    ("I=961", "bf16", "relu2", dict(I=961, H=320)),
    ("I=961", "fp16", "silu", dict(I=961, H=320)),
    ("one expert for all", "bf16", "silu", dict(T=64, edit_ids=_one_expert_for_all)),
    ("top_k=E", "bf16", "silu", dict(E=4, k=4)),
    ("-1 ids", "bf16", "swiglu_oai", dict(edit_ids=_minus_one)),
    ("grouped core", "bf16", "swiglu_oai", dict(force_permute=True)),
    ("grouped core", "fp8_block", "silu", dict(force_permute=True)),
    ("large-T align", "bf16", "silu", dict(T=1200, E=8, k=2)),
    ("E=256 k=8", "fp8_block", "silu", dict(T=20, E=256, k=8, H=256, I=128)),
    ("few rows", "bf16", "relu2", dict(T=3, I=961, H=320)),
    ("few rows E=256 k=8", "fp8_block", "silu", dict(T=2, E=256, k=8, I=128)),
] + [
    ("few rows", scheme, "swiglu_oai", dict(T=4, edit_ids=_minus_one))
    for scheme in ["bf16", "fp16", *TRITON_QUANT_SCHEMES]
]


def _run(backend, x, weights, act, wts, ids, force_permute=False):
    runner = moerunner.MoeRunner(backend, force_permute=force_permute)
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(StandardDispatchOutput(x, TopK(wts, ids)), prepared)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    ("scheme", "activation", "options"),
    [pytest.param(s, a, o, id=f"{c}-{s}-{a}") for c, s, a, o in CASES],
)
def test_edge_case_matches_torch_backend_and_reference(scheme, activation, options):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    T, H, I = (options.get(n, d) for n, d in (("T", 37), ("H", 256), ("I", 256)))
    E, k = options.get("E", 8), options.get("k", 2)
    dtype = torch.float16 if scheme == "fp16" else torch.bfloat16
    act = moerunner.Activation(activation)
    interleaved = activation == "swiglu_oai"
    n13 = 2 * I if act.gated else I
    w13 = torch.randn(E, n13, H, device=dev) / H**0.5
    w2 = torch.randn(E, H, I, device=dev) / I**0.5
    if scheme in ("bf16", "fp16"):
        w13, w2 = w13.to(dtype), w2.to(dtype)
    else:
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    b13 = torch.randn(E, n13, device=dev) * 0.1 if interleaved else None
    b2 = torch.randn(E, H, device=dev) * 0.1 if interleaved else None
    weights = ExpertWeights(w13, w2, b13, b2, interleaved)
    x = torch.randn(T, H, device=dev).to(dtype)
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(T, k, device=dev), dim=1)
    if "edit_ids" in options:
        ids = options["edit_ids"](ids).to(torch.int32)
    force = options.get("force_permute", False)
    out = _run("triton", x, weights, act, wts, ids, force)
    assert out.shape == x.shape
    if T == 0:
        return
    assert not torch.isnan(out).any()
    ref_torch = _run("torch", x, weights, act, wts, ids)
    ref = reference_moe(x, weights, wts, ids, act)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    tol_ref = 3e-2 if scheme in QUANT_ACT else tol
    assert _rel(out, ref_torch) <= tol
    assert _rel(out, ref) <= max(tol_ref, 1.5 * _rel(ref_torch, ref))
