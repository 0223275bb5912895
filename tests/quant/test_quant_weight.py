# QuantizedWeight: layouts, hand vectors per format, exact inverses on representable values,
# random round-trip bounds, padding, expert slicing, rebuilding from tensors, and errors.

import pytest
import torch

from moerunner.quant import (
    SCHEME_NAMES,
    QuantizedWeight,
    QuantScheme,
    codecs,
    dequantize,
    get_scheme,
    quantize,
)
from moerunner.quant.fp8 import expand_block_scale

QUANTIZED = [n for n in SCHEME_NAMES if get_scheme(n).is_quantized]


def static_kwargs(name: str) -> dict:
    return {"input_scale": torch.tensor(0.05)} if "static" in name else {}


def same_tensors(a: QuantizedWeight, b: QuantizedWeight) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for key in ta:
        x, y = ta[key], tb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        if x.dtype in (torch.float8_e4m3fn,):
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), key


# ---------------------------------------------------------------- hand vectors per format


def test_mxfp4_hand_vector():
    row = torch.zeros(32)
    row[:6] = torch.tensor([6.0, 5.0, 3.0, 0.75, -0.25, 7.0])
    # amax 7 -> floor(log2 7) - 2 = 0 -> code 127; 7 saturates to 6 (the OCP rule's clipping),
    # 5 ties to 4, 0.75 ties up to 1.0, -0.25 ties to -0 (code 8).
    qw = quantize(row.reshape(1, 1, 32), "mxfp4")
    assert qw.scale.tolist() == [[[127]]]
    codes = codecs.unpack_nibbles(qw.data)[0, 0, :6].tolist()
    assert codes == [7, 6, 5, 2, 8, 7]
    assert qw.dequantize()[0, 0, :6].tolist() == [6.0, 4.0, 3.0, 1.0, -0.0, 6.0]
    # Same block times 2^-3: the scale code drops by 3, the codes stay.
    qw2 = quantize(row.reshape(1, 1, 32) / 8, "mxfp4")
    assert qw2.scale.tolist() == [[[124]]] and torch.equal(qw2.data, qw.data)


def test_mxfp8_hand_vector_and_nan_scale():
    x = torch.zeros(1, 1, 64)
    x[0, 0, 0], x[0, 0, 1] = 1.0, 0.3  # block 0: amax 1 -> code 119 (2^-8)
    x[0, 0, 32], x[0, 0, 33] = 500.0, float("nan")  # block 1: NaN -> scale 0xFF
    qw = quantize(x, "mxfp8")
    assert qw.scale.tolist() == [[[119, 255]]]
    d = qw.dequantize()
    # 0.3 * 256 = 76.8 lies in [64, 128) where e4m3 spacing is 8 -> 80 -> 80 / 256.
    assert d[0, 0, 0].item() == 1.0 and d[0, 0, 1].item() == 80 / 256
    assert torch.isnan(d[0, 0, 32:]).all() and not torch.isnan(d[0, 0, :32]).any()


def test_mxfp8_saturates_values_above_448_times_scale():
    x = torch.zeros(1, 1, 32)
    x[0, 0, 0] = 500.0  # floor(log2 500) = 8 -> scale 1 -> 500 clips to 448
    assert quantize(x, "mxfp8").dequantize()[0, 0, 0].item() == 448.0


def test_nvfp4_hand_vector():
    x = torch.zeros(1, 1, 32)
    x[0, 0, :4] = torch.tensor([6.0, 3.0, -1.0, 0.5])
    x[0, 0, 16] = 1.5  # second block: amax 1.5
    qw = quantize(x, "nvfp4")
    gs = qw.global_scale.item()
    assert gs == torch.tensor(6.0 / 2688.0).item()
    # block 0: (6 / 6) / gs = 448 -> e4m3 0x7E; block 1: (1.5 / 6) / gs = 112 = 1.75 * 2^6 -> 0x6E.
    assert qw.scale.view(torch.uint8)[0, 0].tolist() == [0x7E, 0x6E]
    assert codecs.unpack_nibbles(qw.data)[0, 0, :4].tolist() == [7, 5, 10, 1]
    torch.testing.assert_close(qw.dequantize(), x, rtol=1e-6, atol=0)


