# Kernel-level timings and A/B experiments for the triton backend on one GPU.
#
#   python benchmarks/experiments/gpu_triton.py [--parts perf rowblocks ...] [--out DIR]
#
# Its former "check" part (every scheme x activation and the edge cases against the torch
# backend and the float64 reference) is now the GPU tests: pytest -m gpu tests/backends
# (test_triton_gpu.py, test_triton_gpu_edges.py). Its former "tune" and "precompile" parts are
# moerunner tune --preset P --scheme S --jobs N [--compile-only].
#
# perf:  measures the device's ceilings with moerunner.bench.roofline (copy bandwidth, bf16/fp8
#        matmul peaks), then times the fused op on the model presets (decode through CUDA-graph
#        replay over 8 rotated routings, prefill with triton.testing.do_bench) and reports the
#        roofline's memory floor (%R) and compute floor (%P) over the time. Records before
#        2026-11-25 used this script's own read bandwidth (torch.sum) and byte count instead.
# warm:  compiles the kernels perf will launch, one process per preset (--jobs > 1).
# rowblocks, pdl: times with one switch off and on, alternately (``_toggles``): row blocks
#        instead of the alignment at T = 1..8, programmatic dependent launch.
# host:  CPU cost of the eager launch path per call (back to back, from idle, profiled).
# --off NAME runs every part with that switch off (e.g. to warm the kernels an A/B needs).
# A compact table is printed last; full results go to DIR/results.json.

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moerunner.backends.base import MoeProblem  # noqa: E402
from moerunner.backends.triton import (  # noqa: E402
    TritonBackend,  # noqa: E402
    TritonOptions,
    register,
    tune,
    with_options,
)
from moerunner.backends.triton import experts as X  # noqa: E402
from moerunner.backends.triton.options import PREPARE_TIME_FIELDS  # noqa: E402
from moerunner.bench import roofline  # noqa: E402
from moerunner.bench.presets import BenchShape  # noqa: E402
from moerunner.config import Activation  # noqa: E402
from moerunner.dispatch.formats import StandardDispatchOutput  # noqa: E402
from moerunner.routing import TopK  # noqa: E402
from moerunner.runner import MoeRunner  # noqa: E402

