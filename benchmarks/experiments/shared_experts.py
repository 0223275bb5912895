# Shared experts through fused_moe (moerunner.shared: the routed call and the shared experts'
# own call on the same runner) against the routed call plus a separate dense MLP per shared
# expert (PyTorch, as a model computes it), at decode and prefill token counts. (The records
# of 2026-11-27 and 2026-12-06 also time the form the own call replaced: the shared experts as
# extra slots of the routed call.)
#
#   python benchmarks/experiments/shared_experts.py --preset deepseek-v3 --tokens 1,16,256,4096
#   python benchmarks/experiments/shared_experts.py --preset cpu-small --device cpu --tokens 1,16
#
# Shapes come from moerunner.bench.presets; the shared experts are given relative to them:
# --shared S experts of intermediate size --shared-mult x the routed I (DeepSeek-V3: 1 x 1;
# Qwen2-MoE-style: 1 x 4 with --gate). --shrink N divides H and I by N (CPU runs). Prints a
# table (milliseconds per call, median; CUDA-graph replay on a GPU where capture works; ratio:
# routed+dense time over fused_moe's, above 1 fused_moe is faster) and writes --json.

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import moerunner  # noqa: E402
from moerunner.bench.presets import PRESETS, get_preset  # noqa: E402
from moerunner.bench.timing import time_cases  # noqa: E402
from moerunner.config import Activation  # noqa: E402
from moerunner.shared import SharedExperts, shared_dense  # noqa: E402


def build_weights(args, device: torch.device, dtype: torch.dtype):
    """The routed and shared experts, once per run, drawn on ``device`` (drawing a model-size
    layer on the host and copying it costs more than the whole measurement)."""
    shape = get_preset(args.preset)
    h = max(16, shape.hidden_size // args.shrink)
    i = max(16, shape.intermediate_size // args.shrink)
    e, k, act = shape.num_experts, shape.top_k, Activation(shape.activation)
    rows = 2 * i if act.gated else i
    i_s = i * args.shared_mult
    rows_s = 2 * i_s if act.gated else i_s
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size, scale):
        return (torch.randn(*size, generator=g, device=device, dtype=dtype)) * scale

    w13, w2 = rand(e, rows, h, scale=h**-0.5), rand(e, h, i, scale=i**-0.5)
    shared = SharedExperts(
        rand(args.shared, rows_s, h, scale=h**-0.5),
        rand(args.shared, h, i_s, scale=i_s**-0.5),
        rand(args.shared, h, scale=h**-0.5) if args.gate else None,
    )
    if args.scheme != "bf16":
        w13, w2 = moerunner.quantize(w13, args.scheme), moerunner.quantize(w2, args.scheme)
    return w13, w2, shared, act, (e, h, i, k)


def build(args, weights, tokens: int, device: torch.device, dtype: torch.dtype):
    """One token count's inputs and routing over ``weights`` (from ``build_weights``)."""
    w13, w2, shared, act, dims = weights
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, dims[1], generator=g, device=device, dtype=dtype)
    logits = torch.randn(tokens, dims[0], generator=g, device=device)
    topk = moerunner.select_experts(logits, dims[3])
    return x, w13, w2, shared, topk, act, dims


def measure(args, case, device: torch.device):
    """Timings of fused_moe with the shared experts and of the routed call + dense MLPs."""
    x, w13, w2, shared, topk, act, _ = case

    def fused(_i):
        return moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, activation=act, backend=args.backend,
            shared_experts=shared, check_ids=False,
        )  # fmt: skip

    def separate(_i):
        routed = moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, activation=act, backend=args.backend,
            check_ids=False,
        )  # fmt: skip
        return routed + shared_dense(x, shared, act).to(x.dtype)

    with torch.no_grad():
        return time_cases(fused, 1, device), time_cases(separate, 1, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--shared", type=int, default=1, help="shared experts S")
    ap.add_argument("--shared-mult", type=int, default=1, help="I_s as a multiple of I")
    ap.add_argument("--gate", action="store_true", help="a sigmoid gate per shared expert")
    ap.add_argument("--scheme", default="bf16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--shrink", type=int, default=1, help="divide H and I by this")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    print(f"{'T':>6} {'fused_moe ms':>12} {'routed+dense ms':>16} {'ratio':>7}  shape E,H,I,k")
    weights = build_weights(args, device, dtype)
    for tokens in (int(t) for t in args.tokens.split(",")):
        case = build(args, weights, tokens, device, dtype)
        a, b = measure(args, case, device)
        dims = case[-1]
        ratio = b.seconds / a.seconds
        print(
            f"{tokens:>6} {a.seconds * 1e3:>12.3f} {b.seconds * 1e3:>16.3f} {ratio:>6.2f}x  "
            f"{','.join(map(str, dims))}"
        )
        rows.append(
            {
                "tokens": tokens,
                "fused_moe_s": a.seconds,
                "fused_moe_mode": a.mode,
                "separate_s": b.seconds,
                "separate_mode": b.mode,
                "speedup": ratio,
                "shape": dims,
                "shared": args.shared,
                "shared_mult": args.shared_mult,
                "gate": args.gate,
                "scheme": args.scheme,
                "preset": args.preset,
                "shrink": args.shrink,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
