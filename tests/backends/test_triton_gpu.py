"""Triton backend on a CUDA GPU: every claimed scheme x activation, and CUDA-graph replay.

Skipped without CUDA (marker ``gpu``). The CPU interpreter suite is ``test_triton.py``;
``benchmarks/gpu_triton.py`` runs the larger matrix and the timings.
"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.routing import TopK
from moerunner.weights import ExpertWeights

pytestmark = pytest.mark.gpu

SCHEMES = ["bf16", "fp16", "fp8_tensor", "fp8_channel", "fp8_block", "int8", "int8_w8a16",
           "int4", "int4_g32_zp", "mxfp4", "mxfp4_mxfp8", "nvfp4", "mxfp8"]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "swiglu_oai", "relu2"]
QUANT_ACT = {"fp8_tensor", "fp8_channel", "fp8_block", "int8", "mxfp8", "mxfp4_mxfp8"}


def _run(backend, x, weights, act, wts, ids):
    runner = moerunner.MoeRunner(backend)
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(StandardDispatchOutput(x, TopK(wts, ids)), prepared)


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_activation_matches_torch_backend(scheme, activation):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    act = moerunner.Activation(activation)
    T, H, I, E, k = 33, 256, 256, 8, 2
    n13 = 2 * I if act.gated else I
    dtype = torch.float16 if scheme == "fp16" else torch.bfloat16
    w13 = torch.randn(E, n13, H, device=dev) / H**0.5
    w2 = torch.randn(E, H, I, device=dev) / I**0.5
    if scheme in ("bf16", "fp16"):
        w13, w2 = w13.to(dtype), w2.to(dtype)
    else:
        w13, w2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    interleaved = activation == "swiglu_oai"
    b13 = torch.randn(E, n13, device=dev) * 0.1
    b2 = torch.randn(E, H, device=dev) * 0.1
    weights = ExpertWeights(w13, w2, b13, b2, interleaved)
    x = torch.randn(T, H, device=dev).to(dtype)
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.int()
    ids[::3, 1] = -1
    wts = torch.rand(T, k, device=dev)
    out = _run("triton", x, weights, act, wts, ids)
    ref = _run("torch", x, weights, act, wts, ids)
    tol = 3e-2 if scheme in QUANT_ACT else (2e-2 if dtype == torch.bfloat16 else 5e-3)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < tol


def test_cuda_graph_capture_and_replay_of_decode_call():
    from moerunner.backends.triton import TritonBackend
    from moerunner.backends.triton.experts import fused_standard

    dev = torch.device("cuda")
    E, H, I, k, T = 16, 512, 256, 4, 8
    act = moerunner.Activation("silu")
    weights = ExpertWeights(torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.05,
                            torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.05)
    prepared = TritonBackend().prepare_weights(weights, weights.spec(act))
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices.int()
    wts = torch.rand(T, k, device=dev)
    fused_standard(x, wts, ids, prepared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_standard(x, wts, ids, prepared)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.rand(T, E, device=dev).topk(k, dim=1).indices.int())
        wts.copy_(torch.rand(T, k, device=dev))
        graph.replay()
        eager = fused_standard(x.clone(), wts.clone(), ids.clone(), prepared)
        assert torch.equal(out, eager)
