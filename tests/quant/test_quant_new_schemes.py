# The schemes added as one registry entry each: fp8 with other block shapes, group-wise int8.
# Hand-computed quantize / dequantize vectors, layouts, padding, activations.

import pytest
import torch

from moerunner.quant import (
    SCHEME_NAMES,
    QuantScheme,
    dequantize,
    fake_quantize_activation,
    get_scheme,
    quantize,
    quantize_activation,
)
from moerunner.quant.schemes import registered_name

FP8_BLOCKS = {"fp8_block_64x64": (64, 64), "fp8_block_64x128": (64, 128)}
FP8_BLOCKS["fp8_block_128x64"] = (128, 64)
INT8_GROUPS = {"int8_g64": (64, False), "int8_g128": (128, False)}
INT8_GROUPS |= {"int8_g64_zp": (64, True), "int8_g128_zp": (128, True)}


def test_new_names_are_registered_with_their_fields():
    assert set(FP8_BLOCKS) | set(INT8_GROUPS) <= set(SCHEME_NAMES)
    for name, shape in FP8_BLOCKS.items():
        s = get_scheme(name)
        assert (s.family, s.granularity, s.block_shape) == ("fp8", "block", shape)
        assert s.activation_group_size == shape[1]
    # A 128-wide K block groups activations per 128: one format, whatever it is called.
    assert get_scheme("fp8_block_64x128").activation_format == "fp8_group128"
    assert get_scheme("fp8_block_64x64").activation_format == "fp8_group"
    for name, (g, zp) in INT8_GROUPS.items():
        s = get_scheme(name)
        assert (s.family, s.group_size, s.zero_point, s.activation_format) == (
            "int8",
            g,
            zp,
            "none",
        )
    # Parametrised names resolve to the same values; a registered format keeps its name.
    assert get_scheme("fp8_block_128x128").same_format(get_scheme("fp8_block"))
    assert registered_name(get_scheme("fp8_block_128x128")) == "fp8_block"
    assert get_scheme("int8_g32_zp").group_size == 32


def test_fp8_group_needs_weight_blocks():
    with pytest.raises(ValueError, match="fp8_group"):
        QuantScheme("x", "e4m3", "fp32", "channel", activation_format="fp8_group")
    with pytest.raises(ValueError, match="zero_point"):
        QuantScheme("x", "int8", "fp32", "channel", zero_point=True)


def test_fp8_64x64_block_hand_vector():
    w = torch.zeros(1, 96, 128)  # 2 x 2 blocks, the last block row partial (32 rows)
    w[0, 0, 0] = 896.0  # block (0, 0): amax 896 -> scale 2
    w[0, 1, 1] = 3.0  # 3 / 2 = 1.5, exact in e4m3
    w[0, 70, 64] = -0.25  # block (1, 1): amax 0.25 -> scale 0.25 / 448
    qw = quantize(w, "fp8_block_64x64")
    assert qw.scale.shape == (1, 2, 2)
    expected = torch.tensor([[[2.0, 1.0], [1.0, 0.25 / 448]]])
    assert torch.equal(qw.scale, expected)
    assert qw.data[0, 0, 0].float() == 448 and qw.data[0, 1, 1].float() == 1.5
    assert qw.data[0, 70, 64].float() == -448
    back = dequantize(qw)
    assert back[0, 0, 0] == 896 and back[0, 1, 1] == 3.0
    assert torch.equal(back[0, 70, 64], torch.tensor(-448 * (0.25 / 448)))


def test_fp8_128x64_block_rows_and_columns():
    w = torch.randn(2, 256, 192)
    qw = quantize(w, "fp8_block_128x64")
    assert qw.scale.shape == (2, 2, 3)
    # Each scale is amax / 448 of its 128 x 64 block.
    amax = w[1, 128:256, 64:128].abs().max()
    assert torch.equal(qw.scale[1, 1, 1], amax / 448)
    err = (dequantize(qw) - w).abs()
    assert bool((err <= w.abs() * 2**-4 + 2**-10 * qw.scale.amax()).all())


