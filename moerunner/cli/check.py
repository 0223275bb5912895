"""``moerunner check``: each backend x scheme available here against the float64 reference.

For every backend that runs on this machine and every scheme it claims (or those named with
``--scheme``), quantizes one random MoE layer, runs it through the backend and prints the error
against the reference with pass/fail against the scheme's bound (``moerunner.testing``).
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from ..api import fused_moe
from ..backends.base import MoeProblem
from ..config import Activation
from ..dispatch.formats import STANDARD
from ..quant import SCHEME_NAMES, get_scheme, quantize
from ..reference import reference_moe
from ..routing import select_experts
from ..runner import default_registry
from ..testing import compare, error_bound
from ..weights import ExpertWeights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    plain = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[scheme_name]
    if plain != dtype:
        return None
    return ExpertWeights(w13.to(device, plain), w2.to(device, plain))


def main(argv: list[str]) -> int:
    """Run the check; returns 1 if any combination misses its bound."""
    parser = argparse.ArgumentParser(prog="moerunner check", description=__doc__)
    parser.add_argument(
        "--scheme",
        action="append",
        choices=SCHEME_NAMES,
        help="scheme(s) to check (default: every scheme each backend claims)",
    )
    parser.add_argument("--backend", action="append", help="backend(s) (default: all available)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="hidden dtype (default: fp32 on CPU, bf16 on GPU)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    registry = default_registry()
    names = args.backend or list(registry.backends)
    unknown = sorted(set(names) - set(registry.backends))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; registered: {sorted(registry.backends)}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    topk = select_experts(
        torch.randn(args.tokens, args.experts, generator=gen).to(device),
        args.top_k,
        renormalize=True,
    )
    act = Activation("silu")
    jobs = []
    for name in names:
        backend = registry.backends[name]
        ok, reason = backend.available()
        if not ok:
            print(f"{name}: not available here ({reason})")
            continue
        schemes = args.scheme or sorted(backend.capabilities.schemes & set(SCHEME_NAMES))
        jobs += [(name, s) for s in schemes]
    rows, failed = [], False
    for name, scheme_name in tqdm(jobs, desc="check", unit="case"):
        weights = _layer(args, device, dtype, scheme_name, gen)
        if weights is None:
            continue
        problem = MoeProblem.of(x, weights, weights.spec(act), STANDARD)
        ok, reason = registry.backends[name].supports(problem)
        if not ok:
            rows.append((name, scheme_name, "-", "-", f"skipped: {reason}"))
            continue
        out = fused_moe(x, weights.w13, weights.w2, topk.weights, topk.ids, backend=name)
        report = compare(out, reference_moe(x, weights, topk.weights, topk.ids, act))
        scheme = get_scheme(scheme_name)
        bound = error_bound(dtype, scheme.is_quantized and scheme.activation_format != "none")
        passed = report.nonfinite == 0 and report.max_rel <= bound
        failed |= not passed
        rows.append(
            (
                name,
                scheme_name,
                f"{report.max_rel:.2e}",
                f"{bound:.1e}",
                "pass" if passed else "FAIL",
            )
        )
    header = ("backend", "scheme", "max rel err", "bound", "result")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)))
    print(
        f"(T={args.tokens}, E={args.experts}, k={args.top_k}, H={args.hidden}, "
        f"I={args.intermediate}, hidden {str(dtype).replace('torch.', '')} on {device})"
    )
    return 1 if failed else 0
