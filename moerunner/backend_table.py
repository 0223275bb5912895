"""Measured backend choice: per device and problem shape, which backend is fastest per
token-count bucket.

A table holds, for one device name, entries keyed by a problem's signature (``ShapeKey``:
dtype, schemes, activation, E, H, I, top-k, biases, gate/up order, dispatch format); each
entry is a list of token-count buckets, each naming the measured winner and the measured
time of every candidate. ``moerunner tune --backends`` writes tables; ``Registry.bucket_plan``
turns an entry into one choice per bucket (the winner where it can serve, else the fastest
measured backend that can, else the preference order).

Files: JSON, one per device (``table_file_name``), with a ``schema`` version field::

    {"schema": "moerunner.backend_table/1", "device": "NVIDIA H100 80GB HBM3",
     "entries": [{"key": {...ShapeKey fields...},
                  "buckets": [{"max_tokens": 24, "tokens": 16, "backend": "triton",
                               "times_us": {"triton": 41.0, "flashinfer": 55.2}}, ...]}]}

A bucket covers the token counts above the previous bucket's ``max_tokens`` up to its own;
the last bucket's ``max_tokens`` is null (no upper end). ``tokens`` is the count measured.
Tables are read from the user folder (``user_table_dir``) first, then from ``tables/``
shipped beside this module; an entry of the user's file replaces the shipped entry of the
same shape.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .device_files import device_key, device_name, user_cache_dir, write_text_atomic
from .quant.schemes import registered_name

__all__ = [
    "SCHEMA",
    "SHIPPED_DIR",
    "BackendTable",
    "BackendTableError",
    "Bucket",
    "ShapeKey",
    "default_table",
    "find_table",
    "load_table_file",
    "table_file_name",
    "user_table_dir",
]

SCHEMA = "moerunner.backend_table/1"
#: Tables shipped with the package (read after the user's folder).
SHIPPED_DIR = Path(__file__).with_name("tables")


class BackendTableError(ValueError):
    """A malformed backend table file (the message names the file and the field)."""


def user_table_dir() -> Path:
    """The user table folder: ``backends`` in the user cache folder (``user_cache_dir``).
    ``moerunner tune --backends`` writes there by default; the runtime reads it first."""
    return user_cache_dir() / "backends"


def table_file_name(device_name: str) -> str:
    """The file of one device's table."""
    return f"backends,device={device_key(device_name)}.json"


