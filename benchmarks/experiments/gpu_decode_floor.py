# How far can a cheaper fp4 decode take mxfp4 W4A16 decode? Times the fused op on
# GPT-OSS-120B-shaped mxfp4 weights in the split and the fragment layout, with the real e2m1
# decode or with a stand-in that costs what any decode must (one mask and one scale multiply
# per bf16x2 register: 8 instructions per 8 weights against the real decode's ~19), so the
# difference bounds what a leaner decode could gain. The stand-in computes wrong values: its
# numbers are a bound, never a result.
#
#   python benchmarks/experiments/gpu_decode_floor.py [--decode real floor] [--tokens 1 16 64 256]
#
# Each decode runs in its own process (the decode is a compile-time constant of the kernel).
# Tiles are the H200-tuned ones of each layout, so both layouts run the same tile shapes on
# any GPU. A compact table is printed last; --out DIR/decode-floor.json gets the rows.

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FLOOR_ASM = """{
.reg .b32 t, nz;
mov.b32 nz, 0x80008000;
and.b32 t, $4, 0x81C081C0;
fma.rn.bf16x2 $0, t, $5, nz;
and.b32 t, $4, 0x80E080E0;
fma.rn.bf16x2 $1, t, $6, nz;
and.b32 t, $4, 0x81608160;
fma.rn.bf16x2 $2, t, $7, nz;
and.b32 t, $4, 0x80708070;
fma.rn.bf16x2 $3, t, $8, nz;
}"""


def run_one(decode: str, tokens: list[int]) -> list[dict]:
    import torch
    import triton.language as tl

    from moerunner.backends.triton import _weight_decode as D

    if decode == "floor":  # before any kernel is compiled
        D._E2M1_BF16_ASM = tl.constexpr(FLOOR_ASM)
        D._E2M1_BF16_MERGED_ASM = tl.constexpr(FLOOR_ASM)

    import gpu_triton as G

    from moerunner.backends.triton import TritonBackend, TritonOptions, tile_config, tune
    from moerunner.config import Activation

    H, I, E, k, act_name = tune.PRESETS["gpt-oss-120b"]
    weights = tune.random_weights(H, I, E, act_name, "mxfp4", G.DEV)
    spec = weights.spec(Activation(act_name))
    copy_bw = G.measure_peaks()["copy_bytes_per_s"] if decode == "real" else None
    rows = []
    for layout in ("split", "fragment"):
        options = TritonOptions(e2m1_layout=layout)
        prepared = TritonBackend(options).prepare_weights(weights, spec)
        name = tile_config.config_file_name(
            E, I, H, "mxfp4", "NVIDIA H200", "fragment" if layout == "fragment" else None
        )
        table = tile_config.load_config_file(str(tile_config.SHIPPED_DIR / name))
        for T in tokens:
            tiles = table[min(table, key=lambda t: (abs(t - T), t))]
            ms, uniq = G.time_fused(prepared, T, k, tiles=tiles)
            stages = G.stage_breakdown(prepared, T, k, tiles=tiles)
            row = dict(
                decode=decode,
                layout=layout,
                T=T,
                us=ms * 1e3,
                experts_hit=uniq,
                bytes=G.fused_cost(prepared, uniq, T, k).bytes,
                tiles=str(tiles),
                gemm1_us=stages.get("gemm1"),
                gemm2_us=stages.get("gemm2"),
            )
            if copy_bw:
                row["copy_bytes_per_s"] = copy_bw
            rows.append(row)
            print(
                f"{decode:5s} {layout:8s} T={T:4d} {row['us']:8.1f} us  gemm1 "
                f"{row['gemm1_us'] or 0:7.1f}  gemm2 {row['gemm2_us'] or 0:7.1f}",
                flush=True,
            )
        del prepared
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", nargs="+", default=["real", "floor"], choices=["real", "floor"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))
    if args.child:
        print("ROWS " + json.dumps(run_one(args.decode[0], args.tokens)), flush=True)
        return
    rows = []
    for decode in args.decode:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--decode",
            decode,
            "--tokens",
            *map(str, args.tokens),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:])
        for line in proc.stdout.splitlines():
            if line.startswith("ROWS "):
                rows += json.loads(line[5:])
            else:
                print(line, flush=True)
    bw = next((r["copy_bytes_per_s"] for r in rows if "copy_bytes_per_s" in r), None)
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "?"
    print(f"\n== decode floor, {dev}, copy {bw / 1e12 if bw else float('nan'):.2f} TB/s ==")
    print(f"{'layout':8s} {'T':>5s} " + " ".join(f"{d:>22s}" for d in args.decode))
    for layout in ("split", "fragment"):
        for T in args.tokens:
            cells = []
            for d in args.decode:
                r = next(
                    (r for r in rows if (r["decode"], r["layout"], r["T"]) == (d, layout, T)), None
                )
                if r is None:
                    cells.append(f"{'-':>22s}")
                else:
                    pct = 100 * r["bytes"] / bw / (r["us"] * 1e-6) if bw else float("nan")
                    cells.append(f"{r['us']:9.1f} us {pct:5.1f}%R")
            print(f"{layout:8s} {T:5d} " + " ".join(cells))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode-floor.json").write_text(
            json.dumps(dict(device=dev, rows=rows), indent=1)
        )


if __name__ == "__main__":
    main()
