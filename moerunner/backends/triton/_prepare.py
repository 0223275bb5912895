# Stage "prepare" of the triton backend (private): each weight described for the GEMM kernel
# and re-laid once, when weights are prepared, never per call.
#
# ``kernel_weight`` turns a plain or quantized weight into a ``KernelWeight``: the tensors the
# kernel reads (fp8 kept as fp8, scale codes as bytes) and the constexprs that describe them.
# Packed 4-bit weights are re-laid: int4 (and e2m1 with ``TritonOptions.e2m1_layout`` "split")
# into the split layout (``split_packed``), e2m1 (mxfp4, nvfp4) into the fragment layout
# (``fragment_packed``), with their scales padded to match. Each ``KernelWeight`` records how
# as a ``WeightLayout``, which also undoes it. ``prepare`` does both weights, records the
# backend's options and finds the weights' tuned tiles.

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...config import ExpertSpec
from ...device_files import gpu_name
from ...errors import MoeInputError
from ...quant.schemes import QuantScheme
from ...weights import ExpertWeights, PreparedWeights, is_quantized
from ..base import SchemeSupport
from . import _operands as OP
from ._operands import QDOT_ACTIVATIONS
from ._weight_decode import e2m1_word_bits, placed_words_checked
from .options import DEFAULT_OPTIONS, TritonOptions
from .tile_config import TileSource, find_tiles

_log = logging.getLogger(__name__)

_SCALE_FMT = {"none": OP.SF_NONE, "fp32": OP.SF_FP32, "e8m0": OP.SF_E8M0, "e4m3": OP.SF_E4M3}
_W_FORMAT = {"e4m3": OP.WF_FP8, "int8": OP.WF_INT8, "int4": OP.WF_UINT4, "e2m1": OP.WF_E2M1}
# The kernels' input-scale layout per activation format fed to the MMA quantized ("qdot").
_QDOT_ACT = {
    fmt: {"row": OP.AS_ROW, "group": OP.AS_GROUP}[scales]
    for fmt, scales in QDOT_ACTIVATIONS.items()
}

#: K groups of weight-only int4 / int8 group scales the kernels implement.
_WEIGHT_GROUPS = (32, 64, 128)
#: K blocks of block-scaled fp8 the kernels implement (activations grouped alike).
_FP8_K_BLOCKS = (64, 128)
_FP8_GROUP_ACT = ("fp8_group128", "fp8_group")


def _scheme_rule(s: QuantScheme) -> str:
    """What the kernels cannot compute of ``s`` ("" when they can), from its fields alone."""
    if s.activation_scales != "dynamic":
        return "static activation scales are not implemented"
    family, act, gran = s.family, s.activation_format, s.granularity
    if family == "fp8" and gran in ("tensor", "channel"):
        return "" if act == "fp8_token" else "fp8 per tensor / channel needs fp8_token inputs"
    if family == "fp8":
        if act not in _FP8_GROUP_ACT or s.activation_group_size != s.block_shape[1]:
            return "block-scaled fp8 needs fp8 inputs grouped by the weight's K block"
        if s.block_shape[1] not in _FP8_K_BLOCKS:
            return f"block-scaled fp8 needs K blocks of {' or '.join(map(str, _FP8_K_BLOCKS))}"
        return ""
    if family == "mx":
        accepted = ("mxfp8",) if s.weight_format == "e4m3" else ("none", "mxfp8")
        return "" if act in accepted else f"{s.weight_format} MX weights need inputs {accepted}"
    if family == "int8" and gran == "channel":
        return "" if act in ("int8_token", "none") else "int8 needs int8_token or bf16 inputs"
    if act != "none":
        return f"{family} weights are weight-only here (activation_format 'none')"
    if family in ("int4", "int8") and s.block_shape[1] not in _WEIGHT_GROUPS:
        return f"weight-only group scales need groups of {_WEIGHT_GROUPS} along K"
    return ""


#: The schemes the kernels implement, as a predicate over scheme fields (static activation
#: scales are not claimed; w13 and w2 share one scheme).
# Mixed w13 / w2 schemes: each GEMM reads its weight (and quantizes its input) by that
# weight's own scheme, so any two supported schemes pair.
SUPPORTED_SCHEMES = SchemeSupport(
    frozenset({"plain", "fp8", "mx", "nvfp4", "int8", "int4"}), _scheme_rule, mixed=True
)


