"""Regressions of faults a prober found in ``moerunner bench`` (its roofline, sweep, timing
advice and table): each test fails on the code before its fix."""

from __future__ import annotations

import json

import pytest
import torch

from moerunner.bench import report, roofline, timing
from moerunner.bench.presets import BenchShape
from moerunner.bench.roofline import DeviceCeilings, RowCost
from moerunner.bench.sweep import (
    BenchConfig,
    Row,
    Sweep,
    accuracy_bound,
    draw_routing,
)
from moerunner.cli import bench as cli_bench
from moerunner.quant import SCHEME_NAMES, get_scheme
from moerunner.quant.activations import quantize_activation
from moerunner.weights import ExpertWeights

TINY = BenchShape("tiny", 8, 64, 96, 2)  # gated: w13 [8, 192, 64], w2 [8, 64, 96]
QUICK = [
    "--tokens", "4", "--routing", "uniform", "--backends", "torch", "--device", "cpu",
    "--min-time", "0.001", "--max-reps", "2", "--rotations", "1", "--quiet",
]  # fmt: skip


def ceilings_cache(path):
    key = roofline.device_key(torch.device("cpu"))
    entry = {"device": key, "copy_gbps": 10.0, "peak_tflops": {"fp32": 0.1, "bf16": 0.1}}
    path.write_text(json.dumps({key: entry}))
    return path


# -- finding 1: the roofline's compute format comes from the scheme's fields ------------------


def _gemm_input_format(name: str) -> str:
    """The format a scheme's GEMM input is stored in, from what ``quantize_activation`` makes
    of one (an 8-bit e4m3 or int8 tensor, packed e2m1 bytes, or the input as it was)."""
    s = get_scheme(name)
    static = {"input_scale": 0.05} if s.activation_scales == "static" else {}
    data = quantize_activation(torch.randn(2, 64), s, **static).data
    if data.dtype in (torch.float8_e4m3fn, torch.int8):
        return "fp8"
    if data.dtype == torch.uint8:  # two e2m1 codes per byte
        return "fp4"
    return "fp32" if s.weight_format == "fp32" else "bf16"


@pytest.mark.parametrize(
    "name", [*SCHEME_NAMES, "fp8_block_32x32", "fp8_block_128x32", "fp8_block_64x256"]
)
def test_compute_format_is_the_format_the_gemm_input_is_stored_in(name):
    # fp8_block_64x64 / 128x64 (activation format "fp8_group") quantize activations to e4m3
    # as fp8_block does, yet were bounded by the bf16 peak.
    assert roofline.compute_format(name) == _gemm_input_format(name)


def test_fp8_group_rows_are_held_to_the_fp8_peak():
    ceilings = DeviceCeilings("x", copy_gbps=1e6, peak_tflops={"bf16": 1.0, "fp8": 2.0})
    cost = RowCost(bytes=10, flops=4 * 10**12, experts_hit=1)  # compute bound
    for name in ("fp8_block", "fp8_block_64x128", "fp8_block_64x64", "fp8_block_128x64"):
        fmt = roofline.compute_format(name)
        assert roofline.floor_seconds(cost, ceilings, fmt) == pytest.approx(2.0), name


# -- finding 2: a repeated --shape -------------------------------------------------------------


@pytest.mark.parametrize("second", ["8,64,96,2", "8,064,96,2"])
def test_a_repeated_shape_runs_once(second):
    parsed = cli_bench.build_parser().parse_args(["--shape", "8,64,96,2", "--shape", second])
    assert [s.name for s in cli_bench.config_from_args(parsed).shapes] == ["shape-8x64x96x2"]
    parsed = cli_bench.build_parser().parse_args(["--shape", "8,64,96,2", "--shape", "8,64,96,4"])
    assert [s.top_k for s in cli_bench.config_from_args(parsed).shapes] == [2, 4]  # both kept


def test_a_repeated_shapes_baselines_are_each_others_speedup_one(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = [
        "--shape", "8,64,96,2", "--shape", "8,64,96,2", *QUICK, "--baselines", "eager",
        "--ceilings", str(ceilings_cache(tmp_path / "c.json")), "--json", str(out),
    ]  # fmt: skip
    assert cli_bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["tokens"]) for r in rows] == [("torch", 4), ("baseline:eager", 4)]
    base = rows[1]
    assert base["speedup"] == {"eager": 1.0}  # over itself (was over the other copy's time)
    assert rows[0]["speedup"] == {"eager": base["time_us"] / rows[0]["time_us"]}


# -- finding 3: every scheme meets its baselines on the same cases, timed beside them ---------


