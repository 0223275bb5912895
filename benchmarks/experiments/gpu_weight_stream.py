# Experiment: how fast can GEMM-shaped tile reads stream expert weights from HBM?
#
#   python benchmarks/experiments/gpu_weight_stream.py [--rows 1048576] [--k 7168] [--out DIR]
#
# The prefill GEMMs at T=4096 on 128/256-expert models stream their weights at ~2.9 of the
# 4.2 TB/s that ``torch.sum`` reads (results page, "Why the misses remain"), even with a
# warp-specialised loader that keeps several stages in flight. A GEMM tile reads its weights
# as [BLOCK_N, BLOCK_K] boxes: BLOCK_N rows, each a BLOCK_K-element run of a K-long row. With
# bf16 and BLOCK_K = 64 that is 128 bytes from each of BLOCK_N rows 2*K bytes apart, per step.
# This script reads one [rows, K] bf16 matrix (the size of DeepSeek-V3's w13 by default)
# with no math, in that access pattern, through a persistent grid, and reports the bandwidth
# for several box shapes, programs per SM and weight layouts:
#
#   row    row-major [rows, K], pointer loads (cp.async pipelined), as the shipped kernels;
#   tma    row-major, TMA descriptor loads, as the Gluon prototype;
#   kblk   K-chunked [K / 64, rows, 64]: one box of 64-wide steps is BLOCK_N * 128
#          contiguous bytes, for any BLOCK_N;
#   tile   tile-contiguous [rows / BN, K / BK, BN, BK]: each box is one contiguous run.
#
# Every variant reads every byte of the same buffer once per call; only the order differs.
# Prints a table (TB/s and the ratio to torch.sum) and writes DIR/weight_stream.json.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from moerunner.bench.presets import get_preset  # noqa: E402

DEEPSEEK_V3 = get_preset("deepseek-v3")  # the default matrix is its w13: [E * 2I, H]

LAYOUTS = ("row", "tma", "kblk", "tile")
CHUNK = 64  # K-chunk of the kblk layout (elements)
BOXES = ((128, 64), (256, 64), (64, 128), (128, 128), (256, 128))  # (BLOCK_N, BLOCK_K)


@triton.jit
def _stream_kernel(
    w_ptr,
    out_ptr,
    rows_total,
    K,
    n_tiles,
    LAYOUT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    CH: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], tl.float32)
    if LAYOUT == 1:
        desc = tl.make_tensor_descriptor(
            w_ptr, shape=[rows_total, K], strides=[K, 1], block_shape=[BN, BK]
        )
    for t in range(pid, n_tiles, nprog):
        n0 = t * BN
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            if LAYOUT == 0:
                ptrs = w_ptr + (n0 + rn)[:, None].to(tl.int64) * K + (k0 + rk)[None, :]
                acc += tl.load(ptrs).to(tl.float32)
            elif LAYOUT == 1:
                acc += desc.load([n0, k0]).to(tl.float32)
            elif LAYOUT == 2:
                kk = k0 + rk
                off = (
                    ((kk // CH).to(tl.int64) * rows_total * CH)[None, :]
                    + (n0 + rn)[:, None].to(tl.int64) * CH
                    + (kk % CH)[None, :]
                )
                acc += tl.load(w_ptr + off).to(tl.float32)
            else:
                base = (t.to(tl.int64) * (K // BK) + k0 // BK) * (BN * BK)
                acc += tl.load(w_ptr + base + rn[:, None] * BK + rk[None, :]).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def _alloc(size: int, alignment: int, stream):  # noqa: ARG001 - TMA scratch for descriptors
    return torch.empty(size, dtype=torch.int8, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--rows",
        type=int,
        help="weight rows (E * 2I)",
        default=DEEPSEEK_V3.num_experts * DEEPSEEK_V3.w13_rows,
    )
    ap.add_argument("--k", type=int, default=DEEPSEEK_V3.hidden_size)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    triton.set_allocator(_alloc)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    rows, K = args.rows, args.k
    w = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    out = torch.empty(8 * sms, device=dev, dtype=torch.float32)

    def tbps(ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e12

    ref_ms = tt.do_bench(lambda: torch.sum(w, dtype=torch.float32), warmup=50, rep=400)
    ref = tbps(ref_ms)
    results = {
        "device": props.name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": rows,
        "K": K,
        "bytes": nbytes,
        "torch_sum_tbps": ref,
        "cases": [],
    }
    print(f"{props.name}: torch.sum reads {ref:.2f} TB/s ({nbytes / 1e9:.1f} GB)", flush=True)
    for layout in LAYOUTS:
        for bn, bk in BOXES:
            stage_bytes = bn * bk * 2
            for per_sm in (1, 2):
                stages = min(4, (200 * 1024 // per_sm) // stage_bytes)
                grid = (per_sm * sms,)
                n_tiles = rows // bn
                case = {"layout": layout, "bn": bn, "bk": bk, "per_sm": per_sm, "stages": stages}

                def call(layout=layout, bn=bn, bk=bk, stages=stages, grid=grid, n_tiles=n_tiles):
                    _stream_kernel[grid](
                        w,
                        out,
                        rows,
                        K,
                        n_tiles,
                        LAYOUTS.index(layout),
                        bn,
                        bk,
                        CHUNK,
                        stages,
                        num_warps=8 if bn * bk >= 128 * 128 else 4,
                    )

                try:
                    ms = tt.do_bench(call, warmup=10, rep=100)
                except Exception as exc:  # out of shared memory / registers: recorded
                    case["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    results["cases"].append(case)
                    print(
                        f"{layout:5s} BN {bn:3d} BK {bk:3d} x{per_sm}: {case['error']}", flush=True
                    )
                    continue
                case.update(ms=ms, tbps=tbps(ms), vs_sum=tbps(ms) / ref)
                results["cases"].append(case)
                print(
                    f"{layout:5s} BN {bn:3d} BK {bk:3d} ({bk * 2:3d} B/row) x{per_sm} "
                    f"stages {stages}: {tbps(ms):.2f} TB/s  {tbps(ms) / ref:.2f}x sum",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight_stream.json").write_text(json.dumps(results, indent=1))
    print("\nlayout  BN   BK  per-SM  TB/s  x sum")
    for c in results["cases"]:
        if "tbps" in c:
            print(
                f"{c['layout']:5s} {c['bn']:4d} {c['bk']:4d} {c['per_sm']:5d} "
                f"{c['tbps']:6.2f} {c['vs_sum']:5.2f}"
            )


if __name__ == "__main__":
    main()