@dataclass(frozen=True)
class ShapeKey:
    """A problem's signature as tables key it. Schemes by ``registered_name`` (schemes with
    equal fields share entries), the dtype as its short name ("bfloat16")."""

    dtype: str
    w13_scheme: str
    w2_scheme: str
    activation: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    has_bias: bool = False
    interleaved: bool = False
    dispatch_format: str = "standard"

    @classmethod
    def of(cls, problem: Any, top_k: int) -> ShapeKey:
        """The key of a ``MoeProblem`` called with ``top_k`` slots per token."""
        return cls(
            dtype=str(problem.dtype).replace("torch.", ""),
            w13_scheme=registered_name(problem.w13_scheme),
            w2_scheme=registered_name(problem.w2_scheme),
            activation=problem.activation,
            num_experts=problem.num_experts,
            hidden_size=problem.hidden_size,
            intermediate_size=problem.intermediate_size,
            top_k=top_k,
            has_bias=problem.has_bias,
            interleaved=problem.interleaved,
            dispatch_format=problem.dispatch_format,
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def problem(self, device_type: str) -> Any:
        """The ``MoeProblem`` this key describes on ``device_type`` (for printing verdicts)."""
        from .backends.base import MoeProblem

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise BackendTableError(f"dtype {self.dtype!r} is not a torch dtype")
        return MoeProblem(
            device_type=device_type,
            dtype=dtype,
            w13_scheme=self.w13_scheme,
            w2_scheme=self.w2_scheme,
            activation=self.activation,
            dispatch_format=self.dispatch_format,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_experts=self.num_experts,
            has_bias=self.has_bias,
            interleaved=self.interleaved,
        )

    def describe(self) -> str:
        """ "E=128 H=2880 I=2880 k=4 mxfp4 bfloat16 swiglu_oai (bias, interleaved)"."""
        schemes = self.w13_scheme
        if self.w2_scheme != self.w13_scheme:
            schemes += f"/{self.w2_scheme}"
        extra = [n for n, on in (("bias", self.has_bias), ("interleaved", self.interleaved)) if on]
        if self.dispatch_format != "standard":
            extra.append(self.dispatch_format)
        return (
            f"E={self.num_experts} H={self.hidden_size} I={self.intermediate_size} "
            f"k={self.top_k} {schemes} {self.dtype} {self.activation}"
            + (f" ({', '.join(extra)})" if extra else "")
        )

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ShapeKey:
        if not isinstance(d, dict):
            raise BackendTableError(f"{where}: must be an object of {_names(cls)}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise BackendTableError(f"{where}: unknown field(s) {unknown}; fields: {_names(cls)}")
        values = {}
        for f in fields(cls):
            if f.name not in d:
                if f.default is not MISSING:  # has a default
                    continue
                raise BackendTableError(f"{where}.{f.name}: missing")
            value, kind = d[f.name], {"int": int, "bool": bool, "str": str}[f.type]
            if type(value) is not kind or (kind is int and value < 0):
                raise BackendTableError(
                    f"{where}.{f.name}: must be a {'non-negative int' if kind is int else f.type}"
                    f", got {value!r}"
                )
            values[f.name] = value
        key = cls(**values)
        key._check(where)
        return key

    def _check(self, where: str) -> None:
        """Raise ``BackendTableError`` for a key no problem can have (sizes, names)."""
        from .config import ACTIVATIONS
        from .dispatch.formats import DISPATCH_FORMATS
        from .quant.schemes import get_scheme
        from .weights import PLAIN_DTYPES

        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            if getattr(self, name) < 1:
                raise BackendTableError(
                    f"{where}.{name}: must be a positive int, got {getattr(self, name)}"
                )
        if self.top_k > self.num_experts:
            raise BackendTableError(
                f"{where}.top_k: {self.top_k} is more than num_experts {self.num_experts}"
            )
        dtypes = [str(d).replace("torch.", "") for d in PLAIN_DTYPES]
        if self.dtype not in dtypes:
            raise BackendTableError(
                f"{where}.dtype: must be one of {', '.join(dtypes)}, got {self.dtype!r}"
            )
        for name in ("w13_scheme", "w2_scheme"):
            try:
                get_scheme(getattr(self, name))
            except ValueError as exc:
                raise BackendTableError(f"{where}.{name}: {exc}") from None
        if self.activation not in ACTIVATIONS:
            raise BackendTableError(
                f"{where}.activation: must be one of {', '.join(sorted(ACTIVATIONS))}, "
                f"got {self.activation!r}"
            )
        if self.dispatch_format not in DISPATCH_FORMATS:
            raise BackendTableError(
                f"{where}.dispatch_format: must be one of {', '.join(DISPATCH_FORMATS)}, "
                f"got {self.dispatch_format!r}"
            )


def _names(cls) -> str:
    return ", ".join(f.name for f in fields(cls))


@dataclass(frozen=True)
class Bucket:
    """One token-count bucket: ``max_tokens`` (None: no upper end), the count measured, the
    winner and every candidate's measured time in microseconds."""

    max_tokens: int | None
    tokens: int
    backend: str
    times_us: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "times_us", MappingProxyType(dict(self.times_us)))

    def __reduce__(self):  # a read-only mapping does not pickle: rebuilt from a dict
        return (Bucket, (self.max_tokens, self.tokens, self.backend, dict(self.times_us)))

    def measured(self) -> str:
        """ "triton 41 us vs flashinfer 55 us" (fastest first)."""
        ranked = sorted(self.times_us.items(), key=lambda item: item[1])
        return " vs ".join(f"{name} {_us(t)} us" for name, t in ranked) or "no times recorded"

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "tokens": self.tokens,
            "backend": self.backend,
            "times_us": dict(self.times_us),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Bucket:
        """A bucket as a file holds it; ``BackendTableError`` naming ``where`` and the field
        for anything ``tune --backends`` would not have written. A winner that is not the
        fastest of its own ``times_us`` is read as it is, with a warning: the runtime
        follows ``backend``, which may be a hand-made choice, and a table is refused only
        where it cannot be used."""
        if not isinstance(d, dict):
            raise BackendTableError(f"{where}: must be an object with max_tokens, tokens, backend")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:  # a typo such as time_us: its times would be dropped without a word
            raise BackendTableError(f"{where}: unknown field(s) {unknown}; fields: {_names(cls)}")
        for name in ("max_tokens", "tokens", "backend"):
            if name not in d:
                raise BackendTableError(f"{where}.{name}: missing")
        top, tokens, backend = d["max_tokens"], d["tokens"], d["backend"]
        if top is not None and (type(top) is not int or top < 0):
            raise BackendTableError(
                f"{where}.max_tokens: must be a non-negative int or null, got {top!r}"
            )
        if type(tokens) is not int or tokens < 0:
            raise BackendTableError(f"{where}.tokens: must be a non-negative int, got {tokens!r}")
        if not isinstance(backend, str) or not backend:
            raise BackendTableError(f"{where}.backend: must be a backend name, got {backend!r}")
        times = d.get("times_us", {})
        if not isinstance(times, dict) or not all(
            isinstance(k, str) and type(v) in (int, float) and 0 < v < math.inf
            for k, v in times.items()
        ):
            raise BackendTableError(
                f"{where}.times_us: must map backend names to positive finite times, got {times!r}"
            )
        if times and times.get(backend) != min(times.values()):
            fastest = min(times, key=times.get)
            warnings.warn(
                f"moerunner: {where}.backend: {backend!r} is not the fastest of the bucket's "
                f"times_us ({fastest!r} is); backend='auto' still tries {backend!r} first "
                "there (fix the file, or re-run 'moerunner tune --backends')",
                RuntimeWarning,
                stacklevel=2,
            )
        return cls(top, tokens, backend, {k: float(v) for k, v in times.items()})


def _us(t: float) -> str:
    return f"{t:.3g}" if t < 100 else f"{t:.0f}"


def _check_buckets(buckets: Sequence[Bucket], where: str) -> None:
    if not buckets:
        raise BackendTableError(f"{where}: needs at least one bucket")
    tops = [b.max_tokens for b in buckets]
    if tops[-1] is not None:
        raise BackendTableError(f"{where}[{len(tops) - 1}].max_tokens: the last must be null")
    for i in range(len(tops) - 1):
        if tops[i] is None or (i and tops[i] <= tops[i - 1]):
            raise BackendTableError(
                f"{where}[{i}].max_tokens: must be an int above the previous bucket's "
                f"(only the last is null), got {tops[i]!r}"
            )


@dataclass(frozen=True, eq=False)
class BackendTable:
    """One device's measured choices. Compared and hashed by identity (selections are
    memoised per table object); ``entries`` maps ``ShapeKey`` -> buckets (ascending)."""

    device: str
    entries: Mapping[ShapeKey, tuple[Bucket, ...]] = field(default_factory=dict)
    paths: tuple[Path, ...] = ()  # the files it was read from (user file first)

    def __post_init__(self) -> None:
        entries = {}
        for key, buckets in self.entries.items():
            if not isinstance(key, ShapeKey):
                raise TypeError(f"entries keys must be ShapeKey, got {type(key).__name__}")
            buckets = tuple(buckets)
            _check_buckets(buckets, f"table of {self.device!r}, entry {key}: buckets")
            entries[key] = buckets
        object.__setattr__(self, "entries", MappingProxyType(entries))

    def __reduce__(self):  # a read-only mapping does not pickle: rebuilt from a dict
        return (BackendTable, (self.device, dict(self.entries), self.paths))

    def buckets(self, key: ShapeKey) -> tuple[Bucket, ...] | None:
        """The buckets of ``key``, or None where the table has no entry."""
        return self.entries.get(key)

    @staticmethod
    def bounds(buckets: Sequence[Bucket]) -> tuple[int, ...]:
        """Upper ends of every bucket but the last: ``bisect_left(bounds, T)`` is T's bucket."""
        return tuple(b.max_tokens for b in buckets[:-1])

    def bucket_of(self, key: ShapeKey, tokens: int) -> Bucket | None:
        """The bucket serving ``tokens`` for ``key`` (None: no entry)."""
        buckets = self.buckets(key)
        if buckets is None:
            return None
        return buckets[bisect_left(self.bounds(buckets), tokens)]

    def merged_over(self, other: BackendTable) -> BackendTable:
        """This table's entries, plus ``other``'s for shapes this one lacks."""
        return BackendTable(
            self.device, {**other.entries, **self.entries}, (*self.paths, *other.paths)
        )

    def with_entry(self, key: ShapeKey, buckets: Sequence[Bucket]) -> BackendTable:
        """A copy with ``key``'s buckets replaced."""
        return BackendTable(self.device, {**self.entries, key: tuple(buckets)}, self.paths)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "device": self.device,
            "entries": [
                {"key": key.to_dict(), "buckets": [b.to_dict() for b in buckets]}
                for key, buckets in self.entries.items()
            ],
        }

    def write(self, path: str | os.PathLike) -> Path:
        """Write as JSON, whole or not at all (``write_text_atomic``; the folder is
        created)."""
        path = write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")
        load_table_file.cache_clear()
        return path

    @classmethod
    def from_dict(cls, doc: Any, where: str = "table") -> BackendTable:
        """Inverse of ``to_dict``; ``where`` (a file name) starts every error message."""
        if not isinstance(doc, dict):
            raise BackendTableError(f"{where}: must be a JSON object with schema, device, entries")
        if doc.get("schema") != SCHEMA:
            raise BackendTableError(
                f"{where}: field 'schema' must be {SCHEMA!r}, got {doc.get('schema')!r}"
            )
        device = doc.get("device")
        if not isinstance(device, str) or not device:
            raise BackendTableError(f"{where}: field 'device' must be a device name")
        raw = doc.get("entries")
        if not isinstance(raw, list):
            raise BackendTableError(f"{where}: field 'entries' must be a list")
        entries: dict[ShapeKey, tuple[Bucket, ...]] = {}
        for i, entry in enumerate(raw):
            at = f"{where}: entries[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"key", "buckets"}:
                raise BackendTableError(f"{at}: must be an object with 'key' and 'buckets'")
            key = ShapeKey.from_dict(entry["key"], f"{at}.key")
            if not isinstance(entry["buckets"], list):
                raise BackendTableError(f"{at}.buckets: must be a list")
            buckets = tuple(
                Bucket.from_dict(b, f"{at}.buckets[{j}]") for j, b in enumerate(entry["buckets"])
            )
            _check_buckets(buckets, f"{at}.buckets")
            for j, bucket in enumerate(buckets):  # the count measured lies in its own bucket
                low, high = _bucket_span(buckets, j)
                if bucket.tokens < low or (high is not None and bucket.tokens > high):
                    raise BackendTableError(
                        f"{at}.buckets[{j}].tokens: {bucket.tokens} is outside its bucket "
                        f"({bucket_range(buckets, j)})"
                    )
            if key in entries:
                raise BackendTableError(f"{at}.key: a second entry for the same shape")
            entries[key] = buckets
        return cls(device, entries)


