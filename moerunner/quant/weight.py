# QuantizedWeight: a quantized expert weight [E, N, K] and the tensors that encode it.
#
# Layout contract (docs/architecture.md, "Quantized weights"); every tensor has experts on
# dim 0 and, where it has one, output rows N on dim 1:
#   data         e4m3 / int8 / bf16.. [E, N, K], or uint8 [E, N, K/2] for packed 4-bit
#   scale        fp32 [E] (tensor) | fp32 [E, N] (channel) | fp32 [E, ceil(N/bn), ceil(K/bk)]
#                (block) | uint8 e8m0 / e4m3 / fp32 [E, N, K/g] (group)
#   global_scale fp32 [E] (NVFP4 only)
#   zero_point   uint8 [E, N, K/g] (int4 with zero point only)
#   input_scale  fp32 [E] static activation scale (optional; required by "static" schemes)
# `dequantize()` is always float32 [E, N, K]. The object is immutable by convention: `pad`,
# `select_rows`, `narrow_experts` and `to` return new objects and never modify tensors.

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moerunner.device_checks import capturing
from moerunner.quant.families import codec_of, pad_rows_cols
from moerunner.quant.schemes import STATIC_ACTIVATION_FORMATS, QuantScheme, get_scheme

__all__ = [
    "TENSOR_FIELDS",
    "QuantizedWeight",
    "check_scale_values",
    "check_storable",
    "check_zero_point_values",
    "dequantize",
    "quantize",
]

#: Order of the tensor fields in `QuantizedWeight.flat_tensors()` / `from_tensors(sequence)`.
TENSOR_FIELDS = ("data", "scale", "global_scale", "zero_point", "input_scale")


def _expected_layout(
    scheme: QuantScheme, shape: tuple[int, int, int]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | None]:
    """dtype and shape of every tensor field for ``scheme`` and logical ``shape`` (E, N, K)."""
    codec = codec_of(scheme)
    g = codec.k_multiple(scheme)
    if g and shape[2] % g:
        raise ValueError(
            f"shape: K={shape[2]} must be a multiple of the group size {g} of scheme "
            f"{scheme.name!r}; zero-pad K before quantizing"
        )
    out: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = dict.fromkeys(TENSOR_FIELDS)
    out.update(codec.layout(scheme, shape))
    if scheme.activation_format in STATIC_ACTIVATION_FORMATS:
        out["input_scale"] = (torch.float32, (shape[0],))
    return out


def check_storable(scheme: str | QuantScheme, shape: tuple[int, int, int]) -> None:
    """ValueError (the one ``quantize`` raises) unless weights of logical ``shape``
    ``(E, N, K)`` can be stored in ``scheme``; allocates nothing (checks before any work)."""
    _expected_layout(get_scheme(scheme), _check_shape(tuple(shape)))


def _check_shape(shape: object) -> tuple[int, int, int]:
    if (
        not isinstance(shape, (tuple, list, torch.Size))
        or len(shape) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape)
    ):
        raise ValueError(f"shape must be three non-negative ints (E, N, K), got {shape!r}")
    return (int(shape[0]), int(shape[1]), int(shape[2]))


