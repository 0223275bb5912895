# Prototype: an explicitly warp-specialised, persistent bf16 GEMM for Hopper, in Gluon.
#
#   python benchmarks/gluon_ws_gemm.py --dense M N K BM BN BK STAGES [--warps 4|8]
#   python benchmarks/gluon_ws_gemm.py --dense M N K BM BN BK STAGES [--warps 4|8] --compile-only
#
# C[M, N] = A[M, K] @ B[N, K]^T with bf16 operands and output and fp32 accumulation. Triton's
# automatic warp specialisation (``tl.range(..., warp_specialize=True)``) never finished on an
# H200 with Triton 3.6 (see gpu_ws_gemm.py), so this kernel spells the roles out with
# ``gl.warp_specialize``:
#
# * a loader partition (1 warp, few registers) walks this program's tiles and K steps and, per
#   step, waits for a ring stage to be free ("empty" mbarrier), arms the stage's "ready"
#   mbarrier with the byte count and issues the TMA loads of the A [BM, BK] and B [BN, BK]
#   tiles into a STAGES-deep shared-memory ring. It runs ahead across tile boundaries, so the
#   next tile's loads overlap this tile's epilogue;
# * the default partition (4 warps = one warpgroup, or 8 = two warpgroups owning BM / 2 rows
#   each) waits for "ready", issues async wgmma with the accumulator in registers, keeps one
#   wgmma in flight and releases the stage of the wgmma that has completed; after the K loop
#   it converts the tile to bf16 and stores it with TMA through shared memory (the store of
#   one tile drains while the next tile's K loop runs).
#
# Programs are persistent (grid = number of SMs, --num-sms) and walk the output tiles in a
# GROUP_M swizzle, so programs running together share A and B tiles in L2. Both partitions
# count K steps with one running counter: stage = counter % STAGES, phase = (counter //
# STAGES) & 1. M, N and K need not be multiples of the block: TMA zero-fills out-of-bounds
# loads and clips the stores (the row strides of A, B and C must be 16-byte aligned).
#
# --dense prints one line: "gluon-ws dense MxNxK bmBM bnBN bkBK sSTAGES wW: <us> us
# <TFLOP/s> TFLOP/s, torch <us> us, err <rel err>", err = ||C - A B^T|| / ||A B^T|| in float64
# on the CPU, times the median of triton.testing.do_bench. The kernel is checked before it is
# timed. A synchronisation bug hangs the GPU: run it under ``timeout``.
# --compile-only needs no GPU: it compiles the kernel for sm_90a and prints its shared memory,
# its warps (workers included) and the number of wgmma, TMA and mbarrier instructions in
# the PTX.

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOADER_WARPS = gl.constexpr(1)
LOADER_REGS = gl.constexpr(40)
H200_SMS = 132
# Hopper: 227 KB of shared memory per block at most.
SMEM_LIMIT = 232448


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (pid_m, pid_n), GROUP_M row blocks at a time (L2-friendly order)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (tile // tiles_per_group) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    in_group = tile % tiles_per_group
    return first_pid_m + in_group % group_rows, in_group // group_rows


@gluon.jit
def _loader_partition(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K,
                      NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Producer (worker partition): TMA loads of A and B tiles into the shared-memory ring.

    Walks the same tiles and K steps as the consumer. For K step number ``count`` (counted
    across all of this program's tiles) it fills stage ``count % STAGES`` once the consumer
    has released it. The wait on "empty" uses the inverted phase: a fresh mbarrier counts
    the phase before its first as complete, so the first pass over the ring does not wait,
    and pass p >= 1 waits for the consumer's p-th release of the stage.
    """
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_steps = gl.cdiv(K, BK)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        for ki in range(k_steps):
            stage = count % STAGES
            phase = (count // STAGES) & 1
            mbarrier.wait(empty_bars.index(stage), phase ^ 1)
            ready = ready_bars.index(stage)
            # Out-of-bounds parts of a box are zero-filled and still count towards the bytes.
            mbarrier.expect(ready, STAGE_BYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, ki * BK], ready, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [off_n, ki * BK], ready, b_bufs.index(stage))
            count += 1


@gluon.jit
def _mma_epilogue_partition(a_bufs, b_bufs, ready_bars, empty_bars, c_desc, c_smem, M, N, K,
                            NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Consumer (default partition): async wgmma over the ring, then the bf16 TMA epilogue.

    One wgmma stays in flight: after issuing step ``count`` it waits until at most one wgmma
    is pending, which means step ``count - 1`` has finished reading its stage, and releases
    that stage. The last step of a tile is released after the final wait. The arrive is made
    by one thread, so a partition-wide thread barrier first makes sure every warp (with 8
    warps: both warpgroups, each owning BM / 2 rows) has seen its wgmma complete.
    """
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    # wgmma: 16-row atoms per warp, warps stacked along M; one instruction spans all of BN.
    gl.static_assert(BM % (16 * num_warps) == 0, "BM must be a multiple of 16 * num_warps")
    gl.static_assert(BN % 8 == 0 and BN <= 256, "BN must be a multiple of 8, at most 256")
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_steps = gl.cdiv(K, BK)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for ki in range(k_steps):
            stage = count % STAGES
            mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
            # B is stored [BN, BK] (K-major); the transposed view is the [BK, BN] operand.
            acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc,
                                use_acc=ki > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # Every warp has seen its wgmma complete before the one-thread arrive below.
            gl.thread_barrier()
            # Step count - 1 (same tile) is complete: hand its stage back to the loader.
            mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES), pred=ki > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))

        # Epilogue: the previous tile's TMA store must have read c_smem before it is rewritten.
        out = acc.to(c_desc.dtype)
        tma.store_wait(pendings=0)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BM, pid_n * BN], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, NUM_SMS: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Persistent warp-specialised C = A @ B^T (A [M, K], B [N, K], C [M, N], bf16).

    Allocates the STAGES-deep A / B ring, the C staging tile and two mbarriers per stage
    ("ready": the loads landed, tracked by bytes; "empty": the wgmma reading it finished, one
    arrive), then forks into the MMA / epilogue default partition (num_warps warps) and the
    TMA loader worker (1 warp).
    """
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    # Make the initialised barriers visible to the async proxy (TMA) before any use.
    fence_async_shared()

    gl.warp_specialize([
        (_mma_epilogue_partition, (a_bufs, b_bufs, ready_bars, empty_bars, c_desc, c_smem,
                                   M, N, K, NUM_SMS, GROUP_M, STAGES, num_warps)),
        (_loader_partition, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K,
                             NUM_SMS, GROUP_M, STAGES)),
    ], [LOADER_WARPS], [LOADER_REGS])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_bars.index(i))
        mbarrier.invalidate(empty_bars.index(i))


def _layouts(bm: int, bn: int, bk: int):
    """NVMMA shared layouts of the A, B and C tiles (128-byte swizzle where the rows allow)."""
    return (gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bm, bn], gl.bfloat16))


def _maxnreg(warps: int) -> int | None:
    """Register cap per thread: 64K registers over the consumer and the padded loader group.

    The compiler splits the cap with setmaxnreg: the loader warpgroup drops to LOADER_REGS
    and the consumer gets the rest. 4 consumer warps + 4 loader warps fit at 256 (no cap);
    with 8 consumer warps (384 threads) the cap is 168 and the consumer gets 232.
    """
    if warps <= 4:
        return None
    threads = (warps + 4) * 32
    return min(255, (65536 // threads) // 8 * 8)


def smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Shared memory the kernel asks for: the A / B ring, the C tile and the mbarriers."""
    return stages * (bm + bn) * bk * 2 + bm * bn * 2 + 2 * stages * 8


