"""``MoE.from_weights`` layers hold their experts as module state, like ``MoE(config)`` layers.

They held the given weights as a plain attribute: ``state_dict()`` was empty (a save and load
between two such layers said "All keys matched" and changed nothing: outputs 0.57 apart),
``.half()`` left plain weights in fp32 (the next fp16 call raised), and loading a quantized
state advised ``quantize_``, which then failed. Checked against the float64 reference.
"""

from __future__ import annotations

import io

import pytest
import torch

import moerunner
from moerunner import ExpertWeights, MoE, reference_moe
from moerunner.quant import quantize
from moerunner.testing import DTYPE_BOUND, assert_close, error_bound

E, H, I, K, T = 4, 32, 16, 2, 6


def _plain(seed: int, bias: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    b13, b2 = (torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)) if bias else (
        None, None)  # fmt: skip
    return ExpertWeights(w13, w2, b13, b2)


def _inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g)
    return x, moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)


@pytest.mark.parametrize("bias", [False, True])
def test_plain_weights_are_the_layers_parameters(bias):
    weights = _plain(0, bias)
    layer = MoE.from_weights(weights, backend="torch")
    names = {"w13", "w2"} | ({"w13_bias", "w2_bias"} if bias else set())
    assert set(layer.state_dict()) == names
    assert layer.w13.data_ptr() == weights.w13.data_ptr()  # the given storage, not a copy
    x, topk = _inputs()
    ref = reference_moe(x, weights, topk.weights, topk.ids)
    with torch.no_grad():
        assert_close(layer(x, topk=topk), ref, DTYPE_BOUND[torch.float32])
    # a save and load into another such layer carries the experts
    other = MoE.from_weights(_plain(1, bias), backend="torch")
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))
    with torch.no_grad():
        assert_close(other(x, topk=topk), ref, DTYPE_BOUND[torch.float32])
    # .half() converts them, and the fp16 layer computes the fp16 result
    layer.half()
    assert layer.w13.dtype == torch.float16
    with torch.no_grad():
        out = layer(x.half(), topk=topk)
    assert out.dtype == torch.float16
    assert_close(out, ref, error_bound(torch.float16, False))


def test_quantized_weights_are_quantize_s_buffers():
    weights = _plain(0)
    q = ExpertWeights(quantize(weights.w13, "fp8_block"), quantize(weights.w2, "fp8_block"))
    layer = MoE.from_weights(q, backend="torch")
    assert {"w13_qdata", "w13_scale", "w13_scheme", "w2_qdata"} <= set(layer.state_dict())
    x, topk = _inputs()
    ref = reference_moe(x, q, topk.weights, topk.ids, "silu")  # the quantized weights' values
    with torch.no_grad():
        out = layer(x, topk=topk)
    # fp32 GEMMs on fp8 (1x128 group) activations, whose rounding the reference leaves out
    assert_close(out, ref, error_bound(torch.float32, True))
    # a quantized MoE(config) layer loads this state and computes the same
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    built = MoE(cfg, backend="torch").quantize_("fp8_block")
    built.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(built(x, topk=topk), out)
    # and a plain from_weights layer takes the advice the refused load gives
    plain = MoE.from_weights(_plain(2), backend="torch")
    with pytest.raises(moerunner.MoeInputError, match=r"quantize_\('fp8_block'\)"):
        plain.load_state_dict(layer.state_dict())
    plain.quantize_("fp8_block").load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(plain(x, topk=topk), out)


def test_up_then_gate_rows_become_gate_then_up_state():
    weights = _plain(0)
    half = weights.w13.shape[1] // 2
    swapped = torch.cat([weights.w13[:, half:], weights.w13[:, :half]], dim=1)
    layer = MoE.from_weights(ExpertWeights(swapped, weights.w2, w13_order="up_gate"),
                             backend="torch")  # fmt: skip
    assert torch.equal(layer.state_dict()["w13"], weights.w13)  # the state in gate-up order
    x, topk = _inputs()
    with torch.no_grad():
        out = layer(x, topk=topk)
    assert_close(out, reference_moe(x, weights, topk.weights, topk.ids), DTYPE_BOUND[torch.float32])
