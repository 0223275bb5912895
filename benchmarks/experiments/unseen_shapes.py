# Default tiles on model shapes with no tuned file shipped: are they within 10 % of the best
# tiles the tuner finds, at every token count?
#
#   python benchmarks/experiments/unseen_shapes.py --out DIR [--schemes bf16] [--tokens ...]
#
# For each preset of moerunner.bench.presets.UNSEEN_TILE_PRESETS (no file in the triton
# backend's configs/) and each T, it times the fused op (``experts.fused_standard``: the
# alignment, both GEMMs, the weighted sum; routing ids given) with three tile choices: the
# rule shipped before the row-band defaults ("old", kept below to measure against), the
# current default (``tile_config.heuristic_tiles``) and the best pair of ``tune.tune_tokens``
# over the tuner's candidates for that T, limited to --max-candidates spread over every
# BLOCK_M (both defaults are always among them). Decode sizes are CUDA-graph replays over 8
# routings, larger T do_bench (``gpu_triton.time_fused``), each choice with its tiles passed
# in, so all three take the same launch path. No (preset, T) starts after --budget-s seconds,
# so a run ends about one row after it. Writes DIR/unseen_shapes.json (every row, rewritten
# after each one, so a cut-off run keeps what it measured) and DIR/unseen_shapes.md (the
# table); ratios are best time / choice time (1.0 = as fast as the best; the bar is >= 0.909,
# within 10 %).

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_triton

import torch  # noqa: E402

from moerunner import Activation  # noqa: E402
from moerunner.backends.triton import TritonBackend, TritonOptions, tile_config, tune  # noqa: E402
from moerunner.backends.triton._prepare import weight_layout  # noqa: E402
from moerunner.backends.triton.tile_config import MoeTiles, TileConfig  # noqa: E402
from moerunner.bench.presets import PRESETS, UNSEEN_TILE_PRESETS  # noqa: E402
from moerunner.quant import get_scheme  # noqa: E402

TOKENS = (1, 16, 64, 256, 1024, 4096)


def old_default_tiles(num_tokens, top_k, num_experts, n, k, scheme, dtype_bytes=2) -> MoeTiles:
    """The default tiles before the row-band table (four fixed bands of rows per expert at
    16 / 64 / 256, BLOCK_K 128 or 64): the baseline this experiment measures against."""
    rpe = tile_config.rows_per_expert(num_tokens, top_k, num_experts)
    scheme = get_scheme(scheme)
    bk = 128 if tile_config.k_blocked(scheme) or k >= 128 else 64
    quant8 = tile_config.mma_8bit(scheme) and dtype_bytes == 1
    if rpe <= 16:
        return MoeTiles(TileConfig(16, 64, bk, 1, 4, 4), TileConfig(16, 64, bk, 1, 4, 4))
    if rpe <= 64:
        return MoeTiles(TileConfig(32, 64, bk, 8, 4, 4), TileConfig(32, 128, bk, 8, 4, 4))
    if rpe <= 256:
        mid = bk if quant8 else min(bk, 64)
        return MoeTiles(TileConfig(64, 64, mid, 8, 4, 4), TileConfig(64, 128, mid, 8, 4, 4))
    large = bk if quant8 or tile_config.k_blocked(scheme) else 64
    return MoeTiles(
        TileConfig(128, 64 if quant8 else 128, large, 8, 8, 3),
        TileConfig(128, 128, large, 8, 8, 3),
    )


def fmt(t: TileConfig) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}"


