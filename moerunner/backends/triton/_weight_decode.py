# Stage "experts" of the triton backend: operand tiles for the grouped GEMM (private).
#
# The A tile and the weight tiles as the grouped GEMM's K loop reads them (weights one element
# per weight, dequantized by group scales where the scheme has them), scale codes (e8m0,
# e4m3, fp32) to multipliers, and packed 4-bit weights (int4, fp4 e2m1) in the split layout
# of ``_prepare.split_packed`` to the MMA's operand type: on the GPU through packed integer
# PTX for fp4 with bf16 activations, elsewhere in float32. ``_gemm_kernel`` calls these from
# its K loop.

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_scale(s, SCALE_FMT: tl.constexpr):
    """Turn loaded scale storage into float32 multipliers."""
    if SCALE_FMT == 2:
        # e8m0: 2^(e - 127) built from bits (exact; ``tl.exp2`` is an approximation on the
        # GPU): code 0 is the fp32 subnormal 2^-127, 255 is NaN per the OCP MX spec.
        e = s.to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
        out = bits.to(tl.float32, bitcast=True)
    elif SCALE_FMT == 3:
        out = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        out = s.to(tl.float32)
    return out


@triton.jit
def _channel_scale(s_base, rows, stride_sn, SCALE_FMT: tl.constexpr):
    """Per-output-row (or per-tensor when stride_sn == 0) weight scale, float32 [BN]."""
    return _decode_scale(tl.load(s_base + rows * stride_sn), SCALE_FMT)


@triton.jit
def _decode_e2m1(q):
    """Nibble (uint8 0..15) -> float32 value of an fp4 e2m1 element."""
    sign = tl.where((q & 8) != 0, -1.0, 1.0)
    exp = ((q >> 1) & 3).to(tl.float32)
    man = (q & 1).to(tl.float32)
    mag = tl.where(exp == 0.0, 0.5 * man, (1.0 + 0.5 * man) * tl.exp2(exp - 1.0))
    return sign * mag


def _e2m1_place_ptx(select: str) -> str:
    """PTX: two bytes of the packed word ``$in`` (picked by the prmt pattern ``select``) to two
    bf16x2 registers, ``lo`` (low nibbles) and ``hi`` (high nibbles). prmt puts the bytes in
    bits 8-15 and 24-31; a nibble's sign goes to bit 15 of its half-word and its 3
    exponent/mantissa bits to bits 6-8, which is the bf16 pattern of the e2m1 value times
    2^-126 (code 1 lands on the subnormal 2^-127 = 0.5 * 2^-126)."""
    return f"""
        prmt.b32 t, $in, 0, {select};
        shl.b32 lo, t, 4;
        and.b32 lo, lo, 0x80008000;
        shr.b32 v, t, 2;
        and.b32 v, v, 0x01C001C0;
        or.b32 lo, lo, v;
        and.b32 hi, t, 0x80008000;
        shr.b32 v, t, 6;
        and.b32 v, v, 0x01C001C0;
        or.b32 hi, hi, v;"""


def _e2m1_bf16_asm(merged: bool) -> str:
    """Four packed bytes ($4) and bf16x2 scales ($5, $6 for the low nibbles, $7, $8 for the
    high ones) -> bf16x2 low-nibble values times scale ($0, $1) and high ones ($2, $3).

    bf16x2 FMAs keep subnormals, and the addend ``nz`` = -0 keeps the sign of zeros. Unmerged,
    one FMA by ``bias`` = 2^126 gives the exact e2m1 value, a second the scale; ``merged``
    scales already carry the 2^126 and one FMA does both."""
    bodies = []
    for select, lo_out, hi_out, s_lo, s_hi in (
        ("0x1404", "$0", "$2", "$5", "$7"),
        ("0x3424", "$1", "$3", "$6", "$8"),
    ):
        body = _e2m1_place_ptx(select)
        if not merged:
            body += """
        fma.rn.bf16x2 lo, lo, bias, nz;
        fma.rn.bf16x2 hi, hi, bias, nz;"""
        bodies.append(
            body
            + f"""
        fma.rn.bf16x2 {lo_out}, lo, {s_lo}, nz;
        fma.rn.bf16x2 {hi_out}, hi, {s_hi}, nz;"""
        )
    return (
        "{\n.reg .b32 t, lo, hi, v, bias, nz;\nmov.b32 bias, 0x7E807E80;\n"
        "mov.b32 nz, 0x80008000;" + "".join(bodies).replace("$in", "$4") + "\n}"
    )


