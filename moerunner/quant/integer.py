# Integer formats: int8 with one fp32 scale per row, int4 with one fp32 scale per K group.
#
# int8 (weights per output channel or per K group, activations per token): scale = amax / 127,
# q = round_half_even(x / scale) clamped to [-128, 127]; value = q * scale. Group-wise int8
# with zero point: the group range [min(x, 0), max(x, 0)] maps onto [-128, 127]: scale =
# (max - min) / 255, zero = round_half_even(-min / scale) - 128 (int8), q = round(x / scale) +
# zero, value = (q - zero) * scale; 0.0 stays exact.
# int4 is stored unsigned (q in 0..15), two per byte, low nibble = even k; value =
# (q - zero) * scale. Symmetric: zero = 8 (not stored), scale = amax / 7, so q - 8 spans
# [-7, 7]. With zero point: the group range [min(x, 0), max(x, 0)] maps onto [0, 15]:
# scale = (max - min) / 15, zero = round_half_even(-min / scale) (uint8, 0..15), which keeps
# 0.0 exactly representable. The last dim must be a multiple of the group size.

from __future__ import annotations

import torch

from moerunner.quant.codecs import (
    absmax_scale,
    encode_int4,
    encode_int8,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = [
    "INT4_SYMMETRIC_ZERO",
    "dequantize_int4",
    "dequantize_int8_groups",
    "dequantize_int8_rows",
    "quantize_int4",
    "quantize_int8_groups",
    "quantize_int8_rows",
]

#: Implicit zero point of symmetric int4 (q = 8 is the value 0).
INT4_SYMMETRIC_ZERO = 8


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to int8 with one fp32 scale per row: ``(data, scale [...])``."""
    scale = absmax_scale(x.float().abs().amax(dim=-1), 127.0)
    return encode_int8(x.float() / scale.unsqueeze(-1)), scale


def dequantize_int8_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 value ``q * scale`` of int8 ``data [..., K]`` with row scales ``[...]``."""
    return data.float() * scale.float().unsqueeze(-1)


def _groups(x: torch.Tensor, group_size: int, what: str = "int4") -> torch.Tensor:
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(
            f"x: {what} with group size {group_size} needs the last dim to be a multiple of it, "
            f"got {k}; zero-pad it first or pick a group size that divides it"
        )
    return x.reshape(*x.shape[:-1], k // group_size, group_size)


def quantize_int4(
    x: torch.Tensor, group_size: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x [..., K]`` to packed int4 with one fp32 scale per ``group_size`` along K.

    Returns ``(data uint8 [..., K/2], scale fp32 [..., K/g], zero uint8 [..., K/g] or None)``.
    """
    groups = _groups(x.float(), group_size)
    if zero_point:
        lo = groups.amin(dim=-1).clamp(max=0.0)
        hi = groups.amax(dim=-1).clamp(min=0.0)
        scale = absmax_scale(hi - lo, 15.0)
        zero = encode_int4(-lo / scale)
    else:
        scale = absmax_scale(groups.abs().amax(dim=-1), 7.0)
        zero = torch.full(scale.shape, INT4_SYMMETRIC_ZERO, dtype=torch.uint8, device=x.device)
    # round(x / s) + z, not round(x / s + z): the sum rounded in float32 first (a second
    # rounding) broke the s/2 bound, and ties broke by the parity of x / s + z
    q = encode_int4(torch.round(groups / scale.unsqueeze(-1)) + zero.unsqueeze(-1).float())
    data = pack_nibbles(q.reshape(x.shape))
    return data, scale, (zero if zero_point else None)


def dequantize_int4(
    data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """Float32 value ``(q - zero) * scale`` of packed int4 ``data`` (zero None means 8)."""
    values = unpack_nibbles(data).float()
    q = _groups(values, group_size)
    z = INT4_SYMMETRIC_ZERO if zero is None else zero.float().unsqueeze(-1)
    return ((q - z) * scale.float().unsqueeze(-1)).reshape(values.shape)


def quantize_int8_groups(
    x: torch.Tensor, group_size: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize ``x [..., K]`` to int8 with one fp32 scale per ``group_size`` along K.

    Returns ``(data int8 [..., K], scale fp32 [..., K/g], zero int8 [..., K/g] or None)``.
    """
    groups = _groups(x.float(), group_size, "int8")
    if zero_point:
        lo = groups.amin(dim=-1).clamp(max=0.0)
        hi = groups.amax(dim=-1).clamp(min=0.0)
        scale = absmax_scale(hi - lo, 255.0)
        zero = encode_int8(torch.round(-lo / scale) - 128.0)
        q = encode_int8(torch.round(groups / scale.unsqueeze(-1)) + zero.unsqueeze(-1).float())
        return q.reshape(x.shape), scale, zero
    scale = absmax_scale(groups.abs().amax(dim=-1), 127.0)
    return encode_int8(groups / scale.unsqueeze(-1)).reshape(x.shape), scale, None


def dequantize_int8_groups(
    data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """Float32 value ``(q - zero) * scale`` of int8 ``data`` (zero None means 0)."""
    q = _groups(data.float(), group_size, "int8")
    if zero is not None:
        q = q - zero.float().unsqueeze(-1)
    return (q * scale.float().unsqueeze(-1)).reshape(data.shape)
