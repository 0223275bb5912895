# How many programs share a tile's K loop in the triton backend's grouped GEMM (private).
#
# Split K (``TileConfig.split_k``, kernel constexpr SPLIT_K; the kernel side is in
# ``_gemm_kernel.moe_gemm_kernel``'s docstring) fills the GPU when a call has too few tiles for
# its SMs. This module decides the count per launch: a tile's own ``split_k``, else the rule
# below; ``experts._launch_gemm`` launches with it and keeps its buffers
# (``workspaces.split_k_workspace``).

from __future__ import annotations

from ._launch import cdiv as _cdiv
from .options import TritonOptions
from .tile_config import TileConfig

# ``split_k_for``'s rule gives each split program at least this many K steps, and splits a
# tile only into at least SPLIT_K_MIN_PROGRAMS programs: every split of 3 to 6 measured on
# e2m1 GEMM2 gained (1.05-1.26x), splits of 2 went either way (0.978x DeepSeek-V3 mxfp4 at
# T = 1, 0.984x GPT-OSS-20B at T = 4, 1.05x GPT-OSS-120B at T = 4; H100).
SPLIT_K_MIN_STEPS = 4
SPLIT_K_MIN_PROGRAMS = 3
# A launch whose partial sums would take more than this many bytes runs unsplit, whatever its
# tile asks: split K is for calls of few tiles, and a tile file pinning it at a large T (a
# user's, or a lookup nearest to a decode entry) must not allocate gigabytes.
SPLIT_K_MAX_BYTES = 64 << 20


def split_k_for(
    tile: TileConfig,
    consts: dict,
    num_tiles: int,
    k_steps: int,
    sms: int | None,
    options: TritonOptions,
    activation: bool = False,
) -> int:
    """Programs per tile of one GEMM launch of ``num_tiles`` tiles (``tile`` as launched,
    weight constexprs ``consts``; ``activation``: its epilogue applies one, as GEMM1's) over
    ``k_steps`` K steps on a GPU of ``sms`` SMs (None: not a GPU). The tile's ``split_k`` if
    set; else, for a GEMM without an activation on e2m1 weights in the fragment layout in
    16-row tiles on a GPU, as many as bring the launch to ``options.decode_split_programs``
    programs per SM with at least ``SPLIT_K_MIN_STEPS`` steps each, if that makes at least
    ``SPLIT_K_MIN_PROGRAMS`` programs per tile; else 1. Either way no program is left without
    steps (``split_k_steps``), and a split whose partial sums would exceed
    ``SPLIT_K_MAX_BYTES`` (counted for the widest, gated tile) is not taken.

    GEMM1 splits only where its tile says so (tuned files): split by this rule it lost 3-5 %
    at T = 1 on Qwen3-30B-A3B and GPT-OSS-120B (H100), and where splitting it gained, the
    tuner finds it (GPT-OSS-120B T = 4)."""
    if tile.split_k is not None:
        split = split_k_steps(tile.split_k, k_steps)
    else:
        per_sm = options.decode_split_programs
        if activation or not (per_sm and sms and consts["FRAG"] and tile.block_m == 16):
            return 1
        want = min(per_sm * sms // max(num_tiles, 1), k_steps // SPLIT_K_MIN_STEPS)
        split = split_k_steps(want, k_steps) if want >= SPLIT_K_MIN_PROGRAMS else 1
    part_bytes = num_tiles * split * tile.block_m * 2 * tile.block_n * 4
    return split if part_bytes <= SPLIT_K_MAX_BYTES else 1


def split_k_steps(split_k: int, k_steps: int) -> int:
    """The programs per tile a launch runs for a tile's ``split_k`` over ``k_steps`` K
    steps: the largest count up to ``split_k`` whose every program gets at least one step
    (shares of ``ceil(k_steps / count)`` steps, the last one the rest)."""
    split = max(1, min(split_k, k_steps))
    while split > 1 and last_share(split, k_steps) < 1:
        split -= 1
    return split


def last_share(split: int, k_steps: int) -> int:
    """K steps of the last of ``split`` programs sharing ``k_steps`` (the smallest share;
    the others take ``ceil(k_steps / split)`` each, as the kernel splits them)."""
    return k_steps - (split - 1) * _cdiv(k_steps, split)