def test_fp8_group_activation_hand_vector():
    x = torch.zeros(1, 128)
    x[0, 3] = 2.0  # group 0 (64 columns): scale 2 / 448
    x[0, 100] = -0.5  # group 1: scale 0.5 / 448
    qx = quantize_activation(x, "fp8_block_64x64")
    assert torch.equal(qx.scale, torch.tensor([[2.0 / 448, 0.5 / 448]]))
    assert qx.data[0, 3].float() == 448 and qx.data[0, 100].float() == -448
    # With 128-wide K blocks the activations are grouped per 128: one scale for the row.
    assert quantize_activation(x, "fp8_block_64x128").scale.shape == (1, 1)
    fq = fake_quantize_activation(x, "fp8_block_128x64")
    assert fq[0, 3] == 2.0 and fq[0, 100] == -0.5


def test_int8_group_symmetric_hand_vector():
    # Group 0 has amax 63.5 -> scale 0.5 exactly; group 1 is zeros -> scale 1, q 0.
    w = torch.tensor([[[63.5, -1.25, 0.75, 10.0, 0.0, 0.0, 0.0, 0.0]]])
    qw = quantize(w, "int8_g4")
    assert qw.data.dtype == torch.int8 and qw.zero_point is None
    assert qw.data.tolist() == [[[127, -2, 2, 20, 0, 0, 0, 0]]]  # -2.5 -> -2, 1.5 -> 2 (even)
    assert qw.scale.tolist() == [[[0.5, 1.0]]]
    assert dequantize(qw).tolist() == [[[63.5, -1.0, 1.0, 10.0, 0.0, 0.0, 0.0, 0.0]]]


def test_int8_group_zero_point_hand_vector():
    # Group range [-16, 47.75] maps onto [-128, 127]: scale 63.75 / 255 = 0.25, zero
    # round(16 / 0.25) - 128 = -64; q = round(x / s) + z.
    w = torch.tensor([[[-16.0, 47.75, 1.3, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    qw = quantize(w, "int8_g4_zp")
    assert qw.zero_point.dtype == torch.int8
    assert qw.scale.tolist() == [[[0.25, 1.0]]]
    assert qw.zero_point.tolist() == [[[-64, -128]]]  # zeros: range [0, 0] -> zero -128
    assert qw.data.tolist() == [[[-128, 127, -59, -64, -128, -128, -128, -128]]]
    assert dequantize(qw).tolist() == [[[-16.0, 47.75, 1.25, 0.0, 0.0, 0.0, 0.0, 0.0]]]


@pytest.mark.parametrize("name", sorted(INT8_GROUPS))
def test_int8_group_round_trip_bound_and_padding(name):
    torch.manual_seed(0)
    w = torch.randn(2, 6, 256)
    qw = quantize(w, name)
    g = qw.scheme.group_size
    err = (dequantize(qw) - w).abs().reshape(2, 6, -1, g)
    assert bool((err <= qw.scale[..., None] / 2 + 1e-7).all())
    # Padding stores what quantizing zeros stores.
    padded = qw.pad(rows_per_segment=4, k=384, segments=2)
    zero_padded = torch.nn.functional.pad(w.reshape(2, 2, 3, 256), (0, 128, 0, 1))
    ref_w = quantize(zero_padded.reshape(2, 8, 384), name)
    for field, t in padded.tensors().items():
        assert torch.equal(t, getattr(ref_w, field)), field
    with pytest.raises(ValueError, match="multiple of its group size"):
        qw.pad(k=256 + g // 2)


@pytest.mark.parametrize("name", sorted(FP8_BLOCKS))
def test_fp8_block_padding_matches_quantizing_zeros(name):
    bn, bk = FP8_BLOCKS[name]
    w = torch.randn(1, 2 * bn, 2 * bk)
    padded = quantize(w, name).pad(k=3 * bk)
    ref = quantize(torch.nn.functional.pad(w, (0, bk)), name)
    assert torch.equal(padded.scale, ref.scale)
    assert torch.equal(padded.data.view(torch.uint8), ref.data.view(torch.uint8))
