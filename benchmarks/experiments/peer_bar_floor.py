# What "1.03x the tuned peer at every point" asks of the GPU: for each point of a recorded
# peer table (gpu peer runs, e.g. nvidia-h100-peer-triton-2026-11-28.json), the time 1.03x the
# peer's would take, against the roofline floor of the call (the library's byte and flop
# count, ``moerunner.bench.roofline.row_cost``, with the experts the run hit), and so the
# share of the best read rate (or matmul peak) a kernel would have to reach there. Above
# 100 %: no kernel can meet the bar at that point on that GPU. No GPU needed: it reads the
# recorded table.
#
#   python benchmarks/experiments/peer_bar_floor.py \
#       benchmarks/results/nvidia-h100-peer-triton-2026-11-28.json [--read-tbps 3.15]
#       [--peak-tflops 776] [--margin 1.03] [--routing uniform] [--json OUT.json]
#
# --read-tbps: the best rate at which any kernel was measured to read expert weights on that
# GPU (3.15 TB/s on an H100: the fp8_block decode tiles in a captured step,
# nvidia-h100-transformers-e2e-fp8-decode-2026-12-07.txt); --peak-tflops: the bf16 matmul
# peak `moerunner bench` measured there (776 on an H100). Prints a table, then a summary.

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moerunner.bench.presets import get_preset  # noqa: E402
from moerunner.bench.roofline import DeviceCeilings, floor_parts, row_cost  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("table", type=Path, help="a peer run's JSON (rows of preset, T, hit, us)")
    p.add_argument("--read-tbps", type=float, default=3.15)
    p.add_argument("--peak-tflops", type=float, default=776.0)
    p.add_argument("--margin", type=float, default=1.03)
    p.add_argument("--routing", default="uniform", help="the table's rows of this routing")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    doc = json.loads(args.table.read_text())
    ceilings = DeviceCeilings(
        doc.get("device", "gpu"), args.read_tbps * 1e3, {"bf16": args.peak_tflops}
    )
    print(f"# {doc.get('device')}: floor at {args.read_tbps} TB/s read, {args.peak_tflops} "
          f"TFLOP/s bf16; bar = peer / {args.margin}")  # fmt: skip
    head = f"{'preset':14s} {'T':>6s} {'hit':>4s} {'peer us':>9s} {'ours us':>9s} {'ratio':>6s}"
    print(f"{head} {'floor us':>9s} {'bound':>5s} {'bar us':>9s} {'needs':>7s}")
    rows = []
    for r in (r for r in doc["rows"] if r.get("routing", "uniform") == args.routing):
        shape = get_preset(r["preset"])
        t = r["T"]
        cost = row_cost(shape, "bf16", t, r["hit"], t * shape.top_k, torch.bfloat16)
        t_mem, t_flop = (s * 1e6 for s in floor_parts(cost, ceilings, "bf16"))
        floor, bar = max(t_mem, t_flop), r["peer_us"] / args.margin
        row = dict(preset=r["preset"], T=t, hit=r["hit"], peer_us=r["peer_us"],
                   ours_us=r["ours_us"], ratio=r["ratio"], floor_us=floor,
                   bound="mem" if t_mem >= t_flop else "flop", bar_us=bar,
                   needs=floor / bar)  # fmt: skip
        rows.append(row)
        print(f"{r['preset']:14s} {t:6d} {r['hit']:4d} {r['peer_us']:9.1f} {r['ours_us']:9.1f} "
              f"{r['ratio']:6.3f} {floor:9.1f} {row['bound']:>5s} {bar:9.1f} "
              f"{100 * row['needs']:6.1f}%")  # fmt: skip
    over = [r for r in rows if r["needs"] > 1]
    near = [r for r in rows if 0.95 < r["needs"] <= 1]
    print(f"points past the floor (bar unreachable): {len(over)}; needing 95-100 %: {len(near)}")
    now = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
    ceiling = math.exp(sum(math.log(r["peer_us"] / r["floor_us"]) for r in rows) / len(rows))
    print(f"geomean peer/ours now {now:.3f}; with every point at its floor {ceiling:.3f}")
    if args.json:
        args.json.write_text(json.dumps(dict(source=args.table.name, read_tbps=args.read_tbps,
                                             peak_tflops=args.peak_tflops, margin=args.margin,
                                             rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