def check_config(bm: int, bn: int, bk: int, stages: int, warps: int) -> list[str]:
    """Problems of a block configuration (empty when it is fine)."""
    problems = []
    if bm % (16 * warps):
        problems.append(f"BM={bm} is not a multiple of 16 * warps = {16 * warps}")
    if bn % 8 or not 8 <= bn <= 256:
        problems.append(f"BN={bn}: a multiple of 8 up to 256 (one wgmma spans BN)")
    if bk % 16:
        problems.append(f"BK={bk}: a multiple of 16")
    if stages < 2:
        problems.append("STAGES must be >= 2")
    if smem_bytes(bm, bn, bk, stages) > SMEM_LIMIT:
        problems.append(f"shared memory {smem_bytes(bm, bn, bk, stages)} B > {SMEM_LIMIT} B")
    acc_regs = bm * bn // (32 * warps)
    if acc_regs > 128:
        problems.append(f"{acc_regs} fp32 accumulator registers per thread (> 128 spills: "
                        "use --warps 8 or a smaller tile)")
    return problems


def ws_gemm(a, b, bm=128, bn=128, bk=64, stages=4, warps=4, group_m=8, num_sms=None, c=None,
            compile_only=False):
    """C = a @ b.T with the warp-specialised kernel; a [M, K], b [N, K], bf16, CUDA.

    ``compile_only`` compiles (and caches) the kernel for these arguments without launching.
    """
    import torch

    assert a.dtype == b.dtype == torch.bfloat16 and a.shape[1] == b.shape[1]
    M, K = a.shape
    N = b.shape[0]
    assert K > 0, "K must be positive"
    problems = check_config(bm, bn, bk, stages, warps)
    if problems:
        raise ValueError("; ".join(problems))
    if c is None:
        c = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    a_l, b_l, c_l = _layouts(bm, bn, bk)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], a_l)
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk], b_l)
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn], c_l)
    num_tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    grid = (max(1, min(num_sms, num_tiles)),)
    opts = {"num_warps": warps}
    if _maxnreg(warps) is not None:
        opts["maxnreg"] = _maxnreg(warps)
    args = (a_desc, b_desc, c_desc, M, N, K, num_sms, group_m, stages)
    if compile_only:
        ws_gemm_kernel.warmup(*args, grid=grid, **opts)
    else:
        ws_gemm_kernel[grid](*args, **opts)
    return c


