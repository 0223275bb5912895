# Activation quantization: what a kernel does to its GEMM input x [M, K] under a scheme.
#
# `quantize_activation` returns the stored form a real kernel feeds its tensor cores;
# `fake_quantize_activation` returns the float32 value that form represents, i.e. what the
# kernel effectively multiplies with the dequantized weight (the torch backend and the float64
# reference both use it, so GPU kernels can be held to tight tolerances). Formats:
#   none          weight-only schemes: x is used as is (fake quantize = cast to float32)
#   fp8_token     e4m3, one fp32 scale per row: amax / 448 (dynamic) or the static input_scale
#   fp8_group128  e4m3, one fp32 scale per row per 128 along K (last group partial)
#   fp8_group     the same per the weight's K block (``QuantScheme.activation_group_size``)
#   mxfp8         e4m3, one e8m0 scale per 32 along K (OCP MX rule); K % 32 == 0
#   nvfp4         e2m1 packed, e4m3 scale per 16 along K, fp32 global scale = amax(row) / 2688
#                 (dynamic, per row, so a token's value never depends on which other tokens
#                 share its batch or expert) or the static input_scale; K % 16 == 0
#   int8_token    int8, one fp32 scale per row: amax / 127 (dynamic) or the static input_scale
# Rows whose amax is 0 get scale 1.0 and store zeros. Returned scales always have M rows.

from __future__ import annotations

from typing import NamedTuple

import torch

from moerunner.quant import fp8, integer, mx, nvfp4
from moerunner.quant.codecs import encode_e4m3, encode_int8
from moerunner.quant.schemes import STATIC_ACTIVATION_FORMATS, QuantScheme, get_scheme

__all__ = [
    "QuantizedActivation",
    "dequantize_activation",
    "fake_quantize_activation",
    "quantize_activation",
]

# Formats with one e4m3 scale per row and K group (the group: ``activation_group_size``).
_FP8_GROUPS = ("fp8_group128", "fp8_group")


