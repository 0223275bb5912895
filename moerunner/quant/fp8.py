# FP8 (e4m3) formats with float32 scales: per tensor, per row, per 1-D group, per 2-D block.
#
# Raw-tensor kernels used by `QuantizedWeight` (weights [E, N, K]) and by activation
# quantization (activations [M, K]). Scales are float32 *multipliers*: value = e4m3 * scale,
# scale = amax / 448 of the elements it covers (1.0 for an all-zero block), and elements are
# encoded as e4m3(x / scale) with round-to-nearest-even and saturation. 2-D blocks use a
# ceil grid: when N or K is not a multiple of the block, the last block is partial and its
# amax is taken over the elements that exist (as DeepSeek-V3 checkpoints do).
#
# Shape suffixes: E experts, N rows, K reduction dim, M activation rows.

from __future__ import annotations

import math

import torch

from moerunner.quant.codecs import E4M3_MAX, absmax_scale, decode_e4m3, encode_e4m3

__all__ = [
    "block_amax",
    "dequantize_fp8_blocks",
    "expand_block_scale",
    "quantize_fp8_blocks",
    "quantize_fp8_rows",
    "quantize_fp8_tensor",
]


def block_amax(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Absolute maximum of each ``block_rows x block_cols`` block of the last two dims of ``x``.

    Returns float32 ``[..., ceil(rows / block_rows), ceil(cols / block_cols)]``; partial edge
    blocks cover only the elements that exist. NaN in a block propagates to its amax.
    """
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims for block_amax, got {tuple(x.shape)}")
    *lead, rows, cols = x.shape
    nb, kb = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = torch.nn.functional.pad(
        x.float().abs(), (0, kb * block_cols - cols, 0, nb * block_rows - rows)
    )
    blocks = padded.reshape(*lead, nb, block_rows, kb, block_cols)
    return blocks.amax(dim=(-3, -1))


def expand_block_scale(
    scale: torch.Tensor, block_rows: int, block_cols: int, rows: int, cols: int
) -> torch.Tensor:
    """Repeat a block-scale grid ``[..., nb, kb]`` to one value per element ``[..., r, c]``."""
    full = scale.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return full[..., :rows, :cols]


def quantize_fp8_blocks(
    x: torch.Tensor, block_rows: int, block_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dims of ``x`` to e4m3 with one fp32 scale per block (ceil grid).

    Returns ``(data e4m3 [..., rows, cols], scale fp32 [..., ceil(rows/br), ceil(cols/bc)])``.
    ``block_rows = 1`` gives per-row groups along the last dim (fp8 activations per 128).
    """
    rows, cols = x.shape[-2:]
    scale = absmax_scale(block_amax(x, block_rows, block_cols), E4M3_MAX)
    full = expand_block_scale(scale, block_rows, block_cols, rows, cols)
    return encode_e4m3(x.float() / full), scale


def dequantize_fp8_blocks(
    data: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """Float32 value of e4m3 ``data`` times its block's scale (inverse of quantize_fp8_blocks)."""
    rows, cols = data.shape[-2:]
    full = expand_block_scale(scale.float(), block_rows, block_cols, rows, cols)
    return decode_e4m3(data) * full


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to e4m3 with one fp32 scale per row: ``(data, scale [...])``.

    Per output channel for weights [E, N, K]; per token for activations [M, K].
    """
    scale = absmax_scale(x.float().abs().amax(dim=-1), E4M3_MAX)
    return encode_e4m3(x.float() / scale.unsqueeze(-1)), scale


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights ``[E, N, K]`` to e4m3 with one fp32 scale per expert ``[E]``."""
    scale = absmax_scale(w.float().abs().amax(dim=(-2, -1)), E4M3_MAX)
    return encode_e4m3(w.float() / scale[:, None, None]), scale
