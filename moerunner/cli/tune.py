"""``moerunner tune``: search Triton tile configs for MoE shapes on this GPU, write JSON.

Examples::

    moerunner tune --preset deepseek-v3 --schemes fp8_block --tokens 1,16,64,256
    moerunner tune --shape 128,2048,768,8 --schemes bf16,mxfp4 --out-dir configs/

For each shape (preset or ``--shape E,H,I,K``), scheme and token count the triton backend's
candidates are timed (``moerunner.backends.triton.tune``); the best tiles go to one JSON file
per shape, scheme and device in ``--out-dir`` (default: the folder the triton backend reads
its tile configs from), merged with the token counts a file already holds. A tile file marks
itself with a top-level "schema": "moerunner.triton.tiles/1"; a file of the same name without
that marker is never merged into or overwritten (a usage error, before any work).

With ``--backends`` it measures backends instead of tiles: which backend is fastest per
token count, written to the device's backend table (``moerunner.cli._tune_backends``)::

    moerunner tune --preset gpt-oss-120b --schemes mxfp4 --backends triton,flashinfer
    moerunner tune --shape 8,64,96,2 --schemes fp32 --backends --device cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import ACTIVATIONS
from . import _common
from ._tune_backends import DEFAULT_MIN_TIME_S

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


def _preset_names() -> list[str]:
    """The presets ``--preset`` takes: the published models' shapes of ``bench.presets``
    (the tile tuner's ``PRESETS`` are the same ones), read there because that needs no
    triton: ``--backends`` also runs without it."""
    from ..bench.presets import MODEL_PRESETS

    return sorted(MODEL_PRESETS)


def build_parser() -> _common.Parser:
    """The argument parser (also used by tests)."""
    p = _common.parser(
        "tune",
        __doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    preset_names = _preset_names()
    p.add_argument(
        "--preset",
        type=_common.name_list(preset_names, "preset"),
        action="append",
        default=[],
        help=f"comma-separated model shape presets: {', '.join(preset_names)}",
    )
    p.add_argument(
        "--shape",
        nargs="+",
        action="append",
        default=[],
        metavar="E,H,I,K",
        help="explicit shape instead of a preset: experts, hidden, intermediate (the "
        "per-GPU I), top-k; repeatable (deprecated: four space-separated H I E TOPK)",
    )
    p.add_argument(
        "--activation",
        choices=sorted(ACTIVATIONS),
        default=None,
        help="activation (default: the preset's; silu for --shape)",
    )
    schemes = _common.name_list(_common.scheme_names, "scheme")
    p.add_argument(
        "--schemes",
        type=schemes,
        default=None,
        help="comma-separated weight schemes (default bf16): bf16, fp8_block, mxfp4, ...",
    )
    p.add_argument("--scheme", type=schemes, action="append", help="deprecated: --schemes")
    p.add_argument(
        "--tokens",
        nargs="+",
        default=None,
        help=f"comma-separated token counts (default {','.join(map(str, DEFAULT_TOKENS))})",
    )
    p.add_argument(
        "--out-dir",
        type=_common.dir_type,
        default=None,
        help="folder for the JSON files (default: the user tile folder, "
        "$XDG_CACHE_HOME/moerunner/tiles or ~/.cache/moerunner/tiles, read before the "
        "shipped files)",
    )
    p.add_argument("--out", type=_common.dir_type, default=None, help="deprecated: --out-dir")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every candidate (fills the kernel cache), time and write nothing",
    )
    p.add_argument(
        "--e2m1-layout",
        choices=("fragment", "split"),
        default=None,
        help="layout mxfp4/nvfp4 weights are prepared in, and tuned for "
        "(TritonOptions.e2m1_layout; default: fragment, whose files are keyed layout=fragment)",
    )
    p.add_argument(
        "--backends",
        nargs="?",
        const="",
        default=None,
        metavar="A,B",
        help="measure backends instead of tiles: the fastest per token count goes to the "
        "device's backend table (default folder: $XDG_CACHE_HOME/moerunner/backends or "
        "~/.cache/moerunner/backends); no list: every backend available here that serves "
        "the shape",
    )
    _common.add_device(p, "cuda; with --backends only")
    p.add_argument(
        "--min-time",
        type=_common.float_type(0.0, strict=True),
        default=None,
        help="with --backends: seconds of timing per backend and token count (default "
        f"{DEFAULT_MIN_TIME_S:g})",
    )
    p.add_argument(
        "--jobs",
        type=_common.int_type(1),
        default=1,
        help="with --preset: compile every candidate first in this many parallel processes "
        "(compiling is CPU work; the search then only times)",
    )
    return p


def _shapes(p: argparse.ArgumentParser, args) -> list[tuple[str, tuple[int, int, int, int, str]]]:
    """(label, (H, I, E, top_k, activation)) of every preset and --shape."""
    from ..bench.presets import PRESETS

    out = []
    for group in args.preset:
        for name in group:
            s = PRESETS[name]
            shape = (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k)
            out.append((name, (*shape, args.activation or s.activation)))
    for values in args.shape:
        if len(values) == 4:  # the old "--shape H I E TOPK"
            _common.deprecated(p, "--shape H I E TOPK", "--shape E,H,I,K")
            h, i, e, k = values
            values = [f"{e},{h},{i},{k}"]
        if len(values) != 1:
            p.error(f"--shape: expected E,H,I,K, got {' '.join(values)!r}")
        try:
            e, h, i, k = _common.shape_type(values[0])
        except argparse.ArgumentTypeError as exc:
            p.error(f"--shape: {exc}")
        out.append((f"shape {e},{h},{i},{k}", (h, i, e, k, args.activation or "silu")))
    return out


def _tokens(p: argparse.ArgumentParser, values: list[str] | None) -> tuple[int, ...]:
    if values is None:
        return DEFAULT_TOKENS
    if len(values) > 1:
        _common.deprecated(p, "--tokens with space-separated counts", "--tokens 1,16,64")
    try:
        return _common.int_list(1)(",".join(values))
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --tokens: {exc}")


def _refuse_foreign_files(p, out_dir: Path, shapes, schemes, device_name: str) -> None:
    """Before any work: every file of this run's names in ``out_dir`` is a tile file moerunner
    wrote (merged into, keeping its other token counts); any other file is a usage error."""
    from ..backends.triton.tile_config import config_files_of, is_tile_file

    for _, (hidden, inter, experts, _, _) in shapes:
        for scheme in schemes:
            for path in config_files_of(out_dir, experts, inter, hidden, scheme, device_name):
                if not (path.is_file() and is_tile_file(path)):
                    p.error(
                        f"{path}: exists and is not a moerunner tile file; refusing to merge "
                        "into it (move it away, or give another --out-dir)"
                    )


def main(argv: list[str] | None = None) -> int:
    """Tune every (shape, scheme); exit status 2 on usage errors or without a GPU."""
    p = build_parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.backends is None:
        _common.require_module(p, "triton", "moerunner tune", "triton")
    elif args.compile_only or args.e2m1_layout or args.jobs != 1:
        p.error("--backends measures backends: --compile-only, --e2m1-layout and --jobs tune tiles")
    if args.backends is None and args.min_time is not None:
        p.error("--min-time applies to --backends only (tiles are timed by the tile search)")
    if args.jobs != 1 and not any(args.preset):
        p.error("--jobs compiles the candidates of --preset shapes; add --preset, or drop --jobs")
    if args.out is not None:
        _common.deprecated(p, "--out", "--out-dir")
        if args.out_dir is not None:
            p.error("give --out-dir only (--out is its deprecated alias)")
    if args.scheme:
        _common.deprecated(p, "--scheme", "--schemes")
    schemes = list(
        dict.fromkeys((args.schemes or []) + [s for g in args.scheme or [] for s in g])
    ) or ["bf16"]
    tokens = _tokens(p, args.tokens)
    shapes = _shapes(p, args)
    if not shapes:
        p.error("give --preset or --shape")
    for label, (hidden, inter, _, _, act) in shapes:
        rows = 2 * inter if ACTIVATIONS[act] else inter
        for scheme in schemes:
            why = _common.unstorable(scheme, [(rows, hidden), (hidden, inter)])
            if why is not None:
                p.error(f"--schemes {scheme}: {label} cannot be stored in it ({why})")
    out_dir = args.out_dir or args.out
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        p.error(f"--out-dir {out_dir}: exists and is not a directory")
    if out_dir is not None:
        _common.check_writable_dir(p, "--out-dir", out_dir)
    if args.backends is not None:
        from . import _tune_backends

        return _tune_backends.main(p, args, shapes, schemes, tokens)
    if args.device is not None:
        p.error("--device: only with --backends (tiles are tuned on the current GPU)")

    import torch

    from ..backends.triton import TritonOptions, tune
    from ..backends.triton.tile_config import user_tile_dir

    options = TritonOptions(e2m1_layout=args.e2m1_layout or "fragment")
    if not torch.cuda.is_available():
        print("moerunner tune: error: needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    if out_dir is None:
        out_dir = user_tile_dir()
        _common.check_writable_dir(p, "--out-dir (default)", out_dir)
    _refuse_foreign_files(p, out_dir, shapes, schemes, torch.cuda.get_device_name())
    presets = [name for group in args.preset for name in group]
    if args.jobs > 1 and presets and not args.compile_only:
        plan = [(name, scheme, tokens) for name in presets for scheme in schemes]
        tune.precompile(plan, args.jobs, e2m1_layout=options.e2m1_layout)
    written = 0  # each (shape, scheme) writes its file when its search ends
    try:
        for _, (hidden, inter, experts, top_k, act) in shapes:
            for scheme in schemes:
                path, _ = tune.tune_preset(
                    hidden,
                    inter,
                    experts,
                    top_k,
                    act,
                    scheme,
                    tokens,
                    out_dir,
                    progress=lambda s: print(s, flush=True),
                    compile_only=args.compile_only,
                    options=options,
                )
                print("compiled every candidate" if path is None else f"wrote {path}")
                written += path is not None
    except KeyboardInterrupt:
        if args.compile_only:
            raise
        total = len(shapes) * len(schemes)
        raise KeyboardInterrupt(f"{written} of {total} tile files written to {out_dir}") from None
    return 0


if __name__ == "__main__":  # the tuner's parallel precompile runs this module per shape
    raise SystemExit(main())
