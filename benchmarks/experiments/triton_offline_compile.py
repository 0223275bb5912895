# Compile the triton backend's GEMM kernel for a Hopper GPU without one, and report what the
# compiler made of it: registers, spills, shared memory and the K loop's instruction mix.
#
#   python benchmarks/experiments/triton_offline_compile.py [--arch 90] [--sass DIR] [--maxnreg N] \
#       [VARIANT ...]
#
# A variant is "scheme:gemm:BLOCK_M:BLOCK_N:BLOCK_K:warps:stages[:split_k]", e.g.
# "mxfp4:1:16:64:128:4:3"
# (gemm 1 = w13 with the gated epilogue, 2 = w2 with the routing weight; scheme mxfp4, mxfp4u
# (scales too large to merge into the decode), nvfp4 or int4 as GPT-OSS layers, bf16, fp8_block
# or fp8_block_pc (per-element block scales) as DeepSeek-style layers). Compilation uses
# Triton's own ptxas and nothing runs, so this answers "does it compile, does it spill, are
# the loads 16 bytes wide, which instructions dominate the K loop" (the longest span closed
# by a backward branch) before a GPU is used. Triton's interpreter must be off.

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("TRITON_INTERPRET"):
    sys.exit("unset TRITON_INTERPRET: this script compiles for the GPU")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moerunner.backends.triton import _activation as A  # noqa: E402
from moerunner.backends.triton import _gemm_kernel as K  # noqa: E402
from moerunner.backends.triton import _operands as OP  # noqa: E402
from moerunner.backends.triton import _overlap as O  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton._prepare import placed_words  # noqa: E402
from moerunner.backends.triton._weight_decode import e2m1_words  # noqa: E402
from moerunner.backends.triton.options import TritonOptions  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# (W_FORMAT, SCALE_FMT, GROUP_K, HALF, HAS_ZP, HAS_GSCALE, MERGED_SCALE, scale pointer type,
#  FRAG); e2m1 schemes as prepared (fragment layout), and "...s" in the split layout.
SCHEMES = {
    "mxfp4": (OP.WF_E2M1, OP.SF_E8M0, 32, 0, False, False, True, "*u8", True),
    "mxfp4u": (OP.WF_E2M1, OP.SF_E8M0, 32, 0, False, False, False, "*u8", True),
    "nvfp4": (OP.WF_E2M1, OP.SF_E4M3, 16, 0, False, True, False, "*u8", True),
    "mxfp4s": (OP.WF_E2M1, OP.SF_E8M0, 32, 32, False, False, True, "*u8", False),
    "nvfp4s": (OP.WF_E2M1, OP.SF_E4M3, 16, 16, False, True, False, "*u8", False),
    "int4": (OP.WF_UINT4, OP.SF_FP32, 128, 64, False, False, False, "*fp32", False),
    "bf16": (OP.WF_PLAIN, OP.SF_NONE, 0, 0, False, False, False, "*fp32", False),
    "fp8_block": (OP.WF_FP8, OP.SF_FP32, 128, 0, False, False, False, "*fp32", False),
}


def _signature(scale_ty: str, a_ty: str, w_ty: str, out_ty: str) -> dict[str, str]:
    ptrs = {
        "a_ptr": a_ty,
        "a_scale_ptr": "*fp32",
        "w_ptr": w_ty,
        "w_scale_ptr": scale_ty,
        "w_zp_ptr": "*u8",
        "w_gscale_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "out_ptr": "*bf16",
        "out_scale_ptr": "*fp32",
        "sorted_rows_ptr": "*i32",
        "block_expert_ptr": "*i32",
        "num_padded_ptr": "*i32",
        "route_w_ptr": "*fp32",
        "delta_ptr": "*fp32",
        "ids_ptr": "*i32",
        "block_done_ptr": "*i32",
        "split_part_ptr": "*fp32",
        "split_count_ptr": "*i32",
    }
    sig = {}
    for param in K.moe_gemm_kernel.params:
        name = param.name
        if name == "out_ptr":
            sig[name] = out_ty
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name in ("alpha", "limit"):
            sig[name] = "fp32"
        elif param.is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return sig


