"""``moerunner bench``: backends and transformers baselines against this device's roofline.

Examples::

    moerunner bench --preset cpu-small --tokens 1,32,512            # CPU, seconds
    moerunner bench --preset qwen3-30b-a3b,deepseek-v3 --schemes bf16,fp8_block \\
        --tokens 1,16,64,256,1024,4096 --routing uniform,zipf --json out.json --png out.png
    moerunner bench --shape 64,4096,2048,6 --tp 2 --activation silu
    moerunner bench --replay out.json --json again.json              # same command again

Expert parallel (one process per rank, NCCL on GPUs, gloo on CPUs)::

    torchrun --nproc-per-node 2 -m moerunner bench --ep-size 2 --preset deepseek-v3 \\
        --tokens 16,256,4096 --dispatcher all_to_all,masked --json ep2.json

Environment read here (the edge): with ``--ep-size``, torchrun's ``WORLD_SIZE`` and
``LOCAL_RANK``.

Files are written only where ``--json``, ``--png``, ``--md`` and ``--ceilings`` point, never
over a file moerunner did not write; nothing else is written (no cache in the home or cache
folder). The device ceilings (copy bandwidth, peak FLOP/s) are measured every run unless
``--ceilings FILE`` names a cache: read from it, measured and added to it when it lacks this
device (or with ``--remeasure``). ``--replay`` drops the recorded command's file flags
(``--json``, ``--png``, ``--md``, ``--ceilings``): a replay writes only where its own flags
point, never over the file it replays (flags are spelled out in full: the parser takes no
abbreviations, so a recorded output flag is always recognised; a JSON other than a bench
record is refused). Only ``--json`` takes ``-`` (stdout). Rows at T=0 are timed but not
checked (status n/a, no speedups); a row is ``wrong`` beyond the bound ``moerunner check``
uses (``moerunner.testing.error_bound``). Each row's timing spread (interquartile range of the
samples, % of the median) is shown, with a warning when it is large. A row takes samples for
``--min-time`` seconds or ``--max-reps`` samples, whichever ends first: the cap ends most
rows (200 calls of 150 us take 0.03 s), so more samples take a larger ``--max-reps``. A
``--shape`` given twice runs once, as a repeated ``--tokens`` or ``--preset`` value does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..bench.presets import PRESETS, get_preset, parse_shape, shard_intermediate
from ..bench.report import SCHEMA as BENCH_SCHEMA
from ..bench.sweep import DTYPES, ROUTINGS, BenchConfig
from ..device_files import write_text_atomic
from . import _common

_csv = _common.csv
SPREAD_WARN_PCT = 10.0


def _dispatchers() -> list[str]:
    from ..distributed_moe import DISPATCHERS

    return list(DISPATCHERS)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by tests)."""
    p = _common.parser(
        "bench",
        __doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # flags spelled out in full: the recorded command of a JSON names each output flag
        # exactly, so --replay can drop them (an abbreviated --js would survive as --json)
        allow_abbrev=False,
    )
    p.add_argument(
        "--preset",
        type=_common.name_list(list(PRESETS), "preset"),
        default=None,
        help=f"comma-separated presets: {', '.join(PRESETS)}",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        help="custom E,H,I,K (I = the model's full intermediate size); repeatable",
    )
    p.add_argument("--activation", default=None, help="activation of --shape rows (default silu)")
    p.add_argument(
        "--tp",
        type=_common.int_type(1),
        default=1,
        help="tensor-parallel size: each rank holds I/tp (must divide I)",
    )
    p.add_argument(
        "--tokens",
        type=_common.int_list(0),
        default=None,
        help="comma-separated token counts (default 1,16,64,256,1024 on CPU; up to 16384 on GPU)",
    )
    schemes = _common.name_list(_common.scheme_names, "scheme")
    p.add_argument(
        "--schemes",
        type=schemes,
        default=None,
        help="comma-separated weight schemes (default bf16): bf16, fp16, fp32, fp8_block, ...",
    )
    p.add_argument("--scheme", type=schemes, action="append", help="deprecated: --schemes")
    p.add_argument(
        "--backends",
        type=_common.name_list(what="backend"),
        default=None,
        help="comma-separated backends to time (default: every backend available here)",
    )
    p.add_argument(
        "--baselines",
        default="eager,grouped_mm",
        help="transformers baselines: eager,grouped_mm or 'none' (without transformers: "
        "plain-PyTorch stand-ins, labelled torch-eq)",
    )
    p.add_argument(
        "--routing",
        type=_common.name_list(list(ROUTINGS), "routing"),
        default=["uniform", "zipf"],
        help=f"comma-separated routing distributions: {', '.join(ROUTINGS)} (default: both)",
    )
    p.add_argument(
        "--preset-schemes",
        action="append",
        default=[],
        help="extra schemes for one preset of this run, e.g. deepseek-v3=fp8_block (repeatable)",
    )
    p.add_argument(
        "--zipf-exponent", type=_common.float_type(0.0), default=1.2, help="s >= 0 (default 1.2)"
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=sorted(DTYPES),
        help="activation dtype for quantized schemes",
    )
    _common.add_device(p)
    p.add_argument("--eager", action="store_true", help="no CUDA-graph replay on GPUs")
    p.add_argument(
        "--graph-max-tokens",
        type=_common.int_type(0),
        default=256,
        help="largest T timed by CUDA-graph replay (decode sizes)",
    )
    p.add_argument(
        "--min-time",
        type=_common.float_type(0.0, strict=True),
        default=None,
        help="seconds of samples to take per row, up to --max-reps samples (default 0.2 GPU, "
        "0.5 CPU)",
    )
    p.add_argument(
        "--max-reps",
        type=_common.int_type(1),
        default=200,
        help="most samples per row (default 200; eager GPU rows a quarter): it ends a row's "
        "timing before --min-time when its calls are fast, as they mostly are",
    )
    p.add_argument(
        "--rotations",
        type=_common.int_type(1),
        default=4,
        help="rotated cases per row (fresh routing, input, weight copy if it fits)",
    )
    p.add_argument("--seed", type=_common.int_type(0, "seed", _common.MAX_SEED), default=0)
    p.add_argument(
        "--ceilings",
        type=_common.path_type,
        default=None,
        help="ceilings cache JSON to read, and to add this device's measured ceilings to "
        "(default: measured every run, nothing written)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="re-measure the device ceilings (and replace them in --ceilings)",
    )
    p.add_argument(
        "--json",
        type=_common.path_type,
        default=None,
        help="write the replayable JSON here ('-': stdout)",
    )
    p.add_argument(
        "--png",
        type=_common.path_type,
        default=None,
        help="write the %% of roofline plot here (matplotlib)",
    )
    p.add_argument(
        "--md", type=_common.path_type, default=None, help="write a markdown summary here"
    )
    p.add_argument("--threads", type=_common.int_type(1), default=None, help="torch CPU threads")
    p.add_argument(
        "--ep-size",
        type=_common.int_type(1),
        default=1,
        help="expert-parallel ranks: launch under torchrun with one process per rank, e.g. "
        "torchrun --nproc-per-node 2 -m moerunner bench --ep-size 2",
    )
    p.add_argument(
        "--dispatcher",
        type=_common.name_list(_dispatchers, "dispatcher"),
        default=None,
        help="with --ep-size: standard, all_to_all, masked (comma-separated; default all_to_all)",
    )
    p.add_argument(
        "--capacity-factor",
        type=_common.float_type(0.0, strict=True),
        default=None,
        help="with --ep-size and masked: capacity = factor x expected rows per expert + 16 "
        "(default 2)",
    )
    p.add_argument(
        "--replay",
        type=_common.path_type,
        default=None,
        help="re-run the command recorded in a bench JSON (its --json, --png, --md and "
        "--ceilings are dropped; give new ones)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed flags into a ``BenchConfig`` (validating presets, shapes and --tp)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.scheme:
        args.schemes = list(
            dict.fromkeys((args.schemes or []) + [s for g in args.scheme for s in g])
        )
    args.schemes = args.schemes or ["bf16"]
    shapes = [get_preset(n) for n in (args.preset or [])]
    if args.activation is not None and not args.shape:
        raise ValueError(
            "--activation applies to --shape rows only (a preset has its own activation); "
            "pass --shape E,H,I,K with it"
        )
    for text in args.shape:
        try:
            _common.shape_type(text)  # the flag's shared checks (bounds, top-k <= E)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--shape: {exc}") from None
        shape = parse_shape(text, args.activation or "silu")
        # A shape given again runs once, as a repeated --tokens or --preset value does. Rows,
        # speedups and --preset-schemes know a shape by its name (E, H, I and k: equal names
        # are equal shapes), so a second copy's rows could not be told from the first's, and
        # its baselines took the place of the first's in every speedup. Not refused: --replay
        # FILE followed by the recorded flags (the shape again) must run what was recorded.
        if all(s.name != shape.name for s in shapes):
            shapes.append(shape)
    if not shapes:
        shapes = [get_preset("qwen3-30b-a3b" if device.startswith("cuda") else "cpu-small")]
    if args.tp != 1:
        shapes = [shard_intermediate(s, args.tp) for s in shapes]
    for r in args.routing:
        if r not in ROUTINGS:
            raise ValueError(f"--routing: unknown {r!r}; accepted: {', '.join(ROUTINGS)}")
    from ..quant import get_scheme

    extra = []
    for item in args.preset_schemes:
        name, sep, schemes = item.partition("=")
        if not sep or not schemes:
            raise ValueError(f"--preset-schemes wants PRESET=SCHEME[,SCHEME], got {item!r}")
        try:
            extra.append((name.strip(), tuple(_csv(schemes))))
        except ValueError as exc:
            raise ValueError(f"--preset-schemes {item!r}: {exc}") from None
    run_names = [shape.name for shape in shapes]
    for name, _ in extra:
        if name not in run_names:
            raise ValueError(
                f"--preset-schemes {name}=...: {name!r} is not a preset of this run "
                f"({', '.join(run_names)})"
            )
    for s in args.schemes:
        get_scheme(s)  # raises naming the accepted schemes
    for name, group in extra:
        for s in group:
            try:
                get_scheme(s)
            except ValueError as exc:
                raise ValueError(f"--preset-schemes {name}={','.join(group)}: {exc}") from None
    for shape in shapes:  # every (shape, scheme) can hold its weights, before any work
        h, i = shape.hidden_size, shape.intermediate_size
        mine = [s for name, group in extra if name == shape.name for s in group]
        for s in dict.fromkeys([*args.schemes, *mine]):
            why = _common.unstorable(s, [(shape.w13_rows, h), (h, i)])
            if why is not None:
                raise ValueError(
                    f"scheme {s}: the weights of {shape.name} (H={h}, I={i} per rank) cannot "
                    f"be stored in it ({why})"
                )
    try:
        baselines = () if args.baselines.strip() == "none" else tuple(_csv(args.baselines))
    except ValueError as exc:
        raise ValueError(f"--baselines: {exc}") from None
    if not baselines and args.baselines.strip() != "none":
        raise ValueError(f"--baselines: got {args.baselines!r}; name baselines, or 'none'")
    from ..bench.baselines import BASELINES
    from ..runner import default_registry

    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(
            f"--baselines: unknown {', '.join(map(repr, unknown))}; accepted: "
            f"{', '.join(BASELINES)} or 'none'"
        )
    registered = list(default_registry().backends)
    unknown = [b for b in args.backends or () if b not in registered]
    if unknown:
        raise ValueError(
            f"--backends: unknown {', '.join(map(repr, unknown))}; registered: "
            f"{', '.join(registered)}"
        )
    tokens = args.tokens or (
        (1, 16, 64, 256, 1024, 4096, 16384) if device.startswith("cuda") else (1, 16, 64, 256, 1024)
    )
    return BenchConfig(
        shapes=tuple(shapes),
        tokens=tuple(tokens),
        schemes=tuple(args.schemes),
        backends=None if args.backends is None else tuple(args.backends),
        baselines=baselines,
        routings=tuple(args.routing),
        dtype=args.dtype,
        device=device,
        cuda_graph=not args.eager,
        graph_max_tokens=args.graph_max_tokens,
        min_time_s=args.min_time
        if args.min_time is not None
        else (0.2 if device.startswith("cuda") else 0.5),
        max_reps=args.max_reps,
        rotations=args.rotations,
        zipf_exponent=args.zipf_exponent,
        seed=args.seed,
        extra_schemes=tuple(extra),
    )


#: The flags naming files a run writes (and --replay): a replay drops the recorded ones.
_OUTPUT_FLAGS = ("--json", "--png", "--md", "--ceilings", "--replay")


def _strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag VALUE`` or ``--flag=VALUE``).
    Exact spellings suffice: the bench parser takes no abbreviations (``allow_abbrev``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not any(arg.startswith(f + "=") for f in flags):
            out.append(arg)
    return out


def _replayed_argv(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]):
    """The recorded command of ``--replay FILE`` (without its output flags) + this one's flags."""
    path = args.replay
    if not path.is_file():
        p.error(f"--replay {path}: no such file")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        p.error(f"--replay {path}: not a moerunner bench JSON record (not JSON)")
    schema = record.get("schema") if isinstance(record, dict) else None
    if schema != BENCH_SCHEMA:
        p.error(
            f"--replay {path}: not a moerunner bench JSON record (schema {schema!r}, "
            f"expected {BENCH_SCHEMA!r})"
        )
    recorded = record.get("argv")
    if not isinstance(recorded, list) or not all(isinstance(a, str) for a in recorded):
        p.error(f"--replay {path}: not a moerunner bench JSON record (no recorded command)")
    new = _strip_flags(recorded, _OUTPUT_FLAGS) + _strip_flags(argv, ("--replay",))
    # By destination, not spelling: whatever the combined command writes is never the file
    # replayed (a recorded flag the parser does not know is a usage error when it runs).
    parsed, _ = p.parse_known_args(new)
    replay = path.expanduser().resolve()
    for flag in ("--json", "--png", "--md", "--ceilings"):
        out = getattr(parsed, flag[2:])
        if out is not None and str(out) != _common.STDOUT and out.expanduser().resolve() == replay:
            p.error(f"{flag} {out}: is the file being replayed; choose another path")
    return new


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Every check that needs no work: device, flag combinations, outputs, dependencies."""
    device = _common.resolve_device(p, args.device)
    args.device = str(device)
    if args.ep_size == 1:
        for flag, value in (
            ("--dispatcher", args.dispatcher),
            ("--capacity-factor", args.capacity_factor),
        ):
            if value is not None:
                p.error(f"{flag} applies to expert-parallel runs only: add --ep-size N")
    if args.ep_size != 1:
        for flag in ("--png", "--md"):
            if getattr(args, flag[2:]) is not None:
                p.error(f"{flag} is not written for expert-parallel (--ep-size) rows; use --json")
    if args.capacity_factor is not None and "masked" not in (args.dispatcher or ()):
        p.error("--capacity-factor applies to the masked dispatcher only: add --dispatcher masked")
    if args.scheme:
        _common.deprecated(p, "--scheme", "--schemes")
    for flag in ("--preset-schemes",):
        for item in args.preset_schemes:
            _, sep, schemes = item.partition("=")
            try:
                listed = _csv(schemes)
            except ValueError:
                listed = []
            if not sep or not listed:
                p.error(f"{flag} wants PRESET=SCHEME[,SCHEME], got {item!r}")
    for flag in ("--png", "--md", "--ceilings"):  # files only: '-' is not stdout for them
        value = getattr(args, flag[2:])
        if value is not None and str(value) == _common.STDOUT:
            p.error(f"{flag} -: {flag} writes a file, not stdout (only --json takes '-')")
    if args.png is not None:
        _common.require_module(p, "matplotlib", "--png", "bench")
        if not args.png.suffix:  # the file the plot goes to (matplotlib adds the suffix)
            args.png = args.png.with_name(args.png.name + ".png")
        elif args.png.suffix.lower() != ".png":
            p.error(f"--png {args.png}: writes a PNG image; give a path ending in .png")
    _common.check_outputs(
        p,
        {
            "--json": (args.json, _common.json_output(BENCH_SCHEMA)),
            "--png": (args.png, "png"),
            "--md": (args.md, "md"),
            "--ceilings": (args.ceilings, "ceilings"),
        },
    )
    return device


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write JSON / PNG / markdown when asked."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    if args.replay is not None:
        return main(_replayed_argv(p, args, argv))
    device = _validate(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ep_size != 1:
        return main_expert_parallel(args, argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    from ..bench import report
    from ..bench.roofline import load_or_measure
    from ..bench.sweep import Sweep, fill_speedups

    to_stdout = str(args.json) == _common.STDOUT
    out = sys.stderr if to_stdout else sys.stdout
    if config.baselines and not report.have_transformers():
        print(
            "moerunner bench: transformers is not installed: the baselines are plain-PyTorch "
            "stand-ins (torch-eq:eager, torch-eq:grouped_mm), not transformers' modules",
            file=sys.stderr,
        )
    if not args.quiet:
        where = f"cached in {args.ceilings}" if args.ceilings else "not cached: no --ceilings"
        print(f"ceilings of {device} ({where}) ...", file=sys.stderr)
    try:
        ceilings = load_or_measure(device, args.ceilings, args.remeasure)
    except ValueError as exc:
        p.error(str(exc))
    bar = None
    sweep = Sweep(config, ceilings)
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=sweep.total_rows(), desc="bench", unit="row", file=sys.stderr)

    def progress(row) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{row.preset} {row.scheme} {row.impl} T={row.tokens}")
            bar.update(1)

    sweep.progress = progress
    env = report.environment(device)

    def checkpoint(rows_so_far) -> None:  # a partial record survives an interrupted run
        if args.json is not None and not to_stdout:
            fill_speedups(rows_so_far)
            report.to_json(
                args.json, argv, config, ceilings, env, rows_so_far, sweep.skipped_backends
            )

    rows = sweep.run(after_shape=checkpoint)
    if bar is not None:
        bar.close()
    fill_speedups(rows)
    print(
        f"{env['device']}: copy {ceilings.copy_gbps:.0f} GB/s, peaks "
        + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in ceilings.peak_tflops.items()),
        file=out,
    )
    print(report.table(rows, config.baselines, env.get("transformers") or False), file=out)
    side_by_side = report.backends_side_by_side(rows)
    if side_by_side:  # two or more backends: their times and ratios on one line per point
        print("\nbackends side by side (ratio: time / the first backend's time)", file=out)
        print(side_by_side, file=out)
    warning = report.spread_warning(
        rows, SPREAD_WARN_PCT, config.min_time_s, env.get("transformers") or False
    )
    if warning:
        print(f"moerunner bench: warning: {warning}", file=sys.stderr)
    if args.json is not None:
        report.to_json(args.json, argv, config, ceilings, env, rows, sweep.skipped_backends)
        if not to_stdout:
            print(f"wrote {args.json}")
    if args.png is not None:
        report.plot(
            args.png, rows, f"{env['device']} {env['date'][:10]}", env.get("transformers") or False
        )
        print(f"wrote {args.png}", file=out)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.md, report.markdown(rows, env, ceilings, config, argv))
        print(f"wrote {args.md}", file=out)
    return 1 if any(r.status == "wrong" for r in rows) else 0


def main_expert_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    """``--ep-size N``: this process is one of N torchrun ranks; time expert-parallel layers.

    Rows: preset x scheme x dispatcher x backend x routing x T (tokens per rank), each timed
    per stage (slowest rank) and checked against the reference on every rank. Rank 0 prints
    and writes the JSON; every rank returns the same exit code.
    """
    from ..bench.expert_parallel import EpOptions, run_ep_sweep
    from ..bench.expert_parallel import table as ep_table
    from ..bench.expert_parallel import to_json as ep_json
    from ..distributed_moe import DISPATCHERS

    n = args.ep_size
    world = os.environ.get("WORLD_SIZE")  # torchrun sets it; read only here, at the edge
    if n < 1 or world is None or world != str(n):
        found = f"this launch has WORLD_SIZE={world}" if world else "not launched by torchrun"
        print(
            f"moerunner bench: error: --ep-size {n} needs one process per rank ({found}); launch "
            f"with: torchrun --nproc-per-node {max(n, 1)} -m moerunner bench --ep-size "
            f"{max(n, 1)} [other flags]",
            file=sys.stderr,
        )
        return 2
    args.dispatcher = args.dispatcher or ["all_to_all"]
    if args.capacity_factor is None:
        args.capacity_factor = 2.0
    problems = [f"--dispatcher: unknown {d!r}" for d in args.dispatcher if d not in DISPATCHERS]
    if args.tp != 1:
        problems.append("--tp and --ep-size cannot be combined (experts are split by ownership)")
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    if problems:
        print(
            f"moerunner bench: error: {'; '.join(problems)} (dispatchers: "
            f"{', '.join(DISPATCHERS)})",
            file=sys.stderr,
        )
        return 2
    import torch.distributed as dist

    from ..bench import report
    from ..distributed import init_world

    device = init_world(torch.device(config.device).type, int(os.environ.get("LOCAL_RANK", "0")))
    try:
        rank = dist.get_rank()
        options = EpOptions(n, tuple(args.dispatcher), args.capacity_factor)
        bar = None
        if rank == 0 and not args.quiet:
            from tqdm import tqdm

            bar = tqdm(desc=f"bench EP={n}", unit="row", file=sys.stderr)

        def progress(row) -> None:
            if bar is not None:
                bar.set_postfix_str(f"{row.preset} {row.scheme} {row.dispatcher} T={row.tokens}")
                bar.update(1)

        rows = run_ep_sweep(config, options, progress=progress)
        if bar is not None:
            bar.close()
        if rank == 0:
            env = report.environment(device)
            env.update(world=n, dist_backend=str(dist.get_backend()))
            out = sys.stderr if str(args.json) == _common.STDOUT else sys.stdout
            print(
                f"{env['device']}: expert parallel over {n} ranks ({env['dist_backend']})",
                file=out,
            )
            print(ep_table(rows), file=out)
            if args.json is not None:
                ep_json(args.json, argv, config, options, env, rows)
                if out is sys.stdout:
                    print(f"wrote {args.json}")
    finally:
        dist.destroy_process_group()
    return 1 if any(r.status == "wrong" for r in rows) else 0
