# Time the fused MoE op of one preset with two tile choices, alternately in one process, so
# that a tile change is judged against run-to-run drift rather than across runs.
#
#   python benchmarks/experiments/gpu_tiles_ab.py --preset deepseek-v3 --scheme fp8_block --tokens 16384 \
#       --a 64,128,128,8,4/64,128,128,4,4 --b 128,64,256,8,3/128,128,256,8,3
#
# A tile choice is "GEMM1/GEMM2", each "block_m,block_n,block_k,num_warps,num_stages"
# (group_m 8). Prints one line per round and the median ratio; --json writes the rounds.

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_triton

import torch  # noqa: E402
import triton.testing as tt  # noqa: E402
from gpu_triton import routing  # noqa: E402  (same random routing as the recorded runs)

from moerunner import Activation  # noqa: E402
from moerunner.backends.triton import TritonBackend, tune  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles, TileConfig  # noqa: E402


def parse_tiles(text: str) -> MoeTiles:
    """'bm,bn,bk,warps,stages/bm,bn,bk,warps,stages' -> MoeTiles (group_m 8)."""
    parts = text.split("/")
    if len(parts) != 2:
        raise SystemExit(f"tiles {text!r}: expected GEMM1/GEMM2")
    tiles = []
    for p in parts:
        bm, bn, bk, warps, stages = (int(v) for v in p.split(","))
        tiles.append(TileConfig(bm, bn, bk, 8, warps, stages))
    return MoeTiles(*tiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True, choices=sorted(tune.PRESETS))
    ap.add_argument("--scheme", default="bf16")
    ap.add_argument("--tokens", type=int, nargs="+", required=True)
    ap.add_argument("--a", required=True, help="baseline tiles")
    ap.add_argument("--b", required=True, help="candidate tiles")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, I, E, k, act = tune.PRESETS[args.preset]
    weights = tune.random_weights(H, I, E, act, args.scheme, dev)
    prepared = TritonBackend().prepare_weights(weights, weights.spec(Activation(act)))
    choices = {"a": parse_tiles(args.a), "b": parse_tiles(args.b)}
    out = []
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w, ids = routing(T, E, k, dev)
        ms = {"a": [], "b": []}
        for r in range(args.rounds):
            for name, tiles in choices.items():
                ms[name].append(
                    tt.do_bench(
                        functools.partial(X.fused_standard, x, w, ids, prepared, tiles),
                        warmup=10,
                        rep=100,
                        return_mode="median",
                    )
                )
            print(
                f"{args.preset} {args.scheme} T={T} round {r}: a {ms['a'][-1] * 1e3:.1f} us, "
                f"b {ms['b'][-1] * 1e3:.1f} us",
                flush=True,
            )
        ratio = statistics.median(a / b for a, b in zip(ms["a"], ms["b"], strict=True))
        print(f"{args.preset} {args.scheme} T={T}: a/b = {ratio:.3f} (b faster when > 1)")
        out.append(
            dict(
                preset=args.preset,
                scheme=args.scheme,
                T=T,
                a=args.a,
                b=args.b,
                a_ms=ms["a"],
                b_ms=ms["b"],
                median_ratio=ratio,
            )
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
