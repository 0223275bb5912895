# The schemes added as one registry entry each: fp8 with other block shapes.
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


def test_new_names_are_registered_with_their_fields():
    assert set(FP8_BLOCKS) <= set(SCHEME_NAMES)
    for name, shape in FP8_BLOCKS.items():
        s = get_scheme(name)
        assert (s.family, s.granularity, s.block_shape) == ("fp8", "block", shape)
        assert s.activation_group_size == shape[1]
    # A 128-wide K block groups activations per 128: one format, whatever it is called.
    assert get_scheme("fp8_block_64x128").activation_format == "fp8_group128"
    assert get_scheme("fp8_block_64x64").activation_format == "fp8_group"
    # Parametrised names resolve to the same values; a registered format keeps its name.
    assert get_scheme("fp8_block_128x128").same_format(get_scheme("fp8_block"))
    assert registered_name(get_scheme("fp8_block_128x128")) == "fp8_block"


def test_fp8_group_needs_weight_blocks():
    with pytest.raises(ValueError, match="fp8_group"):
        QuantScheme("x", "e4m3", "fp32", "channel", activation_format="fp8_group")


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


@pytest.mark.parametrize("name", sorted(FP8_BLOCKS))
def test_fp8_block_padding_matches_quantizing_zeros(name):
    bn, bk = FP8_BLOCKS[name]
    w = torch.randn(1, 2 * bn, 2 * bk)
    padded = quantize(w, name).pad(k=3 * bk)
    ref = quantize(torch.nn.functional.pad(w, (0, bk)), name)
    assert torch.equal(padded.scale, ref.scale)
    assert torch.equal(padded.data.view(torch.uint8), ref.data.view(torch.uint8))