@dataclass(frozen=True)
class KernelWeight:
    """One weight (w13 or w2) as the GEMM kernel reads it, with its constexpr description."""

    data: torch.Tensor  # [E, N, K] in the storage dtype (e4m3 stays fp8) or packed [E, N, K/2]
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    global_scale: torch.Tensor | None
    scheme: Any  # QuantScheme or None for plain weights
    shape: tuple[int, int, int]
    constexprs: dict[str, int | bool]
    layout: WeightLayout  # how data and scale were re-laid (``WeightLayout.invert`` undoes it)

    @property
    def activation_format(self) -> str:
        """How this GEMM's input is quantized ("none" for plain and weight-only schemes)."""
        return "none" if self.scheme is None else self.scheme.activation_format

    @functools.cached_property
    def scale_tiles(self) -> bool:
        """Whether the kernel may read a K step's scale codes as one tile (``scale_tiles_ok``;
        decided once per weight, not per launch)."""
        return scale_tiles_ok(self)


def _as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """Scales and zero points as the kernel decodes them: 8-bit floats viewed as bytes.

    MMA operands (weights, quantized activations) keep their fp8 dtype instead: a load that
    yields fp8 goes from the shared-memory copy straight into the MMA, while a byte load
    bitcast in registers forces a round trip through registers on every K step."""
    if t is None:
        return None
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return t.contiguous().view(torch.uint8)
    return t.contiguous()


def _strided_ok(w: torch.Tensor) -> torch.Tensor:
    """A plain weight as the GEMM reads it: through its strides (``stride_we/wn/wk``) when
    one of its last two dims is contiguous, e.g. a transposed view of a model's ``[E, K, N]``
    parameter, read in place with no copy of the experts; otherwise a contiguous copy."""
    if w.stride(-1) == 1 or w.stride(-2) == 1:
        return w
    return w.contiguous()


def kernel_weight(
    w: Any, gate_up_pairs: bool = False, options: TritonOptions = DEFAULT_OPTIONS
) -> KernelWeight:
    """Describe a plain or quantized weight for the kernel (done once, in prepare).

    ``gate_up_pairs``: ``w`` is a gated w13 stored gate rows then up rows; layouts that keep
    a tile's rows contiguous (``fragment_packed``) store it as (gate, up) row pairs instead,
    the column order of the kernel's gated tile. ``options``: the backend's (the e2m1
    layout)."""
    if is_quantized(w) and not w.scheme.is_quantized:  # quantize(w, "bf16"/"fp16"/"fp32")
        w = w.data
    if not is_quantized(w):
        return KernelWeight(
            _strided_ok(w),
            None,
            None,
            None,
            None,
            tuple(w.shape),
            dict(
                W_FORMAT=OP.WF_PLAIN,
                QDOT=False,
                A_SCALE=OP.AS_NONE,
                SCALE_FMT=OP.SF_NONE,
                GROUP_K=0,
                SCALE_ROW_BLOCK=1,
                HAS_ZP=False,
                HAS_GSCALE=False,
                HALF=0,
                MERGED_SCALE=False,
                FRAG=False,
            ),
            STORED,
        )
    scheme = w.scheme
    why = SUPPORTED_SCHEMES.check(scheme)
    if why:
        raise MoeInputError(
            f"the triton backend cannot compute this weight: {why}; supported: "
            f"{', '.join(SUPPORTED_SCHEMES.names())} and schemes with their fields"
        )
    act = scheme.activation_format
    qdot = act in _QDOT_ACT
    gran = scheme.granularity
    group_k = scheme.block_shape[1] if gran in ("block", "group") else 0
    row_block = {
        "tensor": 0,
        "channel": 1,
        "block": scheme.block_shape[0] if scheme.block_shape else 1,
        "group": 1,
    }[gran]
    consts = dict(
        W_FORMAT=_W_FORMAT[scheme.weight_format],
        QDOT=qdot,
        A_SCALE=_QDOT_ACT.get(act, OP.AS_NONE),
        SCALE_FMT=_SCALE_FMT[scheme.scale_format],
        GROUP_K=group_k,
        SCALE_ROW_BLOCK=row_block,
        HAS_ZP=w.zero_point is not None,
        HAS_GSCALE=w.global_scale is not None,
        HALF=0,
        MERGED_SCALE=False,
        FRAG=False,
    )
    gscale = None if w.global_scale is None else w.global_scale.float().contiguous()
    data = w.data.contiguous()
    scale = _as_bytes(w.scale)
    layout = STORED
    if scheme.packed:
        # e8m0 scales up to 2^1 can carry the fp4 decode's 2^126 in bf16: one multiply per
        # weight pair instead of two (real checkpoints' scales are far below that).
        consts["MERGED_SCALE"] = scheme.scale_format == "e8m0" and (
            w.scale.numel() == 0 or int(w.scale.view(torch.uint8).max()) <= 128
        )
        n, k = w.shape[1], w.shape[2]
        if fragment_ok(scheme, options):
            consts["FRAG"] = True
            layout = WeightLayout(
                "fragment",
                n,
                k,
                group_k=group_k,
                gate_up_pairs=gate_up_pairs,
                placed_words=placed_words(options),
            )
        else:
            half = consts["HALF"] = split_half(scheme)
            layout = WeightLayout("split", n, k, half=half, pad_scales=half == group_k)
        data, scale = layout.apply(data, scale)
    return KernelWeight(
        data, scale, _as_bytes(w.zero_point), gscale, scheme, tuple(w.shape), consts, layout
    )


