# Quantization schemes: one typed, frozen value per weight format.
#
# A `QuantScheme` says everything a kernel needs to know about a quantized expert weight and
# the GEMM input it is multiplied with: element format of the weight, format and granularity
# of its scales, zero points, and how activations are quantized (format, static or dynamic
# scales). It replaces per-format boolean flags. `get_scheme` resolves the documented names
# ("fp8_block", "mxfp4", "int4_g64_zp", ...) and passes a `QuantScheme` through unchanged.
# `eval(repr(scheme))` rebuilds an equal scheme (with `QuantScheme` in scope), so logs replay.

from __future__ import annotations

import dataclasses
import re

__all__ = [
    "ACTIVATION_FORMATS",
    "QuantScheme",
    "SCHEME_NAMES",
    "STATIC_ACTIVATION_FORMATS",
    "get_scheme",
    "plain_scheme",
    "registered_name",
]

WEIGHT_FORMATS = ("bf16", "fp16", "fp32", "e4m3", "e2m1", "int8", "int4")
SCALE_FORMATS = ("none", "fp32", "e8m0", "e4m3")
GRANULARITIES = ("none", "tensor", "channel", "block", "group")
ACTIVATION_FORMATS = (
    "none",
    "fp8_token",
    "fp8_group128",
    "fp8_group",
    "mxfp8",
    "nvfp4",
    "int8_token",
)
ACTIVATION_SCALES = ("dynamic", "static")
#: Activation formats that may use a static (calibrated) scale instead of a dynamic one.
STATIC_ACTIVATION_FORMATS = ("fp8_token", "int8_token", "nvfp4")
# Elements along K per activation scale, for the formats whose group is fixed.
_ACTIVATION_GROUP = {"fp8_group128": 128, "mxfp8": 32, "nvfp4": 16}
_UNQUANTIZED = ("bf16", "fp16", "fp32")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """One weight format plus the activation format its kernels use.

    Fields (all plain values, so ``eval(repr(scheme))`` round-trips):

    - ``name``: the registered name, or any label for a custom scheme.
    - ``weight_format``: element format of ``QuantizedWeight.data``; one of
      ``"bf16" "fp16" "fp32"`` (unquantized), ``"e4m3"``, ``"e2m1"``, ``"int8"``, ``"int4"``.
    - ``scale_format``: ``"none"``, ``"fp32"``, ``"e8m0"`` (OCP MX, stored as uint8) or
      ``"e4m3"`` (NVFP4 block scales).
    - ``granularity``: what one scale covers: ``"none"``, ``"tensor"`` (one per expert),
      ``"channel"`` (one per output row), ``"block"`` (a 2-D block of ``block_shape``) or
      ``"group"`` (``block_shape = (1, group_size)`` along K).
    - ``block_shape``: ``(rows, cols)`` of one scale block for "block" / "group", else None.
    - ``zero_point``: int4 / int8 with "group" granularity: a zero point per group
      (asymmetric) instead of the implicit one (8 for int4, 0 for int8).
    - ``activation_format``: one of ``ACTIVATION_FORMATS``; ``"none"`` for weight-only schemes.
      ``"fp8_group"`` is e4m3 per ``(1, block_shape[1])`` group of the weight's K blocks; with
      128-wide blocks it is stored as ``"fp8_group128"`` (one value per format).
    - ``activation_scales``: ``"dynamic"`` (computed per call) or ``"static"`` (the weight
      must carry ``input_scale``).
    """

    name: str
    weight_format: str
    scale_format: str = "none"
    granularity: str = "none"
    block_shape: tuple[int, int] | None = None
    zero_point: bool = False
    activation_format: str = "none"
    activation_scales: str = "dynamic"

    def __post_init__(self) -> None:
        _check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        _check_choice("scale_format", self.scale_format, SCALE_FORMATS)
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("activation_format", self.activation_format, ACTIVATION_FORMATS)
        _check_choice("activation_scales", self.activation_scales, ACTIVATION_SCALES)
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"QuantScheme name must be a non-empty str, got {self.name!r}")
        unquantized = self.weight_format in _UNQUANTIZED
        if unquantized != (self.scale_format == "none") or unquantized != (
            self.granularity == "none"
        ):
            raise ValueError(
                "QuantScheme: weight_format in ('bf16', 'fp16', 'fp32') goes with "
                "scale_format='none' and granularity='none', and every other weight_format "
                f"needs a scale; got weight_format={self.weight_format!r}, "
                f"scale_format={self.scale_format!r}, granularity={self.granularity!r}"
            )
        if self.granularity in ("block", "group"):
            bs = self.block_shape
            if (
                not isinstance(bs, tuple)
                or len(bs) != 2
                or not all(isinstance(v, int) and v > 0 for v in bs)
            ):
                raise ValueError(
                    "QuantScheme block_shape must be a tuple of two positive ints (rows, cols) "
                    f"for granularity {self.granularity!r}, got {bs!r}"
                )
            if self.granularity == "group" and bs[0] != 1:
                raise ValueError(
                    f"QuantScheme block_shape for granularity 'group' must be (1, group_size), "
                    f"got {bs!r}"
                )
            if self.weight_format in ("e2m1", "int4") and bs[1] % 2:
                raise ValueError(
                    "QuantScheme block_shape[1] must be even for packed 4-bit weights "
                    f"(two values per byte), got {bs!r}"
                )
        elif self.block_shape is not None:
            raise ValueError(
                "QuantScheme block_shape is only accepted with granularity 'block' or 'group', "
                f"got block_shape={self.block_shape!r} with granularity={self.granularity!r}"
            )
        if self.zero_point and (
            self.weight_format not in ("int4", "int8") or self.granularity != "group"
        ):
            raise ValueError(
                "QuantScheme zero_point=True is only accepted for weight_format 'int4' or "
                f"'int8' with granularity 'group', got weight_format={self.weight_format!r}, "
                f"granularity={self.granularity!r}"
            )
        if self.activation_format == "fp8_group":
            if self.granularity not in ("block", "group"):
                raise ValueError(
                    "QuantScheme activation_format 'fp8_group' groups activations by the "
                    "weight's K block and needs granularity 'block' or 'group', got "
                    f"{self.granularity!r}"
                )
            if self.block_shape[1] == _ACTIVATION_GROUP["fp8_group128"]:
                object.__setattr__(self, "activation_format", "fp8_group128")
        if (
            self.activation_scales == "static"
            and self.activation_format not in STATIC_ACTIVATION_FORMATS
        ):
            raise ValueError(
                "QuantScheme activation_scales='static' is accepted for activation_format "
                f"{' or '.join(map(repr, STATIC_ACTIVATION_FORMATS))}, "
                f"got {self.activation_format!r}"
            )

    @property
    def is_quantized(self) -> bool:
        """True when the weight is stored in a low-precision format with scales."""
        return self.weight_format not in _UNQUANTIZED

    @property
    def group_size(self) -> int | None:
        """Number of K elements sharing one scale for "group"/"block" schemes, else None."""
        return None if self.block_shape is None else self.block_shape[1]

    @property
    def packed(self) -> bool:
        """True when two 4-bit values share one byte of ``data`` (low nibble = even k)."""
        return self.weight_format in ("e2m1", "int4")

    @property
    def has_global_scale(self) -> bool:
        """True for NVFP4: e4m3 block scales are multiplied by an fp32 scale per expert."""
        return self.weight_format == "e2m1" and self.scale_format == "e4m3"

    @property
    def quantizes_activations(self) -> bool:
        """True when a kernel quantizes its GEMM input (W8A8, W4A8, W4A4...)."""
        return self.activation_format != "none"

    @property
    def activation_group_size(self) -> int | None:
        """K elements sharing one activation scale (None: per row, or not quantized)."""
        if self.activation_format == "fp8_group":
            return self.block_shape[1]
        return _ACTIVATION_GROUP.get(self.activation_format)

    @property
    def family(self) -> str:
        """Codec family of the weight: "plain", "fp8", "mx", "nvfp4", "int8", "int4", ...

        Derived from the fields (``moerunner.quant.families``), never from the name; raises
        ValueError for a combination of fields no codec stores.
        """
        from moerunner.quant.families import codec_of

        return codec_of(self).name

    @property
    def format_key(self) -> tuple:
        """Every field but ``name``: two schemes with equal formats compute the same thing."""
        return dataclasses.astuple(self)[1:]

    def same_format(self, other: QuantScheme) -> bool:
        """True when ``other`` stores and computes like this scheme (names may differ)."""
        return isinstance(other, QuantScheme) and self.format_key == other.format_key