DEV = torch.device("cuda")
PERF_PLAN = [  # (preset, scheme, token counts)
    ("qwen3-30b-a3b", "bf16", tune.DEFAULT_TOKENS),
    ("mixtral-8x7b", "bf16", tune.DEFAULT_TOKENS),
    ("gpt-oss-120b", "bf16", tune.DEFAULT_TOKENS),
    ("deepseek-v3", "bf16", tune.DEFAULT_TOKENS),
    ("deepseek-v3", "fp8_block", tune.DEFAULT_TOKENS),
    ("gpt-oss-120b", "mxfp4", tune.DEFAULT_TOKENS),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf on NaN)."""
    a, b = a.double().cpu(), b.double().cpu()
    if torch.isnan(a).any():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def routing(num_tokens: int, num_experts: int, top_k: int, device=None):
    device = DEV if device is None else device
    ids = torch.rand(num_tokens, num_experts, device=device).topk(top_k, dim=1).indices
    wts = torch.softmax(torch.randn(num_tokens, top_k, device=device), dim=1)
    return wts.float(), ids.to(torch.int32)


# ------------------------------------------------------------------------------- perf
@triton.jit
def _reread_kernel(x_ptr, out_ptr, n, passes, BLOCK: tl.constexpr):
    """Sum ``passes`` sweeps over ``x`` (grid-strided): a buffer that fits in L2 measures L2."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    step = tl.num_programs(0) * BLOCK
    for _ in range(passes):
        for start in range(tl.program_id(0) * BLOCK, n, step):
            acc += tl.load(x_ptr + start + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def l2_read_bandwidth(mib: int = 16, passes: int = 32) -> float:
    """Bytes per second of reads served by L2: 4 programs per SM sweep a ``mib`` MiB buffer
    ``passes`` times (the buffer stays L2-resident; bytes counted are every sweep's)."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    block = 2048
    grid = 4 * sms
    n = (mib << 20) // 4 // (grid * block) * (grid * block)
    x = torch.randn(n, device=DEV)
    out = torch.empty(grid, device=DEV)
    ms = tt.do_bench(
        lambda: _reread_kernel[(grid,)](x, out, n, passes, BLOCK=block, num_warps=8),
        warmup=25,
        rep=200,
        return_mode="median",
    )
    return passes * n * 4 / (ms * 1e-3)


def measure_peaks():
    """The ceilings of the project's one roofline (``moerunner.bench.roofline``: copy bandwidth,
    bf16/fp8 matmul peaks) in this script's units, and the L2 read rate (a diagnostic the
    roofline does not use)."""
    c = roofline.measure_ceilings(DEV)
    return dict(
        copy_bytes_per_s=c.copy_gbps * 1e9,
        bf16_flops=c.peak_for("bf16") * 1e12,
        fp8_flops=c.peak_for("fp8") * 1e12,
        method=c.method,
        l2_read_bytes_per_s=l2_read_bandwidth(),
    )


def _ceilings(peaks) -> roofline.DeviceCeilings:
    return roofline.DeviceCeilings(
        DEV.type,
        peaks["copy_bytes_per_s"] / 1e9,
        {"bf16": peaks["bf16_flops"] / 1e12, "fp8": peaks["fp8_flops"] / 1e12},
    )


def fused_cost(prepared, experts_hit: float, T: int, k: int) -> roofline.RowCost:
    """Bytes and flops of one fused call by ``roofline.row_cost`` (weights of the experts hit
    at their stored scheme, hidden in and out, routing; no -1 ids)."""
    spec, w13 = prepared.spec, prepared.tensors["w13"]  # triton's KernelWeight
    scheme = w13.scheme.name if w13.scheme is not None else "bf16"
    shape = BenchShape(
        "fused",
        spec.num_experts,
        spec.hidden_size,
        spec.intermediate_size,
        k,
        spec.activation.name,
        bias=prepared.tensors["w13_bias"] is not None,
        gate_up_interleaved=spec.gate_up_interleaved,
    )
    return roofline.row_cost(shape, scheme, T, experts_hit, T * k, torch.bfloat16)


def floor_pcts(cost: roofline.RowCost, peaks, scheme: str, ms: float) -> tuple[float, float]:
    """(% memory floor, % compute floor) of a call of ``ms`` milliseconds."""
    t_mem, t_flop = roofline.floor_parts(cost, _ceilings(peaks), roofline.compute_format(scheme))
    return 100 * t_mem / (ms * 1e-3), 100 * t_flop / (ms * 1e-3)


def rotated_inputs(prepared, T, k, rotations):
    """``rotations`` (hidden states, (routing weights, ids)) pairs and the experts hit per
    call."""
    H = prepared.spec.hidden_size
    E = prepared.spec.num_experts
    xs = [torch.randn(T, H, device=DEV, dtype=torch.bfloat16) for _ in range(rotations)]
    rs = [routing(T, E, k) for _ in range(rotations)]
    uniq = sum(torch.unique(r[1][r[1] >= 0]).numel() for r in rs) / rotations
    return xs, rs, uniq


def fused_graph(prepared, xs, rs, tiles=None):
    """A CUDA graph of one fused call per (hidden states, routing) pair, in turn."""
    for x, (w, i) in zip(xs, rs, strict=True):
        X.fused_standard(x, w, i, prepared, tiles)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x, (w, i) in zip(xs, rs, strict=True):
            X.fused_standard(x, w, i, prepared, tiles)
    return g


def alternate(graphs: dict, rounds: int, calls_per_replay: int) -> dict[str, list[float]]:
    """us per call of each named CUDA graph (``calls_per_replay`` calls per replay, median of
    ``triton.testing.do_bench``), the graphs timed in rotated order for ``rounds`` rounds, so
    each is judged against the same drift."""
    names = list(graphs)
    us = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ms = tt.do_bench(graphs[name].replay, warmup=10, rep=100, return_mode="median")
            us[name].append(ms * 1e3 / calls_per_replay)
    return us


def ratio_summary(base: list[float], us: list[float], floor_us: float) -> str:
    """ "median us, % of a floor, x base/this median [min-max]" of paired samples."""
    ratios = [a / b for a, b in zip(base, us, strict=True)]
    med = statistics.median(us)
    return (
        f"{med:8.1f} us  weights%copy {100 * floor_us / med:5.1f}  "
        f"x{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
    )


def time_fused(prepared, T, k, rotations=None, tiles=None):
    """(ms per call, experts hit per call) over ``rotations`` routings (default 8 at decode
    sizes, else 2), graph-replayed up to T = 256; ``tiles``: these instead of the lookup."""
    rotations = rotations or (8 if T <= 64 else 2)
    xs, rs, uniq = rotated_inputs(prepared, T, k, rotations)
    if T <= 256:
        g = fused_graph(prepared, xs, rs, tiles)
        ms = tt.do_bench(g.replay, warmup=10, rep=100, return_mode="median") / rotations
    else:
        state = {"n": 0}

        def step():
            j = state["n"] % rotations
            state["n"] += 1
            X.fused_standard(xs[j], rs[j][0], rs[j][1], prepared, tiles)

        ms = tt.do_bench(step, warmup=10, rep=200, return_mode="median")
    return ms, uniq


def stage_breakdown(prepared, T, k, calls=3, tiles=None):
    """Device microseconds per call by kernel name, from the profiler over ``calls`` calls
    (both GEMMs share the kernel name and are told apart by their launch order)."""
    H, E = prepared.spec.hidden_size, prepared.spec.num_experts
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    w, i = routing(T, E, k)
    X.fused_standard(x, w, i, prepared, tiles)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            X.fused_standard(x, w, i, prepared, tiles)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    out: dict[str, float] = {}
    seen = 0
    for e in kernels:
        name = e.name
        if name.startswith("moe_gemm_kernel"):
            name = f"gemm{1 + seen % 2}"
            seen += 1
        out[name[:40]] = out.get(name[:40], 0.0) + e.time_range.elapsed_us() / calls
    return out


def time_torch(weights, act, T, k):
    E = weights.num_experts
    x = torch.randn(T, weights.hidden_size, device=DEV, dtype=torch.bfloat16)
    wts, ids = routing(T, E, k)
    runner = MoeRunner("torch")
    spec = weights.spec(act)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    d = StandardDispatchOutput(x, TopK(wts, ids))
    return tt.do_bench(lambda: runner.run(d, prepared), warmup=5, rep=100, return_mode="median")


def part_perf(peaks, plan, rows, checkpoint, options: TritonOptions, with_torch=True):
    """Append a row per (preset, scheme, T) to ``rows`` as it is measured, then ``checkpoint()``
    (so a run cut off by its time limit keeps what it measured)."""
    for preset, scheme, tokens in plan:
        H, I, E, k, act_name = tune.PRESETS[preset]
        act = Activation(act_name)
        weights = tune.random_weights(H, I, E, act_name, scheme, DEV)
        prepared = TritonBackend(options).prepare_weights(weights, weights.spec(act))
        for T in tokens:
            try:
                ms, uniq = time_fused(prepared, T, k)
            except Exception as exc:
                traceback.print_exc()
                rows.append(dict(preset=preset, scheme=scheme, T=T, error=repr(exc)))
                continue
            cost = fused_cost(prepared, uniq, T, k)
            pct_mem, pct_flop = floor_pcts(cost, peaks, scheme, ms)
            row = dict(
                preset=preset,
                scheme=scheme,
                T=T,
                us=ms * 1e3,
                experts_hit=uniq,
                bytes=cost.bytes,
                pct_roofline=pct_mem,
                tflops=cost.flops / (ms * 1e-3) / 1e12,
                pct_peak=pct_flop,
                tiles=str(prepared.tensors["tiles"].lookup(T, k)),
                tile_file=prepared.tensors["tiles"].describe(),
            )
            if T >= 1024:
                try:
                    row["stages_us"] = stage_breakdown(prepared, T, k)
                except Exception as exc:
                    row["stages_error"] = repr(exc)
            if with_torch and scheme == "bf16" and T in (64, 4096):
                try:
                    row["torch_us"] = time_torch(weights, act, T, k) * 1e3
                except Exception as exc:
                    row["torch_error"] = repr(exc)
            rows.append(row)
            stages = " ".join(f"{n} {v:.0f}" for n, v in row.get("stages_us", {}).items())
            print(
                f"perf {preset:14s} {scheme:9s} T={T:6d} {row['us']:9.1f} us "
                f"roof {row['pct_roofline']:5.1f}% peak {row['pct_peak']:5.1f}% "
                f"torch {row.get('torch_us', float('nan')):9.1f} us {stages}",
                flush=True,
            )
            checkpoint()
        del weights, prepared
        torch.cuda.empty_cache()


def _toggles():
    """A/B parts: part -> (``TritonOptions`` field, (off value, on value), token counts)."""
    return {
        # decode with the alignment step (0) or row blocks for up to 8 tokens
        "rowblocks": ("row_blocks_max_tokens", (0, 8), (1, 2, 4, 8)),
        # programmatic dependent launch off / on
        "pdl": ("pdl", (False, True), (1, 16, 64, 1024)),
        # kernels launched through Triton's JIT launch (off) or the compiled-kernel cache
        "launchcache": ("launch_cache", (False, True), (1, 1024)),
        # packed 4-bit scale codes loaded in the K step that uses them (off) or one ahead
        "sprefetch": ("scale_prefetch", (False, True), (1, 16, 64, 256)),
        # packed 4-bit scale codes of a K step of several chunks loaded per chunk (off) or as
        # one pipelined tile
        "stiles": ("scale_tiles", (False, True), (1, 1024, 4096, 16384)),
        # 128-row blocks whose second half is padding run a 64-row tile (off: never)
        "split": ("split_min_block_m", (None, 128), (4096, 16384)),
        # e2m1 weights in the split layout (off) or the fragment layout (on); prepare-time
        "fragment": ("e2m1_layout", ("split", "fragment"), (1, 16, 64, 256, 1024, 4096, 16384)),
        # the fragment layout's register-operand wgmmas serialized by ptxas (off) or kept in
        # flight (on; K_NONEMPTY); meaningful with --on fragment
        "fragasync": ("fragment_async_mma", (False, True), (1, 16, 64, 256, 1024, 4096)),
    }


def switched(options: TritonOptions, part: str, on: bool) -> TritonOptions:
    """``options`` with the switch of A/B part ``part`` off or on."""
    field, values, _ = _toggles()[part]
    return dataclasses.replace(options, **{field: values[on]})


def part_toggle(plan, rows, part, options: TritonOptions, rounds: int = 1):
    """Time the fused op with one switch of the backend off and on, alternately in one
    process (decode sizes graph-replayed), per preset and token count; with several rounds
    (the order alternating, so that neither side always runs first) the row holds the median
    of each and of the per-round ratios. Switches read when weights are prepared
    (``PREPARE_TIME_FIELDS``) prepare the weights once per value; the others share them."""
    field, _, tokens = _toggles()[part]
    variants = {"off_us": switched(options, part, False), "on_us": switched(options, part, True)}
    for preset, scheme, _ in plan:
        H, I, E, k, act_name = tune.PRESETS[preset]
        weights = tune.random_weights(H, I, E, act_name, scheme, DEV)
        spec = weights.spec(Activation(act_name))
        if field in PREPARE_TIME_FIELDS:
            prepared = {
                name: TritonBackend(o).prepare_weights(weights, spec)
                for name, o in variants.items()
            }
        else:
            one = TritonBackend(options).prepare_weights(weights, spec)
            prepared = {name: with_options(one, o) for name, o in variants.items()}
        for T in tokens:
            times = {"off_us": [], "on_us": []}
            for r in range(rounds):  # off first in even rounds, on first in odd ones
                for name in ("off_us", "on_us")[:: 1 - 2 * (r % 2)]:
                    ms = time_fused(prepared[name], T, k)[0]
                    times[name].append(ms * 1e3)
            ratios = [a / b for a, b in zip(times["off_us"], times["on_us"], strict=True)]
            row = dict(
                part=part,
                preset=preset,
                scheme=scheme,
                T=T,
                rounds=rounds,
                off_us=statistics.median(times["off_us"]),
                on_us=statistics.median(times["on_us"]),
                ratio=statistics.median(ratios),
                ratios=ratios,
            )
            rows.append(row)
            print(
                f"{part} {preset:14s} {scheme:9s} T={T:5d} off {row['off_us']:8.1f} us  on "
                f"{row['on_us']:8.1f} us  ({row['ratio']:.3f}x, rounds "
                f"{min(ratios):.3f}-{max(ratios):.3f})",
                flush=True,
            )
        del weights, prepared
        torch.cuda.empty_cache()


def part_host(plan, rows, options: TritonOptions, calls: int = 50):
    """Host cost of the eager launch path: CPU seconds per call issued back to back (no
    sync), wall time per call, the span of one call started from an idle GPU (as moerunner
    bench's eager timing sees it), each with kernels launched through Triton's JIT launch
    and through the compiled-kernel cache (``_launch``) in turn (best of 5 alternations:
    the host's other work only adds time), and a profile of where the CPU time goes with
    the cache. At large T the GPU falls behind and back-pressure enters the CPU figure."""
    import cProfile
    import io as _io
    import pstats

    def measure(x, w, i, prepared):
        X.fused_standard(x, w, i, prepared)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            X.fused_standard(x, w, i, prepared)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        spans = []
        for _ in range(10):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            X.fused_standard(x, w, i, prepared)
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end) * 1e3)
        return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6, sorted(spans)[5]

    for preset, scheme, _ in plan:
        H, I, E, k, act_name = tune.PRESETS[preset]
        weights = tune.random_weights(H, I, E, act_name, scheme, DEV)
        spec = weights.spec(Activation(act_name))
        prepared = TritonBackend(options).prepare_weights(weights, spec)
        by_mode = {
            cached: with_options(prepared, switched(options, "launchcache", cached))
            for cached in (False, True)
        }
        for T in (1, 1024):
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            w, i = routing(T, E, k)
            row = dict(preset=preset, scheme=scheme, T=T)
            for _ in range(5):  # alternately, keeping each mode's fastest (least disturbed)
                for cached in (False, True):
                    tag = "" if cached else "_jit"
                    got = measure(x, w, i, by_mode[cached])
                    for name, v in zip(("cpu_us", "wall_us", "idle_span_us"), got, strict=True):
                        row[name + tag] = min(row.get(name + tag, float("inf")), v)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                X.fused_standard(x, w, i, by_mode[True])
            prof.disable()
            torch.cuda.synchronize()
            text = _io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            row["profile"] = text.getvalue()
            rows.append(row)
            print(
                f"host {preset:14s} {scheme:9s} T={T:5d} cpu {row['cpu_us_jit']:6.1f} -> "
                f"{row['cpu_us']:6.1f} us/call  wall {row['wall_us_jit']:6.1f} -> "
                f"{row['wall_us']:6.1f}  span from idle {row['idle_span_us_jit']:6.1f} -> "
                f"{row['idle_span_us']:6.1f} us (JIT launch -> cached)",
                flush=True,
            )
        del weights, prepared, by_mode
        torch.cuda.empty_cache()


def part_warm(plan, jobs: int, options: TritonOptions):
    """Compile the kernels ``perf`` will launch (one untimed call per token count), one
    process per (preset, scheme) when ``jobs`` > 1: compilation is CPU work, and a perf run
    on a cold kernel cache otherwise compiles every tile serially between its timings."""
    if jobs > 1 and len(plan) > 1:
        import subprocess
        import tempfile

        pending = list(plan)
        running = []
        while pending or running:
            while pending and len(running) < jobs:
                preset, scheme, tokens = pending.pop(0)
                cmd = [
                    sys.executable,
                    __file__,
                    "--parts",
                    "warm",
                    "--jobs",
                    "1",
                    "--out",
                    tempfile.mkdtemp(),
                    "--presets",
                    f"{preset}:{scheme}",
                    "--tune-tokens",
                    *map(str, tokens),
                ]
                for name, (field, (_off, on), _) in _toggles().items():
                    cmd += ["--off" if getattr(options, field) != on else "--on", name]
                running.append((f"{preset}:{scheme}", subprocess.Popen(cmd)))
            time.sleep(0.5)
            for item in list(running):
                if item[1].poll() is not None:
                    running.remove(item)
                    print(f"warm {item[0]}: rc {item[1].returncode}", flush=True)
        return
    for preset, scheme, tokens in plan:
        H, I, E, k, act_name = tune.PRESETS[preset]
        weights = tune.random_weights(H, I, E, act_name, scheme, DEV)
        spec = weights.spec(Activation(act_name))
        prepared = TritonBackend(options).prepare_weights(weights, spec)
        for T in tokens:
            w, i = routing(T, E, k)
            X.fused_standard(torch.randn(T, H, device=DEV, dtype=torch.bfloat16), w, i, prepared)
        torch.cuda.synchronize()
        del weights, prepared
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["perf"])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--presets", nargs="*", default=None)
    ap.add_argument("--tune-tokens", nargs="*", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="off/on rounds of a switch's A/B")
    ap.add_argument("--jobs", type=int, default=6, help="parallel compile processes for warm")
    ap.add_argument(
        "--off",
        action="append",
        default=[],
        choices=sorted(_toggles()),
        help="run every part with this switch off (repeatable)",
    )
    ap.add_argument(
        "--on",
        action="append",
        default=[],
        choices=sorted(_toggles()),
        help="run every part with this switch on (repeatable)",
    )
    args = ap.parse_args()
    options = TritonOptions()
    for name in args.off:
        options = switched(options, name, False)
    for name in args.on:
        options = switched(options, name, True)
    if options != TritonOptions():  # the check part's "triton" runs with them too
        register(TritonBackend(options), replace=True)
    args.out.mkdir(parents=True, exist_ok=True)
    names = {f"{p[0]}:{p[1]}": p for p in PERF_PLAN}
    if args.presets is None:
        plan = PERF_PLAN
    else:  # in the order given; any preset of tune.PRESETS with a scheme beyond the plan's
        for n in args.presets:
            preset, _, scheme = n.partition(":")
            if n not in names and (preset not in tune.PRESETS or not scheme):
                raise SystemExit(
                    f"unknown preset {n!r}; accepted: PRESET:SCHEME with PRESET "
                    f"one of {', '.join(tune.PRESETS)} (the plan: {', '.join(names)})"
                )
        plan = [names.get(n) or (*n.split(":"), tune.DEFAULT_TOKENS) for n in args.presets]
    result = dict(
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        triton=triton.__version__,
        options=repr(options),
    )
    t0 = time.time()

    def save():
        result["seconds"] = time.time() - t0
        (args.out / "results.json").write_text(json.dumps(result, indent=1))

    for part in args.parts:  # in the order given, each saved as soon as it is done
        if part in ("check", "tune", "precompile"):
            raise SystemExit(
                f"part {part!r} moved: the GPU check is pytest -m gpu tests/backends, the tile "
                "search moerunner tune --preset P --scheme S --jobs N [--compile-only]"
            )
        if part == "host":
            result["host"] = []
            part_host(plan, result["host"], options)
        elif part in _toggles():
            result.setdefault("toggles", [])
            part_toggle(plan, result["toggles"], part, options, args.rounds)
        elif part == "warm":
            part_warm([(p[0], p[1], args.tune_tokens or p[2]) for p in plan], args.jobs, options)
        elif part == "perf":
            result["peaks"] = measure_peaks()
            result["perf"] = []
            part_perf(result["peaks"], plan, result["perf"], save, options)
        else:
            raise SystemExit(
                f"unknown part {part!r}; accepted: warm, perf, host, {', '.join(_toggles())}"
            )
        save()
    save()
    print("\n== summary ==", result["device"], result["date"])
    if "peaks" in result:
        p = result["peaks"]
        print(
            f"copy {p['copy_bytes_per_s'] / 1e12:.2f} TB/s  bf16 {p['bf16_flops'] / 1e12:.0f} "
            f"TFLOP/s  fp8 {p['fp8_flops'] / 1e12:.0f} TFLOP/s  L2 read "
            f"{p.get('l2_read_bytes_per_s', float('nan')) / 1e12:.2f} TB/s"
        )
        print(f"{'preset':14s} {'scheme':9s} " + " ".join(f"{t:>13d}" for t in tune.DEFAULT_TOKENS))
        groups = {}
        for r in result["perf"]:
            groups.setdefault((r["preset"], r["scheme"]), {})[r["T"]] = r
        for (preset, scheme), by_t in groups.items():
            cells = []
            for t in tune.DEFAULT_TOKENS:
                r = by_t.get(t)
                if r is None or "us" not in r:
                    cells.append(f"{'-':>13s}")
                elif t <= 64:
                    cells.append(f"{r['us']:7.0f}u{r['pct_roofline']:4.0f}%R")
                else:
                    cells.append(f"{r['us']:7.0f}u{r['pct_peak']:4.0f}%P")
            print(f"{preset:14s} {scheme:9s} " + " ".join(cells))
    print(f"total {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
