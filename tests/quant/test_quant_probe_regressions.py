"""Regressions of a probe of the quantized paths as a user meets them (float64 references).

- A weight quantized with a static activation scale (``quantize(w, "fp8_tensor",
  input_scale=...)``) ran on the triton backend with dynamic per-token scales: the torch
  backend used the static scale, so the same weights gave different results by backend
  (0.25-0.56 apart at this size). Backends now declare whether they use a weight's
  ``input_scale`` (``Capabilities.static_input_scales``); triton declines such weights.
- A ``load_state_dict`` refused for its scale values had already copied them into the held
  buffers, which the layer's quantized weights share: every later call returned NaN.
- ``quantize`` of an ``nn.Parameter`` kept an autograd graph (float temporaries of the whole
  weight, and the parameter, alive as long as the result).
- ``MoE.quantize_`` could not make the static schemes (it took no input scales).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import moerunner
from moerunner import MoeInputError
from moerunner.errors import BackendUnavailableError
from moerunner.quant import quantize
from moerunner.testing import assert_close

E, H, I, K, T = 4, 64, 32, 2, 5
E4M3_MAX = 448.0


def _fp8_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 fake quantization of activations to e4m3 with one static scale."""
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.double() * scale


def _static_reference(x, q13, q2, topk) -> torch.Tensor:
    """float64 MoE with per-tensor fp8 weights (data x scale) and static fp8 inputs."""
    w13 = q13.data.double() * q13.scale.double()[:, None, None]
    w2 = q2.data.double() * q2.scale.double()[:, None, None]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(topk.ids[t, j])
            h = w13[e] @ _fp8_static(x[t].double(), float(q13.input_scale[e]))
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            y = w2[e] @ _fp8_static(a, float(q2.input_scale[e]))
            out[t] += float(topk.weights[t, j]) * y
    return out


def test_a_static_input_scale_is_used_or_the_backend_declines():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    scales = torch.arange(1, E + 1, dtype=torch.float32)
    q13 = quantize(torch.randn(E, 2 * I, H, generator=g) * H**-0.5, "fp8_tensor",
                   input_scale=0.01 * scales)  # fmt: skip
    q2 = quantize(torch.randn(E, H, I, generator=g) * I**-0.5, "fp8_tensor",
                  input_scale=0.005 * scales)  # fmt: skip
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    ref = _static_reference(x, q13, q2, topk)
    with pytest.raises(BackendUnavailableError, match="static activation scales"):
        moerunner.fused_moe(x, q13, q2, topk.weights, topk.ids, backend="triton")
    for backend in ("torch", "auto"):
        out = moerunner.fused_moe(x, q13, q2, topk.weights, topk.ids, backend=backend)
        # fp32 arithmetic on the same e4m3 codes; an input code may differ by one step where
        # fp32 and fp64 round x / scale differently: well under the 0.25 of dynamic scales
        assert_close(out, ref, 2e-3, what=backend)


@pytest.mark.parametrize("scheme, key", [("fp8_block", "w13_scale"), ("int4_g32", "w13_scale"),
                                         ("nvfp4", "w13_global_scale")])  # fmt: skip
def test_a_refused_load_leaves_the_layer_as_it_was(scheme, key):
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    layer = moerunner.MoE(cfg, backend="torch").quantize_(scheme)
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    with torch.no_grad():
        before = layer(x, logits)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state[key][0] = float("nan")
    with pytest.raises(MoeInputError, match=f"{key}: scales must be finite"):
        layer.load_state_dict(state)
    assert torch.isfinite(getattr(layer, key).float()).all()
    with torch.no_grad():
        assert torch.equal(layer(x, logits), before)


@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_tensor", "mxfp8", "bf16"])
def test_quantizing_a_parameter_keeps_no_graph(scheme):
    param = nn.Parameter(torch.randn(E, 2 * I, H) * 0.05)
    q = quantize(param, scheme)
    for name, t in q.tensors().items():
        assert not t.requires_grad and t.grad_fn is None, name
    gone = weakref.ref(param)
    del param
    gc.collect()
    assert gone() is None  # (the graph held the parameter)
    assert q.data.shape[0] == E


def test_a_layer_quantizes_to_a_static_scheme_with_its_input_scales():
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    layer = moerunner.MoE(cfg, backend="torch")
    with pytest.raises(MoeInputError, match="pass w2_input_scale"):
        layer.quantize_("fp8_tensor_static", w13_input_scale=0.01)
    s13 = 0.01 * torch.arange(1, E + 1, dtype=torch.float32)
    layer.quantize_("fp8_tensor_static", keep_float_weights=True, w13_input_scale=s13,
                    w2_input_scale=0.004)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    with torch.no_grad():
        out = layer(x, topk=topk)
        q = layer.quantized
        assert_close(out, _static_reference(x, q.w13, q.w2, topk), 2e-3)
        layer.w13.mul_(0.5)  # an edit: quantized again, with the same static scales
        out = layer(x, topk=topk)
    q = layer.quantized
    assert torch.equal(q.w2.input_scale, torch.full((E,), 0.004))
    assert_close(out, _static_reference(x, q.w13, q.w2, topk), 2e-3)


