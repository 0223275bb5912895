# Experiment: does Triton's automatic warp specialisation on Hopper close the bf16 prefill gap?
#
#   python benchmarks/experiments/gpu_ws_gemm.py [--tokens 4096 16384] [--presets ...] [--ws] \
#       [--out DIR]
#   python benchmarks/experiments/gpu_ws_gemm.py --dense M N K BM BN BK STAGES WS PERSISTENT
#
# The shipped GEMM gathers its A rows with pointer loads and runs one tile per program, so a
# program's weight loads and MMAs alternate instead of overlapping across tiles (results page,
# "Why the misses remain"). The MoE mode times, beside the shipped GEMMs of the same call (by
# profiler kernel times), a persistent grouped GEMM whose operands are TMA tiles, with
# ``tl.range(..., warp_specialize=True)`` on the tile loop when --ws is given (Triton >= 3.5
# partitions such a loop on Hopper into a TMA producer warp group and two MMA consumer warp
# groups; it needs num_warps=4 and an unflattened loop). Its A operand must be
# TMA-addressable, so the rows are first gathered into the aligned (padded, expert-sorted)
# order, GEMM1 writes the intermediate in that order and GEMM2 reads it with TMA and scatters
# its weighted rows to (token, slot) rows. The gather is timed too. Output is checked against
# the shipped fused op. Plain bf16 only; silu. --dense times one dense A @ B^T with the
# persistent kernel or one tile per program, against torch.matmul.
#
# Warp-specialised variants never finished on an H200 with Triton 3.6 (every --dense WS=1
# case, persistent or not, and the MoE GEMMs): run them under ``timeout``.
#
# Prints a table (one row per preset x T x variant: gather, GEMM1, GEMM2 microseconds, their
# sum against the shipped GEMMs, and % of the bf16 peak) and writes DIR/ws_gemm.json.

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing as tt
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_triton as G  # noqa: E402

from moerunner.backends.triton import TritonBackend, TritonOptions  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton import workspaces as W  # noqa: E402
from moerunner.bench.presets import PRESETS  # noqa: E402
from moerunner.config import Activation  # noqa: E402
from moerunner.weights import ExpertWeights  # noqa: E402

DEV = torch.device("cuda")


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    out_ptr,
    sorted_rows_ptr,
    num_padded_ptr,
    num_rows,
    a_row_div,
    H,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[pos] = x[sorted_rows[pos] // a_row_div] for the padded positions (zeros for pads)."""
    num_padded = tl.load(num_padded_ptr)
    pos = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= num_padded:
        return
    row = tl.load(sorted_rows_ptr + pos, mask=pos < num_padded, other=num_rows)
    valid = row < num_rows
    src = tl.where(valid, row // a_row_div, 0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(
            x_ptr + src[:, None] * H + cols[None, :],
            mask=valid[:, None] & (cols[None, :] < H),
            other=0.0,
        )
        tl.store(
            out_ptr + pos.to(tl.int64)[:, None] * H + cols[None, :],
            v,
            mask=(pos[:, None] < num_padded) & (cols[None, :] < H),
        )


@triton.jit
def _ws_gemm_kernel(
    a_desc,
    b_desc,
    out_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    route_w_ptr,
    num_rows,
    N,
    K,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WS: tl.constexpr,
    GATED: tl.constexpr,
):
    """Persistent grouped GEMM over the aligned rows. GATED (GEMM1): silu(A W_gate^T) *
    (A W_up^T) stored at the padded position. Else (GEMM2): route_w * (A W^T) scattered to
    row sorted_rows[pos]."""
    num_padded = tl.load(num_padded_ptr)
    num_m = tl.cdiv(num_padded, BM)
    num_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, warp_specialize=WS):
        pid_m = tile % num_m
        pid_n = tile // num_m
        expert = tl.load(block_expert_ptr + pid_m)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([off_m, ks * BK])
            if GATED:
                b = b_desc.load([expert * 2 * N + off_n, ks * BK])
                acc = tl.dot(a, b.T, acc)
                bu = b_desc.load([expert * 2 * N + N + off_n, ks * BK])
                acc_u = tl.dot(a, bu.T, acc_u)
            else:
                b = b_desc.load([expert * N + off_n, ks * BK])
                acc = tl.dot(a, b.T, acc)
        pos = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        if GATED:
            v = acc / (1.0 + tl.exp(-acc)) * acc_u
            tl.store(
                out_ptr + pos.to(tl.int64)[:, None] * stride_om + cols[None, :],
                v.to(out_ptr.dtype.element_ty),
                mask=(pos[:, None] < num_padded) & (cols[None, :] < N),
            )
        else:
            rows = tl.load(sorted_rows_ptr + pos)
            ok = rows < num_rows
            w = tl.load(route_w_ptr + rows, mask=ok, other=0.0)
            v = acc * w[:, None]
            tl.store(
                out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
                v.to(out_ptr.dtype.element_ty),
                mask=ok[:, None] & (cols[None, :] < N),
            )


