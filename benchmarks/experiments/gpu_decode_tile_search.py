# A wider tile search than the tuner's at decode sizes, and the whole fused call with the
# winner against the shipped tiles. The tuner searches 16-row tiles with BLOCK_K 128 and 4
# warps for block-scaled fp8 at decode (``tune.candidate_tiles``); this script adds BLOCK_K
# 256 (two scale groups per K step), BLOCK_N 256, deeper pipelines and 8 warps, to see
# whether a decode-sized call can read its weights faster than the shipped tiles do.
#
#   python benchmarks/experiments/gpu_decode_tile_search.py --preset deepseek-v3 \
#       --scheme fp8_block --tokens 16 32 64 --jobs 8 --json OUT/search.json
#
# Per T: every candidate's GEMM1 and GEMM2 time (the tuner's own timing, CUDA-graph replay
# over 8 routings), the best pair, then the whole fused call with the shipped tiles (a) and
# the best pair (b) alternately for --rounds rounds, with the bandwidth of the experts' bytes
# each reads (experts hit per routing x bytes per expert). Compiling is CPU work: --jobs
# compiles the candidates in that many processes first (on ``tune.compile_experts`` experts,
# so each holds little GPU memory).

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from moerunner import Activation  # noqa: E402
from moerunner.backends.triton import TritonBackend, tune  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton._prepare import layer_tiles  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles, TileConfig  # noqa: E402


def candidates(bns, bks, pipelines) -> list[TileConfig]:
    return [
        TileConfig(16, bn, bk, 1, warps, stages)
        for bn in bns
        for bk in bks
        for warps, stages in pipelines
    ]


def prepare(preset: str, scheme: str, compile_only: bool):
    H, I, E, k, act = tune.PRESETS[preset]
    E = tune.compile_experts(E, k) if compile_only else E
    weights = tune.random_weights(H, I, E, act, scheme, torch.device("cuda"))
    return TritonBackend().prepare_weights(weights, weights.spec(Activation(act))), k


def expert_bytes(prepared) -> float:
    """Bytes one expert's weights and scales take (both GEMMs)."""
    total = 0
    for name in ("w13", "w2"):
        w = prepared.tensors[name]
        for attr in ("data", "scale", "zero_point"):
            t = getattr(w, attr, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total / prepared.spec.num_experts


def whole_call(prepared, k: int, T: int, tiles: dict[str, MoeTiles], rounds: int) -> dict:
    """The fused call per tile choice, alternately, graph replay over tune.ROUTINGS routings."""
    dev = torch.device("cuda")
    E, H = prepared.spec.num_experts, prepared.spec.hidden_size
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    routings = [
        torch.rand(T, E, device=dev).topk(k, dim=1).indices.to(torch.int32)
        for _ in range(tune.ROUTINGS)
    ]
    w = torch.rand(T, k, device=dev)
    hit = statistics.mean(len(torch.unique(ids)) for ids in routings)

    def call(t):
        def run():
            for ids in routings:
                X.fused_standard(x, w, ids, prepared, t)

        return run

    for t in tiles.values():
        call(t)()
    torch.cuda.synchronize()
    us = {name: [] for name in tiles}
    for _ in range(rounds):
        for name, t in tiles.items():
            us[name].append(tune._bench(call(t), True) / tune.ROUTINGS * 1e3)
    gb = hit * expert_bytes(prepared) / 1e9
    return {
        "hit": hit,
        "GB": gb,
        "us": us,
        "TBps": {n: gb / (statistics.median(v) * 1e-6) / 1e3 for n, v in us.items()},
        "a_over_b": statistics.median(a / b for a, b in zip(us["a"], us["b"], strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3", choices=sorted(tune.PRESETS))
    ap.add_argument("--scheme", default="fp8_block")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--bn", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--bk", type=int, nargs="+", default=[128, 256])
    ap.add_argument(
        "--pipelines",
        nargs="+",
        default=["4x3", "4x4", "4x5", "4x6", "8x3", "8x4"],
        help="WARPSxSTAGES",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--part", default=None, help="I/N: compile the I-th of N slices only")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    pipes = [tuple(int(v) for v in p.split("x")) for p in args.pipelines]
    cands = candidates(args.bn, args.bk, pipes)
    if args.part is not None:  # a compile process
        i, n = (int(v) for v in args.part.split("/"))
        prepared, k = prepare(args.preset, args.scheme, True)
        for T in args.tokens:
            part = cands[i::n]
            tune.tune_tokens(prepared, T, k, part, progress=lambda s: None, compile_only=True)
        return
    start = time.time()
    if args.jobs > 1:
        procs = [
            subprocess.Popen([sys.executable, __file__, *sys.argv[1:], f"--part={i}/{args.jobs}"])
            for i in range(args.jobs)
        ]
        print(f"compile: {[p.wait() for p in procs]} in {time.time() - start:.0f} s", flush=True)
    prepared, k = prepare(args.preset, args.scheme, False)
    shipped = layer_tiles(prepared.spec, args.scheme, prepared.tensors["w13"], None)
    print(f"shipped tiles: {shipped.describe()}; {len(cands)} candidates", flush=True)
    out = []
    for T in args.tokens:
        lines = []
        best, ms = tune.tune_tokens(prepared, T, k, cands, progress=lines.append)
        for line in lines:
            print(f"T={T} {line}", flush=True)
        ship = shipped.lookup(T, k)
        res = whole_call(prepared, k, T, {"a": ship, "b": best}, args.rounds)
        print(
            f"T={T}: hit {res['hit']:.1f} experts, {res['GB']:.2f} GB; shipped {ship}: "
            f"{statistics.median(res['us']['a']):.1f} us ({res['TBps']['a']:.2f} TB/s); "
            f"best {best}: {statistics.median(res['us']['b']):.1f} us "
            f"({res['TBps']['b']:.2f} TB/s); shipped/best {res['a_over_b']:.3f}",
            flush=True,
        )
        found = dict(shipped=str(ship), best=str(best), best_gemm_ms=ms, search=lines)
        out.append(dict(T=T, **found, **res))
    print(f"done in {time.time() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
