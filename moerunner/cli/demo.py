"""``moerunner demo``: a scaled-down Qwen3-30B-A3B MoE on every available backend.

Builds one MoE layer (E=128, k=8, softmax + renormalize routing, SiLU experts; H and I
reduced so it runs in seconds on a CPU) on the default device, runs it through every backend
that can serve it, checks each against the float64 reference and prints backend, path, error
and median time.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from tqdm import tqdm

from ..api import fused_moe
from ..backends.base import MoeProblem
from ..config import Activation
from ..dispatch.formats import STANDARD
from ..reference import reference_moe
from ..routing import select_experts
from ..runner import default_registry
from ..testing import compare
from ..weights import ExpertWeights
from . import _common

SCHEMA = "moerunner-demo/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time_ms(fn, repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv: list[str]) -> int:
    """Run the demo; returns 1 if any backend misses its error bound."""
    parser = _common.parser("demo", __doc__)
    positive = _common.int_type(1)
    parser.add_argument("--tokens", type=positive, default=64, help="T (default 64)")
    parser.add_argument(
        "--hidden", type=positive, default=None, help="H (default 512 CPU, 2048 GPU)"
    )
    parser.add_argument("--intermediate", type=positive, default=None, help="I (default 192/768)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 on GPU"
    )
    _common.add_device(parser)
    parser.add_argument("--repeats", type=positive, default=5, help="timed calls per backend")
    parser.add_argument("--seed", type=_common.int_type(0, "seed", _common.MAX_SEED), default=0)
    parser.add_argument(
        "--json",
        type=_common.path_type,
        default=None,
        help="write the result as JSON here ('-': stdout)",
    )
    args = parser.parse_args(argv)
    device = _common.resolve_device(parser, args.device)
    _common.check_outputs(parser, {"--json": (args.json, _common.json_output(SCHEMA))})

    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    hidden = args.hidden if args.hidden is not None else (2048 if on_gpu else 512)
    inter = args.intermediate if args.intermediate is not None else (768 if on_gpu else 192)
    experts, top_k = 128, 8
    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = rand(args.tokens, hidden)
    weights = ExpertWeights(
        rand(experts, 2 * inter, hidden, scale=hidden**-0.5),
        rand(experts, hidden, inter, scale=inter**-0.5),
    )
    logits = torch.randn(args.tokens, experts, generator=gen).to(device)
    topk = select_experts(logits, top_k, renormalize=True)
    act = Activation("silu")
    to_stdout = str(args.json) == _common.STDOUT
    say = (lambda *a: print(*a, file=sys.stderr)) if to_stdout else print
    say(
        f"demo: Qwen3-30B-A3B-shaped MoE (E={experts}, k={top_k}, H={hidden}, I={inter}), "
        f"T={args.tokens}, {str(dtype).replace('torch.', '')} on {device}"
    )
    ref = reference_moe(x, weights, topk.weights, topk.ids, act)
    # bf16/fp16 carry 8/11 significant bits through two GEMMs and a stored intermediate.
    bound = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]

    registry = default_registry()
    problem = MoeProblem.of(x, weights, weights.spec(act), STANDARD)
    verdicts = registry.verdicts(problem)
    rows, failed = [], False  # (backend, path, max rel err, median ms, status); None: not run
    for name in tqdm(list(verdicts), desc="backends", unit="backend"):
        ok, reason = verdicts[name]
        if not ok:
            rows.append((name, None, None, None, f"skipped: {reason}"))
            continue
        path = registry.paths(name)[STANDARD]

        def call(name=name):
            return fused_moe(x, weights.w13, weights.w2, topk.weights, topk.ids, backend=name)

        out = call()
        err = compare(out, ref).max_rel
        ms = _time_ms(call, args.repeats, device)
        passed = err <= bound
        failed |= not passed
        rows.append((name, path, err, ms, "ok" if passed else f"FAIL > {bound}"))
    header = ("backend", "path", "max rel err", "median ms", "status")
    cells = [
        (n, p or "-", "-" if e is None else f"{e:.2e}", "-" if t is None else f"{t:.2f}", s)
        for n, p, e, t, s in rows
    ]
    widths = [max(len(str(r[i])) for r in [header, *cells]) for i in range(len(header))]
    for row in [header, *cells]:
        say("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)))
    say(f"(error: max |out - ref| / max |ref|, ref in float64; bound for this dtype {bound})")
    if args.json is not None:
        from .. import __version__

        record = {
            "schema": SCHEMA,
            "moerunner": __version__,
            "argv": list(argv),
            "shape": {"E": experts, "H": hidden, "I": inter, "K": top_k, "T": args.tokens},
            "dtype": str(dtype).replace("torch.", ""),
            "device": str(device),
            "bound": bound,
            "rows": [dict(zip(("backend", "path", "max_rel_err", "median_ms", "status"), r,
                              strict=True)) for r in rows],
        }  # fmt: skip
        _common.write_json(args.json, record)
        if not to_stdout:
            print(f"wrote {args.json}")
    return 1 if failed else 0
