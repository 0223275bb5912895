# Where the time of a decode-sized fused call goes, kernel by kernel, on one GPU.
#
#   python benchmarks/experiments/gpu_decode_profile.py [--preset P] [--scheme S] [--tokens 1,16,64]
#       graph   per-kernel device time inside a CUDA-graph replay of 8 rotated routings (the
#               way `gpu_triton.py perf` times decode), beside the replay's own time per call,
#               and each GEMM's weight bytes over its time against the copy bandwidth
#       stream  how fast a plain read (torch.sum) moves the same weight bytes as each GEMM, one
#               kernel per read: the bandwidth a kernel of that size can reach at all
#       once    a few eager calls at one T and nothing else, for a profiler run from outside
#               (e.g. ncu --clock-control none -k regex:moe_gemm python ... once --tokens 16)
#
# Reaches into the backend's private launcher (``experts.fused_standard``) as the other scripts
# of this folder do. Prints a table and writes JSON (--out).

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpu_triton as G  # noqa: E402

from moerunner.backends.triton import TritonBackend, TritonOptions, tune  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.bench import roofline  # noqa: E402
from moerunner.config import Activation  # noqa: E402

DEV = G.DEV


def prepare(preset: str, scheme: str, options: TritonOptions):
    H, I, E, k, act = tune.PRESETS[preset]
    weights = tune.random_weights(H, I, E, act, scheme, DEV)
    return TritonBackend(options).prepare_weights(weights, weights.spec(Activation(act))), k


def weight_bytes(prepared, name: str) -> int:
    """Bytes of one expert's stored weight ``name`` (data, scales, bias) as the kernel reads it."""
    w = prepared.tensors[name]
    total = w.data[0].numel() * w.data.element_size()
    if w.scale is not None and w.scale.dim() == w.data.dim():
        total += w.scale[0].numel() * w.scale.element_size()
    bias = prepared.tensors.get(f"{name}_bias")
    if bias is not None:
        total += bias[0].numel() * bias.element_size()
    return total


def graph_kernels(prepared, T: int, k: int, rotations: int = 8, replays: int = 20):
    """(us per call of the replay, {kernel: us per call}, experts hit per call)."""
    xs, rs, uniq = G.rotated_inputs(prepared, T, k, rotations)
    g = G.fused_graph(prepared, xs, rs)
    ms = tt.do_bench(g.replay, warmup=10, rep=100, return_mode="median") / rotations
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per: dict[str, list[float]] = {}
    gemm_seen = 0
    spans = []
    for e in events:
        name = e.name
        if name.startswith("moe_gemm_kernel"):
            name = f"gemm{1 + gemm_seen % 2}"
            gemm_seen += 1
        per.setdefault(name[:32], []).append(e.time_range.elapsed_us())
        spans.append((e.time_range.start, e.time_range.end))
    calls = replays * rotations
    kernels = {n: sum(v) / calls for n, v in per.items()}
    # Device time covered by at least one kernel (kernels overlap under PDL).
    busy, end = 0.0, None
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    kernels["(covered)"] = busy / calls
    return ms * 1e3, kernels, uniq


def stream_us(nbytes: int) -> float:
    """Microseconds of torch.sum over ``nbytes`` of float32 (one read kernel)."""
    buf = torch.randn(nbytes // 4, device=DEV)
    return tt.do_bench(lambda: buf.sum(), warmup=10, rep=100, return_mode="median") * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("parts", nargs="+", choices=("graph", "stream", "once"))
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--scheme", default="mxfp4")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--tile-dir", default=None, help="tuned tile folder read before the shipped files"
    )
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    options = TritonOptions(tile_dirs=(args.tile_dir,) if args.tile_dir else ())
    prepared, k = prepare(args.preset, args.scheme, options)
    if "once" in args.parts:
        T = tokens[0]
        x = torch.randn(T, prepared.spec.hidden_size, device=DEV, dtype=torch.bfloat16)
        w, i = G.routing(T, prepared.spec.num_experts, k)
        for _ in range(4):
            X.fused_standard(x, w, i, prepared)
        torch.cuda.synchronize()
        return 0
    ceil = roofline.measure_ceilings(DEV)
    bw = ceil.copy_gbps * 1e9
    b13, b2 = weight_bytes(prepared, "w13"), weight_bytes(prepared, "w2")
    result = dict(
        device=torch.cuda.get_device_name(DEV),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        preset=args.preset,
        scheme=args.scheme,
        copy_gbps=ceil.copy_gbps,
        w13_bytes_per_expert=b13,
        w2_bytes_per_expert=b2,
        tiles=prepared.tensors["tiles"].describe(),
        rows=[],
    )
    print(
        f"{result['device']}  copy {ceil.copy_gbps:.0f} GB/s  "
        f"w13 {b13 / 1e6:.2f} MB  w2 {b2 / 1e6:.2f} MB per expert"
    )
    for T in tokens:
        row = dict(T=T)
        if "graph" in args.parts:
            us, kernels, uniq = graph_kernels(prepared, T, k)
            row.update(us=us, kernels=kernels, experts_hit=uniq)
            row["tile"] = str(prepared.tensors["tiles"].lookup(T, k))
            for name, b in (("gemm1", b13), ("gemm2", b2)):
                if name in kernels:
                    row[f"{name}_pct_copy"] = 100 * uniq * b / (kernels[name] * 1e-6) / bw
            row["weights_pct_copy"] = 100 * uniq * (b13 + b2) / (us * 1e-6) / bw
        if "stream" in args.parts:
            uniq = row.get("experts_hit") or min(prepared.spec.num_experts, T * k)
            row["stream_w13_us"] = stream_us(int(uniq * b13))
            row["stream_w2_us"] = stream_us(int(uniq * b2))
            row["stream_w13_pct_copy"] = 100 * uniq * b13 / (row["stream_w13_us"] * 1e-6) / bw
            row["stream_w2_pct_copy"] = 100 * uniq * b2 / (row["stream_w2_us"] * 1e-6) / bw
        result["rows"].append(row)
        print(json.dumps(row))
    print()
    print(f"{'T':>5} {'call us':>8} {'weights %copy':>14}  kernels (us per call)")
    for row in result["rows"]:
        ks = "  ".join(f"{n} {v:.1f}" for n, v in row.get("kernels", {}).items())
        print(
            f"{row['T']:>5} {row.get('us', float('nan')):8.1f} "
            f"{row.get('weights_pct_copy', float('nan')):14.1f}  {ks}"
        )
        extra = {n: round(v, 1) for n, v in row.items() if "pct" in n or "stream" in n}
        print(f"{'':>5} {extra}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