_E2M1_BF16_ASM = tl.constexpr(_e2m1_bf16_asm(merged=False))
_E2M1_BF16_MERGED_ASM = tl.constexpr(_e2m1_bf16_asm(merged=True))


# Words of the fragment layout (``_prepare.fragment_packed``). Byte i of a word holds, in its
# low and high nibble, the values of bf16x2 registers 2 * nibble + i // 2 (half i % 2) of the
# decode's output (``_e2m1_halves_bf16``: low nibbles of bytes 0, 1; of bytes 2, 3; high
# nibbles of bytes 0, 1; of bytes 2, 3). Stored, the 32 bits are placed for that decode:
# register m is rotate-right(word, DS) masked to its two sign bits (15, 31) plus
# rotate-right(word, DM) masked to its two 3-bit exponent/mantissa fields (bits 6-8, 22-24),
# the bf16 patterns of the values times 2^-126, as the byte-local decode makes them with a
# byte permute, three shifts and four masks per two bytes. (DS, DM) per register, from a
# search over such placements: 11 integer instructions per word, against 15 (8 LOP3, 4 SHF,
# 3 PRMT in the byte-local decode's SASS).
E2M1_WORD_RECIPES = ((0, 10), (4, 2), (5, 5), (15, 15))

# How a fragment-layout GEMM reads its words (kernel constexpr E2M1_WORDS):
# - WORDS_PLAIN: stored as plain bytes, decoded byte by byte (``_e2m1_halves_bf16``, or the
#   float32 decode off the GPU);
# - WORDS_UNPLACE: stored placed, put back to plain bytes in the kernel first
#   (``_unplace_words``), then decoded as plain ones;
# - WORDS_DECODE: stored placed, decoded four bytes at a time (``_e2m1_halves_bf16`` with
#   PLACED).
# The word decode is only right where the four bytes that the compiler hands one assembly
# instance are one stored word in memory order. That depends on the register layout Triton
# picks for the tile, so it is used only where the GPU suite has checked it: with the Triton
# versions in PLACED_WORDS_TRITON (weights of other versions are stored plain) and on tiles
# ``word_decode_serves`` admits.
WORDS_PLAIN, WORDS_UNPLACE, WORDS_DECODE = 0, 1, 2
_WORDS_UNPLACE = tl.constexpr(WORDS_UNPLACE)
_WORDS_DECODE = tl.constexpr(WORDS_DECODE)
PLACED_WORDS_TRITON = ((3, 6),)


def placed_words_checked() -> bool:
    """Whether this Triton's version is one the word decode was checked with on a GPU."""
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return (major, minor) in PLACED_WORDS_TRITON


def word_decode_serves(width: int, num_warps: int) -> bool:
    """Whether a fragment-layout tile of ``width`` weight rows (2 * BLOCK_N for a gated
    GEMM1) and ``num_warps`` warps decodes placed words as words. On an H100 with Triton 3.6
    every tile of 16-128 token rows, 16-256 weight rows and 4 or 8 warps got the words in
    memory order (outputs bit-identical to the split layout's) except 32 weight rows with 4
    warps, whose assembly instances get bytes of two words (relative error 1.3-1.4); those
    put the words back to plain bytes first (``WORDS_UNPLACE``)."""
    return not (width == 32 and num_warps == 4)


def e2m1_words(placed: bool, bf16_fp4: bool, width: int, num_warps: int) -> int:
    """E2M1_WORDS of a fragment-layout launch: weights stored ``placed`` (or plain), decoded
    through the packed bf16 assembly (``bf16_fp4``) or not, on a tile of ``width`` weight rows
    and ``num_warps`` warps."""
    if not placed:
        return WORDS_PLAIN
    if bf16_fp4 and word_decode_serves(width, num_warps):
        return WORDS_DECODE
    return WORDS_UNPLACE