@functools.lru_cache(maxsize=64)
def load_table_file(path: str) -> BackendTable | None:
    """The table in ``path``, or None where nothing is there; a malformed file, a folder or a
    symbolic link to nothing in its place raises ``BackendTableError`` naming it and the
    field."""
    p = Path(path)
    if not p.is_file():
        if p.exists():  # a folder, or a device: where the table belongs, so not silent
            raise BackendTableError(f"{p}: is not a file (a folder?), so it holds no table")
        if p.is_symlink():  # is_file follows the link; exists says the target is missing
            raise BackendTableError(
                f"{p}: a symbolic link to {os.readlink(p)!r}, which does not exist"
            )
        return None
    try:
        doc = json.loads(p.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise BackendTableError(f"{p}: not valid JSON ({err})") from None
    except OSError as err:
        raise BackendTableError(f"{p}: cannot be read ({err})") from None
    table = BackendTable.from_dict(doc, str(p))
    return BackendTable(table.device, table.entries, (p,))


def table_folders(table_dirs: Sequence[str | os.PathLike] | None = None) -> tuple[Path, ...]:
    """Folders searched, in order: ``table_dirs`` (None: the user table folder), then the
    shipped one."""
    first = (user_table_dir(),) if table_dirs is None else tuple(Path(d) for d in table_dirs)
    return (*first, SHIPPED_DIR)


def find_table(
    device_name: str, table_dirs: Sequence[str | os.PathLike] | None = None
) -> BackendTable:
    """The table of ``device_name``: every folder's file merged, the earlier folder's entry
    winning for a shape both have (an empty table where no folder has a file). A malformed
    file, or one holding another device's table, raises ``BackendTableError`` naming it."""
    table = BackendTable(device_name)
    for folder in reversed(table_folders(table_dirs)):
        path = folder / table_file_name(device_name)
        found = load_table_file(str(path))
        if found is None:
            continue
        if found.device != device_name:
            raise BackendTableError(
                f"{path}: field 'device' is {found.device!r}, but the file is the table of "
                f"{device_name!r} (its name)"
            )
        table = found.merged_over(table)
    return table


def default_table(device_type: str) -> BackendTable:
    """The table ``backend="auto"`` consults on ``device_type`` by default: ``find_table``
    of the device's name (the current GPU on CUDA), read once per process and device
    (``default_table.cache_clear()`` reads the folders again).

    A user table that cannot be used (unreadable, malformed, another device's) is reported
    once, with a warning naming the file and the reason, and left out: the shipped table and
    the preference order serve instead. ``find_table`` and ``load_table_file`` (tables named
    explicitly) raise ``BackendTableError`` instead."""
    index = torch.cuda.current_device() if device_type == "cuda" else None
    return _default_table(device_type, index)


@functools.lru_cache(maxsize=16)
def _default_table(device_type: str, index: int | None) -> BackendTable:
    name = device_name(torch.device(device_type, index))
    try:
        return find_table(name)
    except BackendTableError as exc:
        user_file = user_table_dir() / table_file_name(name)
        if not str(exc).startswith(str(user_file)):
            raise  # a shipped table is broken: a packaging fault, not the user's file
        warnings.warn(
            f"moerunner: ignoring the user backend table ({exc}); backend='auto' uses "
            "the shipped table and the preference order instead (fix or remove the file, "
            "e.g. re-run 'moerunner tune --backends')",
            RuntimeWarning,
            stacklevel=4,
        )
        return find_table(name, table_dirs=())


default_table.cache_clear = _default_table.cache_clear  # type: ignore[attr-defined]


def _bucket_span(buckets: Sequence[Bucket], index: int) -> tuple[int, int | None]:
    """The token counts bucket ``index`` covers: (lowest, highest; None for no end)."""
    low = 0 if index == 0 else buckets[index - 1].max_tokens + 1
    return low, buckets[index].max_tokens


def bucket_range(buckets: Sequence[Bucket], index: int) -> str:
    """ "T 17-64" for bucket ``index`` (for printing)."""
    low, high = _bucket_span(buckets, index)
    return f"T >= {low}" if high is None else f"T {low}-{high}"
