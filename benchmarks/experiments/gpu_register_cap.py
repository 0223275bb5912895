# A register cap (ptxas ``maxnreg``) and the pipeline depth of the GEMMs of one preset's
# decode-sized calls, alternately in one process: can fewer registers a thread buy resident
# warps (more programs per SM) where the fp4 decode is bound by instruction issue?
#
#   python benchmarks/experiments/gpu_register_cap.py --tokens 16,64 \
#       --variants "ship:-:-:-:-;s3:3:3:-:-;s3r72:3:3:72:72"
#
# A variant is "name:stages1:stages2:cap1:cap2" ("-": the shipped tile's stages, no cap) for
# GEMM1 and GEMM2; the tiles are otherwise the prepared weights' own for each T, pinned for
# every variant (a call without pinned tiles replays a recorded launch plan, which would keep
# the first call's launch options). The cap is passed to Triton as the ``maxnreg`` launch
# option by wrapping the launcher here; the library has no such tile field. Per T: 8 rotated
# uniform routings in one CUDA graph per variant (``gpu_triton.fused_graph``), timed in
# rotated order; x = the first variant's time / this one's, median over rounds [min-max];
# bit_equal: outputs equal to the first variant's. Then the registers and spills of every
# compiled GEMM kernel.

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_triton


def parse_variants(text: str) -> list[tuple[str, int | None, int | None, int | None, int | None]]:
    """'name:s1:s2:r1:r2;...' -> [(name, stages1, stages2, cap1, cap2)] ('-' -> None)."""
    out = []
    for item in filter(None, text.split(";")):
        parts = item.split(":")
        if len(parts) != 5:
            raise SystemExit(f"variant {item!r}: expected name:stages1:stages2:cap1:cap2")
        name, *values = parts
        out.append((name, *(None if v == "-" else int(v) for v in values)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="register cap and pipeline depth, side by side")
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--scheme", default="mxfp4")
    ap.add_argument("--tokens", default="16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="ship:-:-:-:-;s3:3:3:-:-;s3r96:3:3:96:96;s3r72:3:3:72:72")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    variants = parse_variants(args.variants)

    import torch
    from gpu_decode_profile import weight_bytes
    from gpu_triton import alternate, fused_graph, ratio_summary, rotated_inputs

    from moerunner.backends.triton import TritonBackend, TritonOptions, _launch, tune
    from moerunner.backends.triton import _gemm_kernel as K
    from moerunner.backends.triton import experts as X
    from moerunner.backends.triton.tile_config import MoeTiles
    from moerunner.bench import roofline
    from moerunner.config import Activation

    cap = {"gemm1": None, "gemm2": None}
    launch = _launch.launch

    def capped(kernel, grid, *a, options, **kw):
        if kernel is K.moe_gemm_kernel:
            regs = cap["gemm1" if kw.get("GATED") else "gemm2"]
            if regs is not None:
                kw["maxnreg"] = regs
        return launch(kernel, grid, *a, options=options, **kw)

    _launch.launch = capped
    dev = torch.device("cuda")
    H, I, E, k, act = tune.PRESETS[args.preset]
    weights = tune.random_weights(H, I, E, act, args.scheme, dev)
    prepared = TritonBackend(TritonOptions()).prepare_weights(
        weights, weights.spec(Activation(act))
    )
    copy = roofline.measure_ceilings(dev).copy_gbps
    per_expert = weight_bytes(prepared, "w13") + weight_bytes(prepared, "w2")
    device = torch.cuda.get_device_name(dev)
    print(f"{device}  copy {copy:.0f} GB/s", flush=True)
    rows = []
    first = variants[0][0]
    for T in [int(t) for t in args.tokens.split(",")]:
        shipped = prepared.tensors["tiles"].lookup(T, k)
        print(f"T={T} shipped tiles {shipped}", flush=True)
        xs, rs, hit = rotated_inputs(prepared, T, k, 8)
        graphs, outs = {}, {}
        for name, s1, s2, r1, r2 in variants:
            cap["gemm1"], cap["gemm2"] = r1, r2
            tiles = MoeTiles(
                dataclasses.replace(shipped.gemm1, num_stages=s1 or shipped.gemm1.num_stages),
                dataclasses.replace(shipped.gemm2, num_stages=s2 or shipped.gemm2.num_stages),
            )
            outs[name] = [
                X.fused_standard(x, w, i, prepared, tiles) for x, (w, i) in zip(xs, rs, strict=True)
            ]
            graphs[name] = fused_graph(prepared, xs, rs, tiles)
        cap["gemm1"] = cap["gemm2"] = None
        equal = {
            n: all(torch.equal(a, b) for a, b in zip(outs[first], o, strict=True))
            for n, o in outs.items()
        }
        us = alternate(graphs, args.rounds, 8)
        floor = hit * per_expert / (copy * 1e9) * 1e6
        for name, *_ in variants:
            print(
                f"T={T:>5} {name:>6}: {ratio_summary(us[first], us[name], floor)}  "
                f"bit_equal {equal[name]}",
                flush=True,
            )
        rows.append(dict(T=T, hit=hit, floor_us=floor, us=us, bit_equal=equal, tiles=str(shipped)))
    kernels = set()
    for key, (compiled, _) in _launch._compiled.items():
        if key[0] == id(K.moe_gemm_kernel):
            kw = dict(key[2])
            kernels.add(
                (
                    "gemm1" if kw.get("GATED") else "gemm2",
                    kw.get("BLOCK_N"),
                    kw.get("num_stages"),
                    kw.get("maxnreg"),
                    getattr(compiled, "n_regs", None),
                    getattr(compiled, "n_spills", None),
                )
            )
    for g, bn, stages, regs_cap, regs, spills in sorted(kernels, key=str):
        print(f"{g} BLOCK_N {bn} stages {stages} cap {regs_cap}: {regs} registers, {spills} spills")
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(device=device, copy_gbps=copy, variants=args.variants, rows=rows), indent=1
            )
        )


if __name__ == "__main__":
    main()