def _check_choice(field: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"QuantScheme {field} must be one of {accepted}, got {value!r}")


def _unquantized(name: str) -> QuantScheme:
    return QuantScheme(name=name, weight_format=name)


def _int_groups(weight_format: str, group_size: int, zero_point: bool, name: str) -> QuantScheme:
    """Weight-only integer weights with fp32 scales per group of ``group_size`` along K."""
    return QuantScheme(
        name=name,
        weight_format=weight_format,
        scale_format="fp32",
        granularity="group",
        block_shape=(1, group_size),
        zero_point=zero_point,
    )


def _fp8_blocks(rows: int, cols: int, name: str) -> QuantScheme:
    return QuantScheme(name, "e4m3", "fp32", "block", (rows, cols), activation_format="fp8_group")


_NAMED: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        _unquantized("bf16"),
        _unquantized("fp16"),
        _unquantized("fp32"),
        QuantScheme("fp8_tensor", "e4m3", "fp32", "tensor", activation_format="fp8_token"),
        QuantScheme(
            "fp8_tensor_static",
            "e4m3",
            "fp32",
            "tensor",
            activation_format="fp8_token",
            activation_scales="static",
        ),
        QuantScheme("fp8_channel", "e4m3", "fp32", "channel", activation_format="fp8_token"),
        QuantScheme(
            "fp8_block", "e4m3", "fp32", "block", (128, 128), activation_format="fp8_group128"
        ),
        _fp8_blocks(64, 64, "fp8_block_64x64"),
        _fp8_blocks(64, 128, "fp8_block_64x128"),
        _fp8_blocks(128, 64, "fp8_block_128x64"),
        QuantScheme("mxfp8", "e4m3", "e8m0", "group", (1, 32), activation_format="mxfp8"),
        QuantScheme("mxfp4", "e2m1", "e8m0", "group", (1, 32)),
        QuantScheme("mxfp4_mxfp8", "e2m1", "e8m0", "group", (1, 32), activation_format="mxfp8"),
        QuantScheme("nvfp4", "e2m1", "e4m3", "group", (1, 16)),
        QuantScheme("nvfp4_a4", "e2m1", "e4m3", "group", (1, 16), activation_format="nvfp4"),
        QuantScheme(
            "nvfp4_a4_static",
            "e2m1",
            "e4m3",
            "group",
            (1, 16),
            activation_format="nvfp4",
            activation_scales="static",
        ),
        QuantScheme("int8", "int8", "fp32", "channel", activation_format="int8_token"),
        QuantScheme(
            "int8_static",
            "int8",
            "fp32",
            "channel",
            activation_format="int8_token",
            activation_scales="static",
        ),
        QuantScheme("int8_w8a16", "int8", "fp32", "channel"),
        _int_groups("int8", 64, False, "int8_g64"),
        _int_groups("int8", 128, False, "int8_g128"),
        _int_groups("int8", 64, True, "int8_g64_zp"),
        _int_groups("int8", 128, True, "int8_g128_zp"),
        _int_groups("int4", 128, False, "int4"),
        _int_groups("int4", 128, True, "int4_zp"),
        _int_groups("int4", 32, False, "int4_g32"),
        _int_groups("int4", 64, False, "int4_g64"),
        _int_groups("int4", 128, False, "int4_g128"),
        _int_groups("int4", 32, True, "int4_g32_zp"),
        _int_groups("int4", 64, True, "int4_g64_zp"),
        _int_groups("int4", 128, True, "int4_g128_zp"),
    )
}

