"""``moerunner check``: each backend x scheme available here against the float64 reference.

For every backend that runs on this machine and every scheme it claims (or those named with
``--schemes``), quantizes one random MoE layer, runs it through the backend and prints the error
against the reference with pass/fail against the scheme's bound (``moerunner.testing``).
Plain schemes (bf16, fp16, fp32) run with hidden states of their own dtype unless ``--dtype``
says otherwise. Exit status: 0 all checked cases pass, 1 a case fails or nothing was checked,
2 a usage error.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from ..api import fused_moe
from ..backends.base import MoeProblem
from ..bench.sweep import accuracy_bound
from ..config import Activation
from ..dispatch.formats import STANDARD
from ..quant import SCHEME_NAMES, get_scheme, quantize
from ..reference import reference_moe
from ..routing import select_experts
from ..runner import default_registry
from ..testing import compare
from ..weights import ExpertWeights
from . import _common

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEMA = "moerunner-check/1"
#: The size flags, in ``--shape E,H,I,K`` order: (flag, default, meaning).
_SIZE_FLAGS = (
    ("--experts", 8, "E"),
    ("--hidden", 256, "H"),
    ("--intermediate", 256, "I"),
    ("--top-k", 2, "K, at most E"),
)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _layer(args, device, dtype, scheme_name: str, gen: torch.Generator):
    e, h, i = args.experts, args.hidden, args.intermediate
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    scheme = get_scheme(scheme_name)
    if scheme.is_quantized:
        static = scheme.activation_scales == "static"
        s13, s2 = (torch.full((e,), v) if static else None for v in (0.02, 0.005))
        return ExpertWeights(
            quantize(w13, scheme, input_scale=s13).to(device),
            quantize(w2, scheme, input_scale=s2).to(device),
        )
    return ExpertWeights(w13.to(device, dtype), w2.to(device, dtype))


def _quantizable(args, scheme_name: str) -> str | None:
    """Why a layer of these sizes cannot be stored in the scheme (None: it can)."""
    h, i = args.hidden, args.intermediate
    return _common.unstorable(scheme_name, [(2 * i, h), (h, i)])


def build_parser() -> _common.Parser:
    """The argument parser (also used by tests)."""
    parser = _common.parser("check", __doc__)
    schemes = _common.name_list(_common.scheme_names, "scheme")
    parser.add_argument(
        "--schemes",
        type=schemes,
        default=None,
        help="comma-separated schemes to check (default: every scheme each backend claims)",
    )
    parser.add_argument("--scheme", action="append", type=schemes, help="deprecated: --schemes")
    parser.add_argument(
        "--backends", type=_common.name_list(what="backend"), default=None,
        help="comma-separated backends (default: all available)",
    )  # fmt: skip
    parser.add_argument(
        "--backend", action="append", type=_common.name_list(what="backend"),
        help="deprecated: --backends",
    )  # fmt: skip
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="hidden dtype (default: a plain scheme's own; else fp32 on CPU, bf16 on GPU)",
    )
    _common.add_device(parser)
    positive = _common.int_type(1)
    parser.add_argument("--tokens", type=positive, default=16, help="T (default 16)")
    parser.add_argument(
        "--shape",
        type=_common.shape_type,
        default=None,
        metavar="E,H,I,K",
        help="experts, hidden, intermediate, top-k in one flag (as bench and tune take it); "
        "instead of --experts, --hidden, --intermediate, --top-k",
    )
    for flag, default, what in _SIZE_FLAGS:
        parser.add_argument(flag, type=positive, default=None, help=f"{what} (default {default})")
    parser.add_argument(
        "--json",
        type=_common.path_type,
        default=None,
        help="write the result as JSON here ('-': stdout)",
    )
    return parser


def _sizes(parser, args) -> None:
    """``--shape E,H,I,K`` or the four size flags (their defaults where neither is given)."""
    dests = [flag[2:].replace("-", "_") for flag, _, _ in _SIZE_FLAGS]
    given = [flag for (flag, _, _), d in zip(_SIZE_FLAGS, dests, strict=True) if getattr(args, d)]
    if args.shape is not None and given:
        parser.error(f"give --shape E,H,I,K or {', '.join(given)}, not both")
    values = args.shape or [
        getattr(args, d) or dflt for (_, dflt, _), d in zip(_SIZE_FLAGS, dests, strict=True)
    ]
    for dest, value in zip(dests, values, strict=True):
        setattr(args, dest, value)


def main(argv: list[str]) -> int:
    """Run the check; returns 1 if any combination misses its bound or nothing was checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _sizes(parser, args)
    if args.scheme:
        _common.deprecated(parser, "--scheme", "--schemes")
    if args.backend:
        _common.deprecated(parser, "--backend", "--backends")
    requested_schemes = None
    if args.schemes or args.scheme:
        requested_schemes = list(
            dict.fromkeys((args.schemes or []) + [s for g in args.scheme or [] for s in g])
        )
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    device = _common.resolve_device(parser, args.device)
    registry = default_registry()
    names = args.backends or []
    names = list(dict.fromkeys(names + [b for g in args.backend or [] for b in g])) or list(
        registry.backends
    )
    unknown = [n for n in names if n not in registry.backends]
    if unknown:
        parser.error(
            f"--backends: unknown {', '.join(map(repr, unknown))}; "
            f"registered: {', '.join(registry.backends)}"
        )
    for scheme_name in requested_schemes or []:
        why = _quantizable(args, scheme_name)
        if why is not None:
            parser.error(
                f"--schemes {scheme_name}: a layer with hidden size {args.hidden} and "
                f"intermediate size {args.intermediate} cannot be stored in it ({why})"
            )
    _common.check_outputs(parser, {"--json": (args.json, _common.json_output(SCHEMA))})
    to_stdout = str(args.json) == _common.STDOUT
    out = sys.stderr if to_stdout else sys.stdout
    default_dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]

    def dtype_of(scheme_name: str) -> torch.dtype:
        scheme = get_scheme(scheme_name)
        if scheme.is_quantized or args.dtype is not None:
            return default_dtype
        return DTYPES[scheme_name]

    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(args.tokens, args.hidden, generator=gen)
    topk = select_experts(
        torch.randn(args.tokens, args.experts, generator=gen).to(device),
        args.top_k,
        renormalize=True,
    )
    act = Activation("silu")
    jobs, rows, failed = [], [], False
    for name in names:
        backend = registry.backends[name]
        ok, reason = backend.available()
        if not ok:
            print(f"{name}: not available here ({reason})", file=out)
            continue
        schemes = requested_schemes or sorted(backend.capabilities.schemes & set(SCHEME_NAMES))
        for scheme_name in schemes:
            why = None if requested_schemes else _quantizable(args, scheme_name)
            if why is not None:
                rows.append((name, scheme_name, None, None, f"skipped: {why}"))
                continue
            jobs.append((name, scheme_name))
    for name, scheme_name in tqdm(jobs, desc="check", unit="case", file=sys.stderr):
        scheme = get_scheme(scheme_name)
        dtype = dtype_of(scheme_name)
        if not scheme.is_quantized and DTYPES[scheme_name] != dtype:
            rows.append(
                (name, scheme_name, None, None,
                 f"skipped: plain {scheme_name} weights with --dtype {args.dtype} hidden states")
            )  # fmt: skip
            continue
        weights = _layer(args, device, dtype, scheme_name, gen)
        x = x32.to(device, dtype)
        problem = MoeProblem.of(x, weights, weights.spec(act), STANDARD)
        ok, reason = registry.backends[name].supports(problem)
        if not ok:
            rows.append((name, scheme_name, None, None, f"skipped: {reason}"))
            continue
        result = fused_moe(x, weights.w13, weights.w2, topk.weights, topk.ids, backend=name)
        report = compare(result, reference_moe(x, weights, topk.weights, topk.ids, act))
        bound = accuracy_bound(scheme_name, dtype)
        passed = report.nonfinite == 0 and report.max_rel <= bound
        failed |= not passed
        rows.append((name, scheme_name, report.max_rel, bound, "pass" if passed else "FAIL"))
    header = ("backend", "scheme", "max rel err", "bound", "result")
    shown = [
        (name, scheme, _cell(err, ".2e"), _cell(bound, ".1e"), result)
        for name, scheme, err, bound, result in rows
    ]
    widths = [max(len(str(r[i])) for r in [header, *shown]) for i in range(len(header))]
    for row in [header, *shown]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)), file=out)
    hidden_dtypes = sorted({str(dtype_of(s)).replace("torch.", "") for _, s in jobs}) or [
        str(default_dtype).replace("torch.", "")
    ]
    print(
        f"(T={args.tokens}, E={args.experts}, k={args.top_k}, H={args.hidden}, "
        f"I={args.intermediate}, hidden {'/'.join(hidden_dtypes)} on {device})",
        file=out,
    )
    checked = sum(r[4] in ("pass", "FAIL") for r in rows)
    if args.json is not None:
        from .. import __version__

        record = {
            "schema": SCHEMA,
            "moerunner": __version__,
            "argv": list(argv),
            "device": str(device),
            "shape": {"T": args.tokens, "E": args.experts, "K": args.top_k,
                      "H": args.hidden, "I": args.intermediate},
            "rows": [dict(zip(("backend", "scheme", "max_rel_err", "bound", "result"), r,
                              strict=True)) for r in rows],
            "checked": checked,
        }  # fmt: skip
        _common.write_json(args.json, record)
        if not to_stdout:
            print(f"wrote {args.json}")
    if checked == 0:
        print(
            "moerunner check: nothing was checked: every case was skipped or no backend is "
            "available here (see the lines above and 'moerunner info')",
            file=sys.stderr,
        )
        return 1
    return 1 if failed else 0