def check_scale_values(
    fields: Mapping[str, torch.Tensor | None],
    names: Mapping[str, str] | None = None,
    *,
    e8m0_nan: bool = True,
) -> None:
    """Raise ValueError for scale values that would silently corrupt the weight.

    fp32 scales (``scale``, ``global_scale``, ``input_scale``) must be finite and > 0: zero
    makes an expert vanish, a negative one flips its sign (quantizing a weight with NaN/Inf
    gives such a scale). e4m3 block scales (NVFP4) must be finite and >= 0 (0 is what an
    all-zero block quantizes to). e8m0 code 255 is the OCP MX encoding of a NaN block (what
    quantizing a block with a NaN gives; it dequantizes to NaN on every backend): accepted
    unless ``e8m0_nan=False`` (checkpoint import). ``names`` maps a field to the name the
    caller knows it by (a checkpoint key). Reads values (one reduction per tensor): call it
    at construction or import, never per forward; skipped for meta tensors and while
    compiling or capturing a CUDA graph.
    """
    if capturing():
        return
    for field in ("scale", "global_scale", "input_scale"):
        t = fields.get(field)
        if t is None or t.is_meta or t.numel() == 0:
            continue
        name = (names or {}).get(field, field)
        if t.dtype == torch.uint8:  # e8m0 codes
            if not e8m0_nan and bool((t == 255).any()):
                raise ValueError(f"{name}: e8m0 code 255 (NaN) is not a valid scale")
            continue
        v = t.float()
        if t.dtype == torch.float8_e4m3fn:
            bad, rule = torch.isnan(v) | (v < 0), "finite and >= 0 (e4m3 block scales)"
        else:
            bad, rule = ~torch.isfinite(v) | (v <= 0), "finite and > 0"
        if bool(bad.any()):
            index = [int(i) for i in torch.nonzero(bad)[0]]
            raise ValueError(
                f"{name}: scales must be {rule}; got {v[tuple(index)].item()} at index {index}"
                " (a weight with NaN or Inf quantizes to such a scale, and so does one whose"
                " range overflows float32 in the scale, e.g. max - min of int8 zero points)"
            )


def check_zero_point_values(
    scheme: str | QuantScheme, zero_point: torch.Tensor | None, name: str = "zero_point"
) -> None:
    """Raise ValueError for stored zero points outside the range ``scheme``'s codes can mean
    (int4: 0..15 in a uint8): one would shift its whole group of weights far outside their
    range, silently. ``name``: what the caller knows the tensor as (a state-dict key). Reads
    values (one reduction), so call it where `check_scale_values` is called; skipped for meta
    tensors and while compiling or capturing a CUDA graph."""
    if zero_point is None or zero_point.is_meta or zero_point.numel() == 0 or capturing():
        return
    s = get_scheme(scheme)
    bounds = codec_of(s).zero_point_range(s)
    if bounds is None:
        return
    low, high = bounds
    bad = (zero_point < low) | (zero_point > high)
    if bool(bad.any()):
        index = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(
            f"{name}: zero points of scheme {s.name!r} must lie in [{low}, {high}] (the range "
            f"of its codes); got {int(zero_point[tuple(index)])} at index {index}"
        )