class QuantizedActivation(NamedTuple):
    """Stored form of a quantized GEMM input ``[M, K]``.

    ``data``: e4m3 ``[M, K]`` (fp8_token, fp8_group128, mxfp8), int8 ``[M, K]`` (int8_token),
    packed uint8 ``[M, K/2]`` (nvfp4) or ``x`` itself (format "none").
    ``scale``: fp32 ``[M]`` (fp8_token, int8_token), fp32 ``[M, ceil(K/g)]``
    (fp8_group128: g = 128; fp8_group: g = the weight's K block), uint8 e8m0 ``[M, K/32]``
    (mxfp8), e4m3 ``[M, K/16]`` (nvfp4), None (none).
    ``global_scale``: fp32 ``[M]`` for nvfp4 (per row when dynamic), else None.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    global_scale: torch.Tensor | None = None


def _row_scale(input_scale: torch.Tensor, m: int, x: torch.Tensor) -> torch.Tensor:
    """Static scale (scalar or [M]) as fp32 [M]; raises for other shapes or non-positive values."""
    if not isinstance(input_scale, torch.Tensor):
        input_scale = torch.as_tensor(input_scale, dtype=torch.float32)
    s = input_scale.to(device=x.device, dtype=torch.float32)
    if s.numel() == 1:
        s = s.reshape(()).expand(m)
    elif tuple(s.shape) != (m,):
        raise ValueError(
            f"input_scale must be a scalar or have shape [M]=[{m}] (one static scale per row), "
            f"got {list(s.shape)}"
        )
    if bool((s <= 0).any()) or not bool(torch.isfinite(s).all()):
        raise ValueError("input_scale must be finite and > 0")
    return s.contiguous()


def quantize_activation(
    x: torch.Tensor,
    scheme: str | QuantScheme,
    input_scale: torch.Tensor | float | None = None,
) -> QuantizedActivation:
    """Quantize GEMM input ``x [M, K]`` as a kernel of ``scheme`` does (see module header).

    ``input_scale`` (a scalar or fp32 ``[M]``) selects static scales; it is required when
    ``scheme.activation_scales == "static"`` and accepted for fp8_token, int8_token and nvfp4
    (for nvfp4 it is the global scale). For weight-only schemes ``x`` is returned unchanged.
    """
    s = get_scheme(scheme)
    fmt = s.activation_format
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', x)}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K] (2 dims), got shape {list(x.shape)}")
    if input_scale is not None and fmt not in STATIC_ACTIVATION_FORMATS:
        raise ValueError(
            f"input_scale: activation format {fmt!r} of scheme {s.name!r} has no static scale; "
            f"accepted only for {STATIC_ACTIVATION_FORMATS}"
        )
    if input_scale is None and s.activation_scales == "static":
        raise ValueError(
            f"input_scale: scheme {s.name!r} uses static activation scales and needs one "
            "(QuantizedWeight.input_scale)"
        )
    m, k = x.shape
    xf = x.float()
    if fmt == "none":
        return QuantizedActivation(x, None)
    if fmt in ("mxfp8", "nvfp4"):
        block = mx.MX_BLOCK if fmt == "mxfp8" else nvfp4.NVFP4_BLOCK
        if k % block:
            raise ValueError(
                f"x: activation format {fmt!r} needs K to be a multiple of {block}, got K={k}"
            )
    if fmt in ("fp8_token", "int8_token"):
        if input_scale is None:
            quantize_rows = (
                fp8.quantize_fp8_rows if fmt == "fp8_token" else integer.quantize_int8_rows
            )
            if k == 0:
                return _empty(x, fmt)
            data, scale = quantize_rows(xf)
            return QuantizedActivation(data, scale)
        scale = _row_scale(input_scale, m, x)
        encode = encode_e4m3 if fmt == "fp8_token" else encode_int8
        return QuantizedActivation(encode(xf / scale.unsqueeze(-1)), scale)
    if fmt in _FP8_GROUPS:
        if k == 0:
            return _empty(x, fmt)
        data, scale = fp8.quantize_fp8_blocks(xf, 1, s.activation_group_size)
        return QuantizedActivation(data, scale)
    if fmt == "mxfp8":
        data, scale = mx.quantize_mx(xf, "e4m3")
        return QuantizedActivation(data, scale)
    # nvfp4
    if input_scale is not None:
        gs = _row_scale(input_scale, m, x)
    else:
        amax = xf.abs().amax(dim=-1) if xf.numel() else xf.new_zeros((m,))
        gs = nvfp4.nvfp4_global_scale(amax).contiguous()
    data, scale = nvfp4.quantize_nvfp4(xf, gs.unsqueeze(-1))
    return QuantizedActivation(data, scale, gs)


def _empty(x: torch.Tensor, fmt: str) -> QuantizedActivation:
    """K == 0: nothing to reduce; empty data and unit scales."""
    m = x.shape[0]
    dtype = torch.int8 if fmt == "int8_token" else torch.float8_e4m3fn
    data = torch.zeros((m, 0), dtype=torch.float32, device=x.device).to(dtype)
    shape = (m,) if fmt not in _FP8_GROUPS else (m, 0)
    return QuantizedActivation(data, torch.ones(shape, dtype=torch.float32, device=x.device))


def dequantize_activation(qx: QuantizedActivation, scheme: str | QuantScheme) -> torch.Tensor:
    """Float32 ``[M, K]`` value of a `QuantizedActivation` produced under ``scheme``."""
    s = get_scheme(scheme)
    fmt = s.activation_format
    if not isinstance(qx, QuantizedActivation):
        raise TypeError(f"qx must be a QuantizedActivation, got {type(qx).__name__}")
    if fmt == "none":
        return qx.data.float()
    if fmt in ("fp8_token", "int8_token"):
        return qx.data.float() * qx.scale.unsqueeze(-1)
    if fmt in _FP8_GROUPS:
        return fp8.dequantize_fp8_blocks(qx.data, qx.scale, 1, s.activation_group_size)
    if fmt == "mxfp8":
        return mx.dequantize_mx(qx.data, qx.scale, "e4m3")
    return nvfp4.dequantize_nvfp4(qx.data, qx.scale, qx.global_scale.unsqueeze(-1))


def fake_quantize_activation(
    x: torch.Tensor,
    scheme: str | QuantScheme,
    input_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Float32 ``[M, K]`` value a kernel of ``scheme`` effectively multiplies for input ``x``.

    Equal to ``dequantize_activation(quantize_activation(x, scheme, input_scale), scheme)``;
    for weight-only schemes it is ``x.float()``.
    """
    return dequantize_activation(quantize_activation(x, scheme, input_scale), scheme)
