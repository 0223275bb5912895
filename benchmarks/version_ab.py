# Before/after speed of the triton backend across two checkouts of moerunner, on one GPU.
#
#   python benchmarks/version_ab.py --base DIR [--rounds 2] [--json PATH]
#
# DIR is the root of another checkout (e.g. `git worktree add DIR <commit>`). Each round runs
# one worker process per checkout, in alternating order (A B, then B A, ...), on the same GPU;
# a worker imports moerunner from its checkout and times `moerunner.fused_moe(...,
# backend="triton")` on the model presets (shapes from this checkout's preset table, passed to
# the workers as numbers) for bf16, fp8_block and mxfp4 weights at T = 1, 16, 256, 4096:
# uniform random routing (seeded, the same in both), one call captured in a CUDA graph and
# replayed, CUDA events around the replays, median of 7 samples. The table gives each
# point's time under both checkouts and their ratio (base / this: > 1 means this checkout is
# faster), with the spread over rounds; --json writes every sample.

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b", "deepseek-v3")
SCHEMES = ("bf16", "fp8_block", "mxfp4")
TOKENS = (1, 16, 256, 4096)


def _worker(spec: dict) -> dict:
    """Runs in a fresh process with one checkout's moerunner importable."""
    import torch

    import moerunner
    from moerunner.quant import QuantizedWeight

    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = {}
    for shape in spec["shapes"]:
        e, h, i, k = shape["E"], shape["H"], shape["I"], shape["k"]
        rows = 2 * i if shape["gated"] else i
        for scheme in spec["schemes"]:
            w13 = _weight(e, rows, h, scheme, dev, QuantizedWeight, moerunner)
            w2 = _weight(e, h, i, scheme, dev, QuantizedWeight, moerunner)
            for t in spec["tokens"]:
                g = torch.Generator(device=dev).manual_seed(t)
                x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
                ids = torch.rand(t, e, device=dev, generator=g).argsort(dim=1)[:, :k].int()
                tw = torch.softmax(torch.randn(t, k, device=dev, generator=g), dim=1)

                def call(x=x, w13=w13, w2=w2, tw=tw, ids=ids, act=shape["activation"]):
                    return moerunner.fused_moe(
                        x, w13, w2, tw, ids, activation=act, backend="triton", check_ids=False
                    )

                key = f"{shape['name']}|{scheme}|{t}"
                results[key] = _time(call, torch, reps=20 if t <= 256 else 5)
            del w13, w2
            torch.cuda.empty_cache()
    return results


def _weight(e, n, kdim, scheme, dev, quantized_weight, moerunner):
    """Random weights of [E, n, kdim], quantized 16 experts at a time (bounded memory)."""
    import torch

    def chunk(count):
        return torch.randn(count, n, kdim, device=dev, dtype=torch.bfloat16) * kdim**-0.5

    if scheme == "bf16":
        return torch.cat([chunk(min(16, e - s)) for s in range(0, e, 16)])
    parts = [moerunner.quantize(chunk(min(16, e - s)), scheme) for s in range(0, e, 16)]
    fields = {}
    for name in ("data", "scale", "global_scale", "zero_point", "input_scale"):
        values = [getattr(p, name) for p in parts]
        fields[name] = None if values[0] is None else torch.cat(values)
    return quantized_weight(parts[0].scheme, (e, n, kdim), **fields)


def _time(call, torch, reps: int) -> list[float]:
    """Microseconds per call: CUDA-graph replays between events, 7 samples."""
    call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()  # warm on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return samples


def _shapes() -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from moerunner.bench.presets import get_preset

    shapes = []
    for name in PRESETS:
        p = get_preset(name)
        shapes.append(
            {
                "name": name,
                "E": p.num_experts,
                "H": p.hidden_size,
                "I": p.intermediate_size,
                "k": p.top_k,
                "gated": p.gated,
                "activation": p.activation,
            }
        )
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description="triton before/after across two checkouts")
    parser.add_argument("--base", type=Path, help="root of the other checkout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.base is None or not (args.base / "moerunner").is_dir():
        parser.error("--base must be the root of a moerunner checkout")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    spec = {
        "shapes": _shapes(),
        "schemes": args.schemes.split(","),
        "tokens": [int(t) for t in args.tokens.split(",")],
    }
    roots = {"this": ROOT, "base": args.base.resolve()}
    samples: dict[str, dict[str, list[float]]] = {"this": {}, "base": {}}
    for r in range(args.rounds):
        order = ("base", "this") if r % 2 == 0 else ("this", "base")
        for which in order:
            env = dict(os.environ, PYTHONPATH=str(roots[which]))
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                env=env,
                capture_output=True,
                text=True,
                cwd=roots[which],
            )
            if proc.returncode != 0:
                sys.exit(f"{which} worker failed:\n{proc.stderr[-4000:]}")
            for key, values in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                samples[which].setdefault(key, []).append(statistics.median(values))
            print(f"round {r + 1}: {which} done", flush=True)
    rows, ratios = [], []
    for key in samples["this"]:
        this, base = samples["this"][key], samples["base"][key]
        per_round = [b / t for b, t in zip(base, this, strict=True)]
        ratio = statistics.median(base) / statistics.median(this)
        ratios.append(ratio)
        rows.append((key, statistics.median(base), statistics.median(this), ratio, per_round))
    print(f"{'preset|scheme|T':40s} {'base us':>10s} {'this us':>10s} {'base/this':>9s}  rounds")
    for key, b, t, ratio, per_round in rows:
        spread = " ".join(f"{v:.3f}" for v in per_round)
        print(f"{key:40s} {b:10.1f} {t:10.1f} {ratio:9.3f}  {spread}")
    geo = statistics.geometric_mean(ratios)
    print(
        f"geomean base/this over {len(ratios)} points: {geo:.3f}; "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}"
    )
    if args.json:
        import torch

        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "spec": spec,
                    "samples_us": samples,
                    "geomean_base_over_this": geo,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