def compile_variant(
    spec: str, arch: int, options: TritonOptions | None = None, maxnreg: int | None = None
):
    """Compile one variant as the backend with ``options`` (default: the defaults) launches
    it; returns (compiled kernel, its constexprs)."""
    options = TritonOptions() if options is None else options
    scheme, gemm, bm, bn, bk, warps, stages, *split = spec.split(":")
    # "fp8_block_pc": per-column weight block scales (no UNIFORM_WS alignment).
    uniform = scheme != "fp8_block_pc"
    scheme = scheme.removesuffix("_pc")
    wf, sf, group_k, half, zp, gscale, merged, scale_ty, frag = SCHEMES[scheme]
    gemm1 = gemm == "1"
    # Packed schemes model GPT-OSS (interleaved gate/up, biases, swiglu_oai); the others a
    # DeepSeek/Qwen-style layer (gate rows then up rows, silu, no biases).
    gpt_oss = wf in (OP.WF_E2M1, OP.WF_UINT4)
    qdot = wf == OP.WF_FP8
    consts = dict(
        BLOCK_M=int(bm),
        BLOCK_N=int(bn),
        BLOCK_K=int(bk),
        GROUP_M=8,
        EVEN_K=True,
        GATED=gemm1,
        INTERLEAVED=gemm1 and gpt_oss,
        ACT=(A.ACT_SWIGLU_OAI if gpt_oss else A.ACT_SILU) if gemm1 else A.ACT_NONE,
        HAS_BIAS=gpt_oss,
        MUL_ROUTE_W=not gemm1,
        W_FORMAT=wf,
        QDOT=qdot,
        A_SCALE=OP.AS_GROUP if qdot else OP.AS_NONE,
        SCALE_FMT=sf,
        GROUP_K=group_k,
        SCALE_ROW_BLOCK=128 if qdot else 1,
        HAS_ZP=zp,
        HAS_GSCALE=gscale,
        IEEE=False,
        BF16_FP4=wf == OP.WF_E2M1,
        HALF=half,
        MERGED_SCALE=merged,
        E2M1_WORDS=e2m1_words(
            frag and placed_words(options),
            wf == OP.WF_E2M1,
            (2 if gemm1 else 1) * int(bn),
            int(warps),
        ),
        UNIFORM_WS=qdot and uniform,
        ROW_BLOCKS=False,
        # fp8_block GEMM1 quantizes GEMM2's input itself when its tile holds whole
        # 128-column groups, as experts.fuses_gemm2_input_quant decides on the GPU.
        OUT_QUANT=qdot and gemm1 and int(bn) % 128 == 0,
        INTER_DTYPE=tl.bfloat16,
        FP8_ROUND_FIRST=False,
        PDL=options.pdl and arch >= 90,
        S_PREFETCH=options.scale_prefetch,
        S_TILE=options.scale_tiles,
        FRAG=frag,
        K_NONEMPTY=frag and options.fragment_async_mma,
        HAS_DELTA=False,
        MASK_ROWS=options.mask_padding_rows,
        # The early prefetch as a decode call launches it (64 rows of 128 experts).
        EARLY=(O.EARLY_FROM_IDS if gemm1 else O.EARLY_FROM_BLOCKS)
        if frag and options.early_prefetch_steps
        else O.EARLY_NONE,
        EARLY_STEPS=max(1, options.early_prefetch_steps),
        IDS_POW2=64,
        E_POW2=128,
        STREAM=(O.STREAM_PUBLISH if gemm1 else O.STREAM_CONSUME)
        if options.stream_gemms
        else O.STREAM_NONE,
        SPLIT_K=int(split[0]) if split else 1,
    )
    consts["SPLIT_M"] = X.splits_blocks(int(bm), consts, rows_per_expert=int(bm), options=options)
    fn = K.moe_gemm_kernel
    fp8 = "*fp8e4nv"
    sig = _signature(
        scale_ty,
        fp8 if qdot else "*bf16",
        "*bf16" if wf == OP.WF_PLAIN else (fp8 if qdot else "*u8"),
        fp8 if consts["OUT_QUANT"] else "*bf16",
    )
    # Pointers and the leading strides are 16-divisible, as at run time for real shapes; so
    # are the scale strides of packed schemes with one group per half and of the fragment
    # layout, whose scales prepare pads to whole 16-byte rows (_prepare.pad_scale_groups,
    # _prepare.fragment_scales).
    padded = ("stride_se", "stride_sn") if (half and half == group_k) or frag else ()
    div16 = [
        name
        for name in fn.arg_names
        if sig[name].startswith("*")
        or name in ("stride_am", "stride_we", "stride_wn", "stride_om", "N_OUT", "K")
        or name in padded
    ]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    # Unit strides are specialised to 1 (group and block scales are contiguous along K).
    for name in ("stride_ak", "stride_wk", "stride_on", "stride_sk"):
        sig[name] = "constexpr"
        consts[name] = 1
    src = ASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs
    )
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(
        src,
        target=target,
        options={
            "num_warps": int(warps),
            "num_stages": int(stages),
            **({"maxnreg": maxnreg} if maxnreg else {}),
        },
    ), consts