_DS0, _DM0 = tl.constexpr(E2M1_WORD_RECIPES[0][0]), tl.constexpr(E2M1_WORD_RECIPES[0][1])
_DS1, _DM1 = tl.constexpr(E2M1_WORD_RECIPES[1][0]), tl.constexpr(E2M1_WORD_RECIPES[1][1])
_DS2, _DM2 = tl.constexpr(E2M1_WORD_RECIPES[2][0]), tl.constexpr(E2M1_WORD_RECIPES[2][1])
_DS3, _DM3 = tl.constexpr(E2M1_WORD_RECIPES[3][0]), tl.constexpr(E2M1_WORD_RECIPES[3][1])


def e2m1_word_bits() -> tuple[int, ...]:
    """Where each bit of a plain word goes in a placed one: ``placed[bits[p]] = plain[p]``.
    Plain bit ``8i + 4 * nibble + b`` is bit b of that nibble of byte i (b = 3: the sign)."""
    out = [0] * 32
    for i in range(4):
        for nibble in range(2):
            ds, dm = E2M1_WORD_RECIPES[2 * nibble + i // 2]
            half = 16 * (i % 2)
            base = 8 * i + 4 * nibble
            out[base + 3] = (15 + half + ds) % 32
            for b in range(3):
                out[base + b] = (6 + b + half + dm) % 32
    return tuple(out)


def _rotated_word(lines: list[str], d: int, reg: str) -> str:
    """The register holding ``$4`` rotated right by ``d`` (appending the rotation to
    ``lines`` unless ``d`` is 0)."""
    if d == 0:
        return "$4"
    lines.append(f"shf.r.wrap.b32 {reg}, $4, $4, {d};")
    return reg


def _e2m1_word_asm(merged: bool) -> str:
    """PTX of ``_e2m1_halves_bf16`` with PLACED: the operand ``$4`` is a placed word
    (``e2m1_word_bits``); outputs and scales as ``_e2m1_bf16_asm``'s."""
    lines = [
        ".reg .b32 s, g, r, v, bias, nz;",
        "mov.b32 bias, 0x7E807E80;",
        "mov.b32 nz, 0x80008000;",
    ]
    for m, (ds, dm) in enumerate(E2M1_WORD_RECIPES):
        if ds == dm:
            lines.append(f"and.b32 r, {_rotated_word(lines, ds, 's')}, 0x81C081C0;")
        else:
            sign, mag = _rotated_word(lines, ds, "s"), _rotated_word(lines, dm, "g")
            lines += [f"and.b32 r, {sign}, 0x80008000;", f"and.b32 v, {mag}, 0x01C001C0;"]
            lines.append("or.b32 r, r, v;")
        if not merged:
            lines.append("fma.rn.bf16x2 r, r, bias, nz;")
        lines.append(f"fma.rn.bf16x2 ${m}, r, ${5 + m}, nz;")
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_WORD_ASM = tl.constexpr(_e2m1_word_asm(merged=False))
_E2M1_WORD_MERGED_ASM = tl.constexpr(_e2m1_word_asm(merged=True))


@triton.jit
def _rotr(w, D: tl.constexpr):
    """Rotate a uint32 tensor right by D bits."""
    if D == 0:
        out = w
    else:
        out = (w >> D) | (w << (32 - D))
    return out


@triton.jit
def _placed_nibble(w, DS: tl.constexpr, DM: tl.constexpr, HALF: tl.constexpr):
    """One e2m1 code (uint32, 0..15) of placed words ``w``: the value the decode puts in half
    HALF of the register whose recipe is (DS, DM)."""
    sign = (_rotr(w, DS) >> (15 + 16 * HALF)) & 1
    mag = (_rotr(w, DM) >> (6 + 16 * HALF)) & 7
    return (sign << 3) | mag


@triton.jit
def _unplace_words(q, ROWS: tl.constexpr):
    """[ROWS, 128] bytes of placed words back to plain bytes (byte j: low nibble, high
    nibble), for decodes that take nibbles one by one (off the GPU, or fp16/fp32 activations)."""
    x = tl.reshape(q.to(tl.uint32), (ROWS, 32, 2, 2))  # word, byte // 2, byte % 2
    even, odd = tl.split(x)
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    w = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    o0 = _placed_nibble(w, _DS0, _DM0, 0) | (_placed_nibble(w, _DS2, _DM2, 0) << 4)
    o1 = _placed_nibble(w, _DS0, _DM0, 1) | (_placed_nibble(w, _DS2, _DM2, 1) << 4)
    o2 = _placed_nibble(w, _DS1, _DM1, 0) | (_placed_nibble(w, _DS3, _DM3, 0) << 4)
    o3 = _placed_nibble(w, _DS1, _DM1, 1) | (_placed_nibble(w, _DS3, _DM3, 1) << 4)
    out = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # word, byte // 2, byte % 2
    return tl.reshape(out, (ROWS, 128)).to(tl.uint8)


@triton.jit
def _e2m1_halves_bf16(packed, scale_lo, scale_hi, MERGED: tl.constexpr, PLACED: tl.constexpr):
    """Packed bytes -> (low nibbles * scale_lo, high nibbles * scale_hi) in bf16, on the GPU.

    Four bytes per instance in packed integer ops (``_e2m1_bf16_asm``). Products of e2m1 with
    e8m0 or e4m3 scales are exact in bf16. The scales are bf16 tensors of packed's shape, from
    ``_scale_bf16`` with the same ``MERGED``. ``PLACED``: the bytes are placed words
    (``e2m1_word_bits``) for the word decode (``_e2m1_word_asm``), with the same outputs; an
    instance's four bytes must then be one stored word in memory order (``e2m1_words``
    decides where; on an H200 the kernel with an assembly that rotates its operand's bytes
    equalled, bit for bit, the plain kernel on weights rotated within each 4-byte memory
    word, and no other order).
    """
    return tl.inline_asm_elementwise(
        asm=(_E2M1_WORD_MERGED_ASM if MERGED else _E2M1_WORD_ASM)
        if PLACED
        else (_E2M1_BF16_MERGED_ASM if MERGED else _E2M1_BF16_ASM),
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, scale_lo, scale_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _scale_bf16(s, SCALE_FMT: tl.constexpr, MERGED: tl.constexpr):
    """e8m0 or e4m3 scale storage -> the same value in bf16 (exact for both).

    ``MERGED`` (e8m0 codes <= 128 only, checked when the weights are prepared): the scale
    times 2^126, 2^(e - 1), which then is a normal bf16 for every code."""
    if SCALE_FMT == 2:
        e = s.to(tl.uint16)
        if MERGED:
            bits = (e + 126) << 7
        else:
            # 2^(e - 127) as bf16 bits; code 0 is the subnormal 2^-127, 255 is NaN.
            bits = tl.where(e == 0, 0x40, tl.where(e == 255, 0x7FC0, e << 7))
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = s.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    return out


@triton.jit
def _half_group_codes(
    base, rows, k0, K, stride_n, stride_k, GROUP_K: tl.constexpr, HALF: tl.constexpr
):
    """Per-row group values (scale or zero-point codes) [BLOCK_N] of the two halves of the
    split-layout chunk at ``k0`` (0 for a group past K)."""
    n_groups = (K + GROUP_K - 1) // GROUP_K
    g_lo = k0 // GROUP_K
    g_hi = (k0 + HALF) // GROUP_K
    lo = tl.load(base + rows * stride_n + g_lo * stride_k, mask=g_lo < n_groups, other=0)
    hi = tl.load(base + rows * stride_n + g_hi * stride_k, mask=g_hi < n_groups, other=0)
    return lo, hi


@triton.jit
def _step_scale_codes(
    s_base, rows, k0, stride_sn, stride_sk, GROUP_K: tl.constexpr, G_STEP: tl.constexpr
):
    """Scale codes [BLOCK_N, G_STEP] of the G_STEP groups from ``k0`` on, unmasked: prepare
    pads the scales' group count to a multiple of G_STEP with 16-byte aligned rows, so Triton
    copies this tile to shared memory asynchronously with the weights (a load of one byte per
    thread is below its copy width and is not pipelined)."""
    offs_g = k0 // GROUP_K + tl.arange(0, G_STEP)
    return tl.load(s_base + rows[:, None] * stride_sn + offs_g[None, :] * stride_sk)


@triton.jit
def _split_columns(t, ODD: tl.constexpr):
    """Even (or ODD) columns of a [N, 2m] tile: [N, m], or [N] for m = 1. tl.split keeps
    each pair in one thread, so this moves no data between threads."""
    if t.shape[1] == 2:
        even, odd = tl.split(t)
    else:
        even, odd = tl.split(tl.reshape(t, (t.shape[0], t.shape[1] // 2, 2)))
    if ODD:
        out = odd
    else:
        out = even
    return out


@triton.jit
def _column(t, j: tl.constexpr, G: tl.constexpr):
    """Column ``j`` of a [N, G] tile (G = 4 or 8) as [N]."""
    t = _split_columns(t, j % 2 == 1)
    t = _split_columns(t, (j // 2) % 2 == 1)
    if G == 8:
        t = _split_columns(t, j // 4 == 1)
    return t


@triton.jit
def _split_halves(
    w_base,
    s_lo,
    s_hi,
    z_base,
    rows,
    k0,
    K,
    stride_wn,
    stride_wk,
    stride_zn,
    stride_zk,
    COMPUTE: tl.constexpr,
    W_FORMAT: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_FMT: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HALF: tl.constexpr,
    BF16_FP4: tl.constexpr,
    MERGED_SCALE: tl.constexpr,
    MASK_K: tl.constexpr,
):
    """Dequantized halves [HALF, BLOCK_N] of one packed 4-bit chunk of 2 * HALF along K, in
    ``COMPUTE`` (the MMA's right operand): each value times its group scale, whose codes
    ``s_lo`` / ``s_hi`` [BLOCK_N] the caller loaded (see the kernel's K loop).

    In the split layout made by ``prepare`` byte j of a chunk holds k = k0 + j (low nibble) and
    k = k0 + HALF + j (high nibble), and HALF divides the scale group, so each half has one
    scale (and zero point) per row: no interleave or broadcast along K is needed in registers.
    ``split_packed`` zero-pads K to whole chunks, so every byte of a chunk that starts below K
    exists (a byte past (K + 1) // 2 may still hold a real low nibble); ``MASK_K`` (a K step
    of several chunks) skips chunks that start at or past K. Padded nibbles meet A's masked
    zeros; a scale group past the end loads as code 0.
    """
    offs_j = k0 // 2 + tl.arange(0, HALF)
    ptrs = w_base + offs_j[:, None] * stride_wk + rows[None, :] * stride_wn
    if MASK_K:
        packed = tl.load(ptrs, mask=k0 < K, other=0)
    else:
        packed = tl.load(ptrs)
    if BF16_FP4:
        lo_t, hi_t = _e2m1_halves_bf16(
            packed,
            tl.broadcast_to(_scale_bf16(s_lo, SCALE_FMT, MERGED_SCALE)[None, :], packed.shape),
            tl.broadcast_to(_scale_bf16(s_hi, SCALE_FMT, MERGED_SCALE)[None, :], packed.shape),
            MERGED_SCALE,
            False,
        )
    else:
        lo = packed & 0xF
        hi = (packed >> 4) & 0xF
        if W_FORMAT == 3:
            if HAS_ZP:
                z_lo, z_hi = _half_group_codes(
                    z_base, rows, k0, K, stride_zn, stride_zk, GROUP_K, HALF
                )
                z_lo = z_lo.to(tl.float32)[None, :]
                z_hi = z_hi.to(tl.float32)[None, :]
            else:
                z_lo = 8.0
                z_hi = 8.0
            # code -> float as (2^23 + code) - (2^23 + zero point): an OR into the mantissa of
            # 2^23 and one add (exact for 4-bit codes), instead of an int-to-float conversion.
            lo_v = (lo.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + z_lo)
            hi_v = (hi.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + z_hi)
        else:
            lo_v = _decode_e2m1(lo)
            hi_v = _decode_e2m1(hi)
        lo_t = (lo_v * _decode_scale(s_lo, SCALE_FMT)[None, :]).to(COMPUTE)
        hi_t = (hi_v * _decode_scale(s_hi, SCALE_FMT)[None, :]).to(COMPUTE)
    return lo_t, hi_t


@triton.jit
def _fragment_tile(
    w_base,
    s_base,
    row0,
    k0,
    stride_wn,
    stride_sn,
    stride_sk,
    COMPUTE: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_FMT: tl.constexpr,
    BF16_FP4: tl.constexpr,
    MERGED_SCALE: tl.constexpr,
    E2M1_WORDS: tl.constexpr,
):
    """Dequantized ``[WIDTH, 128]`` tile (weight rows ``row0`` on, K from ``k0``) of e2m1
    weights in the fragment layout of ``_prepare.fragment_packed``, in ``COMPUTE``: the MMA's
    left operand. The reshapes and permutes below only rename elements: with the tile as an
    MMA operand in registers, each thread's loaded bytes decode into its own fragments."""
    # Storage rows hold weight rows (g, g + 8) of each 16-row block; a chunk's 128 bytes per
    # storage row are (t, a, r, j) with the MMA's thread-in-group t outermost.
    srows = row0 // 2 + tl.arange(0, WIDTH // 2)
    q = tl.load(w_base + srows[:, None] * stride_wn + (k0 + tl.arange(0, 128))[None, :])
    if E2M1_WORDS == _WORDS_UNPLACE:
        q = _unplace_words(q, WIDTH // 2)
    q = tl.permute(tl.reshape(q, (WIDTH // 16, 8, 4, 8, 2, 2)), (0, 4, 1, 2, 3, 5))
    packed = tl.reshape(q, (WIDTH, 64))  # row, byte (t, a, j)
    # One scale group of GROUP_K (16 or 32) spans 16 // G_STEP consecutive bytes of a t.
    G_STEP: tl.constexpr = 128 // GROUP_K
    rows = row0 + tl.arange(0, WIDTH)
    offs_g = k0 // GROUP_K + tl.arange(0, G_STEP)
    s = tl.load(s_base + rows[:, None] * stride_sn + offs_g[None, :] * stride_sk)
    if BF16_FP4:
        s = _scale_bf16(s, SCALE_FMT, MERGED_SCALE)
    else:
        s = _decode_scale(s, SCALE_FMT)
    s = tl.broadcast_to(tl.reshape(s, (WIDTH, 1, G_STEP, 1)), (WIDTH, 4, G_STEP, 16 // G_STEP))
    s = tl.reshape(s, (WIDTH, 64))
    if BF16_FP4:
        lo, hi = _e2m1_halves_bf16(packed, s, s, MERGED_SCALE, E2M1_WORDS == _WORDS_DECODE)
    else:
        lo = (_decode_e2m1(packed & 0xF) * s).to(COMPUTE)
        hi = (_decode_e2m1(packed >> 4) * s).to(COMPUTE)
    # (t, a, j, nibble) -> k = 16a + 8 * nibble + 2t + j
    w = tl.permute(tl.reshape(tl.join(lo, hi), (WIDTH, 4, 8, 2, 2)), (0, 2, 4, 1, 3))
    return tl.reshape(w, (WIDTH, 128))


@triton.jit
def _fragment_prefetch(w_base, row0, step0, stride_wn, WIDTH: tl.constexpr, STEPS: tl.constexpr):
    """Ask L2 for ``STEPS`` K steps from step ``step0`` of the fragment tile at weight rows
    ``row0`` on (one 128-byte line per storage row and step, as ``_fragment_tile`` reads
    them) without waiting for them: compiled GPU code only (inline PTX)."""
    srows = row0 // 2 + tl.arange(0, WIDTH // 2)
    ptrs = w_base + srows[:, None] * stride_wn + ((step0 + tl.arange(0, STEPS)) * 128)[None, :]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _a_tile(
    a_row_ptrs,
    k0,
    K,
    stride_ak,
    row_mask,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """[BLOCK_M, BLOCK_K] A tile of the block's rows from ``k0`` (zeros past K). MASK_ROWS:
    padding rows (``row_mask`` false) are not read but zero-filled."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = a_row_ptrs + offs_k[None, :] * stride_ak
    if MASK_ROWS:
        if EVEN_K:
            a = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            a = tl.load(ptrs, mask=row_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    elif EVEN_K:
        a = tl.load(ptrs)
    else:
        a = tl.load(ptrs, mask=offs_k[None, :] < K, other=0.0)
    return a


@triton.jit
def _plain_tile(
    w_base, rows, k0, K, stride_wn, stride_wk, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr
):
    """Raw [BLOCK_K, BLOCK_N] tile of one byte-or-wider element per weight."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_base + offs_k[:, None] * stride_wk + rows[None, :] * stride_wn
    if EVEN_K:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(
            ptrs, mask=offs_k[:, None] < K, other=0.0
        )  # 0.0 casts to every operand type, fp8 included
    return raw


@triton.jit
def _weight_tile(
    w_base,
    s_base,
    z_base,
    rows,
    k0,
    K,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zn,
    stride_zk,
    COMPUTE: tl.constexpr,
    W_FORMAT: tl.constexpr,
    QDOT: tl.constexpr,
    GROUP_K: tl.constexpr,
    SCALE_FMT: tl.constexpr,
    HAS_ZP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Load one [BLOCK_K, BLOCK_N] weight tile of expert rows ``rows`` starting at ``k0``.

    Returns the tile in the MMA operand type: the storage type for plain and qdot paths,
    ``COMPUTE`` (A's dtype) for weight-only dequantization (group scales applied here;
    per-channel scales are applied by the caller after the K loop).
    """
    # K groups per tile and the K span each group scale covers inside the tile.
    SPT: tl.constexpr = BLOCK_K // GROUP_K if GROUP_K > 0 and GROUP_K < BLOCK_K else 1
    SPAN: tl.constexpr = BLOCK_K // SPT
    if W_FORMAT == 0:
        tile = _plain_tile(w_base, rows, k0, K, stride_wn, stride_wk, BLOCK_K, EVEN_K)
    else:
        raw = _plain_tile(w_base, rows, k0, K, stride_wn, stride_wk, BLOCK_K, EVEN_K)
        if QDOT:
            tile = raw  # e4m3 or int8, fed to the MMA as stored
        else:
            v = raw.to(tl.float32)
            if GROUP_K > 0:
                offs_s = (k0 + tl.arange(0, SPT) * SPAN) // GROUP_K
                s_mask = offs_s[:, None] < (K + GROUP_K - 1) // GROUP_K
                s = tl.load(
                    s_base + offs_s[:, None] * stride_sk + rows[None, :] * stride_sn,
                    mask=s_mask,
                    other=0,
                )
                s = _decode_scale(s, SCALE_FMT)
                s = tl.reshape(
                    tl.broadcast_to(s[:, None, :], (SPT, SPAN, rows.shape[0])),
                    (BLOCK_K, rows.shape[0]),
                )
                if HAS_ZP:  # group-wise int8 with zero point: (q - zero) * scale
                    z = tl.load(
                        z_base + offs_s[:, None] * stride_zk + rows[None, :] * stride_zn,
                        mask=s_mask,
                        other=0,
                    ).to(tl.float32)
                    z = tl.reshape(
                        tl.broadcast_to(z[:, None, :], (SPT, SPAN, rows.shape[0])),
                        (BLOCK_K, rows.shape[0]),
                    )
                    v = v - z
                v = v * s
            tile = v.to(COMPUTE)
    return tile