def write(out: Path, doc: dict) -> None:
    (out / "unseen_shapes.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# Default tiles on unseen shapes, {doc['device']}, {doc['date']}",
        "",
        "best/old and best/new: the best tuned pair's time over the choice's (1.0 = as fast).",
        "",
        "| preset | scheme | T | rows/expert | old | new | best | best us | best/old | best/new |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['preset']} | {r['scheme']} | {r['T']} | {r['rows_per_expert']:.1f} | "
            f"{r['old']['tiles']} | {r['new']['tiles']} | {r['best']['tiles']} | "
            f"{r['best']['us']:.1f} | {r['best_over_old']:.3f} | {r['best_over_new']:.3f} |"
        )
    rows = doc["rows"]
    if doc.get("not_run"):
        lines.append(f"\nnot run (time budget): {', '.join(doc['not_run'])}")
    if rows:
        for which in ("old", "new"):
            ratios = [r[f"best_over_{which}"] for r in rows]
            lines.append(
                f"\n{which}: geomean {statistics.geometric_mean(ratios):.3f}, min "
                f"{min(ratios):.3f}, within 10 % at {sum(x >= 1 / 1.1 for x in ratios)} of "
                f"{len(ratios)}"
            )
    (out / "unseen_shapes.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Default tiles against the best tuned ones on presets with no tuned file."
    )
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and table")
    ap.add_argument("--presets", nargs="+", default=list(UNSEEN_TILE_PRESETS))
    ap.add_argument("--schemes", nargs="+", default=["bf16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--max-candidates", type=int, default=8, help="per T, besides defaults")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no new (preset, T) after this many seconds (rows so far are written)",
    )
    args = ap.parse_args()
    from gpu_triton import time_fused  # needs CUDA at import

    dev = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "device": torch.cuda.get_device_name(dev),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "max_candidates": args.max_candidates,
        "rows": [],
    }
    start = time.time()
    quiet = lambda msg: None  # noqa: E731  (the tuner's per-candidate lines)
    for name in args.presets:
        s = PRESETS[name]
        for scheme in args.schemes:
            weights = tune.random_weights(
                s.hidden_size, s.intermediate_size, s.num_experts, s.activation, scheme, dev
            )
            # tile_dirs=(): the shipped files only, so no file in a user folder answers.
            prepared = TritonBackend(TritonOptions(tile_dirs=())).prepare_weights(
                weights, weights.spec(Activation(s.activation))
            )
            del weights
            source = prepared.tensors["tiles"]
            if source.path is not None:
                raise SystemExit(f"{name} {scheme}: a tuned file exists ({source.path})")
            w13 = prepared.tensors["w13"]
            dtype_bytes = w13.data.element_size()
            shape = (s.num_experts, s.intermediate_size, s.hidden_size, scheme, dtype_bytes)
            for t in args.tokens:
                if time.time() - start > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent: {name} T={t} not run")
                    doc.setdefault("not_run", []).append(f"{name} {scheme} T={t}")
                    continue
                old = old_default_tiles(t, s.top_k, *shape)
                new = tile_config.heuristic_tiles(t, s.top_k, *shape)
                cands = tune.candidate_tiles(t, s.top_k, s.num_experts, scheme, weight_layout(w13))
                cands = tune.limited_candidates(
                    cands, args.max_candidates, [old.gemm1, old.gemm2, new.gemm1, new.gemm2]
                )
                print(
                    f"[{time.time() - start:5.0f} s] {name} {scheme} T={t}: searching "
                    f"{len(cands)} candidates",
                    flush=True,
                )
                searched = time.time()
                best, gemm_ms = tune.tune_tokens(prepared, t, s.top_k, cands, progress=quiet)
                searched = time.time() - searched
                row = {
                    "preset": name,
                    "scheme": scheme,
                    "T": t,
                    "rows_per_expert": tile_config.rows_per_expert(t, s.top_k, s.num_experts),
                    "candidates": len(cands),
                    "best_gemm_us": gemm_ms * 1e3,
                    # Wall time of the search, compilation included: what a first call with
                    # TritonOptions(autotune="first_call") would spend on this bucket.
                    "search_s": searched,
                }
                for which, tiles in (("old", old), ("new", new), ("best", best)):
                    ms, _ = time_fused(prepared, t, s.top_k, tiles=tiles)
                    row[which] = {
                        "tiles": f"{fmt(tiles.gemm1)} / {fmt(tiles.gemm2)}",
                        "us": ms * 1e3,
                    }
                    row[which]["tile_dicts"] = tiles.to_dict()
                row["best_over_old"] = row["best"]["us"] / row["old"]["us"]
                row["best_over_new"] = row["best"]["us"] / row["new"]["us"]
                doc["rows"].append(row)
                write(args.out, doc)
                print(
                    f"[{time.time() - start:5.0f} s] {name} {scheme} T={t}: old "
                    f"{row['old']['us']:.1f} us, new {row['new']['us']:.1f} us, best "
                    f"{row['best']['us']:.1f} us ({row['best']['tiles']}); best/new "
                    f"{row['best_over_new']:.3f}, best/old {row['best_over_old']:.3f}; "
                    f"search {searched:.1f} s",
                    flush=True,
                )
            del prepared
            torch.cuda.empty_cache()
    write(args.out, doc)  # with what the budget left out
    print((args.out / "unseen_shapes.md").read_text())


if __name__ == "__main__":
    main()