def report(spec: str, arch: int, sass_dir: Path | None, maxnreg: int | None = None) -> dict:
    """Resources and the SASS opcode histogram of one variant (``maxnreg``: ptxas's register
    cap, Triton's launch option of that name)."""
    ck, _ = compile_variant(spec, arch, maxnreg=maxnreg)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        sass = subprocess.run(
            [str(BIN / "cuobjdump"), "-sass", str(cubin)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(ck.asm["ptx"])
        res = subprocess.run(
            [
                str(BIN / "ptxas"),
                f"-arch=sm_{arch}a",
                "-v",
                str(ptx),
                "-o",
                str(Path(tmp) / "v.cubin"),
            ],
            capture_output=True,
            text=True,
        )
    info = res.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    ins = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    ops = collections.Counter(_opcode(t) for _, t in ins)
    # The hot loop: the longest span closed by a backward branch.
    loops = [
        (int(m.group(1), 16), addr)
        for addr, t in ins
        if (m := re.search(r"BRA (?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", t))
        and m.group(1)
        and int(m.group(1), 16) < addr
    ]
    lo, hi = max(loops, key=lambda ab: ab[1] - ab[0], default=(0, -1))
    loop_ops = collections.Counter(_opcode(t) for a, t in ins if lo <= a <= hi)
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / (spec.replace(":", "_") + ".sass")).write_text(sass)
    return dict(
        variant=spec,
        registers=int(regs.group(1)) if regs else -1,
        spill_bytes=int(spill.group(1)) if spill else -1,
        shared=ck.metadata.shared,
        instructions=sum(ops.values()),
        ops=ops,
        loop_instructions=sum(loop_ops.values()),
        loop_ops=loop_ops,
    )


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4})\*/\s+(.*?);")


def _opcode(text: str) -> str:
    """Opcode of one SASS instruction, without predicate and modifiers."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "variants",
        nargs="*",
        default=["mxfp4:1:16:64:64:4:3", "mxfp4:1:16:64:128:4:3", "mxfp4u:1:16:64:64:4:3"],
    )
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sass", type=Path, default=None, help="write each variant's SASS here")
    ap.add_argument(
        "--maxnreg", type=int, default=None, help="register cap a thread (Triton's maxnreg)"
    )
    args = ap.parse_args()
    for v in args.variants:
        r = report(v, args.arch, args.sass, args.maxnreg)
        top = ", ".join(f"{op} {n}" for op, n in r["loop_ops"].most_common(10))
        print(
            f"{v:24s} regs {r['registers']:3d} spill {r['spill_bytes']:3d} B "
            f"smem {r['shared']:6d} B  loop {r['loop_instructions']:4d} instr: {top}"
        )


if __name__ == "__main__":
    main()