class QuantizedWeight:
    """A quantized expert weight of logical shape ``(E, N, K)`` (out rows N, reduction dim K).

    Construct it with `quantize`, a checkpoint importer, or directly from tensors laid out as
    the module header says; the constructor checks every dtype and shape against the scheme.
    """

    # ``_moerunner_prepared``: the runner's per-weight cache of backend-prepared forms.
    __slots__ = (
        "scheme",
        "shape",
        "data",
        "scale",
        "global_scale",
        "zero_point",
        "input_scale",
        "_moerunner_prepared",
        "__weakref__",
    )

    def __init__(
        self,
        scheme: str | QuantScheme,
        shape: Sequence[int],
        data: torch.Tensor,
        scale: torch.Tensor | None = None,
        global_scale: torch.Tensor | None = None,
        zero_point: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        *,
        check_values: bool = True,
    ) -> None:
        """``check_values=False`` skips reading the scales' and zero points' values
        (``check_scale_values``, ``check_zero_point_values``), for tensors already checked
        (moved or cast copies) or not yet written (``to_empty`` before a load); dtypes,
        shapes and devices are always checked."""
        self.scheme = get_scheme(scheme)
        self.shape = _check_shape(tuple(shape))
        self.data = data
        self.scale = scale
        self.global_scale = global_scale
        self.zero_point = zero_point
        self.input_scale = input_scale
        self._validate(check_values)

    def _validate(self, check_values: bool = True) -> None:
        layout = _expected_layout(self.scheme, self.shape)
        device = self.data.device if isinstance(self.data, torch.Tensor) else None
        for field in TENSOR_FIELDS:
            value, want = getattr(self, field), layout[field]
            if value is None:
                if want is not None and (field != "input_scale" or self._static()):
                    raise ValueError(
                        f"{field}: scheme {self.scheme.name!r} needs {field} "
                        f"{want[0]} {list(want[1])}, got None"
                    )
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{field} must be a torch.Tensor or None, got {type(value).__name__}"
                )
            if want is None:
                raise ValueError(
                    f"{field}: scheme {self.scheme.name!r} has no {field} tensor, got one of "
                    f"shape {list(value.shape)}"
                )
            dtype, shape = want
            if value.dtype != dtype or tuple(value.shape) != shape:
                raise ValueError(
                    f"{field}: scheme {self.scheme.name!r} with shape {self.shape} needs {dtype} "
                    f"{list(shape)}, got {value.dtype} {list(value.shape)}"
                )
            if value.device != device:
                raise ValueError(f"{field} is on {value.device} but data is on {device}")
        if check_values:
            check_scale_values(self.tensors())
            check_zero_point_values(self.scheme, self.zero_point)

    def _static(self) -> bool:
        return self.scheme.activation_scales == "static"

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(scheme={self.scheme.name!r}, shape={self.shape}, "
            f"device={self.device})"
        )

    @property
    def num_experts(self) -> int:
        """Number of experts E (dim 0 of every tensor)."""
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        """Device holding all tensors."""
        return self.data.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that are set, by field name (see ``TENSOR_FIELDS``)."""
        return {f: getattr(self, f) for f in TENSOR_FIELDS if getattr(self, f) is not None}

    def flat_tensors(self) -> list[torch.Tensor | None]:
        """All tensor fields in ``TENSOR_FIELDS`` order, None where unset (for custom ops)."""
        return [getattr(self, f) for f in TENSOR_FIELDS]

    @classmethod
    def from_tensors(
        cls,
        scheme: str | QuantScheme,
        shape: Sequence[int],
        tensors: Mapping[str, torch.Tensor | None] | Sequence[torch.Tensor | None],
        *,
        check_values: bool = True,
    ) -> QuantizedWeight:
        """Rebuild from ``tensors()`` (a mapping) or ``flat_tensors()`` (a sequence);
        ``check_values`` as the constructor's."""
        if isinstance(tensors, Mapping):
            unknown = set(tensors) - set(TENSOR_FIELDS)
            if unknown:
                raise ValueError(
                    f"tensors: unknown field(s) {sorted(unknown)}; accepted: {TENSOR_FIELDS}"
                )
            return cls(scheme, shape, **dict(tensors), check_values=check_values)
        if not isinstance(tensors, Sequence) or len(tensors) != len(TENSOR_FIELDS):
            raise ValueError(
                f"tensors must be a mapping or a sequence of {len(TENSOR_FIELDS)} entries in the "
                f"order {TENSOR_FIELDS}"
            )
        fields = dict(zip(TENSOR_FIELDS, tensors, strict=True))
        return cls(scheme, shape, **fields, check_values=check_values)

    def _replace(
        self, shape: tuple[int, int, int], **fields: torch.Tensor | None
    ) -> QuantizedWeight:
        values = {f: getattr(self, f) for f in TENSOR_FIELDS}
        values.update(fields)
        return QuantizedWeight(self.scheme, shape, **values)

    def alias(self) -> QuantizedWeight:
        """A new weight object over the same tensors (nothing copied, nothing re-checked),
        without the memo of prepared forms this one carries: what the prepared forms hold,
        so they do not keep this object alive from inside its own memo."""
        return QuantizedWeight(
            self.scheme,
            self.shape,
            **{f: getattr(self, f) for f in TENSOR_FIELDS},
            check_values=False,
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """Copy of this weight with every tensor moved to ``device``."""
        if isinstance(device, torch.dtype):
            raise TypeError(
                f"QuantizedWeight.to takes a device, got the dtype {device}: a quantized "
                "weight's dtypes are its scheme's (quantize the float weight to another scheme)"
            )
        moved = {f: t.to(device) for f, t in self.tensors().items()}
        return self._replace(self.shape, **moved)

    def narrow_experts(self, start: int, length: int) -> QuantizedWeight:
        """Experts ``start .. start + length - 1`` (views, no copy), e.g. one EP rank's share."""
        e = self.num_experts
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, length)):
            raise TypeError(
                f"start and length must be ints, got {type(start).__name__} and "
                f"{type(length).__name__}"
            )
        if start < 0 or length < 0 or start + length > e:
            raise ValueError(
                f"start/length: experts [{start}, {start + length}) are not within [0, {e})"
            )
        narrowed = {f: t.narrow(0, start, length) for f, t in self.tensors().items()}
        return self._replace((length, self.shape[1], self.shape[2]), **narrowed)

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[E, N, K]`` value of the weight (see docs/architecture.md for the rules)."""
        return codec_of(self.scheme).dequantize(self)

    def dequantize_experts(self, start: int, length: int = 1) -> torch.Tensor:
        """Float32 ``[length, N, K]`` value of experts ``start .. start + length - 1``: the
        rows ``dequantize()[start : start + length]`` would hold, bit for bit, computed from
        views of those experts only (no ``[E, N, K]`` temporary). Checks only host ints, never
        tensor values, so a forward may call it per expert without a device sync."""
        e, n, k = self.shape
        if isinstance(start, bool) or isinstance(length, bool):
            raise TypeError("start and length must be ints")
        if not (isinstance(start, int) and isinstance(length, int)):
            raise TypeError("start and length must be ints")
        if start < 0 or length < 0 or start + length > e:
            raise ValueError(
                f"start/length: experts [{start}, {start + length}) are not within [0, {e})"
            )
        part = object.__new__(QuantizedWeight)  # views of checked tensors: no re-validation
        part.scheme, part.shape = self.scheme, (length, n, k)
        for field in TENSOR_FIELDS:
            t = getattr(self, field)
            setattr(part, field, None if t is None else t.narrow(0, start, length))
        return codec_of(self.scheme).dequantize(part)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` of N (e.g. de-interleave gate/up); not for 2-D block scales."""
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.is_floating_point():
            raise TypeError("index must be a 1-D integer tensor of row numbers")
        codec_of(self.scheme).check_select_rows(self.scheme)
        rows = self.shape[1]
        if index.numel() and not capturing():  # (reads the index: where weights are prepared)
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= rows:
                raise ValueError(
                    f"index: row numbers must be in [0, {rows}) (N of the weight), got "
                    f"{low} .. {high}"
                )
        index = index.to(self.device)
        fields = {"data": self.data.index_select(1, index)}
        if self.scale is not None and self.scale.dim() >= 2:
            fields["scale"] = self.scale.index_select(1, index)
        if self.zero_point is not None:
            fields["zero_point"] = self.zero_point.index_select(1, index)
        return self._replace((self.shape[0], int(index.numel()), self.shape[2]), **fields)

    def pad(
        self, *, rows_per_segment: int | None = None, k: int | None = None, segments: int = 1
    ) -> QuantizedWeight:
        """Zero-pad N and/or K so a kernel's alignment holds; the padded entries dequantize to 0.

        N is split into ``segments`` equal parts (2 for a gated w13: gate rows, then up rows),
        and each part is padded at its end to ``rows_per_segment`` rows, so the halves stay
        separately aligned. K is padded at its end to ``k`` columns. New scale entries hold
        what quantizing zeros would give, so ``quantize(pad(w)) == pad(quantize(w))`` where the
        blocks line up. Raises ValueError where the format cannot express it: K for group
        formats must stay a multiple of the group size. (fp8_block segments that are not
        whole 128-row blocks are padded too, their values exact; docs/quantization.md.)
        """
        e, n, k0 = self.shape
        if not isinstance(segments, int) or segments < 1 or n % segments:
            raise ValueError(f"segments must be a positive int dividing N={n}, got {segments!r}")
        n0 = n // segments
        r1 = n0 if rows_per_segment is None else rows_per_segment
        k1 = k0 if k is None else k
        if not isinstance(r1, int) or r1 < n0:
            raise ValueError(
                f"rows_per_segment must be an int >= the current rows per segment {n0}, got {r1!r}"
            )
        if not isinstance(k1, int) or k1 < k0:
            raise ValueError(f"k must be an int >= the current K={k0}, got {k1!r}")
        codec = codec_of(self.scheme)
        g = codec.k_multiple(self.scheme)
        if g and k1 % g:
            raise ValueError(
                f"k: scheme {self.scheme.name!r} needs K to be a multiple of its group size "
                f"{g}, got {k1}"
            )
        fill = codec.pad_fill(self.scheme)
        unit = 2 if self.scheme.packed else 1
        fields: dict[str, torch.Tensor | None] = {
            "data": pad_rows_cols(self.data, segments, r1 - n0, (k1 - k0) // unit, fill["data"]),
            "scale": codec.pad_scale(self, segments, r1, k1),
        }
        if self.zero_point is not None:
            g = self.scheme.block_shape[1]
            fields["zero_point"] = pad_rows_cols(
                self.zero_point, segments, r1 - n0, (k1 - k0) // g, fill["zero_point"]
            )
        return self._replace((e, segments * r1, k1), **fields)


#: Default bound of ``quantize``'s ``chunk_bytes``: the float32 copy of the experts quantized
#: at once (256 MiB: two DeepSeek-V3 w13 experts, 4096 x 7168).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def quantize(
    weight: torch.Tensor,
    scheme: str | QuantScheme,
    *,
    input_scale: torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> QuantizedWeight:
    """Quantize float expert weights ``[E, N, K]`` to ``scheme`` (a name or a QuantScheme).

    Quantized schemes return a `QuantizedWeight`; "bf16" / "fp16" / "fp32" return it too, with
    ``data`` cast to that dtype. ``input_scale`` (fp32 ``[E]`` or a scalar, broadcast to every
    expert) is the static activation scale, required by "static" schemes and accepted by those
    that quantize activations to fp8 / int8 / nvfp4. Shape rules: K must be a multiple of the
    group size for MX (32), NVFP4 (16) and int4 (g), else ValueError; fp8_block accepts any N
    and K (the last block row / column is partial: ceil grid).

    Memory: the result's tensors are allocated once and filled a chunk of experts at a time
    (every scheme quantizes each expert on its own, so the result is bit for bit the one of
    quantizing all experts at once). A chunk holds as many experts as fit ``chunk_bytes`` as
    float32 ``[n, N, K]`` (at least one expert), so the memory beyond the input and the
    result stays below ``TRANSIENT_FACTOR`` (6) times ``max(chunk_bytes, N * K * 4)`` whatever
    E is (docs/quantization.md, "Memory"). Plain schemes ("bf16"...) are one cast, not
    chunked. The result carries no autograd graph (quantized weights have no backward), also
    for a ``weight`` that requires grad (an ``nn.Parameter``). Its tensors are contiguous
    whatever the strides of ``weight`` (a transposed view), as safetensors stores them.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int (bytes), got {chunk_bytes!r}")
    s = get_scheme(scheme)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point() or weight.dtype in (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e8m0fnu,
    ):
        raise TypeError(f"weight must be bf16, fp16, fp32 or fp64, got {weight.dtype}")
    if weight.dim() != 3:
        raise ValueError(f"weight must be [E, N, K] (3 dims), got shape {list(weight.shape)}")
    shape = _check_shape(tuple(weight.shape))
    layout = _expected_layout(s, shape)  # raises early for K not a multiple of the group
    # A quantized weight has no backward: no autograd graph (it would hold float temporaries
    # of the whole weight, and the parameter, for as long as the result lives).
    weight = weight.detach()
    if weight.dtype == torch.float64 and weight.numel():
        # Quantized in float32: a finite float64 value beyond its range became inf there
        # (the MX schemes then stored the NaN scale of a non-finite block). One host read.
        big = float(weight.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax())
        if big > torch.finfo(torch.float32).max:
            raise ValueError(
                f"weight holds finite float64 values beyond float32's range (largest |w| "
                f"{big:.3g}); the schemes quantize in float32: rescale the weight first"
            )
    if isinstance(input_scale, torch.Tensor):
        input_scale = input_scale.detach()
    if input_scale is not None:
        if layout["input_scale"] is None:
            raise ValueError(
                f"input_scale: scheme {s.name!r} does not quantize activations with a static "
                "scale; accepted only for activation formats fp8_token, int8_token, nvfp4"
            )
        why = f"input_scale must be a float or floats (one per expert), got {input_scale!r:.60}"
        if isinstance(input_scale, (str, bytes, bool)):
            raise TypeError(why)
        try:
            input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=weight.device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(why) from err
        if input_scale.numel() not in (1, shape[0]):
            raise ValueError(
                f"input_scale must be a scalar or one value per expert (E={shape[0]}), got "
                f"shape {list(input_scale.shape)}"
            )
        input_scale = input_scale.reshape(-1).expand(shape[0]).contiguous()
    fields: dict[str, torch.Tensor | None] = {"input_scale": input_scale}
    if s.is_quantized and min(shape) == 0:
        fields.update(_empty_fields(layout, weight.device))
    elif s.is_quantized:
        fields.update(_quantize_chunks(s, weight, layout, chunk_bytes))
    else:  # a cast (the weight itself where its dtype is the scheme's)
        fields.update(codec_of(s).quantize(s, weight))
    # Contiguous whatever the input's strides (a transposed view's codes keep them, and
    # safetensors' save_file refuses such tensors): at most one chunk's copy, the chunked
    # result being made contiguous already.
    fields = {f: v.contiguous() if v is not None else None for f, v in fields.items()}
    return QuantizedWeight(s, shape, **fields)


#: Measured bound of ``quantize``'s transient memory in units of one chunk's float32 bytes
#: (the largest codec, fp8 blocks from bf16, peaks near 4.3; tests/quant/test_quant_memory.py).
TRANSIENT_FACTOR = 6


def experts_per_chunk(shape: tuple[int, int, int], chunk_bytes: int) -> int:
    """Experts of ``shape`` (E, N, K) quantized at once: as many as fit ``chunk_bytes`` as
    float32, at least one, at most E."""
    e, n, k = shape
    return max(1, min(e, chunk_bytes // max(1, n * k * 4)))


def _quantize_chunks(
    scheme: QuantScheme,
    weight: torch.Tensor,
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]] | None],
    chunk_bytes: int,
) -> dict[str, torch.Tensor]:
    """The codec's tensor fields of ``weight``, quantized ``experts_per_chunk`` experts at a
    time into tensors allocated once (one call when every expert fits one chunk)."""
    codec = codec_of(scheme)
    e = weight.shape[0]
    step = experts_per_chunk(tuple(weight.shape), chunk_bytes)
    if step >= e:
        return codec.quantize(scheme, weight)
    out: dict[str, torch.Tensor] = {}
    for start in range(0, e, step):
        part = codec.quantize(scheme, weight[start : start + step])
        for field, value in part.items():
            if value is None:
                continue
            if field not in out:
                dtype, shape = layout[field]
                out[field] = torch.empty(shape, dtype=dtype, device=weight.device)
            out[field][start : start + value.shape[0]].copy_(value)
        del part
    return out


def _empty_fields(
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]] | None], device: torch.device
) -> dict[str, torch.Tensor]:
    """Tensors of an empty weight (some dim is 0): scales of 1.0 / code 0, nothing to reduce."""
    out = {}
    for field in ("data", "scale", "global_scale", "zero_point"):
        want = layout[field]
        if want is not None:
            dtype, shape = want
            fill = 1.0 if dtype == torch.float32 else 0
            out[field] = torch.full(shape, fill, dtype=torch.float32, device=device).to(dtype)
    return out


def dequantize(qweight: QuantizedWeight | torch.Tensor) -> torch.Tensor:
    """Float32 value of a `QuantizedWeight` (a plain float tensor is just cast to float32)."""
    if isinstance(qweight, QuantizedWeight):
        return qweight.dequantize()
    if isinstance(qweight, torch.Tensor) and qweight.is_floating_point():
        return qweight.float()
    raise TypeError(
        f"qweight must be a QuantizedWeight or a float tensor, got {type(qweight).__name__}"
    )
