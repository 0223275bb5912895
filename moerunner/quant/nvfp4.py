# NVFP4: e2m1 elements, one e4m3 scale per 16 elements along K, one fp32 global scale.
#
# value = e2m1 * e4m3_block_scale * global_scale. The global scale is amax / (448 * 6) of the
# tensor it covers (an expert's weight, or an activation tensor), so block scales use the whole
# e4m3 range; a block's scale is e4m3((block_amax / 6) / global_scale) (nearest-even,
# saturating at 448), and its elements are e2m1(x / (block_scale * global_scale)) computed in
# float32. A block whose e4m3 scale rounds to 0 stores zeros. Elements are packed two per byte,
# low nibble = even element; the last dim must be a multiple of 16.

from __future__ import annotations

import torch

from moerunner.quant.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    absmax_scale,
    decode_e2m1,
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = ["NVFP4_BLOCK", "dequantize_nvfp4", "nvfp4_global_scale", "quantize_nvfp4"]

#: Elements per NVFP4 block scale.
NVFP4_BLOCK = 16


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 global (dequantization) scale ``amax / (448 * 6)``; 1.0 where that is 0."""
    return absmax_scale(amax, E4M3_MAX * E2M1_MAX)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (K a multiple of 16) to NVFP4 under a given global scale.

    ``global_scale`` (fp32) must broadcast against ``x.shape[:-1] + (1,)`` (e.g. ``[E, 1, 1]``
    for weights ``[E, N, K]``, a scalar for one activation tensor). Returns
    ``(data uint8 [..., K/2], block scale e4m3 [..., K/16])``.
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(
            f"x: NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {k}; "
            "zero-pad it first (QuantizedWeight.pad pads K of an already quantized weight)"
        )
    gs = global_scale.float().unsqueeze(-1)
    blocks = x.float().reshape(*x.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = encode_e4m3((blocks.abs().amax(dim=-1) / E2M1_MAX) / gs.squeeze(-1))
    step = decode_e4m3(block_scale).unsqueeze(-1) * gs
    safe = torch.where(step == 0, torch.ones_like(step), step)
    scaled = torch.where(step == 0, torch.zeros_like(blocks), blocks / safe)
    return pack_nibbles(encode_e2m1(scaled.reshape(x.shape))), block_scale


def dequantize_nvfp4(
    data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """Float32 value of NVFP4 ``data`` (inverse of ``quantize_nvfp4``, same broadcasting)."""
    values = decode_e2m1(unpack_nibbles(data))
    k = values.shape[-1]
    blocks = values.reshape(*values.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    step = (decode_e4m3(scale) * global_scale.float()).unsqueeze(-1)
    return (blocks * step).reshape(values.shape)
