"""``moerunner tune --backends``: which backend is fastest per token count, into a table.

For each shape and scheme, every candidate backend (``--backends a,b``; no list: every
backend available here that serves the shape) is checked against the reference and timed
at each token count (``moerunner.bench.backend_choice``); the winners go to the device's
backend table (``moerunner.backend_table``) in ``--out-dir`` (default: the user table
folder, read before the shipped tables), merged with the entries the file already holds.
The table is written again as each shape and scheme finishes, so an interrupted or failed
run keeps what finished. A file of that name that is not a backend table is never
overwritten (a usage error).
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import _common

#: Seconds of timing per backend and token count where --min-time is not given.
DEFAULT_MIN_TIME_S = 0.2


def main(p: argparse.ArgumentParser, args, shapes, schemes, tokens) -> int:
    """Measure and write; ``shapes``: (label, (H, I, E, top_k, activation))."""
    from ..backend_table import (
        BackendTable,
        BackendTableError,
        bucket_range,
        load_table_file,
        table_file_name,
        user_table_dir,
    )
    from ..bench.backend_choice import candidate_backends, tune_backends
    from ..bench.presets import PRESETS, BenchShape
    from ..device_files import device_name
    from ..runner import default_registry

    if args.device is None and not torch.cuda.is_available():
        print(
            "moerunner tune: error: --backends measures on a CUDA GPU and none is available "
            "here; pass --device cpu to measure the CPU backends (small shapes)",
            file=sys.stderr,
        )
        return 2
    device = _common.resolve_device(p, args.device)
    registry = default_registry()
    try:
        names = _common.csv(args.backends)
    except ValueError as exc:
        p.error(f"--backends: {exc}")
    unknown = [n for n in names if n not in registry.backends]
    if unknown:
        p.error(
            f"--backends: unknown {', '.join(map(repr, unknown))}; registered: "
            f"{', '.join(sorted(registry.backends))}"
        )
    out_dir = args.out_dir or args.out or user_table_dir()
    name = device_name(device)
    path = out_dir / table_file_name(name)
    _common.check_writable_dir(p, "--out-dir", out_dir)
    if path.exists() and not path.is_file():
        p.error(f"{path}: exists and is not a file; move it away or choose another --out-dir")
    try:  # None where nothing is there; a symbolic link to nothing is refused here
        table = load_table_file(str(path)) or BackendTable(name)
    except BackendTableError as exc:
        p.error(f"{path}: exists and is not a moerunner backend table ({exc}); move it away")
    if table.device != name:
        p.error(f"{path}: holds the table of {table.device!r}, not of {name!r}")
    min_time = args.min_time if args.min_time is not None else DEFAULT_MIN_TIME_S
    plan = []  # (label, scheme, shape, backends): every verdict checked before any timing
    for label, (hidden, inter, experts, top_k, act) in shapes:
        preset = PRESETS.get(label)
        shape = (
            preset
            if preset is not None and preset.activation == act
            else BenchShape(label, experts, hidden, inter, top_k, act)
        )
        for scheme in schemes:
            try:
                chosen = candidate_backends(shape, scheme, names, "bf16", device.type, registry)
            except ValueError as exc:
                p.error(f"--backends: {label} {scheme}: {exc}")
            plan.append((label, scheme, shape, chosen))
    from tqdm import tqdm

    bar = tqdm(
        total=sum(len(chosen) for *_, chosen in plan) * len(set(tokens)),
        desc="tune --backends",
        unit="row",
        file=sys.stderr,
    )

    def progress(row) -> None:
        bar.set_postfix_str(f"{row.preset} {row.scheme} {row.impl} T={row.tokens}")
        bar.update(1)

    done = 0
    try:
        for label, scheme, shape, chosen in plan:
            try:
                key, buckets, rows = tune_backends(
                    shape,
                    scheme,
                    tokens,
                    backends=chosen,
                    device=device,
                    registry=registry,
                    min_time_s=min_time,
                    progress=progress,
                )
            except ValueError as exc:
                bar.close()
                print(f"moerunner tune: {label} {scheme}: {exc}", file=sys.stderr)
                if done:  # what finished is kept: written as it finished
                    print(f"wrote {path} ({done} of {len(plan)} shape/scheme entries)")
                return 1
            # Merged and written now, not after the loop: Ctrl-C or a failure in a later
            # shape then keeps this one (a whole file each time: write_text_atomic).
            table = table.with_entry(key, buckets)
            table.write(path)
            done += 1
            untuned = {r.impl: r.note for r in rows if r.status == "untuned"}
            for impl, why in untuned.items():
                bar.write(
                    f"moerunner tune: {label} {scheme}: {impl} left out: its kernels ran "
                    f"untuned ({why})",
                    file=sys.stderr,
                )
            served = {r.tokens for r in rows if r.status == "ok"}
            for t in sorted({r.tokens for r in rows} - served):
                why = "; ".join(
                    f"{r.impl}: {r.status} {r.note}".strip() for r in rows if r.tokens == t
                )
                bar.write(
                    f"moerunner tune: {label} {scheme}: T={t} left out of the table: no "
                    f"backend ran it correctly ({why})",
                    file=sys.stderr,
                )
            lines = [f"{label} {scheme} on {name}:"]
            for i, bucket in enumerate(buckets):
                lines.append(
                    f"  {bucket_range(buckets, i)}: {bucket.backend} ({bucket.measured()})"
                )
            bar.write("\n".join(lines), file=sys.stdout)
    except KeyboardInterrupt:
        saved = f"{done} of {len(plan)} shape/scheme entries saved in {path}" if done else ""
        raise KeyboardInterrupt(saved or "nothing saved: no shape/scheme had finished") from None
    finally:
        bar.close()
    print(f"wrote {path}")
    return 0
