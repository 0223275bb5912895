# Stage "prepare" of the flashinfer backend: the weight layouts FlashInfer's SM90 CUTLASS fused
# MoE reads, as pure tensor re-arrangements that run on any device (tests run them on CPU).
#
# - GEMM1 rows in up-then-gate order (``up_gate_rows``): FlashInfer / TensorRT-LLM compute
#   ``act(rows[I:2I]) * rows[0:I]``; canonical weights are gate-then-up or interleaved.
# - Packed e2m1 (mxfp4) in the byte and bit order of the SM90 mixed-input GEMM
#   (``E2m1Sm90Layout``): per 16-row x 64-element tile, each 4-byte word gathers two bytes of
#   rows r and r + 8 at columns c and c + 4 and permutes their 32 bits, so the kernel's
#   lookup-table conversion reads one word per MMA fragment.
# - e8m0 group scales folded into 16-byte blocks (``fold_scales``): each 64-row x 128-column
#   block of the weight keeps its 64 x 4 scale bytes as 16 rows of 16 bytes.
# Each layout is a value with its inverse, and tests round-trip both.

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import MoeInputError
from ...weights import is_quantized, swap_row_halves

# Shape legend: E experts, N weight rows (GEMM output), K reduction, G = K / 32 scale groups.

#: Rows of one interleave tile, packed bytes of one K partition (64 e2m1 values).
_TILE_ROWS = 16
_PART_BYTES = 32
#: Weight rows / K columns covered by one 16-byte block of folded scales.
FOLD_ROWS = 64
FOLD_K = 128
MX_GROUP = 32

# The SM90 mixed-input bit permutation of one 32-bit word (4 packed bytes, little-endian):
# (source mask, left shift; negative shifts right). Each e2m1 value's sign bit and its three
# exponent/mantissa bits move apart, so the kernel's lookup table reads them with one shift.
_BIT_MOVES: tuple[tuple[int, int], ...] = (
    (0x00000080, 24),
    (0x00000070, 18),
    (0x00000008, 12),
    (0x00000007, 6),
    (0x00008000, 13),
    (0x00007000, 7),
    (0x00000800, 1),
    (0x00000700, -5),
    (0x00800000, 2),
    (0x00700000, -4),
    (0x00080000, -10),
    (0x00070000, -16),
    (0x80000000, -1),
    (0x10000000, 1),
    (0x60000000, -3),
    (0x08000000, -13),
    (0x01000000, -11),
    (0x06000000, -15),
)


def _move_bits(words: torch.Tensor, moves) -> torch.Tensor:
    out = torch.zeros_like(words)
    for mask, shift in moves:
        part = words & mask
        out |= (part << shift) if shift >= 0 else (part >> -shift)
    return out


def _inverse_moves() -> tuple[tuple[int, int], ...]:
    moves = []
    for mask, shift in _BIT_MOVES:
        target = (mask << shift) if shift >= 0 else (mask >> -shift)
        moves.append((target, -shift))
    return tuple(moves)


