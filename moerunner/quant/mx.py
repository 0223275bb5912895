# OCP Microscaling (MX v1.0) formats: MXFP8 (e4m3 elements) and MXFP4 (e2m1 elements).
#
# Every 32 consecutive elements along the last dim share one e8m0 scale X = 2^(code - 127),
# stored as uint8. The shared exponent is floor(log2(amax)) - emax_elem of the block (spec
# section 6.3), clamped to the e8m0 range; 0xFF is NaN. Elements are encoded as e(x / X) with
# round-to-nearest-even and saturation to the element's max finite value (448 / 6). MXFP4
# elements are packed two per byte, low nibble = even element. The last dim must be a
# multiple of 32 (no partial MX blocks).
#
# Shape suffixes: any leading dims, K the blocked (last) dim.

from __future__ import annotations

import torch

from moerunner.quant.codecs import (
    E2M1_EMAX,
    E4M3_EMAX,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    e8m0_from_amax,
    encode_e2m1,
    encode_e4m3,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = ["MX_BLOCK", "dequantize_mx", "quantize_mx"]

#: Elements per MX scale block (OCP MX v1.0).
MX_BLOCK = 32
_ELEMENTS = ("e4m3", "e2m1")


def _check_elem(elem_format: str) -> None:
    if elem_format not in _ELEMENTS:
        raise ValueError(f"elem_format must be one of {_ELEMENTS}, got {elem_format!r}")


def quantize_mx(x: torch.Tensor, elem_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K a multiple of 32) to MX: ``(data, scale uint8 [..., K/32])``.

    ``elem_format`` "e4m3" gives data float8_e4m3fn ``[..., K]``; "e2m1" gives packed uint8
    ``[..., K/2]`` (low nibble = even element).
    """
    _check_elem(elem_format)
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(
            f"x: MX formats need the last dim to be a multiple of {MX_BLOCK}, got {k}; "
            "zero-pad it first (QuantizedWeight.pad pads K of an already quantized weight)"
        )
    blocks = x.float().reshape(*x.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    emax = E4M3_EMAX if elem_format == "e4m3" else E2M1_EMAX
    codes = e8m0_from_amax(blocks.abs().amax(dim=-1), emax)
    # Division by a power of two is exact, so rounding happens only once, in the element encode.
    scaled = (blocks / decode_e8m0(codes).unsqueeze(-1)).reshape(x.shape)
    if elem_format == "e4m3":
        return encode_e4m3(scaled), codes
    return pack_nibbles(encode_e2m1(scaled)), codes


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, elem_format: str) -> torch.Tensor:
    """Float32 value of MX ``data`` with e8m0 ``scale`` (inverse of ``quantize_mx``)."""
    _check_elem(elem_format)
    values = decode_e4m3(data) if elem_format == "e4m3" else decode_e2m1(unpack_nibbles(data))
    k = values.shape[-1]
    blocks = values.reshape(*values.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    return (blocks * decode_e8m0(scale).unsqueeze(-1)).reshape(values.shape)