def ws_call(x, w13_2d, w2_2d, wts, ids, E, inter, hidden, cfg, ws_on, bufs):
    """The experimental sequence; returns (out [T, H], launches as zero-arg callables)."""
    bm, bn1, bn2, bk, stages = cfg
    T, k = ids.shape
    num_rows = T * k
    rows = X.layout_rows(ids.reshape(-1), k, E, bm, bufs, TritonOptions())
    max_pad = bufs["sorted_rows"].shape[0]
    a_perm, inter_buf, y = bufs["a_perm"], bufs["inter"], bufs["y"]
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    route_w = wts.reshape(-1).float()
    a_desc1 = TensorDescriptor.from_tensor(a_perm, [bm, bk])
    b_desc1 = TensorDescriptor.from_tensor(w13_2d, [bn1, bk])
    a_desc2 = TensorDescriptor.from_tensor(inter_buf, [bm, bk])
    b_desc2 = TensorDescriptor.from_tensor(w2_2d, [bn2, bk])

    def gather():
        _gather_rows_kernel[(triton.cdiv(max_pad, 64),)](
            x,
            a_perm,
            rows.sorted_rows,
            rows.num_padded,
            num_rows,
            k,
            hidden,
            BLOCK_R=64,
            BLOCK_H=128,
            num_warps=4,
        )

    def gemm1():
        _ws_gemm_kernel[(sms,)](
            a_desc1,
            b_desc1,
            inter_buf,
            rows.sorted_rows,
            rows.block_expert,
            rows.num_padded,
            route_w,
            num_rows,
            inter,
            hidden,
            inter_buf.stride(0),
            BM=bm,
            BN=bn1,
            BK=bk,
            NUM_PROGRAMS=sms,
            WS=ws_on,
            GATED=True,
            num_warps=4,
            num_stages=stages,
        )

    def gemm2():
        _ws_gemm_kernel[(sms,)](
            a_desc2,
            b_desc2,
            y,
            rows.sorted_rows,
            rows.block_expert,
            rows.num_padded,
            route_w,
            num_rows,
            hidden,
            inter,
            y.stride(0),
            BM=bm,
            BN=bn2,
            BK=bk,
            NUM_PROGRAMS=sms,
            WS=ws_on,
            GATED=False,
            num_warps=4,
            num_stages=stages,
        )

    gather()
    gemm1()
    gemm2()
    out = y.view(T, k, hidden).float().sum(1).to(x.dtype)
    return out, dict(gather=gather, gemm1=gemm1, gemm2=gemm2)


CONFIGS = [
    (128, 128, 128, 64, 3),
    (128, 128, 256, 64, 3),
    (128, 64, 128, 64, 4),
    (128, 128, 128, 64, 4),
]


