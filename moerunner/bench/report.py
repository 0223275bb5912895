"""Benchmark output: the terminal table, the replayable JSON, the PNG plot, a markdown summary.

The JSON holds everything needed to replay a run exactly: the command-line arguments, the
``BenchConfig`` repr (``eval`` rebuilds it with ``BenchConfig`` and ``BenchShape`` in scope),
the device, library / torch / triton / transformers / CUDA / driver versions, the date, the
measured ceilings, the machine load, and every row.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from ..device_files import hardware_name, write_text_atomic
from .roofline import DeviceCeilings
from .sweep import BenchConfig, Row

SCHEMA = "moerunner-bench/1"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001  (absent or broken optional package: no version)
        return None


def _driver() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device: torch.device) -> dict:
    """Device name, versions, thread count, load average and date of this run."""
    env = {
        "device": hardware_name(device),
        "device_type": device.type,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "moerunner": _version("moerunner"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "driver": _driver(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if hasattr(os, "getloadavg"):
        env["loadavg_1_5_15"] = list(os.getloadavg())
    return env


def have_transformers() -> bool:
    """Whether transformers imports (else the baselines are plain-PyTorch stand-ins)."""
    return _version("transformers") is not None


def impl_label(impl: str, transformers_version: str | None | bool = True) -> str:
    """A row's implementation as shown: backends by name, baselines as ``hf:<impl>`` when they
    are transformers' modules and ``torch-eq:<impl>`` when transformers was absent and they
    are plain-PyTorch stand-ins."""
    if not impl.startswith("baseline:"):
        return impl
    return ("hf:" if transformers_version else "torch-eq:") + impl[len("baseline:") :]


def spread_warning(
    rows: list[Row],
    threshold_pct: float,
    min_time_s: float | None = None,
    transformers_version: str | None | bool = None,
) -> str | None:
    """A warning naming the rows whose timing spread (IQR, % of median) exceeds the threshold,
    the worst by its label in the table (``transformers_version`` as ``table``'s), and the
    flag that gives them more samples. A row's sampling ends at ``min_time_s`` seconds or at
    ``--max-reps`` samples, whichever comes first; where the samples of a noisy row took less
    than ``min_time_s``, the cap ended them and a larger ``--min-time`` would change nothing.
    """
    noisy = [r for r in rows if r.spread_pct == r.spread_pct and r.spread_pct > threshold_pct]
    if not noisy:
        return None
    if transformers_version is None:
        transformers_version = have_transformers()
    worst = max(noisy, key=lambda r: r.spread_pct)
    if min_time_s is None:
        advice = "more samples (a larger --max-reps, or --min-time where the cap is not reached)"
    else:
        capped = sum(r.samples * r.time_us * 1e-6 < min_time_s for r in noisy)
        advice = (
            f"a larger --max-reps (it ended the samples of {capped} of them before "
            f"--min-time {min_time_s:g} s)"
            if capped
            else "a larger --min-time"
        )
    return (
        f"{len(noisy)} of {len(rows)} rows have a timing spread (IQR) above {threshold_pct:g}% "
        f"of their median (worst {worst.spread_pct:.0f}%: {worst.preset} {worst.scheme} "
        f"{impl_label(worst.impl, transformers_version)} T={worst.tokens}); the machine may be "
        f"busy, compare with care or rerun with {advice}"
    )


def to_json(
    path: Path,
    argv: list[str],
    config: BenchConfig,
    ceilings: DeviceCeilings,
    env: dict,
    rows: list[Row],
    skipped: dict[str, str],
) -> dict:
    """Write the replayable record; returns it."""
    record = {
        "schema": SCHEMA,
        "argv": list(argv),
        "config": repr(config),
        "environment": env,
        "ceilings": asdict(ceilings),
        "skipped_backends": skipped,
        "rows": [asdict(r) for r in rows],
    }
    text = json_text(record)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
        return record
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)  # whole or not at all: a half file would block the next run
    return record


def _finite(value):
    """``value`` with every NaN or infinite float replaced by None (JSON null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_text(record: dict) -> str:
    """Strict JSON of a record: a number not measured or not finite (NaN, inf) is null,
    never a bare ``NaN`` other JSON readers reject; other objects by ``str``."""
    return json.dumps(_finite(record), indent=1, default=str, allow_nan=False)


_NAN_FIELDS = tuple(
    f.name for f in fields(Row) if isinstance(f.default, float) and math.isnan(f.default)
)


def load_json(path: Path) -> tuple[dict, BenchConfig, list[Row]]:
    """Read a record back: the raw dict, the rebuilt config and the rows."""
    from .presets import BenchShape  # noqa: F401  (in scope for eval of the config repr)

    record = json.loads(Path(path).read_text())
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} record (schema={record.get('schema')!r})")
    config = eval(record["config"], {"BenchConfig": BenchConfig, "BenchShape": BenchShape})  # noqa: S307
    rows = [
        Row(**{**r, **{f: float("nan") for f in _NAN_FIELDS if r.get(f, 0.0) is None}})
        for r in record["rows"]
    ]  # null (not measured) back to NaN
    return record, config, rows


def fmt_cell(value: float | None, spec: str) -> str:
    """One table cell: ``format(value, spec)``, or "-" for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def fmt_digits(value: float | None, decimals: int, digits: int = 2) -> str:
    """``fmt_cell`` with ``decimals`` decimals, or more where those would show fewer than
    ``digits`` significant digits: a CPU row's 0.4 GB/s reads "0.40", not "0"."""
    if value is not None and math.isfinite(value) and value != 0:
        decimals = max(decimals, digits - 1 - math.floor(math.log10(abs(value))))
    return fmt_cell(value, f".{decimals}f")


def hit_cell(row: Row) -> str:
    """Experts hit: the average over the row's rotated cases, whole or with up to two
    decimals (exact for up to four cases: 7.5 reads "7.5", not a rounded "8"); "-" for a
    row that was not measured (skipped, failed)."""
    if row.status in ("skipped", "failed"):
        return "-"
    return fmt_cell(row.experts_hit, ".2f").rstrip("0").rstrip(".")


def align_table(lines: list[list[str]], left: set[int]) -> str:
    """Fixed-width text from rows of cells (the first is the header): columns in ``left``
    left-aligned, the others right-aligned; the last column (status) is not padded."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    out = []
    for line in lines:
        cells = [
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(line[:-1], widths, strict=False))
        ]
        out.append("  ".join(cells) + "  " + line[-1])
    return "\n".join(out)


def table(
    rows: list[Row], baselines: tuple[str, ...], transformers_version: str | None | bool = None
) -> str:
    """Fixed-width text table, one line per row; ``hit`` is the experts hit (``hit_cell``),
    ``spread`` the timing samples' interquartile range as % of the median; rates show at
    least two significant digits (``fmt_digits``). ``transformers_version``: of the run
    (None: whether transformers is importable now), for the baselines' labels."""
    if transformers_version is None:
        transformers_version = have_transformers()
    head = [
        "preset",
        "scheme",
        "impl",
        "routing",
        "T",
        "hit",
        "time us",
        "spread%",
        "TFLOP/s",
        "GB/s",
        "%roof",
        *[f"x{impl_label('baseline:' + b, transformers_version)}" for b in baselines],
        "max err",
        "status",
    ]
    lines = [head]
    for r in rows:
        lines.append(
            [
                r.preset,
                r.scheme,
                impl_label(r.impl, transformers_version),
                r.routing,
                str(r.tokens),
                hit_cell(r),
                fmt_cell(r.time_us, ".1f"),
                fmt_cell(r.spread_pct, ".0f"),
                fmt_digits(r.tflops, 2),
                fmt_digits(r.gbps, 0),
                fmt_cell(r.pct_roofline, ".1f"),
                *[fmt_cell(r.speedup.get(b, float("nan")), ".2f") for b in baselines],
                fmt_cell(r.max_rel_err, ".1e"),
                r.status if r.status == "ok" else f"{r.status}: {r.note[:60]}",
            ]
        )
    return align_table(lines, left={0, 1, 2, 3})


def backends_side_by_side(rows: list[Row]) -> str:
    """The backends of each (preset, scheme, routing, T) on one line: each one's time, each
    later one's time as a ratio of the first's (below 1: faster than it) and the fastest
    ("" where fewer than two backends were timed: nothing to compare)."""
    backends = list(dict.fromkeys(r.impl for r in rows if not r.impl.startswith("baseline:")))
    if len(backends) < 2:
        return ""
    first = backends[0]
    head = [
        "preset",
        "scheme",
        "routing",
        "T",
        *[f"{b} us" for b in backends],
        *[f"{b}/{first}" for b in backends[1:]],
        "fastest",
    ]
    points: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.impl in backends:
            key = (r.preset, r.scheme, r.routing, r.tokens)
            ok = r.status == "ok" and r.time_us == r.time_us
            points.setdefault(key, {})[r.impl] = r.time_us if ok else float("nan")
    lines = [head]
    for (preset, scheme, routing, tokens), times in points.items():
        base = times.get(first, float("nan"))
        timed = {b: t for b, t in times.items() if t == t}
        lines.append(
            [
                preset,
                scheme,
                routing,
                str(tokens),
                *[fmt_cell(times.get(b, float("nan")), ".1f") for b in backends],
                *[fmt_cell(times.get(b, float("nan")) / base, ".2f") for b in backends[1:]],
                min(timed, key=timed.get) if timed else "-",
            ]
        )
    return align_table([*lines], left={0, 1, 2})


def plot(
    path: Path, rows: list[Row], title: str, transformers_version: str | None | bool = None
) -> None:
    """% of roofline vs tokens: one panel per preset, one line per implementation and scheme."""
    import matplotlib

    if transformers_version is None:
        transformers_version = have_transformers()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r.preset for r in rows))
    cols = min(2, len(presets)) or 1
    nrows = math.ceil(len(presets) / cols) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows), squeeze=False)
    for ax, preset in zip(axes.flat, presets, strict=False):
        series: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r.preset == preset and r.status in ("ok", "wrong") and r.tokens > 0:
                series.setdefault((r.impl, r.scheme, r.routing), []).append(
                    (r.tokens, r.pct_roofline)
                )
        for (impl, scheme, routing), points in sorted(series.items()):
            points.sort()
            style = "--" if impl.startswith("baseline:") else "-"
            marker = "o" if routing == "uniform" else "x"
            shown = impl_label(impl, transformers_version)
            shown = shown.replace("hf:", "transformers ").replace("torch-eq:", "torch stand-in ")
            label = f"{shown} {scheme} ({routing})"
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], style, marker=marker, label=label
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("% of roofline floor")
        ax.set_title(preset)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(presets) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110, metadata={"Software": "moerunner bench"})
    plt.close(fig)