#: Every name `get_scheme` accepts, in documentation order. "int4" is int4_g128 (symmetric);
#: "int4_zp" is int4_g128_zp. Parametrised names are accepted too: "int4_g<even size>[_zp]",
#: "int8_g<size>[_zp]" and "fp8_block_<rows>x<cols>".
SCHEME_NAMES: tuple[str, ...] = tuple(_NAMED)


# Parametrised names: (pattern, builder of the scheme from the match, or None to refuse it).
def _int4_named(match: re.Match, key: str) -> QuantScheme | None:
    size = int(match.group(1))
    return _int_groups("int4", size, match.group(2) is not None, key) if size % 2 == 0 else None


def _int8_named(match: re.Match, key: str) -> QuantScheme:
    return _int_groups("int8", int(match.group(1)), match.group(2) is not None, key)


def _fp8_named(match: re.Match, key: str) -> QuantScheme:
    return _fp8_blocks(int(match.group(1)), int(match.group(2)), key)


_PATTERNS = (
    (re.compile(r"int4_g([1-9][0-9]*)(_zp)?"), _int4_named),
    (re.compile(r"int8_g([1-9][0-9]*)(_zp)?"), _int8_named),
    (re.compile(r"fp8_block_([1-9][0-9]*)x([1-9][0-9]*)"), _fp8_named),
)
_PATTERN_NAMES = "'int4_g<even size>[_zp]', 'int8_g<size>[_zp]', 'fp8_block_<rows>x<cols>'"
_BY_FORMAT = {s.format_key: s.name for s in reversed(_NAMED.values())}