def _recording_sweep(schemes, batches=None):
    config = BenchConfig(
        shapes=(TINY,), tokens=(1, 5), schemes=schemes, backends=("torch",),
        baselines=("eager",), routings=("uniform", "zipf"), min_time_s=0.001, max_reps=2,
        rotations=2,
    )  # fmt: skip
    sweep = Sweep(config, DeviceCeilings("cpu", 1.0, {"fp32": 1.0, "bf16": 1.0}))
    if batches is not None:  # the GPU layout: one scheme at a time
        sweep._batches = batches
    sessions = []  # per call of _measure_all: its rows and its cases
    measure_all = sweep._measure_all

    def record(measured, shape, cases, dtype):
        sessions.append(([m[0] for m in measured], cases))
        return measure_all(measured, shape, cases, dtype)

    sweep._measure_all = record
    return sweep, sessions


def test_quantized_rows_are_timed_beside_their_baselines_on_the_same_cases():
    schemes = ("bf16", "fp8_tensor", "mxfp4")
    sweep, sessions = _recording_sweep(schemes)
    rows = sweep.run()
    # One session per (routing, T): every scheme's row and the baseline, interleaved.
    assert len(sessions) == 4
    for timed, _ in sessions:
        assert sorted((r.scheme, r.impl) for r in timed) == [
            ("bf16", "baseline:eager"),
            ("bf16", "torch"),
            ("fp8_tensor", "torch"),
            ("mxfp4", "torch"),
        ]
    # Each row's experts hit are those of the cases it ran, and the baseline's.
    for timed, cases in sessions:
        hit = [len(torch.unique(c.topk.ids)) for c in cases]
        for r in timed:
            assert r.status == "ok" and r.experts_hit == sum(hit) / len(hit)
    # Rows are still listed scheme by scheme, the baseline with the first scheme.
    listed = [(r.scheme, r.impl, r.routing, r.tokens) for r in rows]
    want = [
        (s, impl, routing, t)
        for s in schemes
        for routing in ("uniform", "zipf")
        for t in (1, 5)
        for impl in (("torch", "baseline:eager") if s == "bf16" else ("torch",))
    ]
    assert listed == want


def test_one_scheme_at_a_time_still_draws_the_baselines_cases():
    sweep, sessions = _recording_sweep(("bf16", "fp8_tensor"), lambda s: [[x] for x in s])
    sweep.run()
    assert len(sessions) == 8  # two batches of four (routing, T)
    first, second = sessions[:4], sessions[4:]
    for (rows_a, cases_a), (rows_b, cases_b) in zip(first, second, strict=True):
        assert {r.scheme for r in rows_a} == {"bf16"} and {r.scheme for r in rows_b} == {
            "fp8_tensor"
        }
        assert (rows_a[0].routing, rows_a[0].tokens) == (rows_b[0].routing, rows_b[0].tokens)
        for a, b in zip(cases_a, cases_b, strict=True):
            assert torch.equal(a.x, b.x) and torch.equal(a.topk.ids, b.topk.ids)
            assert torch.equal(a.topk.weights, b.topk.weights) and a.copy == b.copy


# -- finding 4: static activation scales --------------------------------------------------------


# What one scale maps an amax onto (moerunner.quant.activations' header): e4m3's 448, int8's
# 127, and for nvfp4's global scale 448 (e4m3 block scale) x 6 (e2m1).
QMAX = {"fp8_tensor_static": 448.0, "int8_static": 127.0, "nvfp4_a4_static": 448.0 * 6}


@pytest.mark.parametrize("scheme", sorted(QMAX))
def test_static_scales_are_each_experts_largest_gemm_input(scheme):
    e, h, i = 4, 32, 48
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    x = 3 * torch.randn(9, h, generator=g)
    shape = BenchShape("s", 3, h, i, 2)  # routes over experts 0-2 only: expert 3 gets no rows
    topk = draw_routing(9, shape, "uniform", g, 1.2)
    from moerunner.bench.sweep import calibrate_input_scales
    from moerunner.config import Activation

    s13, s2 = calibrate_input_scales(ExpertWeights(w13, w2), Activation("silu"), scheme, x, topk)
    x64 = x.double()
    want13, want2 = torch.zeros(e, dtype=torch.float64), torch.zeros(e, dtype=torch.float64)
    for t in range(9):
        for ex in topk.ids[t].tolist():
            gate, up = (x64[t] @ w13[ex].double().T).split(i)
            a = gate * torch.sigmoid(gate) * up
            want13[ex] = max(want13[ex], x64[t].abs().max() / QMAX[scheme])
            want2[ex] = max(want2[ex], a.abs().max() / QMAX[scheme])
    for want in (want13, want2):
        want[3] = want[:3].max()  # an expert no row reached: the largest of the others
    torch.testing.assert_close(s13.double(), want13, rtol=1e-5, atol=0)
    torch.testing.assert_close(s2.double(), want2, rtol=1e-4, atol=0)