def test_quantized_weight_methods_name_bad_arguments():
    q = quantize(torch.randn(3, 64, 64), "mxfp4")
    with pytest.raises(TypeError, match="start and length must be ints, got bool"):
        q.narrow_experts(True, 1)  # (torch's narrow raised its own TypeError)
    with pytest.raises(ValueError, match=r"row numbers must be in \[0, 64\).*got 0 .. 70"):
        q.select_rows(torch.tensor([0, 70]))  # (an internal index_select RuntimeError)
    with pytest.raises(TypeError, match="takes a device, got the dtype torch.float16"):
        q.to(torch.float16)  # (blamed the data's dtype)
    assert q.select_rows(torch.tensor([1, 0])).shape == (3, 2, 64)


def test_a_finite_weight_whose_zero_point_range_overflows_is_named_as_such():
    w = (torch.rand(1, 8, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1) * 3e38
    assert torch.isfinite(w).all()
    with pytest.raises(ValueError, match="range overflows float32"):  # (blamed NaN / Inf)
        quantize(w, "int8_g64_zp")


def test_the_argument_memo_tells_a_static_input_scale_apart():
    """``fused_moe`` memoises its argument checks and problem by the arguments' signature;
    a weight with a static scale after one without (same shapes and scheme) was served the
    first one's problem, and triton ran it with per-token scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5, torch.randn(E, H, I, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    dynamic = (quantize(w13, "fp8_tensor"), quantize(w2 * I**-0.5, "fp8_tensor"))
    moerunner.fused_moe(x, *dynamic, topk.weights, topk.ids, backend="triton")
    q13 = quantize(w13, "fp8_tensor", input_scale=0.01)
    q2 = quantize(w2 * I**-0.5, "fp8_tensor", input_scale=0.005)
    with pytest.raises(BackendUnavailableError, match="static activation scales"):
        moerunner.fused_moe(x, q13, q2, topk.weights, topk.ids, backend="triton")


def test_fp8_block_segments_off_the_block_grid_pad_to_their_exact_values():
    """The docs said this raised; it pads, and the values are the zero-padded ones."""
    from moerunner.quant import dequantize

    q = quantize(torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(0)), "fp8_block")
    padded = q.pad(rows_per_segment=128, segments=2)  # two 64-row halves to 128 rows each
    want = torch.zeros(2, 256, 256)
    d = dequantize(q)
    want[:, :64], want[:, 128:192] = d[:, :64], d[:, 64:]
    assert torch.equal(dequantize(padded), want)


# -- a second probe (2026-12-06): integer rounding, float64 range ---------------------------


def _int_codes64(x: torch.Tensor, scale: float, zero: int, lo: int, hi: int) -> torch.Tensor:
    """The documented codes: round_half_even(x / s) + z, clamped, in float64."""
    return (torch.round(x.double() / scale) + zero).clamp(lo, hi)


def test_zero_point_codes_round_before_adding_the_zero_point():
    """The codes were round(x / s + z): ties broke by the parity of the sum (-62 for the
    documented -63 below), and a layer with int4 zero points was 1.2e-2 off the reference
    built on the documented rule."""
    from moerunner.quant import dequantize

    x = torch.tensor([[[-15.75, 48.0, 0.625, 0.0]]])  # s = 0.25, z = -65, 0.625 / s = 2.5
    q = quantize(x, "int8_g4_zp")
    want = _int_codes64(x, float(q.scale), int(q.zero_point), -128, 127)
    assert q.data.double().tolist() == want.tolist() == [[[-128.0, 127.0, -63.0, -65.0]]]
    x4 = torch.tensor([[[-1.0, 14.0, 2.5, 0.0]]])  # s = 1, z = 1: 2.5 -> round(2.5) + 1 = 3
    q4 = quantize(x4, "int4_g4_zp")
    assert dequantize(q4).tolist() == [[[-1.0, 14.0, 2.0, 0.0]]]


def test_symmetric_int4_keeps_the_half_step_bound():
    """round(x / s + 8) rounded the sum in float32 first: 1.4999999 with s = 1 became code
    10 (value 2.0, an error of 0.5000001 s) instead of 9."""
    from moerunner.quant import dequantize

    w = torch.zeros(1, 1, 32)
    w[0, 0, 0], w[0, 0, 1] = 7.0, 1.4999999
    q = quantize(w, "int4_g32")
    assert float(dequantize(q)[0, 0, 1]) == 1.0
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 64, 128, generator=g).bfloat16().float()  # bf16 values hit the ties
    for scheme in ("int4_g32", "int4_g32_zp", "int8_g32_zp"):
        q = quantize(w, scheme)
        s = q.scale.double().repeat_interleave(32, dim=-1)
        err = (dequantize(q).double() - w.double()).abs()
        # (+ float32 rounding of the dequantized product, up to 2^-24 of |w| and a half step)
        assert bool((err <= s / 2 * (1 + 2**-20) + 2**-23 * w.double().abs()).all()), scheme


def test_float64_weights_beyond_float32_range_are_refused():
    """mxfp4 stored the NaN scale for a finite float64 value of 1e39 (inf in float32), so
    the block dequantized to NaN; the other schemes' error named the scale."""
    w = torch.zeros(1, 1, 1024, dtype=torch.float64)
    w[0, 0, 0] = 1e39
    for scheme in ("mxfp4", "int8", "fp8_block"):
        with pytest.raises(ValueError, match="weight holds finite float64 values beyond"):
            quantize(w, scheme)


def test_input_scale_of_another_type_is_named():
    with pytest.raises(TypeError, match="input_scale must be a float"):
        quantize(torch.randn(2, 8, 16), "int8_static", input_scale="1")
