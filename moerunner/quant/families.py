# Scheme families: one codec object per way of storing an expert weight [E, N, K].
#
# A `QuantScheme` names its family by its fields (``QuantScheme.family``): the first codec in
# ``CODECS`` whose ``accepts`` takes the scheme stores it. A codec knows, for every scheme of
# its family, the tensors of a `QuantizedWeight` (``layout``), how float weights become them
# (``quantize``) and back (``dequantize``), what padding stores (``pad_fill``, ``pad_scale``),
# which K its groups need (``k_multiple``) and whether rows may be reordered. `QuantizedWeight`
# dispatches through this table and never branches on a family itself.
#
# Adding a scheme whose family exists is one entry in ``schemes._NAMED``; a new family is one
# more codec here (docs/architecture.md, "Adding a scheme").
#
# `cat_rows` (re-exported by ``checkpoints``) joins weights along N, e.g. gate and up into w13,
# by the same per-family rules: which scales cover a whole part, and an int scheme's implicit
# zero point when one part is the symmetric twin of another's zero-point scheme.

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from moerunner.quant import fp8, integer, mx, nvfp4
from moerunner.quant.codecs import decode_e4m3, encode_e4m3
from moerunner.quant.schemes import QuantScheme

if TYPE_CHECKING:
    from moerunner.quant.weight import QuantizedWeight

__all__ = ["CODECS", "FamilyCodec", "codec_of"]