# Group scales of packed weights are padded to a multiple of this many groups (and to rows of
# a multiple of 16 bytes), so a K step of up to four chunks reads its scales as one aligned,
# in-bounds tile. Padded groups meet the zero-padded nibbles of ``split_packed``.
SCALE_GROUP_MULTIPLE = 8


def _scale_group_multiple(scale: torch.Tensor) -> int:
    """Groups per padded row: a multiple of ``SCALE_GROUP_MULTIPLE`` and of 16 bytes."""
    return max(SCALE_GROUP_MULTIPLE, 16 // scale.element_size())


def pad_scale_groups(scale: torch.Tensor) -> torch.Tensor:
    """``[E, N, G]`` group scales zero-padded along G to whole 16-byte rows of at least
    ``SCALE_GROUP_MULTIPLE`` groups' granularity (once, at prepare time)."""
    pad = -scale.shape[-1] % _scale_group_multiple(scale)
    return torch.nn.functional.pad(scale, (0, pad)) if pad else scale


def scale_tiles_ok(w: KernelWeight) -> bool:
    """True when ``w``'s group scales are padded for the kernel's per-step scale tiles
    (``KernelWeight.scale_tiles`` keeps the answer per weight)."""
    s = w.scale
    return (
        w.constexprs["HALF"] > 0
        and s is not None
        and s.dim() == 3
        and s.shape[-1] % _scale_group_multiple(s) == 0
        and s.stride(-1) == 1
    )


def split_half(scheme: Any) -> int:
    """HALF of a packed scheme's split layout: its scale group along K, at most 64, so each
    half of a chunk has one scale per row."""
    return min(scheme.block_shape[1], 64)


def split_packed(data: torch.Tensor, k: int, half: int) -> torch.Tensor:
    """Packed 4-bit ``[E, N, K/2]`` (byte j: k = 2j, 2j + 1) to the split layout.

    K is cut into chunks of ``2 * half``; byte j of chunk c holds k = c*2*half + j (low nibble)
    and k = c*2*half + half + j (high nibble). K is zero-padded to whole chunks. Done once per
    expert at prepare time, so the kernel reads A in two contiguous halves with one scale each.
    """
    e, n, _ = data.shape
    chunk = 2 * half
    padded = -(-k // chunk) * chunk
    out = torch.empty(e, n, padded // 2, dtype=torch.uint8, device=data.device)
    for i in range(e):
        codes = torch.stack((data[i] & 0xF, data[i] >> 4), dim=-1).reshape(n, -1)[:, :k]
        codes = torch.nn.functional.pad(codes, (0, padded - k)).view(n, -1, 2, half)
        out[i] = (codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)).reshape(n, -1)
    return out


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., K]`` to bytes ``[..., ceil(K / 2)]`` (low nibble = even k)."""
    codes = torch.nn.functional.pad(codes, (0, codes.shape[-1] % 2))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unsplit_packed(data: torch.Tensor, k: int, half: int) -> torch.Tensor:
    """Inverse of ``split_packed``: the split layout back to packed ``[E, N, K/2]``."""
    e, n, _ = data.shape
    chunks = data.view(e, n, -1, half)
    codes = torch.stack((chunks & 0xF, chunks >> 4), dim=-2)  # [E, N, chunk, lo/hi, half]
    return _pack_codes(codes.reshape(e, n, -1)[..., :k])


# The fragment layout of packed e2m1 weights (mxfp4, nvfp4). The kernel computes
# acc^T = W @ A^T with the dequantized weights as the MMA's left operand held in registers
# (Hopper's wgmma takes A from registers), so each thread decodes exactly the values of its
# own MMA fragments: no shared-memory round trip or register shuffle between the decode and
# the MMA. For 16-bit operands a thread's fragment of rows (g, g + 8) of a 16-row block and
# a 16-wide K step is k = 2t, 2t + 1, 2t + 8, 2t + 9 (t = lane % 4, g = lane // 4). Within a
# chunk of FRAGMENT_K = 128 along K this layout stores, per pair of rows (g, g + 8) of each
# 16-row block, the 32 bytes of each t contiguously; byte (a, r, j) of a run (a = 0..7, r =
# 0 for row g and 1 for g + 8, j = 0, 1) holds k = 16a + 2t + j in its low nibble and
# k = 16a + 8 + 2t + j in its high one. So a 4-byte word decodes into four bf16x2 registers
# that are MMA fragments as they stand, its 8 values share one scale group of 16 or 32 per
# row, and a thread loads its bytes 16 at a time. Where ``placed_words`` says so, each
# word's 32 bits are then placed for that decode (``_weight_decode.e2m1_word_bits``: a
# rotate and a mask per register).
FRAGMENT_K = 128
# Rows are zero-padded to a multiple of the widest tile (2 * BLOCK_N <= 256 rows).
FRAGMENT_ROWS = 256


def fragment_ok(scheme: Any, options: TritonOptions = DEFAULT_OPTIONS) -> bool:
    """Whether ``scheme``'s weights are prepared in the fragment layout: e2m1 with scale
    groups of 16 or 32 (one group per decoded word), where ``options.e2m1_layout`` says
    "fragment" (the default; the measurements are on ``TritonOptions.e2m1_layout``)."""
    return (
        options.e2m1_layout == "fragment"
        and scheme.weight_format == "e2m1"
        and scheme.granularity == "group"
        and scheme.block_shape[1] in (16, 32)
    )


def placed_words(options: TritonOptions = DEFAULT_OPTIONS) -> bool:
    """Whether the fragment layout stores its words placed for the word decode
    (``TritonOptions.e2m1_placed_words``; ``None``: with the Triton versions checked on a GPU)."""
    if options.e2m1_placed_words is None:
        return placed_words_checked()
    return options.e2m1_placed_words


def weight_layout(w: KernelWeight) -> str | None:
    """Name of ``w``'s prepared layout where its tiles are tuned apart from the scheme's
    default: "fragment" for e2m1 in the fragment layout, else None."""
    return w.layout.tile_key


def gate_up_pair_order(rows: int) -> torch.Tensor:
    """Row order of a gated w13 (gate rows, then up rows) as (gate c, up c) pairs."""
    half = torch.arange(rows // 2)
    return torch.stack((half, half + rows // 2), dim=1).reshape(-1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def fragment_packed(
    data: torch.Tensor, k: int, row_order: torch.Tensor | None = None, placed: bool = False
) -> torch.Tensor:
    """Packed e2m1 ``[E, N, K/2]`` (byte j: k = 2j low nibble, 2j + 1 high) to the fragment
    layout ``[E, N_pad / 2, K_pad]`` (module comment above): rows taken in ``row_order``
    (default: as stored) and zero-padded to a multiple of ``FRAGMENT_ROWS``, K zero-padded
    to a multiple of ``FRAGMENT_K``. Storage row ``8b + g`` holds weight rows ``16b + g``
    and ``16b + g + 8``. ``placed``: each word's bits placed for the word decode
    (``e2m1_word_bits``), else plain bytes. Done once per expert at prepare time."""
    e, n, _ = data.shape
    n_pad, k_pad = _round_up(n, FRAGMENT_ROWS), _round_up(k, FRAGMENT_K)
    out = torch.empty(e, n_pad // 2, k_pad, dtype=torch.uint8, device=data.device)
    for i in range(e):
        codes = torch.stack((data[i] & 0xF, data[i] >> 4), dim=-1).reshape(n, -1)[:, :k]
        if row_order is not None:
            codes = codes[row_order.to(codes.device)]
        codes = torch.nn.functional.pad(codes, (0, k_pad - k, 0, n_pad - n))
        # rows (block, r, g), k (chunk, a, nibble, t, j)
        c = codes.view(n_pad // 16, 2, 8, k_pad // FRAGMENT_K, 8, 2, 4, 2)
        byte = c[..., 0, :, :] | (c[..., 1, :, :] << 4)  # block, r, g, chunk, a, t, j
        plain = byte.permute(0, 2, 3, 5, 4, 1, 6).reshape(n_pad // 2, k_pad)
        out[i] = _permute_word_bits(plain, e2m1_word_bits()) if placed else plain
    return out


def _permute_word_bits(data: torch.Tensor, bits: tuple[int, ...]) -> torch.Tensor:
    """uint8 ``data`` (last dim a multiple of 4) as little-endian 32-bit words with bit ``p``
    of each moved to bit ``bits[p]`` (``e2m1_word_bits``: the fragment layout's placement)."""
    shape = data.shape
    b = data.reshape(-1, 4).to(torch.int64)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    placed = torch.zeros_like(words)
    for src, dst in enumerate(bits):
        placed |= ((words >> src) & 1) << dst
    out = torch.stack([(placed >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return out.to(torch.uint8).reshape(shape)


def _inverse_bits(bits: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(bits)
    for src, dst in enumerate(bits):
        out[dst] = src
    return tuple(out)


def unfragment_packed(
    data: torch.Tensor,
    n: int,
    k: int,
    row_order: torch.Tensor | None = None,
    placed: bool = False,
) -> torch.Tensor:
    """Inverse of ``fragment_packed``: the fragment layout of ``n`` rows (stored in
    ``row_order``, words ``placed`` or plain) and ``k`` columns back to packed ``[E, N, K/2]``."""
    e, half_rows, k_pad = data.shape
    n_pad = 2 * half_rows
    if placed:
        data = _permute_word_bits(data, _inverse_bits(e2m1_word_bits()))
    # storage (block, g, chunk, t, a, r, j) -> (block, r, g, chunk, a, t, j)
    byte = data.view(e, n_pad // 16, 8, k_pad // FRAGMENT_K, 4, 8, 2, 2)
    byte = byte.permute(0, 1, 6, 2, 3, 5, 4, 7)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-3)  # nibble before (t, j)
    codes = codes.reshape(e, n_pad, k_pad)[:, :n, :k]
    if row_order is not None:
        codes = codes[:, torch.argsort(row_order.to(codes.device))]
    return _pack_codes(codes)


def fragment_scales(
    scale: torch.Tensor, k: int, group_k: int, row_order: torch.Tensor | None = None
) -> torch.Tensor:
    """Group scale codes ``[E, N, G]`` for the fragment layout: rows in ``row_order`` and
    zero-padded like ``fragment_packed``'s, groups zero-padded to whole K chunks and then to
    16-byte rows. With rows 16-byte aligned, each K step's [rows, 128 / group_k] scale tile is
    a 4- or 8-byte aligned load per row, which Triton copies asynchronously with the weights
    (unaligned, it was a global load each step waited on)."""
    if row_order is not None:
        scale = scale[:, row_order.to(scale.device)]
    e, n, g = scale.shape
    pad_g = _round_up(_round_up(k, FRAGMENT_K) // group_k, _scale_group_multiple(scale)) - g
    pad_n = _round_up(n, FRAGMENT_ROWS) - n
    return torch.nn.functional.pad(scale, (0, pad_g, 0, pad_n)).contiguous()


@dataclass(frozen=True)
class WeightLayout:
    """How ``kernel_weight`` re-laid one weight's data and group scales, as a value with its
    inverse: ``apply`` lays canonical tensors out, ``invert`` gives them back (bytes for
    8-bit scale codes). ``kind``:

    - "stored": as given (plain and 8-bit weights, which the kernel reads as stored);
    - "split": packed 4-bit in chunks of ``2 * half`` along K (``split_packed``), group
      scales zero-padded to 16-byte rows when ``pad_scales`` (``pad_scale_groups``);
    - "fragment": packed e2m1 in MMA fragment order (``fragment_packed``), rows as (gate,
      up) pairs when ``gate_up_pairs``, scales to match (``fragment_scales``), words with
      their bits placed for the word decode when ``placed_words``.

    ``rows`` and ``k`` are the canonical weight's N and K; ``group_k`` its scale group."""

    kind: str = "stored"
    rows: int = 0
    k: int = 0
    half: int = 0
    pad_scales: bool = False
    group_k: int = 0
    gate_up_pairs: bool = False
    placed_words: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("stored", "split", "fragment"):
            raise ValueError(f"kind must be stored, split or fragment, got {self.kind!r}")

    @property
    def tile_key(self) -> str | None:
        """The layout's name in tuned tile files, where tiles are tuned apart from the
        scheme's default layout: "fragment", else None."""
        return "fragment" if self.kind == "fragment" else None

    def _row_order(self) -> torch.Tensor | None:
        return gate_up_pair_order(self.rows) if self.gate_up_pairs else None

    def apply(
        self, data: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Canonical (data, scale codes) -> this layout (once, at prepare time)."""
        if self.kind == "split":
            data = split_packed(data, self.k, self.half)
            if self.pad_scales and scale is not None:
                scale = pad_scale_groups(scale)
        elif self.kind == "fragment":
            order = self._row_order()
            data = fragment_packed(data, self.k, order, self.placed_words)
            if scale is not None:
                scale = fragment_scales(scale, self.k, self.group_k, order)
        return data, scale

    def invert(
        self, data: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This layout -> canonical (data ``[E, N, K/2]`` packed, scale codes ``[E, N, G]``)."""
        if self.kind == "split":
            data = unsplit_packed(data, self.k, self.half)
            if self.pad_scales and scale is not None:
                scale = scale[..., : -(-self.k // self.half)]
        elif self.kind == "fragment":
            order = self._row_order()
            data = unfragment_packed(data, self.rows, self.k, order, self.placed_words)
            if scale is not None:
                scale = scale[:, : self.rows, : -(-self.k // self.group_k)]
                if order is not None:
                    scale = scale[:, torch.argsort(order.to(scale.device))]
        return data, scale


#: Weights the kernel reads as given.
STORED = WeightLayout()


def layer_tiles(
    spec: ExpertSpec,
    scheme: QuantScheme,
    w13: KernelWeight,
    tile_dirs: tuple[str, ...] | None,
) -> TileSource:
    """The tiles of a layer whose w13 (of ``scheme``) was prepared as ``w13``: the first
    tuned file for its shape, layout and GPU in ``tile_dirs`` (``TritonOptions.tile_dirs``),
    else the heuristic."""
    return find_tiles(
        spec.num_experts,
        spec.intermediate_size,
        spec.hidden_size,
        scheme,
        gpu_name(w13.data.device),
        dtype_bytes=w13.data.element_size(),
        layout=w13.layout.tile_key,
        tile_dirs=tile_dirs,
    )


def prepare(
    weights: ExpertWeights, spec: ExpertSpec, name: str, options: TritonOptions
) -> PreparedWeights:
    """Make the kernels' view of the weights once (contiguous, byte views, fp32 biases,
    packed 4-bit re-laid as ``options`` say), record ``options`` for the launches and find
    the weights' tuned tiles (``tensors["tiles"]``; its file, if any, in the notes).

    The result keeps no reference to ``weights`` (``source`` is None): it holds the tensors
    it reads as stored (shared with ``weights``) and the re-laid ones (its own), so once the
    caller drops ``weights`` the canonical packed data of re-laid 4-bit weights is freed."""
    prepared = PreparedWeights(backend=name, source=None, spec=spec, options=options)
    t = prepared.tensors
    pairs = spec.gated and not spec.gate_up_interleaved
    t["w13"] = kernel_weight(weights.w13, gate_up_pairs=pairs, options=options)
    t["w2"] = kernel_weight(weights.w2, options=options)
    for key, bias in (("w13_bias", weights.w13_bias), ("w2_bias", weights.w2_bias)):
        t[key] = None if bias is None else bias.float().contiguous()
    w13 = t["w13"]
    t["tiles"] = layer_tiles(spec, weights.w13_scheme, w13, options.tile_dirs)
    layouts = sorted({t["w13"].layout.kind, t["w2"].layout.kind})
    prepared.notes.append(
        f"weights in the {'/'.join(layouts)} layout; biases as float32; "
        f"tiles: {t['tiles'].describe()}"
    )
    _log.debug("%s: prepared %s; %s", name, spec, prepared.notes[-1])
    return prepared
