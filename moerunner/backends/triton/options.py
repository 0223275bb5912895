# Options of the triton backend: one frozen value, given to ``TritonBackend(options=...)``.
#
# Every switch of the kernel sequence lives here, with the measurement that justifies its
# default. The backend records its options in the weights it prepares
# (``PreparedWeights.options``) and every launch reads them from there: two backends with
# different options run side by side in one process. Fields marked *prepare time* decide how
# weights are prepared (their layout, where tiles are looked up); the others are read per call.
# The value is validated once, here; reading it per call is an attribute read.

from __future__ import annotations

import os
from dataclasses import dataclass

from ..option_fields import changed_repr, check_bool, check_int

E2M1_LAYOUTS = ("fragment", "split")
AUTOTUNE_MODES = ("off", "first_call")
# Fields that change what ``prepare_weights`` makes (the rest only change launches).
PREPARE_TIME_FIELDS = ("e2m1_layout", "e2m1_placed_words", "tile_dirs")


@dataclass(frozen=True, slots=True)
class TritonOptions:
    """Switches of the triton backend's kernel sequence (defaults: the measured best).

    Build one with keyword arguments and pass it to ``TritonBackend(options=...)``; derive a
    variant with ``dataclasses.replace(options, field=value)``. Its ``repr`` rebuilds it.
    """

    #: Up to this many tokens each (token, slot) row is its own GEMM block and no alignment
    #: step runs: one launch fewer. One token's slots name distinct experts, so no weights are
    #: read twice; from two tokens on, rows that share an expert would each read its weights
    #: (on an H200 row blocks saved 3-5 us at T = 1 on every preset and cost up to 2x on
    #: Mixtral-8x7B's 8 experts at T = 2-8, where the alignment groups the repeats).
    row_blocks_max_tokens: int = 1
    #: A layer call of at most this many tokens (0: none) whose experts align their rows
    #: (more than ``row_blocks_max_tokens`` tokens), whose routing runs on the triton
    #: kernel and whose tokens fit one routing program's block (8 tokens at 128 experts, 4
    #: at 256) routes and aligns in one launch: one program routes the block, then aligns
    #: the ids it wrote. One launch fewer (on an H200, Qwen3-30B-A3B at T = 8: 138.6 against
    #: 139.4 us per CUDA-graph replay, 3 us less host time eager). Applies to the layer's
    #: replayed eager calls (``MoE`` on CUDA).
    route_align_max_tokens: int = 8
    #: Aligned blocks of at least this many rows run a tile of half the rows when their second
    #: half is padding (an expert's last block; ``None``: never), if the experts average at
    #: most ``split_max_blocks_per_expert`` blocks. Near one block per expert a third of the
    #: blocks are such, and their padding rows would otherwise cost full MMAs: on an H200, bf16
    #: at T = 4096 ran 1.07-1.10x faster on Qwen3-30B-A3B, GPT-OSS-120B and DeepSeek-V3.
    #: Below 128 rows the half tile would fall under the 64 rows of Hopper's warpgroup MMA.
    split_min_block_m: int | None = 128
    #: See ``split_min_block_m``: with many blocks per expert there is little to gain and the
    #: second tile costs a little (Mixtral-8x7B at T = 16384, 32 blocks per expert: 0.98x).
    split_max_blocks_per_expert: int = 4
    #: Packed 4-bit weights with one split-layout chunk per K step load the next step's scale
    #: codes one step ahead, so the loop does not wait on a global load (see the kernel).
    scale_prefetch: bool = True
    #: Packed 4-bit weights whose halves have one scale group each and K steps of 2 or 4
    #: chunks load the step's scale codes as one tile (needs the padded scales of
    #: ``_prepare.pad_scale_groups``).
    scale_tiles: bool = True
    #: The fragment layout's GEMMs tell the compiler that K > 0 (``K_NONEMPTY``), so ptxas
    #: keeps their register-operand wgmmas in flight instead of waiting after each
    #: (1.03-1.06x at T = 16-4096 on an H100; off: serialized, bit-identical results).
    fragment_async_mma: bool = True
    #: Off the GPU GEMM1 leaves GEMM2's input quantization to the PyTorch twin (the path every
    #: other input takes there) unless this is set; tests set it to check the epilogue's logic.
    fuse_input_quant_off_gpu: bool = False
    #: *Prepare time.* Layout packed e2m1 weights (mxfp4, nvfp4) are prepared in:
    #: ``"fragment"`` or ``"split"``. GPT-OSS-120B mxfp4 on an H100, tiles tuned for each
    #: layout on it, same process: fragment 1.20x at T = 16, 1.26x at 64, 1.26x at 256, 1.27x
    #: at 1024, 1.33x at 4096, 1.35x at 16384, and 0.87x at T = 1, where one token's four
    #: experts gave too few programs to hide the K loop's latency; with split K there
    #: (``decode_split_programs``, re-tuned tiles) the fragment layout is ahead at T = 1 too
    #: (38.0 against 43.7 us, same process, 2026-11-28). ``moerunner tune --e2m1-layout``
    #: tunes either layout.
    e2m1_layout: str = "fragment"
    #: *Prepare time.* The fragment layout stores each 4-byte word with its bits placed for a
    #: rotate-and-mask decode (``_weight_decode.e2m1_word_bits``: 11 integer instructions per
    #: 8 values against 15 for plain bytes). mxfp4 on an H100, same process, alternating
    #: (``benchmarks/version_ab.py``): geomean 1.052x over four presets at T = 1, 16, 64 and
    #: 4096, 1.008-1.120x per point. The decode relies on the register layout Triton picks,
    #: so ``None`` (the default) places the words only with the Triton versions whose GPU
    #: suite checked it (``_weight_decode.PLACED_WORDS_TRITON``) and stores plain bytes
    #: elsewhere; ``True`` / ``False`` force either.
    e2m1_placed_words: bool | None = None
    #: Launch through the compiled-kernel cache of ``_launch`` (False: always through Triton's
    #: JIT launch, which costs 58 against 13 us of CPU per GEMM launch on an H200 host).
    launch_cache: bool = True
    #: Launch the sequence with programmatic dependent launch where the GPU supports it
    #: (compute capability 9 and later): 1.02-1.04x at T = 1 on an H200.
    pdl: bool = True
    #: The GEMMs zero-fill the A rows of a block's padding instead of reading them (they would
    #: all read row 0). Blocks of experts with few rows are mostly padding, so unmasked they
    #: moved about as many A bytes from L2 as their real rows. On an H200, same tiles: T = 1024
    #: DeepSeek-V3 bf16 1.08x (Zipf-skewed routing 1.23x, fp8_block 1.26x), GPT-OSS-120B bf16
    #: 1.05x (Zipf 1.15x); 1.00-1.06x at the other points measured, none slower. Off: padding
    #: rows read row 0; the output is identical (padding rows are never stored).
    mask_padding_rows: bool = True
    #: With PDL, GEMM2 does not wait for all of GEMM1 but starts each block of rows once
    #: GEMM1's tiles of that block are done (a count per block on the device), so GEMM2's
    #: first blocks run under GEMM1's last ones instead of after a drain and a ramp. Only
    #: where GEMM2 follows GEMM1 directly (no input quantization or LoRA launch between) over
    #: aligned rows (not row blocks). Outputs are bit-identical either way. On an H100, same
    #: process, CUDA-graph replay, 7 alternating rounds: GPT-OSS-120B mxfp4 T = 16 / 64 / 256
    #: 1.079 / 1.022 / 1.013x (T = 1, row blocks: 0.988x, hence not there); Qwen3-30B-A3B
    #: bf16 T = 16 / 64 / 256 / 1024 0.994 / 0.998 / 1.010 / 1.017x; DeepSeek-V3 fp8_block
    #: T = 16 / 256 1.008 / 1.002x. Calls of more than ``overlap_max_tokens`` tokens do not
    #: stream.
    stream_gemms: bool = True
    #: With PDL, the GEMMs on e2m1 weights in the fragment layout ask L2 for this many K steps
    #: of their first tiles before they wait for the launch before them (0: off): GEMM2 (or
    #: its stream wait) while GEMM1 drains, GEMM1 while the one-program alignment runs (it
    #: computes its blocks' experts from the row ids meanwhile). A prefetch only warms L2:
    #: outputs are bit-identical. GPT-OSS-120B mxfp4 on an H100, same runs as
    #: ``stream_gemms``: alone T = 1 / 16 / 64 1.005 / 1.023 / 1.007x; with the streaming
    #: 1.006 / 1.008x more at T = 16 / 64. On an H200, whose decode is bound by instruction
    #: issue, 0.99-1.01x. Calls of more than ``overlap_max_tokens`` tokens do not prefetch.
    early_prefetch_steps: int = 4
    #: ``stream_gemms`` and ``early_prefetch_steps`` apply to calls of at most this many
    #: tokens: they hide a drain and a ramp, which matter where the GEMMs are short. On an
    #: H100, GPT-OSS-120B mxfp4 with both against neither: T = 1024 0.98-0.99x in two runs
    #: (spread 0.93-1.11x), T = 4096 0.972x; Qwen3-30B-A3B bf16 streaming at T = 1024 1.017x
    #: in two runs (spread 1.015-1.018x).
    overlap_max_tokens: int = 1024
    #: GEMMs on e2m1 weights in the fragment layout whose tile leaves ``split_k`` to the
    #: launcher (``TileConfig.split_k`` None, as tuned files without the field) split each
    #: 16-row tile's K loop over up to this many programs per SM, in all (0: never split;
    #: ``_split_k.split_k_for``). A decode of few rows per tile is bound by each program's K
    #: loop latency, not by bandwidth, once the tiles are few: GPT-OSS-120B mxfp4 on an H100,
    #: GEMM2 split 6 ways at T = 1 (92 tiles) 1.15x, both GEMMs split at T = 2 1.34x, T = 4
    #: 1.07x, nothing to gain at T = 8; GPT-OSS-20B (no tuned file) T = 1 / 2 1.17 / 1.14x.
    #: bf16 and fp8 weights gained nothing at T = 1-4 (they stream their bytes at 75-99 % of
    #: the copy bandwidth there) and do not split.
    decode_split_programs: int = 8
    #: LoRA deltas of a hooked call (``moerunner.lora``) group the rows by (adapter, expert)
    #: pair, so that each block of rows reads its pair's factors once, when the call has at
    #: least this many rows per pair of the adapters (rows >= this x adapters x experts);
    #: with fewer, each row reads its own factors and no grouping launch runs. 0: always
    #: grouped. A first estimate (at 2 rows per pair a grouped block still pads to 16 rows
    #: of which about 2 are used, but reads half the factors), not yet measured on a GPU.
    lora_group_min_rows_per_pair: int = 2
    #: A standard-format call whose hooks are all LoRA records (``moerunner.lora``) and whose
    #: rows are not grouped by pair (``lora_group_min_rows_per_pair``) runs them inside the
    #: fused sequence: one launch per GEMM makes its float32 delta and the GEMM adds it
    #: before the activation (GEMM1) or the routing weight (GEMM2), two launches over the
    #: plain call. Off: the hooked sequence (GEMM1 without its activation, the delta, an
    #: activation launch, GEMM2, the delta, the weighted sum), four launches over it.
    lora_in_sequence: bool = True
    #: GEMMs over aligned rows (not row blocks) launch with GROUP_M at least this: programs of
    #: the same weight tile then take several M-blocks in a row, so an expert that gets many
    #: blocks reads each weight tile about once instead of once per block. Tuned files were
    #: searched with uniform routing, where it hardly matters (GROUP_M 1 at decode sizes);
    #: real routers send many rows to a few experts. On an H100, bf16, Zipf-skewed routing
    #: (s = 1.2): DeepSeek-V3 T = 256 1.15x, T = 64 1.03x, GPT-OSS-120B T = 256 1.03x;
    #: uniform routing 0.993-0.998x (``gpu_tiles_ab.py --routing``). 1: the tile's own.
    min_group_m: int = 8
    #: *Prepare time.* Folders of tuned tile files, searched in order before the files shipped
    #: with the package (the first file found for a shape is used whole; ``~`` expanded).
    #: ``None``: the user tile folder that ``moerunner tune`` writes to
    #: (``tile_config.user_tile_dir()``); ``()``: shipped files only.
    tile_dirs: tuple[str, ...] | None = None
    #: Where no tuned file has an entry for a call's token bucket (``autotune.token_bucket``),
    #: ``"off"`` takes the default tiles (``tile_config.heuristic_tiles``); ``"first_call"``
    #: times a few of the tuner's candidates for that bucket once per weights' shape and
    #: device, on the first eager call that needs it (seconds; it synchronises once, as a
    #: first compilation does), and caches the winner in the first tile folder (``tile_dirs``,
    #: default the user tile folder; ``()``: in memory only) in ``moerunner tune``'s schema.
    #: Under CUDA-graph capture or ``torch.compile`` tracing it never times: the default
    #: tiles answer there.
    autotune: str = "off"

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            check_bool(self, name)
        check_int(self, "row_blocks_max_tokens", 0)
        check_int(self, "route_align_max_tokens", 0)
        check_int(self, "split_max_blocks_per_expert", 0)
        check_int(self, "lora_group_min_rows_per_pair", 0)
        check_int(self, "min_group_m", 1)
        check_int(self, "early_prefetch_steps", 0)
        check_int(self, "overlap_max_tokens", 0)
        check_int(self, "decode_split_programs", 0)
        if self.e2m1_placed_words is not None:
            check_bool(self, "e2m1_placed_words")
        if self.split_min_block_m is not None:
            check_int(self, "split_min_block_m", 2)
        if not isinstance(self.e2m1_layout, str):
            raise TypeError(
                f"TritonOptions.e2m1_layout must be a str, got {type(self.e2m1_layout).__name__}"
            )
        if self.e2m1_layout not in E2M1_LAYOUTS:
            raise ValueError(
                f"TritonOptions.e2m1_layout must be one of {', '.join(E2M1_LAYOUTS)}, "
                f"got {self.e2m1_layout!r}"
            )
        if not isinstance(self.autotune, str):
            raise TypeError(
                f"TritonOptions.autotune must be a str, got {type(self.autotune).__name__}"
            )
        if self.autotune not in AUTOTUNE_MODES:
            raise ValueError(
                f"TritonOptions.autotune must be one of {', '.join(AUTOTUNE_MODES)}, "
                f"got {self.autotune!r}"
            )
        if self.tile_dirs is not None:
            object.__setattr__(self, "tile_dirs", _folders(self.tile_dirs))

    def __repr__(self) -> str:
        """The fields that differ from the defaults, as a call that rebuilds the value."""
        return changed_repr(self)

    def differs_at_prepare(self, other: TritonOptions) -> bool:
        """Whether weights prepared with ``other`` differ from those prepared with these."""
        return any(getattr(self, f) != getattr(other, f) for f in PREPARE_TIME_FIELDS)


_BOOL_FIELDS = (
    "scale_prefetch",
    "scale_tiles",
    "fragment_async_mma",
    "mask_padding_rows",
    "fuse_input_quant_off_gpu",
    "launch_cache",
    "pdl",
    "lora_in_sequence",
    "stream_gemms",
)


def _folders(value) -> tuple[str, ...]:
    """``tile_dirs`` as a tuple of folder names (one folder may be given alone), a leading
    ``~`` expanded (read as a folder literally named ``~``, the folder was never found)."""
    if isinstance(value, (str, os.PathLike)):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"TritonOptions.tile_dirs must be None or a sequence of folders, "
            f"got {type(value).__name__}"
        )
    out = []
    for item in value:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(
                f"TritonOptions.tile_dirs entries must be str or path-like, "
                f"got {type(item).__name__}"
            )
        out.append(os.path.expanduser(os.fspath(item)))
    return tuple(out)


#: The defaults (the registered ``triton`` backend's options).
DEFAULT_OPTIONS = TritonOptions()