def markdown(
    rows: list[Row], env: dict, ceilings: DeviceCeilings, config: BenchConfig, argv: list[str]
) -> str:
    """A short summary: device, date, ceilings, the command, and the table."""
    peaks = ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in ceilings.peak_tflops.items())
    return "\n".join(
        [
            f"# moerunner bench: {env['device']} ({env['date'][:10]})",
            "",
            f"- device: {env['device']} ({env['device_type']}), torch {env['torch']}, "
            f"triton {env['triton']}, transformers {env['transformers']}, CUDA {env['cuda']}, "
            f"driver {env['driver']}, {env['torch_threads']} threads, "
            f"load average {env.get('loadavg_1_5_15')}",
            f"- measured ceilings: copy {ceilings.copy_gbps:.0f} GB/s; {peaks} ({ceilings.method})",
            f"- command: `moerunner bench {' '.join(argv)}`",
            "- % roof = roofline floor (max of min bytes / copy bandwidth, flops / peak) / time; "
            "spread% = interquartile range of the timing samples / median; "
            "x<baseline> = baseline time / this time ("
            + (
                "transformers experts modules"
                if env.get("transformers")
                else "plain-PyTorch stand-ins for transformers' experts modules, which were "
                "not installed"
            )
            + ", run on the same weights, routing and inputs in the same process; "
            + (
                "timed in the same interleaved rounds"
                if env.get("device_type") == "cpu"
                else "each row timed alone"
            )
            + ").",
            "",
            "```",
            table(rows, config.baselines, env.get("transformers") or False),
            "```",
            "",
        ]
    )
