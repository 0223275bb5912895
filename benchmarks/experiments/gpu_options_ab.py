# Several TritonOptions variants (fields read per call) on one prepared weight set, in one
# process: each variant's speed against the first one's, and whether its outputs are
# bit-equal to the first one's.
#
#   python benchmarks/experiments/gpu_options_ab.py --preset gpt-oss-120b --scheme mxfp4 \
#       --tokens 16,64,256 --rounds 5 \
#       --variants "off=stream_gemms=False,early_prefetch_steps=0;st=early_prefetch_steps=0;on="
#
# A variant is "name=field=value,field=value" (values are Python literals; "name=" alone is
# the defaults), variants separated by ";". The weights are prepared once with the defaults
# and each variant runs them through ``with_options`` (so only per-call fields may differ).
# Per T: 8 calls with rotated uniform routings captured in one CUDA graph per variant, timed
# by triton.testing.do_bench (median; us per call = replay / 8); the variants alternate in
# rotated order for --rounds rounds. x = the first variant's time / this variant's, median
# over rounds [min-max]. "weights%copy" counts the stored weight bytes of the experts hit
# (fragment-layout padding included, unlike `moerunner bench`'s 4.25-bit floor) at the copy
# bandwidth measured here. Prints one line per (T, variant); --json writes every sample.

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_triton

import torch  # noqa: E402
from gpu_decode_profile import weight_bytes  # noqa: E402
from gpu_triton import alternate, fused_graph, ratio_summary, rotated_inputs  # noqa: E402

from moerunner.backends.triton import TritonBackend, TritonOptions, tune, with_options  # noqa: E402
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.bench import roofline  # noqa: E402
from moerunner.config import Activation  # noqa: E402

ROTATIONS = 8


def parse_variants(text: str) -> dict[str, dict]:
    """'name=field=value,...;name=...' -> {name: TritonOptions keyword arguments}."""
    out = {}
    for item in filter(None, text.split(";")):
        name, _, fields = item.partition("=")
        kw = {}
        for field in filter(None, fields.split(",")):
            key, _, value = field.partition("=")
            kw[key.strip()] = ast.literal_eval(value.strip())
        out[name.strip()] = kw
    if not out:
        raise SystemExit("--variants: give at least one variant")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="TritonOptions variants side by side")
    ap.add_argument("--preset", default="gpt-oss-120b", choices=sorted(tune.PRESETS))
    ap.add_argument("--scheme", default="mxfp4")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="off=stream_gemms=False,early_prefetch_steps=0;on=")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, I, E, k, act = tune.PRESETS[args.preset]
    weights = tune.random_weights(H, I, E, act, args.scheme, dev)
    prepared = TritonBackend(TritonOptions()).prepare_weights(
        weights, weights.spec(Activation(act))
    )
    variants = {
        name: with_options(prepared, dataclasses.replace(TritonOptions(), **kw))
        for name, kw in parse_variants(args.variants).items()
    }
    names = list(variants)
    copy_gbps = roofline.measure_ceilings(dev).copy_gbps
    # Stored bytes of one expert's w13 and w2 (data, scales, biases) as the kernels read them.
    per_expert = weight_bytes(prepared, "w13") + weight_bytes(prepared, "w2")
    device = torch.cuda.get_device_name(dev)
    print(f"{device}  copy {copy_gbps:.0f} GB/s  {per_expert / 1e6:.2f} MB per expert", flush=True)
    result = dict(
        device=device,
        preset=args.preset,
        scheme=args.scheme,
        copy_gbps=copy_gbps,
        per_expert_bytes=per_expert,
        variants={n: repr(v.options) for n, v in variants.items()},
        rows=[],
    )
    for T in [int(t) for t in args.tokens.split(",")]:
        xs, rs, hit = rotated_inputs(prepared, T, k, ROTATIONS)
        first = [
            X.fused_standard(x, w, i, variants[names[0]]) for x, (w, i) in zip(xs, rs, strict=True)
        ]
        equal = {}
        for name, p in variants.items():
            outs = [X.fused_standard(x, w, i, p) for x, (w, i) in zip(xs, rs, strict=True)]
            equal[name] = all(torch.equal(a, b) for a, b in zip(first, outs, strict=True))
        graphs = {name: fused_graph(p, xs, rs) for name, p in variants.items()}
        us = alternate(graphs, args.rounds, ROTATIONS)
        floor_us = hit * per_expert / (copy_gbps * 1e9) * 1e6
        result["rows"].append(dict(T=T, experts_hit=hit, floor_us=floor_us, us=us, bit_equal=equal))
        for name in names:
            print(
                f"{args.preset} {args.scheme} T={T:>5} {name:>6}: "
                f"{ratio_summary(us[names[0]], us[name], floor_us)}  bit_equal {equal[name]}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