def _word_index(n: int, kb: int, device: torch.device):
    """For every output word of an ``[N, kb]`` byte matrix: the 4 source byte indices of the
    word (``src``) and the first destination byte index (``dst``), both flat row-major."""
    if n % _TILE_ROWS or kb % _PART_BYTES:
        raise MoeInputError(
            f"the SM90 e2m1 layout needs N % {_TILE_ROWS} == 0 and K % {2 * _PART_BYTES} == 0, "
            f"got N={n}, K={2 * kb}"
        )
    ar = lambda m: torch.arange(m, device=device)  # noqa: E731
    # block: a pair (r, r + 8) of the first 8 rows of each 16-row tile
    block = ar(n // 2)
    row = block // 8 * _TILE_ROWS + block % 8  # [B]
    part = ar(kb // _PART_BYTES)  # [P]
    lane = ar(16)  # [L]
    mma = lane // 4
    col = part[:, None] * _PART_BYTES + (mma * 8 + lane % 4)[None, :]  # [P, L]
    dst_row = row[:, None] + (mma % 2 * 8)[None, :]  # [B, L]
    dst_col = part[:, None] * _PART_BYTES + (lane // 8 * 16 + lane % 4 * 4)[None, :]  # [P, L]
    r0 = row[:, None, None] * kb
    r8 = (row[:, None, None] + 8) * kb
    c = col[None, :, :]
    src = torch.stack((r0 + c, r8 + c, r0 + c + 4, r8 + c + 4), dim=-1)  # [B, P, L, 4]
    dst = dst_row[:, None, :] * kb + dst_col[None, :, :]  # [B, P, L]
    return src.reshape(-1, 4), dst.reshape(-1)


def interleave_e2m1_sm90(data: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 ``[E, N, K/2]`` (uint8, low nibble = even k) -> the SM90 mixed-input GEMM
    layout (same shape and bytes, re-ordered). One expert at a time (int64 words of one
    expert are 8x its bytes)."""
    e, n, kb = data.shape
    src, dst = _word_index(n, kb, data.device)
    out = torch.empty_like(data)
    for i in range(e):
        b = data[i].reshape(-1).to(torch.int64)[src]  # [W, 4]
        words = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
        words = _move_bits(words, _BIT_MOVES)
        flat = out[i].view(-1)
        for j in range(4):
            flat[dst + j] = ((words >> (8 * j)) & 0xFF).to(torch.uint8)
    return out


def deinterleave_e2m1_sm90(data: torch.Tensor) -> torch.Tensor:
    """Inverse of ``interleave_e2m1_sm90``."""
    e, n, kb = data.shape
    src, dst = _word_index(n, kb, data.device)
    out = torch.empty_like(data)
    for i in range(e):
        flat = data[i].reshape(-1).to(torch.int64)
        words = flat[dst] | flat[dst + 1] << 8 | flat[dst + 2] << 16 | flat[dst + 3] << 24
        words = _move_bits(words, _inverse_moves())
        target = out[i].view(-1)
        for j in range(4):
            target[src[:, j]] = ((words >> (8 * j)) & 0xFF).to(torch.uint8)
    return out


def fold_scales(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scale bytes ``[E, N, G]`` (one per 32 along K) -> ``[E, N/64, K/128, 16, 16]``:
    scale ``(r, g)`` with ``r = 64 a + 16 s + m`` and ``g = 4 b + j`` goes to
    ``[a, b, m, 4 s + j]``, one 16-byte row per 16 weight rows of a 64 x 128 block."""
    e, n, g = scale.shape
    if n % FOLD_ROWS or g % (FOLD_K // MX_GROUP):
        raise MoeInputError(
            f"folded e8m0 scales need N % {FOLD_ROWS} == 0 and K % {FOLD_K} == 0, "
            f"got N={n}, K={g * MX_GROUP}"
        )
    per = FOLD_K // MX_GROUP
    folded = scale.reshape(e, n // FOLD_ROWS, 4, 16, g // per, per).permute(0, 1, 4, 3, 2, 5)
    return folded.reshape(e, n // FOLD_ROWS, g // per, 16, 16).contiguous()


def unfold_scales(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of ``fold_scales``."""
    e, a, b, _, _ = folded.shape
    per = FOLD_K // MX_GROUP
    parts = folded.reshape(e, a, b, 16, 4, per).permute(0, 1, 4, 3, 2, 5)
    return parts.reshape(e, a * FOLD_ROWS, b * per).contiguous()


def up_gate_rows(w, interleaved: bool):
    """GEMM1 weight (or bias) ``[E, 2I, ...]`` in up-then-gate row order, from gate-then-up
    (halves swapped by ``swap_row_halves``, which moves whole fp8 scale blocks) or interleaved
    (row 2j gate j, row 2j + 1 up j; quantized weights move their per-row scales with their
    rows, ``select_rows``)."""
    if w is None:
        return None
    if not interleaved:
        return swap_row_halves(w)
    rows = w.shape[1]
    index = torch.cat((torch.arange(1, rows, 2), torch.arange(0, rows, 2)))
    if is_quantized(w):
        return w.select_rows(index)
    return w.index_select(1, index.to(w.device)).contiguous()


@dataclass(frozen=True)
class E2m1Sm90Layout:
    """How an mxfp4 weight was re-laid for the SM90 mixed-input GEMM: ``apply`` takes the
    canonical (packed data ``[E, N, K/2]``, e8m0 codes ``[E, N, K/32]``) to FlashInfer's
    (interleaved data, folded scales as int32 words), ``invert`` gives them back."""

    def apply(self, data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        folded = fold_scales(scale.contiguous())
        return interleave_e2m1_sm90(data.contiguous()), folded.view(torch.int32)

    def invert(self, data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return deinterleave_e2m1_sm90(data), unfold_scales(scale.view(torch.uint8))