def test_static_schemes_run_in_the_bench(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = [
        "--shape", "8,64,96,2", *QUICK, "--baselines", "none",
        "--schemes", "fp8_tensor_static,int8_static,nvfp4_a4_static",
        "--ceilings", str(ceilings_cache(tmp_path / "c.json")), "--json", str(out),
    ]  # fmt: skip
    assert cli_bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["scheme"] for r in rows) == [
        "fp8_tensor_static",
        "int8_static",
        "nvfp4_a4_static",
    ]
    for r in rows:
        bound = accuracy_bound(r["scheme"], torch.bfloat16)
        assert r["status"] == "ok" and 0 < r["max_rel_err"] < bound, r


# -- finding 7: the spread warning names the flag that limits the samples ---------------------


def test_the_cap_ends_fast_rows_and_the_warning_says_so():
    # The documented contract (--max-reps: "most samples per row"): the cap wins over
    # --min-time, so a fast call gets max_reps samples, far short of min_time_s.
    calls = []
    timed = timing.time_interleaved_cpu(
        {0: calls.append}, 1, min_time_s=5.0, min_reps=2, max_reps=20
    )[0]
    assert timed.samples == 20 and len(calls) < 30  # warm-up, estimate, 20 samples
    capped = Row("p", "bf16", "bf16", "torch", "uniform", 1, time_us=150.0, spread_pct=40.0)
    capped.samples = 200  # 0.03 s of samples
    slow = Row("p", "bf16", "bf16", "torch", "uniform", 64, time_us=1e5, spread_pct=30.0)
    slow.samples = 10  # 1 s of samples: --min-time ended them
    warning = report.spread_warning([capped, slow], 10.0, 0.5, transformers_version=False)
    assert "larger --max-reps" in warning and "1 of them before --min-time 0.5 s" in warning
    assert "larger --min-time" not in warning
    warning = report.spread_warning([slow], 10.0, 0.5, transformers_version=False)
    assert warning.endswith("rerun with a larger --min-time")


# -- finding 9: the table's cells and labels ---------------------------------------------------


def _cells(text: str, row: int) -> dict[str, str]:
    """Cells of table line ``row`` (1: the first row) by header, for single-word headers."""
    lines = text.splitlines()
    head = lines[0].replace("time us", "time_us").replace("max err", "max_err").split()
    return dict(zip(head, lines[row].split(), strict=False))


def test_table_shows_average_hits_small_rates_and_dashes_for_rows_not_measured():
    def row(**kw):
        base = dict(time_us=100.0, spread_pct=1.0, pct_roofline=1.0, max_rel_err=1e-3)
        return Row("p", "bf16", "bf16", "torch", "uniform", 4, **{**base, **kw})

    rows = [
        row(experts_hit=7.5, gbps=0.4, tflops=0.0004),
        row(experts_hit=7.25, gbps=3000.4, tflops=512.345),
        row(experts_hit=8.0, gbps=35.2, tflops=3.4),
        Row("p", "bf16", "bf16", "triton", "uniform", 4, status="skipped", note="no GPU"),
        Row("p", "bf16", "bf16", "triton", "uniform", 4, status="failed", note="boom"),
    ]
    text = report.table(rows, (), transformers_version=False)
    got = [(c["hit"], c["GB/s"], c["TFLOP/s"]) for c in (_cells(text, n) for n in (1, 2, 3))]
    assert got == [("7.5", "0.40", "0.00040"), ("7.25", "3000", "512.35"), ("8", "35", "3.40")]
    assert _cells(text, 4)["hit"] == "-" and _cells(text, 5)["hit"] == "-"


def test_spread_warning_names_a_row_as_the_table_does():
    noisy = Row("p", "bf16", "bf16", "baseline:eager", "uniform", 1, time_us=3.0, spread_pct=40.0)
    assert "p bf16 hf:eager T=1" in report.spread_warning([noisy], 10.0, 0.2, "5.0")
    assert "p bf16 torch-eq:eager T=1" in report.spread_warning([noisy], 10.0, 0.2, False)
    text = report.table([noisy], ("eager",), transformers_version=False)
    assert "torch-eq:eager" in text and "baseline:" not in text


@pytest.mark.parametrize("scheme", ["fp8_tensor_static", "int8_static"])
def test_expert_parallel_weights_calibrate_static_scales(scheme):
    """``bench --ep-size`` quantized the whole layer without input scales, so a static-scale
    scheme crashed in ``quantize``; it now calibrates them as the single-process sweep does,
    the same scales for the same seed (every rank builds the layer alike)."""
    from moerunner.bench.expert_parallel import full_weights
    from moerunner.bench.presets import parse_shape

    shape = parse_shape("8,32,32,2")
    w = full_weights(shape, scheme, torch.float32, torch.device("cpu"), seed=3)
    again = full_weights(shape, scheme, torch.float32, torch.device("cpu"), seed=3)
    for name in ("w13", "w2"):
        scale = getattr(w, name).tensors()["input_scale"]
        assert scale.shape == (8,) and bool((scale > 0).all())
        assert torch.equal(scale, getattr(again, name).tensors()["input_scale"])
