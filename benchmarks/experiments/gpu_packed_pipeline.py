# Deeper pipelines and longer K steps for packed 4-bit decode tiles (mxfp4 W4A16, split
# layout), beyond the tuner's decode candidates (K steps of 1-4 chunks, at most 4 stages).
#
#   python benchmarks/experiments/gpu_packed_pipeline.py [--tokens 16 64] [--jobs 12] [--out DIR]
#
# Why: with the fp4 decode replaced by a stand-in of less than half its instructions
# (gpu_decode_floor.py) the T = 16/64 decode of GPT-OSS-120B hardly moved on an H100, so the
# K loop's per-step cost, not the decode, bounds it; each step moves 8 KB of weights per
# 128-row tile against the 32 KB of a bf16 step. This times, per token count, each GEMM with
# every candidate (compiled first in parallel processes), then the fused op with the best
# pair against the shipped tiles, alternately in one process. A table is printed last;
# --out DIR gets packed-pipeline.json.

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))

PRESET, SCHEME = "gpt-oss-120b", "mxfp4"


def candidates():
    from moerunner.backends.triton.tile_config import TileConfig

    out = []
    for bn, bk, (warps, stages) in itertools.product(
        (32, 64, 128), (128, 256, 512), ((4, 3), (4, 4), (4, 5), (4, 6), (8, 4), (8, 6))
    ):
        out.append(TileConfig(16, bn, bk, 1, warps, stages))
    return out


def _setup(num_experts: int | None = None):
    """The preset's prepared weights in the split layout (``num_experts`` of them: compiling
    needs few)."""
    import torch

    from moerunner.backends.triton import TritonBackend, TritonOptions, tune
    from moerunner.config import Activation

    # This study is of the split layout's decode tiles, against the shipped ones.
    split = TritonOptions(e2m1_layout="split", tile_dirs=())

    torch.manual_seed(0)
    H, I, E, k, act = tune.PRESETS[PRESET]
    E = num_experts or E
    weights = tune.random_weights(H, I, E, act, SCHEME, torch.device("cuda"))
    return TritonBackend(split).prepare_weights(weights, weights.spec(Activation(act))), k


def _compile(args):
    tokens, idx = args
    from moerunner.backends.triton import tune

    prepared, k = _setup(num_experts=8)
    cands = [c for i, c in enumerate(candidates()) if i % idx[1] == idx[0]]
    for T in tokens:
        tune.tune_tokens(prepared, T, k, cands, progress=lambda s: None, compile_only=True)
    return len(cands)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        pool.map(_compile, [(args.tokens, (i, args.jobs)) for i in range(args.jobs)])
    print("compiled", flush=True)

    import gpu_triton as G
    import torch

    from moerunner.backends.triton import tune

    prepared, k = _setup()
    copy_bw = G.measure_peaks()["copy_bytes_per_s"]
    dev = torch.cuda.get_device_name()
    result = dict(device=dev, copy_bytes_per_s=copy_bw, rows=[])
    for T in args.tokens:
        log = []
        best, gemm_ms = tune.tune_tokens(prepared, T, k, candidates(), progress=log.append)
        shipped = prepared.tensors["tiles"].lookup(T, k)
        times = {"shipped": [], "best": []}
        for r in range(args.rounds):
            for name in ("shipped", "best")[:: 1 - 2 * (r % 2)]:
                tiles = shipped if name == "shipped" else best
                ms, uniq = G.time_fused(prepared, T, k, 8, tiles)
                times[name].append(ms * 1e3)
        nbytes = G.fused_cost(prepared, uniq, T, k).bytes
        row = dict(
            T=T,
            shipped=str(shipped),
            best=str(best),
            best_gemm_ms=gemm_ms,
            shipped_us=statistics.median(times["shipped"]),
            best_us=statistics.median(times["best"]),
            times=times,
            bytes=nbytes,
            candidates=log,
        )
        row["shipped_pct_r"] = 100 * nbytes / copy_bw / (row["shipped_us"] * 1e-6)
        row["best_pct_r"] = 100 * nbytes / copy_bw / (row["best_us"] * 1e-6)
        result["rows"].append(row)
        print("\n".join(log[-8:]), flush=True)
        print(
            f"T={T}: shipped {row['shipped_us']:.1f} us ({row['shipped_pct_r']:.1f}%R) "
            f"best {row['best_us']:.1f} us ({row['best_pct_r']:.1f}%R)",
            flush=True,
        )
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "packed-pipeline.json").write_text(json.dumps(result, indent=1))
    print(f"\n== packed pipelines, {dev}, copy {copy_bw / 1e12:.2f} TB/s ==")
    for row in result["rows"]:
        print(
            f"T={row['T']:4d} shipped {row['shipped_us']:7.1f} us {row['shipped_pct_r']:5.1f}%R"
            f"  best {row['best_us']:7.1f} us {row['best_pct_r']:5.1f}%R  {row['best']}"
        )


if __name__ == "__main__":
    main()
