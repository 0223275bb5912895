# Prefill-sized GEMMs: the triton sequence's two grouped GEMMs against PyTorch's grouped GEMM
# (torch._grouped_mm, CUTLASS on Hopper) on the same row counts, one GPU.
#
#   python benchmarks/experiments/gpu_prefill_gemms.py [--presets P,...] [--tokens 4096,16384]
#
# Question: at T >= 4096 (compute-bound bf16 GEMMs), does a library grouped GEMM run the two
# expert GEMMs faster than the Triton ones? If so, prefill could hand its GEMMs to it.
# ours: per-kernel device time of a fused call in a CUDA-graph replay (gpu_decode_profile);
# grouped_mm: GEMM1 [rows, H] x [E, H, 2I] and GEMM2 [rows, I] x [E, I, H] with the same
# per-expert row counts (rows sorted by expert, no padding), do_bench medians with L2 flushed;
# dense: E plain torch.mm (cuBLAS) GEMMs of the mean rows per expert, the same weight layout.
# Prints a table and writes JSON (--out).

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

import gpu_decode_profile as P  # noqa: E402
import gpu_triton as G  # noqa: E402

from moerunner.backends.triton import TritonOptions, tune  # noqa: E402
from moerunner.bench import roofline  # noqa: E402

DEV = G.DEV


def grouped_mm_us(H: int, I: int, E: int, counts: torch.Tensor, gated: bool) -> tuple[float, float]:
    """Median us of GEMM1 and GEMM2 through torch._grouped_mm for rows grouped by ``counts``."""
    rows = int(counts.sum())
    ends = torch.cumsum(counts, 0).to(torch.int32)
    n1 = 2 * I if gated else I
    x = torch.randn(rows, H, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(rows, I, device=DEV, dtype=torch.bfloat16)
    # The stored layouts of the experts' weights ([E, N, K], K contiguous), as the kernels read.
    w13 = torch.randn(E, n1, H, device=DEV, dtype=torch.bfloat16) / 40
    w2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) / 40

    def g1():
        return torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends)

    def g2():
        return torch._grouped_mm(a, w2.transpose(-2, -1), offs=ends)

    t1 = tt.do_bench(g1, warmup=10, rep=200, return_mode="median") * 1e3
    t2 = tt.do_bench(g2, warmup=10, rep=200, return_mode="median") * 1e3
    return t1, t2


def dense_us(H: int, I: int, E: int, rows: int, gated: bool) -> tuple[float, float]:
    """E times the median us of one expert's GEMM1 and GEMM2 as plain torch.mm over the
    mean rows per expert (cuBLAS: what a library dense GEMM of that size reaches)."""
    m = max(1, rows // E)
    n1 = 2 * I if gated else I
    x = torch.randn(m, H, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(m, I, device=DEV, dtype=torch.bfloat16)
    w13 = torch.randn(n1, H, device=DEV, dtype=torch.bfloat16) / 40
    w2 = torch.randn(H, I, device=DEV, dtype=torch.bfloat16) / 40
    t1 = tt.do_bench(lambda: x @ w13.T, warmup=10, rep=200, return_mode="median") * 1e3
    t2 = tt.do_bench(lambda: a @ w2.T, warmup=10, rep=200, return_mode="median") * 1e3
    return E * t1, E * t2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", default="qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b,deepseek-v3")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    result = dict(
        device=torch.cuda.get_device_name(DEV),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        bf16_peak_tflops=roofline.measure_ceilings(DEV).peak_for("bf16"),
        rows=[],
    )
    print(
        f"{result['device']}  bf16 peak (moerunner bench) {result['bf16_peak_tflops']:.0f} TFLOP/s"
    )
    for preset in args.presets.split(","):
        H, I, E, k, act = tune.PRESETS[preset]
        prepared, _ = P.prepare(preset, "bf16", TritonOptions())
        gated = prepared.spec.activation.gated
        n1 = 2 * I if gated else I
        for T in tokens:
            us, kernels, uniq = P.graph_kernels(prepared, T, k, rotations=2, replays=3)
            _, ids = G.routing(T, E, k)
            counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
            g1, g2 = grouped_mm_us(H, I, E, counts, gated)
            d1, d2 = dense_us(H, I, E, T * k, gated)
            f1, f2 = 2.0 * T * k * H * n1, 2.0 * T * k * I * H
            row = dict(
                preset=preset,
                T=T,
                call_us=us,
                gemm1_us=kernels.get("gemm1"),
                gemm2_us=kernels.get("gemm2"),
                kernels=kernels,
                grouped_mm_gemm1_us=g1,
                grouped_mm_gemm2_us=g2,
                dense_gemm1_us=d1,
                dense_gemm2_us=d2,
                gemm1_flops=f1,
                gemm2_flops=f2,
            )
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    print()
    print(
        f"{'preset':14} {'T':>6} {'call':>8} {'g1 ours':>8} {'g1 gmm':>8} {'ratio':>6}"
        f" {'g2 ours':>8} {'g2 gmm':>8} {'ratio':>6}  TFLOP/s ours/gmm/dense"
    )
    for r in result["rows"]:
        o1, o2 = r["gemm1_us"], r["gemm2_us"]
        m1, m2 = r["grouped_mm_gemm1_us"], r["grouped_mm_gemm2_us"]
        d = r["dense_gemm1_us"] + r["dense_gemm2_us"]
        tf = (r["gemm1_flops"] + r["gemm2_flops"]) / 1e6
        print(
            f"{r['preset']:14} {r['T']:>6} {r['call_us']:8.0f} {o1:8.0f} {m1:8.0f} {m1 / o1:6.3f}"
            f" {o2:8.0f} {m2:8.0f} {m2 / o2:6.3f}  {tf / (o1 + o2):.0f}/{tf / (m1 + m2):.0f}"
            f"/{tf / d:.0f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