def test_fp8_block_ceil_grid_partial_blocks():
    torch.manual_seed(0)
    w = torch.randn(2, 130, 200)
    qw = quantize(w, "fp8_block")
    assert qw.scale.shape == (2, 2, 2)
    # The partial block (rows 128..129, cols 128..199) is scaled by its own amax.
    assert qw.scale[1, 1, 1].item() == pytest.approx(w[1, 128:, 128:].abs().max().item() / 448)
    full = expand_block_scale(qw.scale, 128, 128, 130, 200)
    assert torch.equal(qw.dequantize(), qw.data.float() * full)


def test_int4_symmetric_and_zero_point_vectors():
    g = torch.zeros(1, 1, 32)
    g[0, 0, :4] = torch.tensor([7.0, -7.0, 3.5, 2.5])  # scale 1: 3.5 -> 4, 2.5 -> 2 (even)
    qw = quantize(g, "int4_g32")
    assert qw.scale.tolist() == [[[1.0]]] and qw.zero_point is None
    assert codecs.unpack_nibbles(qw.data)[0, 0, :4].tolist() == [15, 1, 12, 10]
    z = torch.zeros(1, 1, 32)
    z[0, 0, :2] = torch.tensor([-3.0, 12.0])  # range [-3, 12]: scale 1, zero 3
    qz = quantize(z, "int4_g32_zp")
    assert qz.scale.tolist() == [[[1.0]]] and qz.zero_point.tolist() == [[[3]]]
    assert codecs.unpack_nibbles(qz.data)[0, 0, :3].tolist() == [0, 15, 3]
    assert torch.equal(qz.dequantize(), z)


# ---------------------------------------------------- exact inverse on representable values