@triton.jit
def _tile_gemm_kernel(
    a_desc,
    b_desc,
    out_ptr,
    N,
    K,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WS: tl.constexpr,
):
    """One [BM, BN] tile per program of a dense A @ B^T, the K loop warp-specialised or not:
    does the partitioning work at all without the persistent tile loop around it?"""
    off_m = tl.program_id(0) * BM
    off_n = tl.program_id(1) * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WS):
        acc = tl.dot(a_desc.load([off_m, k0]), b_desc.load([off_n, k0]).T, acc)
    rows = off_m + tl.arange(0, BM)
    cols = off_n + tl.arange(0, BN)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
    )


def dense(M: int, N: int, K: int, cfg, ws_on: bool, persistent: bool = True) -> None:
    """One expert, every row: the persistent kernel against torch.matmul (a sanity check of
    the kernel and of warp specialisation, free of the routing)."""
    bm, bn, _, bk, stages = cfg
    a = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
    rows = torch.arange(M, device=DEV, dtype=torch.int32)
    experts = torch.zeros(triton.cdiv(M, bm), device=DEV, dtype=torch.int32)
    num_padded = torch.tensor([M], device=DEV, dtype=torch.int32)
    route_w = torch.ones(M, device=DEV)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])

    def launch():
        if not persistent:
            _tile_gemm_kernel[(M // bm, N // bn)](
                a_desc,
                b_desc,
                out,
                N,
                K,
                out.stride(0),
                BM=bm,
                BN=bn,
                BK=bk,
                WS=ws_on,
                num_warps=4,
                num_stages=stages,
            )
            return
        _ws_gemm_kernel[(sms,)](
            a_desc,
            b_desc,
            out,
            rows,
            experts,
            num_padded,
            route_w,
            M,
            N,
            K,
            out.stride(0),
            BM=bm,
            BN=bn,
            BK=bk,
            NUM_PROGRAMS=sms,
            WS=ws_on,
            GATED=False,
            num_warps=4,
            num_stages=stages,
        )

    launch()
    torch.cuda.synchronize()
    err = G.rel(out, a @ b.T)
    ms = tt.do_bench(launch, warmup=5, rep=50, return_mode="median")
    ref_ms = tt.do_bench(lambda: a @ b.T, warmup=5, rep=50, return_mode="median")
    tflops = 2 * M * N * K / (ms * 1e-3) / 1e12
    kind = "persistent" if persistent else "tile"
    print(
        f"dense {kind} {M}x{N}x{K} bm{bm} bn{bn} bk{bk} s{stages} ws={int(ws_on)}: "
        f"{ms * 1e3:.0f} us "
        f"{tflops:.0f} TFLOP/s, torch {ref_ms * 1e3:.0f} us, err {err:.1e}",
        flush=True,
    )


def main():
    if sys.argv[1:2] == ["--dense"]:
        m, n, kk, bm, bn, bk, stages, ws_on, persistent = (int(v) for v in sys.argv[2:11])
        dense(m, n, kk, (bm, bn, bn, bk, stages), bool(ws_on), bool(persistent))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--presets", nargs="+", default=["deepseek-v3", "qwen3-30b-a3b", "gpt-oss-120b"]
    )
    ap.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--ws", action="store_true", help="also the warp-specialised variants")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    torch.manual_seed(0)
    peak = G.measure_peaks()["bf16_flops"]
    rows_out = []
    for name in args.presets:
        p = PRESETS[name]
        H, I, E, k = p.hidden_size, p.intermediate_size, p.num_experts, p.top_k
        w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
        weights = ExpertWeights(w13, w2)
        spec = weights.spec(Activation("silu"))
        prepared = TritonBackend().prepare_weights(weights, spec)
        for T in args.tokens:
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            wts, ids = G.routing(T, E, k)
            flops = 2 * T * k * 3 * I * H
            ref = X.fused_standard(x, wts, ids, prepared)
            stages = G.stage_breakdown(prepared, T, k)
            base = stages.get("gemm1", 0.0) + stages.get("gemm2", 0.0)
            fused_ms = tt.do_bench(
                lambda: X.fused_standard(x, wts, ids, prepared),  # noqa: B023
                warmup=10,
                rep=100,
                return_mode="median",
            )
            rows_out.append(
                dict(
                    preset=name,
                    T=T,
                    variant="shipped",
                    gemm1_us=stages["gemm1"],
                    gemm2_us=stages["gemm2"],
                    gemms_us=base,
                    fused_us=fused_ms * 1e3,
                    gemms_pct_peak=100 * flops / (base * 1e-6) / peak,
                )
            )
            print(
                f"{name} T={T} shipped gemm1 {stages['gemm1']:.0f} gemm2 {stages['gemm2']:.0f}"
                f" fused {fused_ms * 1e3:.0f} us",
                flush=True,
            )
            for cfg in CONFIGS:
                for ws_on in (False, True) if args.ws else (False,):
                    bm = cfg[0]
                    bufs = W.alignment_workspace(T * k, E, bm, DEV)
                    max_pad = bufs["sorted_rows"].shape[0]
                    bufs["a_perm"] = torch.empty(max_pad, H, device=DEV, dtype=torch.bfloat16)
                    bufs["inter"] = torch.empty(max_pad, I, device=DEV, dtype=torch.bfloat16)
                    bufs["y"] = torch.empty(T * k, H, device=DEV, dtype=torch.bfloat16)
                    tag = f"bm{cfg[0]} bn{cfg[1]}/{cfg[2]} bk{cfg[3]} s{cfg[4]} ws={int(ws_on)}"
                    try:
                        out, fns = ws_call(
                            x,
                            w13.view(E * 2 * I, H),
                            w2.view(E * H, I),
                            wts,
                            ids,
                            E,
                            I,
                            H,
                            cfg,
                            ws_on,
                            bufs,
                        )
                        err = G.rel(out, ref)
                        us = {
                            n: 1e3 * tt.do_bench(f, warmup=10, rep=100, return_mode="median")
                            for n, f in fns.items()
                        }
                    except Exception as exc:  # a variant that fails to compile is reported
                        print(
                            f"{name} T={T} {tag}: {type(exc).__name__}: {str(exc)[:300]}",
                            flush=True,
                        )
                        rows_out.append(dict(preset=name, T=T, variant=tag, error=repr(exc)))
                        continue
                    total = us["gemm1"] + us["gemm2"]
                    rows_out.append(
                        dict(
                            preset=name,
                            T=T,
                            variant=tag,
                            err_vs_shipped=err,
                            gather_us=us["gather"],
                            gemm1_us=us["gemm1"],
                            gemm2_us=us["gemm2"],
                            gemms_us=total,
                            vs_shipped=base / total,
                            gemms_pct_peak=100 * flops / (total * 1e-6) / peak,
                        )
                    )
                    print(
                        f"{name} T={T} {tag}: gather {us['gather']:.0f} gemm1 "
                        f"{us['gemm1']:.0f} gemm2 {us['gemm2']:.0f} -> {base / total:.2f}x "
                        f"of shipped GEMMs, err {err:.1e}",
                        flush=True,
                    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name(),
        date=str(datetime.date.today()),
        torch=torch.__version__,
        triton=triton.__version__,
        bf16_peak=peak,
    )
    (out_dir / "ws_gemm.json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    print(
        f"\n{'preset':14s} {'T':>6s} {'variant':34s} {'gather':>7s} {'gemm1':>7s} "
        f"{'gemm2':>7s} {'vs':>6s} {'%P':>5s}"
    )
    for r in rows_out:
        if "error" in r:
            print(f"{r['preset']:14s} {r['T']:6d} {r['variant']:34s} error")
            continue
        print(
            f"{r['preset']:14s} {r['T']:6d} {r['variant']:34s} {r.get('gather_us', 0):7.0f} "
            f"{r['gemm1_us']:7.0f} {r['gemm2_us']:7.0f} {r.get('vs_shipped', 1.0):6.2f} "
            f"{r['gemms_pct_peak']:5.1f}"
        )


if __name__ == "__main__":
    main()
