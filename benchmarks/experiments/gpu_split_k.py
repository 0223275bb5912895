# Split K (``TileConfig.split_k``) at decode sizes: for each preset, scheme and T, the tuned
# (or default) tiles with GEMM1 and GEMM2 split into s1 x s2 programs per tile and as the
# launcher's rule splits them ("rule"), side by side in one process, and how far each is from
# the unsplit tiles' output ("1x1", the reference of the ratios).
#
#   python benchmarks/experiments/gpu_split_k.py --points gpt-oss-120b:mxfp4:1,2,4 \
#       --points qwen3-30b-a3b:bf16:1 --splits 1,2,3,4,6 --rounds 3 --json out.json
#
# Per point: 8 calls with rotated uniform routings captured in one CUDA graph per variant,
# timed by triton.testing.do_bench (median; us per call = replay / 8); variants alternate in
# rotated order for --rounds rounds. x = the unsplit time / this variant's, median over
# rounds [min-max]. "weights%copy" counts the stored weight bytes of the experts hit at the
# copy bandwidth measured here. --old-tiles FOLDER also times the tiles a tuned file there
# gives ("old"; a file before a re-tune). --split-layout also times mxfp4 / nvfp4 weights
# prepared in the split e2m1 layout with their own tuned tiles (the layout that was faster at
# T = 1).
# Prints the best variants per point; --json writes every sample.

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_triton

import torch  # noqa: E402
from gpu_decode_profile import weight_bytes  # noqa: E402
from gpu_triton import alternate, fused_graph, ratio_summary, rotated_inputs  # noqa: E402

from moerunner.backends.triton import TritonBackend, TritonOptions, autotune, tune  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton._prepare import layer_tiles  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles  # noqa: E402
from moerunner.bench import roofline  # noqa: E402
from moerunner.config import Activation  # noqa: E402

ROTATIONS = 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _pinned(tiles: MoeTiles, s1: int, s2: int) -> MoeTiles:
    return MoeTiles(
        dataclasses.replace(tiles.gemm1, split_k=s1), dataclasses.replace(tiles.gemm2, split_k=s2)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="split-K variants of the tuned tiles")
    ap.add_argument("--points", action="append", required=True, help="preset:scheme:T,T,...")
    ap.add_argument("--splits", default="1,2,3,4,6")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--split-layout", action="store_true")
    ap.add_argument(
        "--old-tiles", default=None, help="also time the tiles a tuned file in this folder gives"
    )
    ap.add_argument("--show", type=int, default=6, help="variants printed per point")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    splits = [int(s) for s in args.splits.split(",")]
    copy_gbps = roofline.measure_ceilings(dev).copy_gbps
    device = torch.cuda.get_device_name(dev)
    print(f"{device}  copy {copy_gbps:.0f} GB/s", flush=True)
    result = dict(device=device, copy_gbps=copy_gbps, splits=splits, rows=[])
    for point in args.points:
        preset, scheme, tokens = point.split(":")
        H, I, E, k, act = tune.PRESETS[preset]
        weights = tune.random_weights(H, I, E, act, scheme, dev)
        spec = weights.spec(Activation(act))
        prepared = TritonBackend(TritonOptions()).prepare_weights(weights, spec)
        per_expert = weight_bytes(prepared, "w13") + weight_bytes(prepared, "w2")
        split_layout = None
        if args.split_layout and scheme in ("mxfp4", "nvfp4"):
            split_layout = TritonBackend(TritonOptions(e2m1_layout="split")).prepare_weights(
                weights, spec
            )
        old = None
        if args.old_tiles:
            old = layer_tiles(spec, weights.w13_scheme, prepared.tensors["w13"], (args.old_tiles,))
            print(f"old tiles: {old.describe()}", flush=True)
        del weights
        for T in [int(t) for t in tokens.split(",")]:
            base = autotune.tiles_for_call(prepared, T, k, dev)
            xs, rs, hit = rotated_inputs(prepared, T, k, ROTATIONS)
            # "rule": the tiles as found, split_k left to the launcher (``split_k_for``).
            variants = {"rule": base, "1x1": _pinned(base, 1, 1)}
            if old is not None:
                variants["old"] = old.lookup(T, k)
            for s1 in splits:
                for s2 in splits:
                    variants[f"{s1}x{s2}"] = _pinned(base, s1, s2)
            ref = [
                X.fused_standard(x, w, i, prepared, variants["1x1"])
                for x, (w, i) in zip(xs, rs, strict=True)
            ]
            err = {}
            for name, tiles in variants.items():
                outs = [
                    X.fused_standard(x, w, i, prepared, tiles)
                    for x, (w, i) in zip(xs, rs, strict=True)
                ]
                err[name] = max(_rel(o, r) for o, r in zip(outs, ref, strict=True))
            graphs = {
                name: fused_graph(prepared, xs, rs, tiles) for name, tiles in variants.items()
            }
            if split_layout is not None:
                graphs["split-layout"] = fused_graph(split_layout, xs, rs)
            us = alternate(graphs, args.rounds, ROTATIONS)
            floor_us = hit * per_expert / (copy_gbps * 1e9) * 1e6
            row = dict(
                preset=preset,
                scheme=scheme,
                T=T,
                experts_hit=hit,
                floor_us=floor_us,
                base=base.to_dict(),
                us=us,
                rel_err_vs_unsplit=err,
            )
            result["rows"].append(row)
            one = us["1x1"]
            order = sorted(us, key=lambda n: statistics.median(us[n]))
            fixed = ("rule", "old", "1x1", "split-layout")
            shown = order[: args.show] + [n for n in fixed if n in us]
            print(f"{preset} {scheme} T={T} hit {hit:.1f} base {base}", flush=True)
            for name in dict.fromkeys(shown):
                print(
                    f"  {name:>12}: {ratio_summary(one, us[name], floor_us)}"
                    f"  rel_err {err.get(name, float('nan')):.1e}",
                    flush=True,
                )
        del prepared, split_layout
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