Layout = dict[str, "tuple[torch.dtype, tuple[int, ...]] | None"]
_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FamilyCodec:
    """Storage rules shared by the schemes of one family (subclasses override what differs).

    Defaults: fp32 scales of 1.0 and data of 0 encode padding, scales are 1-D per expert,
    2-D per row or 3-D per row and K group, K needs no multiple, rows may be reordered.
    """

    #: Family name (``QuantScheme.family``).
    name: str = ""
    #: What the family stores, for the error listing every family (one line).
    summary: str = ""

    def accepts(self, scheme: QuantScheme) -> bool:
        """Whether this codec stores ``scheme``."""
        raise NotImplementedError

    def k_multiple(self, scheme: QuantScheme) -> int | None:
        """K must be a multiple of this (the K group of packed or group formats), else None."""
        return None

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        """dtype and shape of ``data``, ``scale``, ``global_scale``, ``zero_point`` (None where
        the scheme has none); ``shape`` is the logical (E, N, K)."""
        raise NotImplementedError

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensor fields of float ``weight [E, N, K]`` (non-empty) stored in ``scheme``."""
        raise NotImplementedError

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        """Float32 ``[E, N, K]`` value of ``qw``."""
        raise NotImplementedError

    def pad_fill(self, scheme: QuantScheme) -> dict[str, float]:
        """Raw fills of new data / scale / zero-point entries, which dequantize to 0 and equal
        what quantizing zeros stores."""
        return {"data": 0.0, "scale": 1.0, "zero_point": 0.0}

    def pad_scale(
        self, qw: QuantizedWeight, segments: int, rows_per_segment: int, k: int
    ) -> torch.Tensor | None:
        """``qw.scale`` after padding N per segment to ``rows_per_segment`` and K to ``k``."""
        scale, (_, n, k0) = qw.scale, qw.shape
        extra_rows = rows_per_segment - n // segments
        if scale is None or scale.dim() == 1:  # none, or one per expert
            return scale
        if scale.dim() == 2:  # per row
            return pad_rows_cols(scale[..., None], segments, extra_rows, 0, 1.0)[..., 0]
        g = qw.scheme.block_shape[1]  # per row and K group
        fill = self.pad_fill(qw.scheme)["scale"]
        return pad_rows_cols(scale, segments, extra_rows, (k - k0) // g, fill)

    def check_select_rows(self, scheme: QuantScheme) -> None:
        """Raise ValueError when rows of ``scheme`` cannot be reordered one by one."""

    def zero_point_range(self, scheme: QuantScheme) -> tuple[int, int] | None:
        """The stored zero points ``scheme`` can mean (inclusive), where its zero-point dtype
        holds more values than that; None where every value of the dtype is one (or there
        are no zero points)."""
        return None


def _packed(shape: tuple[int, int, int]) -> tuple[torch.dtype, tuple[int, ...]]:
    e, n, k = shape
    return (torch.uint8, (e, n, k // 2))


def _groups(scheme: QuantScheme, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    e, n, k = shape
    return (e, n, k // scheme.block_shape[1])


class PlainCodec(FamilyCodec):
    """bf16 / fp16 / fp32 weights, as they are."""

    name = "plain"
    summary = "unquantized bf16 / fp16 / fp32"

    def accepts(self, scheme: QuantScheme) -> bool:
        return not scheme.is_quantized

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        return {"data": (_PLAIN_DTYPES[scheme.weight_format], shape)}

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": weight.to(_PLAIN_DTYPES[scheme.weight_format])}

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return qw.data.float()


class Fp8Codec(FamilyCodec):
    """e4m3 with fp32 scales per expert, per row, or per 2-D block / 1-D K group (ceil grid:
    the last block row / column may be partial)."""

    name = "fp8"
    summary = "fp8 e4m3 with fp32 scales per tensor / channel / block / group"

    def accepts(self, scheme: QuantScheme) -> bool:
        return scheme.weight_format == "e4m3" and scheme.scale_format == "fp32"

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        e, n, k = shape
        if scheme.granularity == "tensor":
            scale = (e,)
        elif scheme.granularity == "channel":
            scale = (e, n)
        else:
            bn, bk = scheme.block_shape
            scale = (e, math.ceil(n / bn), math.ceil(k / bk))
        return {"data": (torch.float8_e4m3fn, shape), "scale": (torch.float32, scale)}

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        if scheme.granularity == "tensor":
            data, scale = fp8.quantize_fp8_tensor(w)
        elif scheme.granularity == "channel":
            data, scale = fp8.quantize_fp8_rows(w)
        else:
            data, scale = fp8.quantize_fp8_blocks(w, *scheme.block_shape)
        return {"data": data, "scale": scale}

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        g = qw.scheme.granularity
        if g == "tensor":
            return qw.data.float() * qw.scale[:, None, None]
        if g == "channel":
            return qw.data.float() * qw.scale[:, :, None]
        return fp8.dequantize_fp8_blocks(qw.data, qw.scale, *qw.scheme.block_shape)

    def pad_scale(
        self, qw: QuantizedWeight, segments: int, rows_per_segment: int, k: int
    ) -> torch.Tensor | None:
        if qw.scheme.granularity in ("block", "group"):
            return pad_block_grid(qw.scale, qw.scheme, qw.shape[1], segments, rows_per_segment, k)
        return super().pad_scale(qw, segments, rows_per_segment, k)

    def check_select_rows(self, scheme: QuantScheme) -> None:
        if scheme.block_shape is not None and scheme.block_shape[0] != 1:
            raise ValueError(
                f"index: scheme {scheme.name!r} shares one scale across "
                f"{scheme.block_shape[0]} rows, so its rows cannot be reordered"
            )


class MxCodec(FamilyCodec):
    """OCP MX: e4m3 (MXFP8) or packed e2m1 (MXFP4) with an e8m0 scale per 32 along K."""

    name = "mx"
    summary = "e4m3 or e2m1 with e8m0 scales per (1, 32)"

    def accepts(self, scheme: QuantScheme) -> bool:
        return (
            scheme.weight_format in ("e4m3", "e2m1")
            and scheme.scale_format == "e8m0"
            and scheme.granularity == "group"
            and scheme.block_shape == (1, mx.MX_BLOCK)
        )

    def k_multiple(self, scheme: QuantScheme) -> int | None:
        return scheme.block_shape[1]

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        data = (torch.float8_e4m3fn, shape) if scheme.weight_format == "e4m3" else _packed(shape)
        return {"data": data, "scale": (torch.uint8, _groups(scheme, shape))}

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        data, scale = mx.quantize_mx(weight.float(), scheme.weight_format)
        return {"data": data, "scale": scale}

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return mx.dequantize_mx(qw.data, qw.scale, qw.scheme.weight_format)

    def pad_fill(self, scheme: QuantScheme) -> dict[str, float]:
        return {"data": 0.0, "scale": 0.0, "zero_point": 0.0}  # e8m0 code 0: a zero block


class Nvfp4Codec(FamilyCodec):
    """NVFP4: packed e2m1, an e4m3 scale per 16 along K, an fp32 global scale per expert."""

    name = "nvfp4"
    summary = "e2m1 with e4m3 scales per (1, 16) and an fp32 global scale"

    def accepts(self, scheme: QuantScheme) -> bool:
        return (
            scheme.weight_format == "e2m1"
            and scheme.scale_format == "e4m3"
            and scheme.granularity == "group"
            and scheme.block_shape == (1, nvfp4.NVFP4_BLOCK)
        )

    def k_multiple(self, scheme: QuantScheme) -> int | None:
        return scheme.block_shape[1]

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        return {
            "data": _packed(shape),
            "scale": (torch.float8_e4m3fn, _groups(scheme, shape)),
            "global_scale": (torch.float32, (shape[0],)),
        }

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        gs = nvfp4.nvfp4_global_scale(w.abs().amax(dim=(-2, -1)))
        data, scale = nvfp4.quantize_nvfp4(w, gs[:, None, None])
        return {"data": data, "scale": scale, "global_scale": gs}

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return nvfp4.dequantize_nvfp4(qw.data, qw.scale, qw.global_scale[:, None, None])

    def pad_fill(self, scheme: QuantScheme) -> dict[str, float]:
        return {"data": 0.0, "scale": 0.0, "zero_point": 0.0}  # e4m3 0.0: a zero block


class Int8Codec(FamilyCodec):
    """int8 with an fp32 scale per output row, or per K group with an optional int8 zero
    point (value (q - zero) * scale)."""

    name = "int8"
    summary = "int8 with fp32 scales per channel or per group (optional zero point)"

    def accepts(self, scheme: QuantScheme) -> bool:
        return (
            scheme.weight_format == "int8"
            and scheme.scale_format == "fp32"
            and scheme.granularity in ("channel", "group")
        )

    def k_multiple(self, scheme: QuantScheme) -> int | None:
        return scheme.group_size

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        if scheme.granularity == "channel":
            return {"data": (torch.int8, shape), "scale": (torch.float32, shape[:2])}
        groups = _groups(scheme, shape)
        return {
            "data": (torch.int8, shape),
            "scale": (torch.float32, groups),
            "zero_point": (torch.int8, groups) if scheme.zero_point else None,
        }

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if scheme.granularity == "channel":
            data, scale = integer.quantize_int8_rows(weight.float())
            return {"data": data, "scale": scale}
        data, scale, zero = integer.quantize_int8_groups(
            weight.float(), scheme.group_size, scheme.zero_point
        )
        return {"data": data, "scale": scale, "zero_point": zero}

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        if qw.scheme.granularity == "channel":
            return qw.data.float() * qw.scale[:, :, None]
        return integer.dequantize_int8_groups(
            qw.data, qw.scale, qw.zero_point, qw.scheme.group_size
        )

    def pad_fill(self, scheme: QuantScheme) -> dict[str, float]:
        # A zero group with zero point: range [0, 0], zero -128 and every q -128.
        fill = -128.0 if scheme.zero_point else 0.0
        return {"data": fill, "scale": 1.0, "zero_point": fill}


class Int4Codec(FamilyCodec):
    """Packed unsigned int4 with an fp32 scale per K group, zero 8 or a uint8 zero point."""

    name = "int4"
    summary = "int4 with fp32 scales per group (optional zero point)"

    def accepts(self, scheme: QuantScheme) -> bool:
        return (
            scheme.weight_format == "int4"
            and scheme.scale_format == "fp32"
            and scheme.granularity == "group"
        )

    def k_multiple(self, scheme: QuantScheme) -> int | None:
        return scheme.block_shape[1]

    def layout(self, scheme: QuantScheme, shape: tuple[int, int, int]) -> Layout:
        groups = _groups(scheme, shape)
        return {
            "data": _packed(shape),
            "scale": (torch.float32, groups),
            "zero_point": (torch.uint8, groups) if scheme.zero_point else None,
        }

    def quantize(self, scheme: QuantScheme, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        data, scale, zero = integer.quantize_int4(
            weight.float(), scheme.block_shape[1], scheme.zero_point
        )
        return {"data": data, "scale": scale, "zero_point": zero}

    def dequantize(self, qw: QuantizedWeight) -> torch.Tensor:
        return integer.dequantize_int4(qw.data, qw.scale, qw.zero_point, qw.scheme.block_shape[1])

    def pad_fill(self, scheme: QuantScheme) -> dict[str, float]:
        # Symmetric: two int4 zeros (q = 8) per byte; with a zero point, code 0 and zero 0.
        return {"data": 0.0 if scheme.zero_point else float(0x88), "scale": 1.0, "zero_point": 0.0}

    def zero_point_range(self, scheme: QuantScheme) -> tuple[int, int] | None:
        # A uint8 zero point holds 0..255, but only the codes' 0..15 keep (q - zero) in range.
        return (0, 15) if scheme.zero_point else None


#: Every family, in lookup order (the first codec that accepts a scheme stores it).
CODECS: tuple[FamilyCodec, ...] = (
    PlainCodec(),
    MxCodec(),
    Nvfp4Codec(),
    Fp8Codec(),
    Int8Codec(),
    Int4Codec(),
)


def codec_of(scheme: QuantScheme) -> FamilyCodec:
    """The codec storing ``scheme``; ValueError listing the families when none does."""
    for codec in CODECS:
        if codec.accepts(scheme):
            return codec
    raise ValueError(
        f"scheme: no codec for weight_format={scheme.weight_format!r}, "
        f"scale_format={scheme.scale_format!r}, granularity={scheme.granularity!r}, "
        f"block_shape={scheme.block_shape!r}; supported: "
        + "; ".join(c.summary for c in CODECS if c.summary)
    )


def pad_rows_cols(
    t: torch.Tensor, segments: int, extra_rows: int, extra_cols: int, fill: float
) -> torch.Tensor:
    """Pad dim 1 of ``t [E, rows, cols]`` per segment and dim 2 at the end with ``fill``."""
    if extra_rows == 0 and extra_cols == 0:
        return t
    e, rows, cols = t.shape
    seg = t.reshape(e, segments, rows // segments, cols)
    out = torch.full(
        (e, segments, rows // segments + extra_rows, cols + extra_cols),
        fill,
        dtype=t.dtype,
        device=t.device,
    )
    out[:, :, : rows // segments, :cols] = seg
    return out.reshape(e, -1, cols + extra_cols)


def pad_block_grid(
    scale: torch.Tensor, scheme: QuantScheme, n: int, segments: int, r1: int, k1: int
) -> torch.Tensor:
    """New block-scale grid after padding; each new block must map to one old block."""
    bn, bk = scheme.block_shape
    n0 = n // segments
    e, _, kb0 = scale.shape
    nb1, kb1 = math.ceil(segments * r1 / bn), math.ceil(k1 / bk)
    rows: list[torch.Tensor] = []
    for j in range(nb1):
        sources = set()
        for i in range(j * bn, min((j + 1) * bn, segments * r1)):
            seg, local = divmod(i, r1)
            if local < n0:
                sources.add((seg * n0 + local) // bn)
        if len(sources) > 1:
            raise ValueError(
                f"rows_per_segment: scheme {scheme.name!r} shares one scale per {bn} rows; "
                f"padding {segments} segments of {n0} rows to {r1} would put rows of different "
                f"scale blocks into one block; use segments whose rows are multiples of {bn}"
            )
        if sources:
            rows.append(scale[:, sources.pop(), :])
        else:
            rows.append(torch.ones(e, kb0, dtype=scale.dtype, device=scale.device))
    grid = torch.stack(rows, dim=1) if rows else scale.new_ones(e, 0, kb0)
    if kb1 > kb0:
        grid = torch.cat([grid, grid.new_ones(e, nb1, kb1 - kb0)], dim=2)
    return grid


def _rescale_per_expert(parts: Sequence[QuantizedWeight], field: str) -> list[QuantizedWeight]:
    """Bring parts to the largest per-expert ``field`` (fp8 tensor scale / nvfp4 global scale).

    The part's finer-grained scale (fp8: data, nvfp4: e4m3 block scales) is multiplied by
    old / new and re-rounded to e4m3, so this is lossy where the ratio is not a power of two.
    """
    target = torch.stack([getattr(p, field) for p in parts]).amax(dim=0)
    out = []
    for p in parts:
        ratio = (getattr(p, field) / target)[:, None, None]
        if field == "scale":
            fields = {"data": encode_e4m3(decode_e4m3(p.data) * ratio), "scale": target}
        else:
            fields = {"scale": encode_e4m3(decode_e4m3(p.scale) * ratio), "global_scale": target}
        out.append(p._replace(p.shape, **fields))
    return out


def _zero_point_twins(parts: Sequence[QuantizedWeight]) -> Sequence[QuantizedWeight]:
    """Symmetric int parts beside parts of their zero-point twin (same bits and groups) as
    that twin: the importers give the symmetric scheme where every zero point is the
    midpoint, so gate and up can come out one of each, and the midpoint stored as explicit
    zero points (8 for int4, 0 for int8, which stores zero - 128) keeps every value."""
    from moerunner.quant.weight import TENSOR_FIELDS  # weight.py imports this module

    zp = next((p for p in parts if p.scheme.zero_point), None)
    if zp is None:
        return parts
    out = []
    for p in parts:
        if p.scheme == dataclasses.replace(zp.scheme, name=p.scheme.name, zero_point=False):
            mid = 8 if p.scheme.weight_format == "int4" else 0
            zero = torch.full_like(p.scale, mid, dtype=zp.zero_point.dtype)
            fields = {f: getattr(p, f) for f in TENSOR_FIELDS}  # input_scale and all
            p = type(p)(zp.scheme, p.shape, **{**fields, "zero_point": zero})
        out.append(p)
    return out


def cat_rows(parts: Sequence[QuantizedWeight], *, rescale: bool = False) -> QuantizedWeight:
    """Stack weights of one scheme along N (e.g. gate then up into w13); exact by default.

    An int scheme and its zero-point twin (``int4_g32`` and ``int4_g32_zp``) join as the
    twin, the symmetric parts' implicit midpoint stored as their zero points (exact).
    Per-expert scales covering a whole part (fp8_tensor ``scale``, nvfp4 ``global_scale``)
    must be equal across parts, or ``rescale=True`` moves every part to the largest one
    (lossy, see `_rescale_per_expert`). ``input_scale`` takes the largest value, since all
    parts multiply the same activations. fp8_block parts except the last need N a multiple
    of the block rows.
    """
    from moerunner.quant.weight import QuantizedWeight  # weight.py imports this module

    if not parts or not all(isinstance(p, QuantizedWeight) for p in parts):
        raise TypeError("parts must be a non-empty sequence of QuantizedWeight")
    parts = _zero_point_twins(parts)
    first = parts[0]
    e, _, k = first.shape
    for p in parts:
        if p.scheme != first.scheme or p.shape[0] != e or p.shape[2] != k:
            raise ValueError(
                f"parts: all parts need the same scheme, E and K; got {first!r} and {p!r}"
            )
    for field in ("global_scale",) + (
        ("scale",) if first.scale is not None and first.scale.dim() == 1 else ()
    ):
        values = [getattr(p, field) for p in parts]
        if values[0] is None or all(torch.equal(values[0], v) for v in values[1:]):
            continue
        if not rescale:
            raise ValueError(
                f"parts: per-expert {field} differs between parts; pass rescale=True to "
                "re-round every part to the largest (lossy)"
            )
        parts = _rescale_per_expert(parts, field)
    bs = first.scheme.block_shape
    if first.scheme.granularity == "block" and any(p.shape[1] % bs[0] for p in parts[:-1]):
        raise ValueError(
            f"parts: scheme {first.scheme.name!r} shares a scale per {bs[0]} rows, so every part "
            f"but the last needs N divisible by {bs[0]}; got N = {[p.shape[1] for p in parts]}"
        )
    fields: dict[str, torch.Tensor | None] = {"data": torch.cat([p.data for p in parts], dim=1)}
    if first.scale is not None:
        fields["scale"] = (
            parts[0].scale if first.scale.dim() == 1 else torch.cat([p.scale for p in parts], dim=1)
        )
    if first.zero_point is not None:
        fields["zero_point"] = torch.cat([p.zero_point for p in parts], dim=1)
    fields["global_scale"] = parts[0].global_scale
    inputs = [p.input_scale for p in parts if p.input_scale is not None]
    fields["input_scale"] = torch.stack(inputs).amax(dim=0) if inputs else None
    n = sum(p.shape[1] for p in parts)
    return QuantizedWeight(first.scheme, (e, n, k), **fields)
