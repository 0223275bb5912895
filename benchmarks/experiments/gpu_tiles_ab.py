# Time the fused MoE op of one preset with two tile choices, alternately in one process, so
# that a tile change is judged against run-to-run drift rather than across runs.
#
#   python benchmarks/experiments/gpu_tiles_ab.py --preset deepseek-v3 --scheme fp8_block \
#       --tokens 16384 \
#       --a 64,128,128,8,4/64,128,128,4,4 --b 128,64,256,8,3/128,128,256,8,3
#
# A tile choice is "GEMM1/GEMM2", each "block_m,block_n,block_k,num_warps,num_stages" with
# an optional ",group_m" (8 when not given), or "dir:FOLDER" (the tiles a tuned file in FOLDER
# gives for each T, as prepared weights would look them up; "dir:" alone: the shipped files),
# for judging a re-tuned file against the shipped one. ``--routing zipf`` draws skewed expert
# loads (a few hot experts; ``moerunner.bench.sweep.draw_routing``) instead of the recorded
# uniform routing. ``--a-options`` / ``--b-options`` give each side TritonOptions fields
# ("field=value,...", Python literals), so one switch of the kernel sequence can be judged
# the same way (same tiles on both sides: "--a dir: --b dir:").
# Prints one line per round and the median ratio; --json writes the rounds.

from __future__ import annotations

import argparse
import ast
import dataclasses
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
from moerunner.backends.triton import TritonBackend, TritonOptions, tune  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton._prepare import layer_tiles  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles, TileConfig  # noqa: E402


def parse_tiles(text: str) -> MoeTiles:
    """'bm,bn,bk,warps,stages[,group_m]/...' -> MoeTiles (group_m 8 when not given)."""
    parts = text.split("/")
    if len(parts) != 2:
        raise SystemExit(f"tiles {text!r}: expected GEMM1/GEMM2")
    tiles = []
    for p in parts:
        values = [int(v) for v in p.split(",")]
        if len(values) not in (5, 6):
            raise SystemExit(f"tiles {text!r}: expected bm,bn,bk,warps,stages[,group_m]")
        bm, bn, bk, warps, stages = values[:5]
        group_m = values[5] if len(values) == 6 else 8
        tiles.append(TileConfig(bm, bn, bk, group_m, warps, stages))
    return MoeTiles(*tiles)


def parse_options(text: str) -> dict:
    """'field=value,...' (Python literals) -> keyword arguments of TritonOptions."""
    out = {}
    for item in filter(None, text.split(",")):
        field, _, value = item.partition("=")
        out[field.strip()] = ast.literal_eval(value.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True, choices=sorted(tune.PRESETS))
    ap.add_argument("--scheme", default="bf16")
    ap.add_argument("--tokens", type=int, nargs="+", required=True)
    ap.add_argument("--a", required=True, help="baseline tiles")
    ap.add_argument("--b", required=True, help="candidate tiles")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--zipf-exponent", type=float, default=1.2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--min-group-m",
        type=int,
        default=1,
        help="TritonOptions.min_group_m (default 1: each GEMM launches with the GROUP_M "
        "given; 8 is the library's default, for an A/B of tile files as users run them)",
    )
    ap.add_argument("--a-options", default="", help="TritonOptions fields of the baseline")
    ap.add_argument("--b-options", default="", help="TritonOptions fields of the candidate")
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, I, E, k, act = tune.PRESETS[args.preset]
    weights = tune.random_weights(H, I, E, act, args.scheme, dev)
    # min_group_m=1: every GEMM launches with the GROUP_M given here (the A/B may be of it)
    base = TritonOptions(min_group_m=args.min_group_m)
    options = {
        "a": dataclasses.replace(base, **parse_options(args.a_options)),
        "b": dataclasses.replace(base, **parse_options(args.b_options)),
    }
    prepared = {
        name: TritonBackend(opts).prepare_weights(weights, weights.spec(Activation(act)))
        for name, opts in options.items()
    }
    print(f"a: {options['a']!r}  b: {options['b']!r}")

    def source(text: str, options: TritonOptions):
        """Tiles for T: fixed tiles, or the lookup of a tile folder's file ("dir:...")."""
        if not text.startswith("dir:"):
            tiles = parse_tiles(text)
            return lambda T: tiles
        folder = text[len("dir:") :]
        # The lookup prepare makes for users' weights, in another folder.
        found = layer_tiles(
            prepared["a"].spec,
            weights.w13_scheme,
            prepared["a"].tensors["w13"],
            (folder,) if folder else (),
        )
        print(f"{text}: {found.describe()}")
        return lambda T: found.lookup(T, k)

    sources = {"a": source(args.a, options["a"]), "b": source(args.b, options["b"])}
    out = []
    for T in args.tokens:
        choices = {name: pick(T) for name, pick in sources.items()}
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        if args.routing == "uniform":
            w, ids = routing(T, E, k, dev)
        else:
            from moerunner.bench.presets import get_preset
            from moerunner.bench.sweep import draw_routing

            gen = torch.Generator().manual_seed(T)
            topk = draw_routing(T, get_preset(args.preset), "zipf", gen, args.zipf_exponent)
            w, ids = topk.weights.to(dev), topk.ids.to(dev)
        ms = {"a": [], "b": []}
        for r in range(args.rounds):
            for name, tiles in choices.items():
                ms[name].append(
                    tt.do_bench(
                        functools.partial(X.fused_standard, x, w, ids, prepared[name], tiles),
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
                a=str(choices["a"]),
                b=str(choices["b"]),
                a_options=repr(options["a"]),
                b_options=repr(options["b"]),
                routing=args.routing,
                a_ms=ms["a"],
                b_ms=ms["b"],
                median_ratio=ratio,
            )
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