def representable(name: str, e: int = 2, n: int = 128, k: int = 256) -> QuantizedWeight:
    """A random weight whose dequantized value quantizes back to exactly the same tensors:
    power-of-two (or e4m3) scales, and every scale group holds an element at its maximum."""
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    s = get_scheme(name)

    def pow2(*shape: int) -> torch.Tensor:
        return torch.pow(2.0, torch.randint(-6, 4, shape, generator=gen).float())

    def e4m3_vals(*shape: int, lim: float = 448.0) -> torch.Tensor:
        return codecs.encode_e4m3((torch.rand(shape, generator=gen) * 2 - 1) * lim)

    def mark_max(vals: torch.Tensor, group_rows: int, group_cols: int, top: float) -> None:
        vals[..., ::group_rows, ::group_cols] = top  # first element of every group at max

    extra = {"input_scale": torch.full((e,), 0.05)} if "static" in name else {}
    if s.weight_format == "e4m3":
        v = e4m3_vals(e, n, k).float()
        if s.scale_format == "e8m0":
            mark_max(v, 1, 32, 448.0)
            codes = torch.randint(100, 150, (e, n, k // 32), generator=gen, dtype=torch.uint8)
            return QuantizedWeight(s, (e, n, k), codecs.encode_e4m3(v), codes)
        if s.granularity == "tensor":
            mark_max(v, n, k, -448.0)
            return QuantizedWeight(s, (e, n, k), codecs.encode_e4m3(v), pow2(e), **extra)
        if s.granularity == "channel":
            mark_max(v, 1, k, 448.0)
            return QuantizedWeight(s, (e, n, k), codecs.encode_e4m3(v), pow2(e, n))
        bn, bk = s.block_shape
        mark_max(v, bn, bk, 448.0)
        return QuantizedWeight(s, (e, n, k), codecs.encode_e4m3(v), pow2(e, n // bn, k // bk))
    if s.weight_format == "e2m1":
        c = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
        g = s.block_shape[1]
        c[..., ::g] = 7  # +6 in every group
        data = codecs.pack_nibbles(c)
        if s.scale_format == "e8m0":
            codes = torch.randint(100, 150, (e, n, k // 32), generator=gen, dtype=torch.uint8)
            return QuantizedWeight(s, (e, n, k), data, codes)
        bscale = e4m3_vals(e, n, k // 16).float().abs().clamp(min=0.125)
        bscale[:, 0, 0] = 448.0  # the expert's largest block sets the global scale
        return QuantizedWeight(
            s, (e, n, k), data, codecs.encode_e4m3(bscale), global_scale=pow2(e), **extra
        )
    if s.weight_format == "int8" and s.granularity == "group":
        g = s.block_shape[1]
        q = torch.randint(-127, 128, (e, n, k), generator=gen, dtype=torch.int8)
        if not s.zero_point:
            q[..., ::g] = 127
            return QuantizedWeight(s, (e, n, k), q, pow2(e, n, k // g))
        q[..., ::g], q[..., 1::g] = -128, 127  # each group spans the whole range
        zero = torch.randint(-128, 128, (e, n, k // g), generator=gen, dtype=torch.int8)
        return QuantizedWeight(s, (e, n, k), q, pow2(e, n, k // g), None, zero)
    if s.weight_format == "int8":
        q = torch.randint(-127, 128, (e, n, k), generator=gen, dtype=torch.int8)
        q[..., ::k] = 127
        return QuantizedWeight(s, (e, n, k), q, pow2(e, n), **extra)
    g = s.block_shape[1]
    q = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
    if s.zero_point:
        q[..., ::g], q[..., 1::g] = 0, 15
        zero = torch.randint(0, 16, (e, n, k // g), generator=gen, dtype=torch.uint8)
        return QuantizedWeight(s, (e, n, k), codecs.pack_nibbles(q), pow2(e, n, k // g), None, zero)
    q = q.clamp(min=1)
    q[..., ::g] = 15  # +7
    return QuantizedWeight(s, (e, n, k), codecs.pack_nibbles(q), pow2(e, n, k // g))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantize_inverts_dequantize_on_representable_values(name):
    qw = representable(name)
    again = quantize(qw.dequantize(), name, **static_kwargs(name))
    same_tensors(again, qw)
    assert torch.equal(again.dequantize(), qw.dequantize())


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantizing_a_transposed_view_gives_contiguous_tensors(name):
    """A weight stored [E, K, N] and quantized through its transposed view (GPT-OSS's
    experts) gives the same values as its contiguous copy, in contiguous tensors: the codes
    kept the view's strides, which safetensors' ``save_file`` refuses."""
    stored = torch.randn(2, 128, 48)
    view = stored.transpose(1, 2)  # [E, N = 48, K = 128]
    qw = quantize(view, name, **static_kwargs(name))
    for field, tensor in qw.tensors().items():
        assert tensor.is_contiguous(), field
    same_tensors(qw, quantize(view.contiguous(), name, **static_kwargs(name)))


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_unquantized_schemes_cast(name):
    w = torch.randn(2, 4, 8)
    qw = quantize(w, name)
    assert qw.data.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, torch.float32)
    assert torch.equal(dequantize(qw), w.to(qw.data.dtype).float())
    assert not qw.scheme.is_quantized


# ----------------------------------------------------------------- random round-trip bounds


def element_step(qw: QuantizedWeight) -> torch.Tensor:
    """Per-element multiplier of one unit of the element format (the scale it is stored at)."""
    e, n, k = qw.shape
    s = qw.scheme
    if s.granularity == "tensor":
        return qw.scale[:, None, None].expand(e, n, k)
    if s.granularity == "channel":
        return qw.scale[:, :, None].expand(e, n, k)
    if s.granularity == "block":
        return expand_block_scale(qw.scale, *s.block_shape, n, k)
    g = s.block_shape[1]
    if s.scale_format == "e8m0":
        per_group = codecs.decode_e8m0(qw.scale)
    elif s.scale_format == "e4m3":
        per_group = qw.scale.float() * qw.global_scale[:, None, None]
    else:
        per_group = qw.scale
    return per_group.repeat_interleave(g, dim=-1)


def roundtrip_bound(name: str, w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Largest |dequantize(quantize(w)) - w| the format allows, per element.

    e4m3: half an ulp is 2^-4 of |w| for normals (3 mantissa bits) and 2^-10 * step in the
    subnormal range (spacing 2^-9); MX blocks may also clip |w| above 448 * step (the OCP rule
    takes floor(log2 amax)). e2m1: spacing is at most half the value above 1 and 0.5 below,
    so half a step is <= 0.25 |w| or 0.25 * step; values above 6 * step clip (MX floor rule,
    or an NVFP4 block scale rounded down in e4m3). int8/int4: half a step. A 1e-6 relative
    slack covers the float32 division by the scale.
    """
    s = get_scheme(name)
    a = w.abs()
    if s.weight_format == "e4m3":
        bound = torch.maximum(a * 2**-4, step * 2**-10)
        bound = torch.maximum(bound, a - 448 * step)
    elif s.weight_format == "e2m1":
        bound = torch.maximum(a * 0.25, step * 0.25)
        bound = torch.maximum(bound, a - 6 * step)
    else:
        bound = step * 0.5
    return bound * (1 + 1e-6) + 1e-30


@pytest.mark.parametrize("name", QUANTIZED)
def test_random_roundtrip_within_format_bound(name):
    torch.manual_seed(1)
    # Rows spanning 8 orders of magnitude exercise subnormals, clipping and zero-ish blocks.
    w = torch.randn(3, 128, 256) * torch.logspace(-4, 4, 128)[None, :, None]
    w[0, 0] = 0.0
    qw = quantize(w, name, **static_kwargs(name))
    err = (qw.dequantize() - w).abs()
    bound = roundtrip_bound(name, w, element_step(qw))
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), f"{name}: worst at {worst}: {err.flatten()[worst]}"
    assert torch.equal(qw.dequantize()[0, 0], torch.zeros(256))


# ---------------------------------------------------------------------------- padding


def zero_pad(w: torch.Tensor, segments: int, rows: int, k: int) -> torch.Tensor:
    e, n, k0 = w.shape
    out = torch.zeros(e, segments, rows, k)
    out[:, :, : n // segments, :k0] = w.reshape(e, segments, n // segments, k0)
    return out.reshape(e, segments * rows, k)


@pytest.mark.parametrize("name", QUANTIZED)
def test_pad_equals_quantizing_zero_padded_weight(name):
    torch.manual_seed(2)
    if get_scheme(name).granularity == "block":
        w, rows, k = torch.randn(2, 256, 200), 256, 300  # block-aligned halves, partial K block
    else:
        w, rows, k = torch.randn(2, 24, 128), 16, 256  # I = 12 per half -> 16, as seed 004
    padded = quantize(w, name, **static_kwargs(name)).pad(rows_per_segment=rows, k=k, segments=2)
    assert padded.shape == (2, 2 * rows, k)
    same_tensors(padded, quantize(zero_pad(w, 2, rows, k), name, **static_kwargs(name)))


def test_pad_fp8_tensor_odd_intermediate_size():
    # Seed 004: I = 961 per rank, padded to 976 with gate and up halves padded separately.
    w13 = torch.randn(1, 2 * 961, 32)
    q = quantize(w13, "fp8_tensor").pad(rows_per_segment=976, segments=2)
    d = q.dequantize()
    ref = quantize(w13, "fp8_tensor").dequantize()
    assert torch.equal(d[:, :961], ref[:, :961]) and torch.equal(d[:, 976:1937], ref[:, 961:])
    assert not d[:, 961:976].any() and not d[:, 1937:].any()


def test_pad_rejects_what_the_format_cannot_express():
    qw = quantize(torch.randn(1, 200, 64), "fp8_block")
    with pytest.raises(ValueError, match="rows_per_segment"):
        qw.pad(rows_per_segment=128, segments=2)  # halves of 100 rows straddle a block
    with pytest.raises(ValueError, match="k: .*multiple of its group size 32"):
        quantize(torch.randn(1, 2, 64), "mxfp4").pad(k=80)
    with pytest.raises(ValueError, match="segments"):
        qw.pad(segments=3)
    with pytest.raises(ValueError, match="rows_per_segment must be an int >="):
        qw.pad(rows_per_segment=10, segments=2)


# -------------------------------------------------------- slicing, devices, rebuild, rows


@pytest.mark.parametrize("name", ["fp8_block", "mxfp4", "nvfp4_a4_static", "int4_zp"])
def test_narrow_experts_and_rebuild_from_tensors(name):
    w = torch.randn(4, 128, 128)
    qw = quantize(w, name, **static_kwargs(name))
    part = qw.narrow_experts(1, 2)
    assert part.num_experts == 2 and part.shape == (2, 128, 128)
    assert torch.equal(part.dequantize(), qw.dequantize()[1:3])
    rebuilt = QuantizedWeight.from_tensors(qw.scheme.name, list(qw.shape), qw.tensors())
    same_tensors(rebuilt, qw)
    flat = QuantizedWeight.from_tensors(qw.scheme, qw.shape, qw.flat_tensors())
    same_tensors(flat, qw)
    same_tensors(qw.to("cpu"), qw)
    with pytest.raises(ValueError, match="start/length"):
        qw.narrow_experts(3, 2)


def test_select_rows_reorders_per_row_formats_only():
    w = torch.randn(2, 64, 64)
    index = torch.arange(63, -1, -1)
    for name in ("mxfp4", "fp8_channel", "int4_g32_zp", "nvfp4"):
        qw = quantize(w, name)
        assert torch.equal(qw.select_rows(index).dequantize(), qw.dequantize()[:, index])
    with pytest.raises(ValueError, match="index: scheme 'fp8_block'"):
        quantize(w, "fp8_block").select_rows(index)


def test_empty_weights_quantize():
    for name in QUANTIZED:
        qw = quantize(torch.zeros(0, 64, 128), name, **static_kwargs(name))
        assert qw.dequantize().shape == (0, 64, 128)


# ------------------------------------------------------------------------------- errors


def test_quantize_rejects_k_not_multiple_of_group():
    with pytest.raises(ValueError, match="shape: K=48 must be a multiple of the group size 32"):
        quantize(torch.randn(1, 4, 48), "mxfp4")
    with pytest.raises(ValueError, match="group size 128"):
        quantize(torch.randn(1, 4, 64), "int4")
    with pytest.raises(ValueError, match="group size 16"):
        quantize(torch.randn(1, 4, 40), "nvfp4")


def test_quantize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp9'.*fp8_block"):
        quantize(torch.randn(1, 4, 32), "fp9")
    with pytest.raises(ValueError, match=r"weight must be \[E, N, K\]"):
        quantize(torch.randn(4, 32), "fp8_tensor")
    with pytest.raises(TypeError, match="weight must be bf16"):
        quantize(torch.ones(1, 4, 32, dtype=torch.int32), "fp8_tensor")
    with pytest.raises(ValueError, match="input_scale: scheme 'mxfp4'"):
        quantize(torch.randn(1, 4, 32), "mxfp4", input_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="input_scale: scheme 'fp8_tensor_static' needs"):
        quantize(torch.randn(1, 4, 32), "fp8_tensor_static")


def test_inconsistent_tensors_name_the_field():
    qw = quantize(torch.randn(2, 64, 64), "mxfp4")
    with pytest.raises(
        ValueError, match=r"scale: scheme 'mxfp4' .* needs torch.uint8 \[2, 64, 2\]"
    ):
        QuantizedWeight("mxfp4", (2, 64, 64), qw.data, qw.scale[:, :, :1])
    with pytest.raises(ValueError, match="data: scheme 'mxfp4'"):
        QuantizedWeight("mxfp4", (2, 64, 64), qw.data.view(torch.int8), qw.scale)
    with pytest.raises(ValueError, match="scale: scheme 'mxfp4' .* got None"):
        QuantizedWeight("mxfp4", (2, 64, 64), qw.data)
    with pytest.raises(ValueError, match="zero_point: scheme 'mxfp4' has no zero_point"):
        QuantizedWeight("mxfp4", (2, 64, 64), qw.data, qw.scale, zero_point=qw.scale)
    with pytest.raises(ValueError, match="shape must be three"):
        QuantizedWeight("mxfp4", (2, 64), qw.data, qw.scale)
    with pytest.raises(ValueError, match="tensors: unknown field"):
        QuantizedWeight.from_tensors("mxfp4", (2, 64, 64), {"data": qw.data, "scales": qw.scale})
    with pytest.raises(TypeError, match="qweight must be"):
        dequantize("mxfp4")


def test_custom_scheme_without_codec_is_rejected():
    odd = QuantScheme("odd", "e2m1", "e8m0", "group", (1, 64))
    with pytest.raises(ValueError, match="scheme: no codec"):
        quantize(torch.randn(1, 2, 64), odd)


def test_zero_points_outside_the_codes_are_refused():
    # Was accepted: a uint8 int4 zero point of 200 (the codes mean 0..15) shifted its whole
    # group by ~190 steps. Checked where the scales are (construction, from_tensors).
    qw = quantize(torch.randn(2, 8, 64), "int4_g32_zp")
    for value in (0, 15):  # the ends of the range are zero points
        zp = qw.zero_point.clone()
        zp[1, 2, 1] = value
        QuantizedWeight(qw.scheme, qw.shape, qw.data, qw.scale, zero_point=zp)
    for value in (16, 200):
        zp = qw.zero_point.clone()
        zp[1, 2, 1] = value
        match = (
            rf"zero_point: .*'int4_g32_zp' must lie in \[0, 15\].*got {value} at index \[1, 2, 1\]"
        )
        with pytest.raises(ValueError, match=match):
            QuantizedWeight(qw.scheme, qw.shape, qw.data, qw.scale, zero_point=zp)
        with pytest.raises(ValueError, match=match):
            QuantizedWeight.from_tensors(qw.scheme, qw.shape, {**qw.tensors(), "zero_point": zp})
    # As for scales, check_values=False (moved copies, to_empty) reads no values.
    QuantizedWeight(qw.scheme, qw.shape, qw.data, qw.scale, zero_point=zp, check_values=False)
