# Bit-exact element and scale codecs shared by every quantized format.
#
# Contract: every encoder takes a float tensor already divided by its scale and returns the
# stored integer / fp8 representation; every decoder returns float32. Rounding is to nearest,
# ties to even, with saturation to the largest finite value (never to NaN or inf), as the OCP
# Microscaling v1.0 spec and the NVIDIA NVFP4 format define. fp8 dtypes are storage-only on
# CPU, so all arithmetic happens in float32 and only the final cast produces e4m3. e8m0 scales
# are computed from the block's absolute maximum by the OCP rule, never by a plain cast (a cast
# rounds 3 up to 4). fp4 values are kept as uint8 codes / packed bytes: low nibble = even element.

from __future__ import annotations

import torch

__all__ = [
    "absmax_scale",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_EMAX",
    "E2M1_EMAX",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "e8m0_from_amax",
    "encode_e2m1",
    "encode_e4m3",
    "encode_int8",
    "encode_int4",
    "pack_nibbles",
    "unpack_nibbles",
]

#: Largest finite e4m3 (float8_e4m3fn) magnitude: 1.75 * 2^8.
E4M3_MAX = 448.0
#: Largest finite e2m1 magnitude: 1.5 * 2^2.
E2M1_MAX = 6.0
#: emax of the element formats (exponent of the largest normal), used by the OCP MX scale rule.
E4M3_EMAX = 8
E2M1_EMAX = 2
#: e8m0 code c encodes 2^(c - 127); code 255 is NaN.
E8M0_BIAS = 127
E8M0_NAN = 255

#: Value of each 4-bit e2m1 code; bit 3 is the sign, codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)

# Midpoints between consecutive positive e2m1 codes i and i + 1. At an exact midpoint the even
# code wins: for even i the magnitude must exceed the midpoint to move up, for odd i it moves up
# when it reaches it (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x.float()


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float values to float8_e4m3fn: nearest, ties to even, saturating at +-448.

    NaN stays NaN; +-inf saturates to +-448; subnormals (multiples of 2^-9) are kept.
    """
    x = _check_float("x", x)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def decode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Exact float32 value of float8_e4m3fn tensor ``x``."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x must be a torch.float8_e4m3fn tensor, got {getattr(x, 'dtype', x)}")
    return x.float()


def e8m0_from_amax(amax: torch.Tensor, elem_emax: int) -> torch.Tensor:
    """OCP MX v1.0 shared scale of blocks with absolute maximum ``amax``, as uint8 e8m0 codes.

    shared exponent = floor(log2(amax)) - elem_emax, clamped to [-127, 127], stored biased by
    127. A zero block gets the smallest scale (code 0); a block whose amax is NaN or inf gets
    code 255 (NaN), so the whole block dequantizes to NaN. ``elem_emax`` is 8 for e4m3 elements
    and 2 for e2m1. Note the spec's rule lets block maxima in [emax_value, 2^(elem_emax+1)) *
    2^e exceed the element's largest finite value; those saturate when encoded.
    """
    amax = _check_float("amax", amax)
    if not isinstance(elem_emax, int):
        raise TypeError(f"elem_emax must be an int, got {type(elem_emax).__name__}")
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly,
    # including float32 subnormals.
    _, exponent = torch.frexp(amax)
    shared = exponent.to(torch.int32) - 1 - elem_emax
    codes = (shared + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS)
    codes = torch.where(amax == 0, torch.zeros_like(codes), codes)
    codes = torch.where(torch.isfinite(amax), codes, torch.full_like(codes, E8M0_NAN))
    return codes.to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """Float32 value 2^(code - 127) of uint8 (or float8_e8m0fnu) scales; code 255 is NaN.

    Built from the float32 bit pattern, so every code is exact (code 0 is the subnormal 2^-127).
    """
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype == torch.float8_e8m0fnu:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8 or float8_e8m0fnu, got {codes.dtype}")
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    bits = torch.where(c == E8M0_NAN, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values to e2m1 codes (uint8 0..15, unpacked): nearest, ties to even.

    Magnitudes above 6 saturate to 6 (code 7 / 15); the sign bit (bit 3) follows the sign of the
    input, so -0.0 and tiny negatives that round to zero give code 8. NaN encodes as 0.
    """
    x = _check_float("x", x)
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = mag > mid if i % 2 == 0 else mag >= mid
        code += up.to(torch.uint8)
    sign = torch.signbit(x) & ~torch.isnan(x)
    return code | (sign.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Float32 value of e2m1 codes (uint8 0..15, unpacked) by the 16-entry table."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', codes)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & 0x0F).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., K]`` (K even) into bytes ``[..., K/2]``: low nibble = even k."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', codes)}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"codes must have an even last dimension to pack two per byte, got {tuple(codes.shape)}"
        )
    low = codes[..., 0::2] & 0x0F
    high = codes[..., 1::2] & 0x0F
    return low | (high << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., K/2]`` into 4-bit codes ``[..., K]`` (uint8): low nibble first."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', packed)}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def encode_int8(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest (ties to even, as torch.round does) and clamp to [-128, 127], as int8.

    NaN encodes as 0.
    """
    x = _check_float("x", x)
    return torch.nan_to_num(torch.round(x), nan=0.0).clamp(-128, 127).to(torch.int8)


def encode_int4(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest (ties to even) and clamp to the unsigned int4 range [0, 15], as uint8.

    ``x`` already includes the zero point (8 for symmetric int4). NaN encodes as 0.
    """
    x = _check_float("x", x)
    return torch.nan_to_num(torch.round(x), nan=0.0).clamp(0, 15).to(torch.uint8)


def absmax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Float32 scale ``amax / qmax`` mapping a block's absolute maximum onto ``qmax``.

    Where that is 0 (an all-zero block, or an amax so small the quotient underflows) the scale
    is 1.0 instead, so quantizing divides by a finite non-zero number and the block stores 0.
    A quotient among float32's subnormals (blocks with amax below about 2^-126 * qmax) holds
    fewer bits: the documented error bounds do not hold there (docs/quantization.md).
    """
    amax = _check_float("amax", amax)
    scale = amax / qmax
    # Rounded up, qmax * scale can pass float32's largest value (a finite amax near it): the
    # next float32 below keeps every dequantized value finite (an infinite amax stays so).
    past = torch.isfinite(scale) & torch.isinf(scale * qmax)
    scale = torch.where(past, torch.nextafter(scale, scale.new_zeros(())), scale)
    return torch.where(scale == 0, torch.ones_like(scale), scale)