def plain_scheme(dtype: object) -> QuantScheme:
    """The unquantized scheme of a torch dtype (bf16, fp16 or fp32)."""
    name = str(dtype).replace("torch.", "")
    name = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name)
    if name is None:
        raise TypeError(f"dtype must be torch.bfloat16, float16 or float32, got {dtype}")
    return _NAMED[name]


def registered_name(scheme: QuantScheme) -> str:
    """Name of the registered scheme with ``scheme``'s format (its own name if none has it).

    Keys that outlive one object (tuned tile files, benchmark rows) use it, so a custom
    ``QuantScheme`` with the fields of "fp8_block" finds the files tuned for "fp8_block".
    Where several names share a format ("int4" and "int4_g128") the first registered wins.
    """
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme must be a QuantScheme, got {type(scheme).__name__}")
    return _BY_FORMAT.get(scheme.format_key, scheme.name)


def get_scheme(name_or_scheme: str | QuantScheme) -> QuantScheme:
    """Resolve a scheme name (see ``SCHEME_NAMES``) or pass a ``QuantScheme`` through.

    Raises TypeError for other types and ValueError for unknown names, listing the names
    accepted.
    """
    if isinstance(name_or_scheme, QuantScheme):
        return name_or_scheme
    if not isinstance(name_or_scheme, str):
        raise TypeError(
            "scheme must be a QuantScheme or a scheme name (str), "
            f"got {type(name_or_scheme).__name__}"
        )
    key = name_or_scheme.strip().lower()
    found = _NAMED.get(key)
    if found is not None:
        return found
    for pattern, build in _PATTERNS:
        match = pattern.fullmatch(key)
        scheme = None if match is None else build(match, key)
        if scheme is not None:
            return scheme
    raise ValueError(
        f"scheme: unknown quantization scheme {name_or_scheme!r}; accepted names: "
        f"{', '.join(SCHEME_NAMES)} (and {_PATTERN_NAMES})"
    )