def compile_offline(bm, bn, bk, stages, warps, group_m=8, num_sms=H200_SMS, arch=90):
    """Compile the kernel for sm_<arch>a without a GPU; returns the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_l, b_l, c_l = _layouts(bm, bn, bk)
    fn = ws_gemm_kernel
    sig = {"a_desc": f"tensordesc<bf16[{bm},{bk}],{a_l!r}>",
           "b_desc": f"tensordesc<bf16[{bn},{bk}],{b_l!r}>",
           "c_desc": f"tensordesc<bf16[{bm},{bn}],{c_l!r}>",
           "M": "i32", "N": "i32", "K": "i32",
           "NUM_SMS": "constexpr", "GROUP_M": "constexpr", "STAGES": "constexpr",
           "num_warps": "constexpr"}
    consts = {"NUM_SMS": num_sms, "GROUP_M": group_m, "STAGES": stages, "num_warps": warps}
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                              for k, v in consts.items()})
    opts = {"num_warps": warps}
    if _maxnreg(warps) is not None:
        opts["maxnreg"] = _maxnreg(warps)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def _ptxas_info(ptx: str, arch: int = 90) -> str:
    """Registers and spills as ptxas reports them (Triton's own ptxas)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return "ptxas not found"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    if not regs or not spill:
        return "ptxas: " + res.stderr.strip().replace("\n", " | ")
    return f"regs {regs.group(1)}, spills {spill.group(1)}/{spill.group(2)} B"


def _compile_report(bm, bn, bk, stages, warps, group_m, num_sms) -> str:
    """One line describing the sm_90a build of a configuration."""
    ck = compile_offline(bm, bn, bk, stages, warps, group_m, num_sms)
    ptx = ck.asm["ptx"]
    counts = {name: len(re.findall(re.escape(name), ptx))
              for name in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier")}
    m = re.search(r"\.reqntid\s+(\d+)", ptx)
    total_warps = int(m.group(1)) // 32 if m else ck.metadata.num_warps
    regs = sorted({f"{op} {n}" for op, n in
                   re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    problems = check_config(bm, bn, bk, stages, warps)
    return (f"gluon-ws compile sm_90a bm{bm} bn{bn} bk{bk} s{stages} w{warps}: "
            f"shared {ck.metadata.shared} B, num_warps {total_warps} "
            f"({warps} consumer + {LOADER_WARPS.value} loader, padded to a warpgroup), "
            f"maxnreg {_maxnreg(warps)}, setmaxnreg {{{', '.join(regs)}}}, "
            f"{_ptxas_info(ptx)}; PTX: "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
            + ("; NOT RUNNABLE: " + "; ".join(problems) if problems else ""))


def _dense(M, N, K, bm, bn, bk, stages, warps, group_m, num_sms) -> str:
    import torch
    import triton.testing as tt

    if not torch.cuda.is_available():
        sys.exit("--dense needs a CUDA GPU (use --compile-only to build without one)")
    dev = torch.device("cuda")
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)

    def run():
        ws_gemm(a, b, bm, bn, bk, stages, warps, group_m, num_sms, c)

    ws_gemm(a, b, bm, bn, bk, stages, warps, group_m, num_sms, c, compile_only=True)
    print("compiled; first launch (a hang from here on is a synchronisation bug)",
          file=sys.stderr, flush=True)
    run()
    torch.cuda.synchronize()
    print("first launch finished", file=sys.stderr, flush=True)
    ref = a.double().cpu() @ b.double().cpu().T
    err = (torch.linalg.norm(c.double().cpu() - ref) / torch.linalg.norm(ref)).item()
    ms = tt.do_bench(run, return_mode="median")
    ms_torch = tt.do_bench(lambda: torch.matmul(a, b.T), return_mode="median")
    tflops = 2.0 * M * N * K / (ms * 1e-3) / 1e12
    return (f"gluon-ws dense {M}x{N}x{K} bm{bm} bn{bn} bk{bk} s{stages} w{warps}: "
            f"{ms * 1e3:.1f} us {tflops:.1f} TFLOP/s, torch {ms_torch * 1e3:.1f} us, "
            f"err {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Warp-specialised persistent Gluon GEMM (Hopper).")
    ap.add_argument("--dense", nargs=7, type=int, required=True,
                    metavar=("M", "N", "K", "BM", "BN", "BK", "STAGES"))
    ap.add_argument("--warps", type=int, default=4, choices=(4, 8),
                    help="consumer warps: one or two warpgroups")
    ap.add_argument("--group-m", type=int, default=8)
    ap.add_argument("--num-sms", type=int, default=None,
                    help="persistent programs (default: the GPU's SM count; 132 offline)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile for sm_90a without a GPU and report the build")
    args = ap.parse_args()
    M, N, K, bm, bn, bk, stages = args.dense
    if args.compile_only:
        if os.environ.get("TRITON_INTERPRET"):
            sys.exit("unset TRITON_INTERPRET: --compile-only compiles for the GPU")
        print(_compile_report(bm, bn, bk, stages, args.warps, args.group_m,
                              args.num_sms or H200_SMS))
        return
    print(_dense(M, N, K, bm, bn, bk, stages, args.warps, args.group_m, args.num_sms),
          flush=True)


if __name__ == "__main__":
    main()
