"""CPU: the ``torch`` backend vs transformers' eager experts loop and its grouped_mm experts.

Qwen3-30B-A3B's MoE shape (E=128, k=8, H=2048, I=768) at T = 1, 32, 512 in fp32 and bf16.
The three implementations run on the same weights and inputs, in one process, with the same
thread count. Each output is first checked against the float64 reference; then the three
are timed together in interleaved rounds (``moerunner.bench.timing.time_interleaved_cpu``:
rotating order, fresh routing per call, every implementation warmed up, medians), and that
is repeated ``--repeats`` times: a ratio is reported as its median over the repeats, with
its range. The CPU's ceilings are measured in the same process, before and after the rows,
by ``moerunner.bench.roofline.measure_ceilings`` (the project's one roofline: matmul peak per
dtype from square GEMMs, copy bandwidth). Each row is placed against its compute floor
(flops / peak) and memory floor (bytes of the experts hit, activations and routing /
bandwidth), both from ``roofline.row_cost`` and ``roofline.floor_parts``. The CPU time other
processes used during each repeat is measured (from the kernel's counters where readable); a
repeat during which they used more than ``--max-other-cpus`` CPUs is discarded (all
implementations alike) and done again after a pause, and the discarded ones are recorded.

    python benchmarks/cpu_torch_vs_transformers.py [--out benchmarks/results] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.bench import roofline
from moerunner.bench.baselines import build_baseline
from moerunner.bench.presets import get_preset
from moerunner.bench.roofline import DeviceCeilings, row_cost
from moerunner.bench.sweep import check_against_reference, draw_routing, make_weights
from moerunner.bench.timing import time_interleaved_cpu
from moerunner.cli import _common
from moerunner.dispatch.formats import STANDARD, StandardDispatchOutput
from moerunner.testing import DTYPE_BOUND
from moerunner.weights import ExpertWeights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPE = get_preset("qwen3-30b-a3b")
IMPLS = ("torch", "eager", "grouped_mm")
BASELINES = IMPLS[1:]


def measure_ceilings(args) -> dict:
    """``roofline.measure_ceilings`` on a quiet CPU (measured again while other processes are
    busy)."""
    for _ in range(args.max_discarded):
        with OtherLoad() as load:
            ceilings = roofline.measure_ceilings(torch.device("cpu"))
        if load.cpus is None or load.cpus <= args.max_other_cpus:
            return dataclasses.asdict(ceilings) | {"other_cpus": load.cpus}
        time.sleep(args.busy_wait)
    raise SystemExit("the CPU stayed busy while measuring its ceilings; try again later")


class OtherLoad:
    """CPUs' worth of time other processes used while the block ran (None if unreadable)."""

    def __enter__(self):
        self.start = (self._busy(), sum(os.times()[:2]), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy, own, wall = self._busy(), sum(os.times()[:2]), time.perf_counter()
        if busy is None or self.start[0] is None:
            self.cpus = None
        else:
            other = (busy - self.start[0]) - (own - self.start[1])
            self.cpus = max(0.0, other / (wall - self.start[2]))

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def run_dtype(name: str, tokens: list[int], args, gen: torch.Generator) -> list[dict]:
    dtype, shape = DTYPES[name], SHAPE
    w = make_weights(shape, dtype, torch.device("cpu"), args.seed)
    weights = ExpertWeights(w["w13"], w["w2"])
    spec = weights.spec(moerunner.Activation(shape.activation))
    runner = moerunner.MoeRunner("torch")
    probe = torch.zeros(1, shape.hidden_size, dtype=dtype)
    prepared = runner.prepare(weights, MoeProblem.of(probe, weights, spec, STANDARD), spec)
    baselines = {b: build_baseline(shape, b, w["w13"], w["w2"])[0] for b in BASELINES}

    def call(impl: str, case: dict) -> torch.Tensor:
        if impl == "torch":
            return runner.run(StandardDispatchOutput(case["x"], case["topk"]), prepared)
        return baselines[impl](case["x"], case["topk"].ids.long(), case["topk"].weights.to(dtype))

    rows = []
    for t in tokens:
        cases = []
        for _ in range(args.rotations):
            topk = draw_routing(t, shape, "uniform", gen, 1.2)
            cases.append(
                {"x": torch.randn(t, shape.hidden_size, generator=gen).to(dtype), "topk": topk}
            )
        row = {"dtype": name, "tokens": t, "impls": {}}
        with torch.inference_mode():
            for impl in IMPLS:
                out = call(impl, cases[0])
                err = check_against_reference(
                    out, cases[0]["x"], cases[0]["topk"], weights, shape, 2 << 30
                )
                row["impls"][impl] = {"max_rel_err": err[0], "rms_rel_err": err[1], "seconds": []}
            row["other_cpus"], row["discarded_other_cpus"] = [], []
            runs = {i: (lambda c, i=i, cases=cases: call(i, cases[c])) for i in IMPLS}
            while len(row["other_cpus"]) < args.repeats:
                with OtherLoad() as load:
                    timings = time_interleaved_cpu(runs, len(cases), min_time_s=args.min_time)
                if load.cpus is not None and load.cpus > args.max_other_cpus:
                    row["discarded_other_cpus"].append(load.cpus)  # measured on a busy CPU
                    if len(row["discarded_other_cpus"]) > args.max_discarded:
                        raise SystemExit(f"{name} T={t}: the CPU stayed busy; try again later")
                    time.sleep(args.busy_wait)
                    continue
                for impl in IMPLS:
                    row["impls"][impl]["seconds"].append(timings[impl].seconds)
                row["other_cpus"].append(load.cpus)
                row["samples"] = timings["torch"].samples
        costs = [
            row_cost(
                shape,
                name,
                t,
                len(torch.unique(c["topk"].ids[c["topk"].ids >= 0])),
                int((c["topk"].ids >= 0).sum()),
                dtype,
            )
            for c in cases
        ]
        row["experts_hit"] = statistics.mean(k.experts_hit for k in costs)
        row["bytes"] = statistics.mean(k.bytes for k in costs)
        row["flops"] = statistics.mean(k.flops for k in costs)
        torch_s = row["impls"]["torch"]["seconds"]
        row["ratios"] = {
            b: [base / own for base, own in zip(row["impls"][b]["seconds"], torch_s, strict=True)]
            for b in BASELINES
        }
        rows.append(row)
        ratios = ", ".join(f"vs {b} {_ratio(v)}" for b, v in row["ratios"].items())
        print(f"{name} T={t}: torch {ratios}", file=sys.stderr, flush=True)
    return rows


def place(rows: list[dict], ceilings: DeviceCeilings) -> None:
    """Each implementation's median time against the compute and memory floors."""
    for row in rows:
        cost = roofline.RowCost(row["bytes"], row["flops"], row["experts_hit"])
        memory_floor, compute_floor = roofline.floor_parts(
            cost, ceilings, roofline.compute_format(row["dtype"])
        )
        row["compute_floor_s"], row["memory_floor_s"] = compute_floor, memory_floor
        for r in row["impls"].values():
            s = statistics.median(r["seconds"])
            r["median_s"] = s
            r["pct_compute_peak"] = 100 * compute_floor / s
            r["pct_bandwidth"] = 100 * memory_floor / s
            r["pct_floor"] = 100 * max(compute_floor, memory_floor) / s


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


HEADER = (
    "| dtype | T | hit | torch ms | eager ms | grouped_mm ms | torch vs eager | "
    "torch vs grouped_mm | torch % compute peak | torch % bandwidth | other CPUs | max err |"
)


def _line(row: dict) -> str:
    ms = {i: statistics.median(r["seconds"]) * 1e3 for i, r in row["impls"].items()}
    torch_row = row["impls"]["torch"]
    other = [c for c in row["other_cpus"] if c is not None]
    cells = [
        row["dtype"],
        str(row["tokens"]),
        f"{row['experts_hit']:.0f}",
        f"{ms['torch']:.2f}",
        f"{ms['eager']:.2f}",
        f"{ms['grouped_mm']:.2f}",
        _ratio(row["ratios"]["eager"]),
        _ratio(row["ratios"]["grouped_mm"]),
        f"{torch_row['pct_compute_peak']:.1f}",
        f"{torch_row['pct_bandwidth']:.1f}",
        f"{max(other):.2f}" if other else "n/a",
        f"{torch_row['max_rel_err']:.1e}",
    ]
    return "| " + " | ".join(cells) + " |"


def environment() -> dict:
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = None
    return {
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": hf,
        "moerunner": getattr(moerunner, "__version__", None),
        "date": time.strftime("%Y-%m-%d"),
    }


def markdown(result: dict) -> str:
    env, used = result["environment"], result["ceilings"]["used"]
    lines = [
        f"# CPU: torch backend vs transformers experts ({env['date']})",
        "",
        f"- {env['machine']} ({env['cpu_capability']}), {env['threads']} threads, "
        f"torch {env['torch']}, transformers {env['transformers']}",
        f"- shape: {SHAPE.name} experts (E={SHAPE.num_experts}, k={SHAPE.top_k}, "
        f"H={SHAPE.hidden_size}, I={SHAPE.intermediate_size}), uniform routing, "
        f"{result['config']['rotations']} routings per row taken in turn, "
        f"{result['config']['repeats']} repeats of the interleaved timing",
        f"- ceilings (best of before / after): matmul peak fp32 "
        f"{used['peak_tflops']['fp32']:.3f} TFLOP/s, bf16 {used['peak_tflops']['bf16']:.3f} "
        f"TFLOP/s; copy bandwidth {used['copy_gbps']:.1f} GB/s ({used['method']})",
        "- ratio = baseline time / torch time: median over repeats [range]; "
        "% compute peak = flops / peak / time; % bandwidth = bytes / copy bandwidth / time "
        "(moerunner.bench.roofline); "
        "other CPUs = the most CPU time other processes used during a kept repeat, in CPUs "
        f"(repeats above {result['config']['max_other_cpus']} were done again: "
        f"{sum(len(r['discarded_other_cpus']) for r in result['rows'])} in this run)",
        f"- command: `{' '.join(result['argv'])}`",
        "",
        HEADER,
        "|" + " --- |" * (HEADER.count("|") - 1),
    ]
    lines += [_line(row) for row in result["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--tokens", type=_common.int_list(1), default=(1, 32, 512))
    parser.add_argument(
        "--dtypes", type=_common.name_list(list(DTYPES), "dtype"), default=list(DTYPES)
    )
    parser.add_argument("--repeats", type=_common.int_type(1), default=3)
    parser.add_argument("--rotations", type=_common.int_type(1), default=4)
    parser.add_argument(
        "--min-time",
        type=_common.float_type(0.0, strict=True),
        default=1.0,
        help="seconds per impl per repeat",
    )
    parser.add_argument("--threads", type=_common.int_type(1), default=None)
    parser.add_argument(
        "--max-other-cpus",
        type=_common.float_type(0.0),
        default=0.2,
        help="a repeat during which other processes used more CPUs than this is done again",
    )
    parser.add_argument("--max-discarded", type=_common.int_type(0), default=20)
    parser.add_argument(
        "--busy-wait", type=_common.float_type(0.0), default=30.0, help="seconds before retrying"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _common.check_writable_dir(parser, "--out", args.out)  # before any measurement
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = list(args.tokens)
    before = measure_ceilings(args)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for name in args.dtypes:
        rows += run_dtype(name, tokens, args, gen)
        gc.collect()  # the dtype's weights and baselines go before the next ones are made
    after = measure_ceilings(args)
    used = {
        "device": after["device"],
        "peak_tflops": {k: max(before["peak_tflops"][k], after["peak_tflops"][k]) for k in DTYPES},
        "copy_gbps": max(before["copy_gbps"], after["copy_gbps"]),
        "method": after["method"] + "; best of before / after the rows",
    }
    place(rows, DeviceCeilings(**used))
    result = {
        "argv": ["python", "benchmarks/cpu_torch_vs_transformers.py", *sys.argv[1:]],
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": environment(),
        "ceilings": {"before": before, "after": after, "used": used},
        "rows": rows,
    }
    text = markdown(result)
    print(text)
    stem = args.out / f"cpu-torch-vs-transformers-{result['environment']['date']}"
    args.out.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{stem}.md").write_text(text)
    print(f"wrote {stem}.json and {stem}.md")
    wrong = [
        (r["dtype"], r["tokens"], impl)
        for r in rows
        for impl, i in r["impls"].items()
        if not i["max_rel_err"] <= DTYPE_BOUND[DTYPES[r["dtype"]]]
    ]
    if wrong:
        print(f"outside the reference bound: {wrong}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
