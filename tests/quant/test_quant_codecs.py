# Bit-exact codec vectors, computed by hand from the format definitions.
#
# e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; max finite 448 = 0x7E; subnormals are
# multiples of 2^-9. e2m1: values 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), bit 3 is the sign.
# e8m0: code c means 2^(c - 127), 255 is NaN. MX shared exponent: floor(log2(amax)) - emax.

import math

import pytest
import torch

from moerunner.quant import codecs


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def e4m3_bytes(x: torch.Tensor) -> list[int]:
    return codecs.encode_e4m3(x).view(torch.uint8).tolist()


def test_e4m3_max_finite_and_saturation():
    # 448 = 1.75 * 2^8 -> exponent field 15, mantissa 110 -> 0x7E; beyond range saturates.
    assert e4m3_bytes(f32(448.0, 460.0, 1e9, float("inf"), -1e9)) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert torch.isnan(codecs.encode_e4m3(f32(float("nan"))).float()).all()


def test_e4m3_ties_to_even():
    # In [16, 32) the spacing is 2: 17 is halfway between 16 (mantissa 000) and 18 (001) -> 16;
    # 19 is halfway between 18 (001) and 20 (010) -> 20.
    assert codecs.encode_e4m3(f32(17.0, 19.0, -17.0)).float().tolist() == [16.0, 20.0, -16.0]
    # 1.0 is 0x38 (exponent 7, mantissa 0); 1.0625 is halfway to 1.125 -> 1.0.
    assert e4m3_bytes(f32(1.0, 1.0625)) == [0x38, 0x38]


def test_e4m3_subnormals_and_zero():
    tiny = 2.0**-9
    # 2^-9 is the smallest subnormal (0x01); 2^-10 ties between 0 and 2^-9 -> 0 (even);
    # 1.5 * 2^-9 ties between 2^-9 (mantissa 001) and 2^-8 (010) -> 2^-8 (0x02).
    assert e4m3_bytes(f32(tiny, tiny / 2, 1.5 * tiny, 0.0)) == [0x01, 0x00, 0x02, 0x00]
    assert e4m3_bytes(f32(-0.0)) == [0x80]


def test_e8m0_from_amax_follows_ocp_rule():
    amax = f32(1.0, 448.0, 511.0, 512.0, 3.0, 6.0, 7.9, 0.0, float("nan"), float("inf"))
    emax = [8, 8, 8, 8, 2, 2, 2, 8, 8, 8]
    got = [codecs.e8m0_from_amax(a.reshape(1), e).item() for a, e in zip(amax, emax, strict=True)]
    # 1.0: 0 - 8 + 127 = 119; 448 and 511: 8 - 8 + 127; 512: 9 - 8 + 127; 3 with e2m1:
    # floor(log2 3) = 1 -> 1 - 2 + 127 = 126 (a plain e8m0 cast would round 3 up to 4).
    assert got == [119, 127, 127, 128, 126, 127, 127, 0, 255, 255]


def test_e8m0_clamps_to_range():
    # 2^-140 -> shared exponent -148 clamps to -127 (code 0); 2^126 * 1.5 with emax 2 -> 124.
    small = codecs.e8m0_from_amax(f32(2.0**-140, 2.0**-149), 8)
    assert small.tolist() == [0, 0]
    assert codecs.e8m0_from_amax(f32(1.5 * 2.0**126), 2).tolist() == [124 + 127]
    assert codecs.e8m0_from_amax(f32(3.0e38), -127).tolist() == [254]


def test_decode_e8m0_exact_and_nan():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = codecs.decode_e8m0(codes)
    expected = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert got[:6].tolist() == expected
    assert math.isnan(got[6].item())
    assert codecs.decode_e8m0(codes.view(torch.float8_e8m0fnu)).tolist()[:6] == expected


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = f32(0.0, 0.25, 0.26, 0.5, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, 100.0)
    # 0.25 -> 0 (code 0 even), 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2,
    # 3.5 -> 4, 5 -> 4 (code 6 even), above 6 saturates to code 7.
    assert codecs.encode_e2m1(x).tolist() == [0, 0, 1, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7]
    neg = f32(-0.0, -0.25, -0.5, -3.0, -6.5, 0.1)
    assert codecs.encode_e2m1(neg).tolist() == [8, 8, 9, 13, 15, 0]


def test_e2m1_decode_table_and_packing():
    codes = torch.arange(16, dtype=torch.uint8)
    assert codecs.decode_e2m1(codes).tolist() == list(codecs.E2M1_VALUES)
    packed = codecs.pack_nibbles(torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8))
    # low nibble holds the even element: (1, 2) -> 0x21, (3, 4) -> 0x43, (15, 0) -> 0x0F
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert codecs.unpack_nibbles(packed).tolist() == [[1, 2, 3, 4, 15, 0]]
    with pytest.raises(ValueError, match="even last dimension"):
        codecs.pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_int_encoders_round_half_even_and_clamp():
    x = f32(0.5, 1.5, 2.5, -0.5, -2.5, 127.4, 200.0, -200.0, float("nan"))
    assert codecs.encode_int8(x).tolist() == [0, 2, 2, 0, -2, 127, 127, -128, 0]
    y = f32(-1.0, 0.5, 8.5, 9.5, 20.0)
    assert codecs.encode_int4(y).tolist() == [0, 0, 8, 10, 15]


def test_absmax_scale_zero_block_gets_unit_scale():
    assert codecs.absmax_scale(f32(0.0, 896.0), 448.0).tolist() == [1.0, 2.0]


def test_codecs_reject_wrong_types():
    with pytest.raises(TypeError, match="x must be a floating-point"):
        codecs.encode_e4m3(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="codes must be uint8"):
        codecs.decode_e8m0(torch.zeros(2, dtype=torch.int32))


def test_e2m1_matches_brute_force_nearest_even():
    # Every multiple of 1/8 in [-8, 8] (which hits every midpoint) plus random values: the
    # encoder must pick the nearest table value, the even code on ties, 6 beyond range.
    torch.manual_seed(0)
    x = torch.cat([torch.arange(-64, 65) / 8.0, torch.randn(2000) * 3])
    table = torch.tensor(codecs.E2M1_VALUES[:8])
    dist = (x.abs()[:, None] - table[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = (dist == best) * (1 + (torch.arange(8) % 2 == 0).int())  # prefer even codes
    expected = candidates.argmax(dim=1).to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    assert torch.equal(codecs.encode_e2m1(x), expected)
