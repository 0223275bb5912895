"""Measure which backend is fastest per token count, for a backend table (``backend_table``).

For one shape and scheme, the bench sweep (``sweep.Sweep``: fresh inputs per row, each
backend checked against the float64 reference, then timed: on CPU all backends of one T in
interleaved rounds, on a GPU each alone, under CUDA graphs up to its graph limit) runs every
candidate backend at every token count; the fastest backend whose output passed the check
wins the count's bucket. Buckets meet at the geometric mean of neighbouring measured counts
(``bucket_bounds``), so a call is served by the choice measured nearest to it on a log scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..backend_table import Bucket, ShapeKey
from ..backends.base import MoeProblem
from ..registry import Registry
from ..runner import default_registry
from .presets import BenchShape
from .roofline import DeviceCeilings
from .sweep import BenchConfig, Row, Sweep, act_dtype_for
from .sweep import problem_of as sweep_problem

__all__ = [
    "bucket_bounds",
    "buckets_from_rows",
    "candidate_backends",
    "serving_backends",
    "shape_key",
    "tune_backends",
]


def bucket_bounds(tokens: Sequence[int]) -> list[int | None]:
    """Upper ends of the buckets of ascending measured counts: the floor of the geometric mean
    of each count and the next; the last bucket has none (no counts: no buckets)."""
    tokens = sorted(tokens)
    if not tokens:
        return []
    bounds: list[int | None] = [math.isqrt(a * b) for a, b in zip(tokens, tokens[1:], strict=False)]
    return [*bounds, None]


def problem_of(shape: BenchShape, scheme: str, dtype: str, device_type: str) -> MoeProblem:
    """The problem the sweep's weights of ``shape`` in ``scheme`` pose (standard format)."""
    return sweep_problem(shape, scheme, act_dtype_for(scheme, dtype), device_type)


def shape_key(shape: BenchShape, scheme: str, dtype: str, device_type: str) -> ShapeKey:
    """The table key of ``shape`` in ``scheme``."""
    return ShapeKey.of(problem_of(shape, scheme, dtype, device_type), shape.top_k)


def serving_backends(
    shape: BenchShape, scheme: str, dtype: str, device_type: str, registry: Registry
) -> tuple[str, ...]:
    """Every registered backend that is available here and can serve the shape."""
    verdicts = registry.verdicts(problem_of(shape, scheme, dtype, device_type))
    return tuple(name for name, (ok, _) in verdicts.items() if ok)


def candidate_backends(
    shape: BenchShape,
    scheme: str,
    backends: Sequence[str] | None,
    dtype: str,
    device_type: str,
    registry: Registry,
) -> tuple[str, ...]:
    """The backends ``tune_backends`` times: ``backends`` (None or empty: every one that
    serves the shape here). Raises ``ValueError``, before any measurement, naming each named
    backend that cannot serve the shape here and why, or where none serves."""
    verdicts = registry.verdicts(problem_of(shape, scheme, dtype, device_type))
    if not backends:
        names = tuple(name for name, (ok, _) in verdicts.items() if ok)
        if not names:
            why = "; ".join(f"{n}: {reason}" for n, (_, reason) in verdicts.items())
            raise ValueError(f"no backend serves {shape.name} in {scheme} on {device_type} ({why})")
        return names
    refused = [
        f"{name}: {verdicts[name][1] if name in verdicts else 'not registered'}"
        for name in backends
        if not verdicts.get(name, (False, ""))[0]
    ]
    if refused:
        raise ValueError(
            f"cannot time {shape.name} in {scheme} on {device_type} with " + "; ".join(refused)
        )
    return tuple(dict.fromkeys(backends))


def buckets_from_rows(rows: Sequence[Row]) -> tuple[Bucket, ...]:
    """One bucket per measured token count: the fastest backend whose row is ``ok`` (its
    output within tolerance of the reference, its kernels tuned) wins; a count where none is
    ok gets none. Rows of other statuses (``untuned`` included) leave no time in the table."""
    times: dict[int, dict[str, float]] = {}
    for row in rows:
        if row.status == "ok" and not row.impl.startswith("baseline:"):
            times.setdefault(row.tokens, {})[row.impl] = row.time_us
    counts = sorted(t for t, by in times.items() if by)
    return tuple(
        Bucket(top, t, min(times[t], key=times[t].get), times[t])
        for t, top in zip(counts, bucket_bounds(counts), strict=True)
    )


def tune_backends(
    shape: BenchShape,
    scheme: str,
    tokens: Sequence[int],
    *,
    backends: Sequence[str] | None = None,
    dtype: str = "bf16",
    device: str | torch.device = "cuda",
    registry: Registry | None = None,
    min_time_s: float = 0.2,
    progress: Callable[[Row], None] | None = None,
) -> tuple[ShapeKey, tuple[Bucket, ...], list[Row]]:
    """Time ``backends`` (None: every one that serves the shape here) at each token count;
    return the table key, its buckets and the sweep's rows (for printing). Raises
    ``ValueError`` where fewer than one backend serves or no count was measured ok."""
    registry = registry if registry is not None else default_registry()
    device = torch.device(device)
    names = candidate_backends(shape, scheme, backends, dtype, device.type, registry)
    config = BenchConfig(
        shapes=(shape,),
        tokens=tuple(sorted(set(tokens))),
        schemes=(scheme,),
        backends=names,
        baselines=(),
        dtype=dtype,
        device=str(device),
        min_time_s=min_time_s,
    )
    # The roofline columns of the rows are not used here: placeholder ceilings.
    ceilings = DeviceCeilings(str(device), 1.0, {"bf16": 1.0})
    rows = Sweep(config, ceilings, registry, progress).run()
    buckets = buckets_from_rows(rows)
    if not buckets:
        outcomes: dict[str, list[int]] = {}  # one line per outcome, with its token counts
        for r in rows:
            outcomes.setdefault(f"{r.impl}: {r.status} {r.note}".strip(), []).append(r.tokens)
        notes = "; ".join(
            f"{what} (T={','.join(map(str, counts))})" for what, counts in outcomes.items()
        )
        raise ValueError(f"no backend ran {shape.name} in {scheme} correctly: {notes}")
    return shape_key(shape, scheme, dtype, device.type), buckets, rows
