"""benchmarks/transformers_e2e.py: the zero-cost experts, time in experts, the four model
shapes, the static-cache / compiled decode modes and the decode-step breakdown, run tiny on a
CPU (the ``gpu`` test runs the CUDA-only modes)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

# Tiny and quick: 1-2 timed blocks of 2 decode steps, a 128-word vocabulary, aot_eager (traces
# the whole decode step under fullgraph=True without generating code).
FAST = ("--tiny", "--dtype", "float32", "--vocab", "128", "--repeats", "2", "--decode-steps", "2")
FAST += ("--profile-steps", "1", "--backend", "aot_eager")


@pytest.fixture(scope="module")
def e2e(load_benchmark):
    return load_benchmark("transformers_e2e.py")


def _run(e2e, tmp_path, capsys, *options, device="cpu"):
    e2e.main([*FAST, "--device", device, "--out", str(tmp_path), *options])
    table = capsys.readouterr().out
    return json.loads((tmp_path / "transformers_e2e.json").read_text()), table


class _NoWeights(torch.nn.Module):
    """An experts module whose weights may not be read."""

    def __getattr__(self, name):
        raise AssertionError(f"the zero-cost experts read {name}")


@pytest.mark.parametrize(("tokens", "dtype"), [(5, torch.float32), (0, torch.bfloat16)])
def test_zero_cost_experts_give_zeros_without_reading_weights(e2e, tokens, dtype):
    x = torch.randn(tokens, 8).to(dtype)
    ids = torch.zeros(tokens, 2, dtype=torch.long)
    out = e2e.zero_experts_forward(_NoWeights(), x, ids, torch.ones(tokens, 2))
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert not out.any()


def test_zero_cost_is_registered_beside_the_others(e2e):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = e2e.register_zero_cost()
    assert ALL_EXPERTS_FUNCTIONS[name] is e2e.zero_experts_forward
    model = e2e.build_model("qwen3-30b-a3b", 2, 128, True, torch.float32, "cpu")
    model.set_experts_implementation(name)
    seen = []
    for _, experts in e2e.mt.experts_modules(model):
        experts.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(torch.arange(6)[None])
    assert len(seen) == 2 and all(o.shape == (6, 64) and not o.any() for o in seen)


def test_new_shapes_have_every_layer_moe_with_the_published_routing(e2e):
    ds = e2e.build_model("deepseek-v3", 2, 128, True, torch.float32, "cpu")
    cfg = ds.config
    assert cfg.first_k_dense_replace == 0 and (cfg.n_group, cfg.topk_group) == (4, 2)
    labels = list(e2e.stage_labels(ds).values())
    assert labels.count("experts") == labels.count("shared experts") == 2
    assert labels.count("moe block") == labels.count("attention") == 2
    assert labels.count("norms") == 2 * 2 + 1  # per layer two, and the final norm
    assert "dense mlp" not in labels and labels.count("lm head") == 1
    real = e2e.SHAPES["deepseek-v3"][1]
    assert (real["n_group"], real["topk_group"], real["kv_lora_rank"]) == (8, 4, 512)
    mixtral = e2e.build_model("mixtral-8x7b", 2, 128, True, torch.float32, "cpu")
    assert len(list(e2e.mt.experts_modules(mixtral))) == 2


def test_experts_time_is_step_time_less_zero_cost(e2e):
    def row(impl, prefill, decode):
        return {
            "shape": "s",
            "impl": impl,
            "prefill_ms": {"median": prefill},
            "decode_ms": {"median": decode},
        }

    rows = [row("grouped_mm", 10.0, 4.0), row("moerunner", 13.0, 5.0), row("zero-cost", 6.0, 3.0)]
    rows.append({"shape": "s", "impl": "eager", "error": "RuntimeError: boom"})
    e2e.add_experts_time(rows, ("prefill", "decode"))
    gm, mr, zero, failed = rows
    assert (gm["prefill_experts_ms"], gm["decode_experts_ms"]) == (4.0, 1.0)
    assert (mr["prefill_experts_ms"], mr["decode_experts_ms"]) == (7.0, 2.0)
    assert (mr["prefill_experts_vs_grouped_mm"], mr["decode_experts_vs_grouped_mm"]) == (1.75, 2.0)
    assert zero["decode_experts_ms"] == 0.0 and "decode_experts_vs_grouped_mm" not in zero
    assert "decode_experts_ms" not in failed


def test_a_failing_graph_mode_is_reported_and_the_run_goes_on(e2e, monkeypatch):
    def fake(model, ids, steps, repeats, mode, backend):
        if mode == "compile":
            raise RuntimeError("cannot trace\nsecond line")
        return {"samples": [0.002, 0.001], "first_call_s": 0.5}

    class Model:
        def set_experts_implementation(self, name):
            pass

    monkeypatch.setattr(e2e, "time_static_decode", fake)
    args = type("Args", (), dict(decode_steps=2, repeats=2, backend="aot_eager", graph_modes=None))
    ids = torch.zeros(2, 4, dtype=torch.long)
    rows = e2e.measure_graphs(Model(), "s", "moerunner", "moerunner", ids, args)
    assert [r["mode"] for r in rows] == ["static", "compile"]
    assert rows[0]["decode_ms"] == {"min": 1.0, "median": 1.5, "max": 2.0}
    assert rows[0]["decode_tok_s"] == pytest.approx(2 / 1.5e-3)
    assert rows[1]["error"] == "RuntimeError: cannot trace"
    eager = e2e.measure_graphs(Model(), "s", "eager", "eager", ids, args)
    assert all("skipped" in r["error"] for r in eager)


def _check_rows(results, shapes, impls):
    rows = results["rows"]
    assert [(r["shape"], r["impl"]) for r in rows] == [(s, i) for s in shapes for i in impls]
    for r in rows:
        assert "error" not in r, r
        for phase in ("prefill", "decode"):
            s = r[f"{phase}_ms"]
            assert 0 < s["min"] <= s["median"] <= s["max"]
            zero = next(z for z in rows if z["shape"] == r["shape"] and z["impl"] == "zero-cost")
            expected = s["median"] - zero[f"{phase}_ms"]["median"]
            assert r[f"{phase}_experts_ms"] == pytest.approx(expected)
        if r["impl"] == "zero-cost":
            assert r["max_rel_vs_first"] is None
        else:  # fp32 on a CPU: every implementation agrees with the first to rounding
            assert r["max_rel_vs_first"] < 1e-4
        if r["impl"] == "moerunner":
            assert "decode_experts_vs_grouped_mm" in r
            assert "prefill_span_vs_grouped_mm" in r and "decode_span_vs_grouped_mm" in r
        for phase in ("prefill", "decode"):  # the experts' span, measured in runs of its own
            span = r[f"{phase}_span_ms"]
            assert 0 < span["min"] <= span["median"] <= span["max"]
            assert r["experts_hit_per_call"][phase] >= 1  # (exact: the span test below)


def test_experts_span_counts_only_the_experts_calls(e2e):
    """The span hooks time the experts modules' calls and nothing else: with experts that
    sleep 20 ms per call, and a 30 ms sleep outside them (a hook that runs before the
    span's own), a 2-layer forward's span is 40 ms and a bit, not 100."""
    import time

    from transformers.integrations.moe import ExpertsInterface

    def slow_zero(self, hidden_states, *args, **kwargs):
        time.sleep(0.02)
        return hidden_states.new_zeros(hidden_states.shape)

    ExpertsInterface.register("slow_zero_for_test", slow_zero)
    model = e2e.build_model("qwen3-30b-a3b", 2, 128, True, torch.float32, "cpu")
    model.set_experts_implementation("slow_zero_for_test")
    routed = []
    for _, experts in e2e.mt.experts_modules(model):
        experts.register_forward_pre_hook(lambda m, a: time.sleep(0.03) or routed.append(a[1]))
    span = e2e.ExpertsSpan(model, torch.device("cpu"))
    assert span.take() == 0.0
    with torch.no_grad():
        model(torch.arange(6)[None])
    ms = span.take()
    # the experts each call's routing hits (6 tokens, top-8 of 32 here: several distinct)
    hit = [len(ids.unique()) for ids in routed]
    assert len(hit) == 2 and span.take_hit() == pytest.approx(sum(hit) / 2)
    assert span.take_hit() is None  # taken: starts over
    span.remove()
    assert 40.0 <= ms < 60.0, ms
    assert span.take() == 0.0  # taken: starts over


def test_tiny_run_of_the_new_shapes(e2e, tmp_path, capsys):
    shapes = ["deepseek-v3", "mixtral-8x7b"]
    results, table = _run(
        e2e, tmp_path, capsys, "--shapes", ",".join(shapes), "--impls", "grouped_mm,moerunner"
    )
    _check_rows(results, shapes, ["grouped_mm", "moerunner", "zero-cost"])
    assert results["graph_rows"] == [] and results["breakdown"] == []
    # --tiny: a one-row prefill and two-row decode (the decode prompt has its own rows)
    assert {(r["prefill_tokens"], r["decode_batch"]) for r in results["rows"]} == {(64, 2)}
    served = {r["shape"]: r["backends"] for r in results["rows"] if r["impl"] == "moerunner"}
    assert served == {"deepseek-v3": ["torch"], "mixtral-8x7b": ["torch"]}  # no table on a CPU
    # then in turns: one row per shape and implementation, time in experts against zero-cost
    turns = {(r["shape"], r["impl"]): r for r in results["round_rows"]}
    assert set(turns) == {(s, i) for s in shapes for i in ("grouped_mm", "moerunner", "zero-cost")}
    for (shape, _), r in turns.items():
        zero = turns[(shape, "zero-cost")]
        for phase in ("prefill", "decode"):
            got = r[f"{phase}_ms"]["median"] - zero[f"{phase}_ms"]["median"]
            assert r[f"{phase}_experts_ms"] == pytest.approx(got)
    assert "in turns (1 rounds)" in table
    assert "decode ms min/med/max" in table and "exp ms" in table
    assert "deepseek-v3    zero-cost" in table and "mixtral-8x7b   moerunner" in table


def test_graph_modes_pick_the_modes_and_refuse_unknown_ones(e2e, tmp_path, capsys):
    results, _ = _run(
        e2e,
        tmp_path,
        capsys,
        *("--shapes", "qwen3-30b-a3b", "--impls", "moerunner", "--graph"),
        *("--graph-modes", "static", "--rounds", "0"),
    )
    assert {(r["impl"], r["mode"]) for r in results["graph_rows"]} == {
        ("moerunner", "static"),
        ("zero-cost", "static"),
    }
    with pytest.raises(SystemExit):
        e2e.main([*FAST, "--device", "cpu", "--graph", "--graph-modes", "cudagraph"])
    assert "unknown on cpu: ['cudagraph']" in capsys.readouterr().err


def test_tiny_run_with_graph_and_breakdown(e2e, tmp_path, capsys):
    impls = ["eager", "grouped_mm", "moerunner", "zero-cost"]
    results, table = _run(
        e2e, tmp_path, capsys, "--shapes", "qwen3-30b-a3b", "--graph", "--breakdown"
    )
    _check_rows(results, ["qwen3-30b-a3b"], impls)
    graph = {(r["impl"], r["mode"]): r for r in results["graph_rows"]}
    assert set(graph) == {(i, m) for i in impls for m in ("static", "compile")}
    for (impl, mode), r in graph.items():
        if impl == "eager":
            assert "skipped" in r["error"]
            continue
        assert "error" not in r, r  # the static and the compiled step run on a CPU
        assert 0 < r["decode_ms"]["min"] <= r["decode_ms"]["median"] <= r["decode_ms"]["max"]
        assert r["first_call_s"] > 0
        zero = graph[("zero-cost", mode)]["decode_ms"]["median"]
        assert r["decode_experts_ms"] == pytest.approx(r["decode_ms"]["median"] - zero)
    assert "compile" in table and "skipped: transformers' eager loop" in table

    breakdown = {r["impl"]: r for r in results["breakdown"]}
    assert list(breakdown) == impls
    for r in breakdown.values():
        assert "error" not in r, r
        assert set(r["stages"]) == set(e2e.STAGES)
        # Nested profiler ranges: no stage (router = moe block less its experts) below zero.
        assert all(s["host_ms"] >= 0 for s in r["stages"].values()), r["stages"]
        for stage in ("embedding", "attention", "norms", "router", "experts", "lm head"):
            assert r["stages"][stage]["host_ms"] > 0, stage
        assert r["step_ms"] > 0 and "device_idle_ms" not in r  # no GPU here
    assert "decode step breakdown, qwen3-30b-a3b" in table
    assert "other (between stages)" in table and "step (wall)" in table


@pytest.mark.gpu
def test_tiny_run_on_a_gpu_reports_every_graph_mode(e2e, tmp_path, capsys):
    impls = ["grouped_mm", "moerunner", "zero-cost"]
    results, table = _run(
        e2e,
        tmp_path,
        capsys,
        "--shapes",
        "qwen3-30b-a3b",
        "--impls",
        "grouped_mm,moerunner",
        "--graph",
        "--breakdown",
        "--backend",
        "inductor",
        device="cuda",
    )
    modes = ("static", "compile", "cudagraph", "compile+cudagraph", "reduce-overhead")
    graph = {(r["impl"], r["mode"]): r for r in results["graph_rows"]}
    assert set(graph) == {(i, m) for i in impls for m in modes}
    for key, r in graph.items():  # each mode either ran or says why not
        assert ("decode_ms" in r) != ("error" in r), (key, r)
    for mode in modes:  # zeros for experts: nothing of moerunner's can stop these
        assert "error" not in graph[("zero-cost", mode)], graph[("zero-cost", mode)]
    # moerunner's state lives outside the trees' pool (``moerunner.memory.kept``)
    assert "error" not in graph[("moerunner", "reduce-overhead")], graph[
        ("moerunner", "reduce-overhead")
    ]
    for r in results["breakdown"]:
        assert r["device_busy_ms"] > 0 and r["step_ms"] >= r["device_busy_ms"]
        assert r["stages"]["experts"]["device_ms"] >= 0
    assert "gpu idle (host gaps)" in table


def test_relayout_rows_read_the_canonical_layout_and_the_others_the_stored_one(e2e):
    """``moerunner+relayout`` runs GPT-OSS's transposed experts re-laid as ``use_moerunner``
    lays them; switching to any other implementation lays them back as stored (grouped_mm
    reads the stored layout), with the same values throughout."""
    from moerunner.integrations import _relayout

    model = e2e.build_model("gpt-oss-120b", 2, 128, True, torch.float32, "cpu")
    experts = [m for _, m in e2e.mt.experts_modules(model)]
    values = [m.gate_up_proj.detach().clone() for m in experts]
    name = e2e.mt.register()
    first = torch.zeros(1, 4, dtype=torch.long)
    rows = [
        ("moerunner+relayout", "canonical"),
        ("grouped_mm", "stored"),
        ("moerunner+auto", "canonical"),  # re-laid by its first call
        ("grouped_mm", "stored"),
    ]
    for impl, layout in rows * 2:
        e2e.use_impl(model, impl, name if impl.startswith("moerunner") else impl, first=first)
        for m, v in zip(experts, values, strict=True):
            assert _relayout.in_layout(m.gate_up_proj, layout), (impl, layout)
            assert torch.equal(m.gate_up_proj, v)
        assert e2e.experts_layout(model) == layout
    assert e2e.base_impl("moerunner:triton+auto") == "moerunner:triton"


def test_quantized_rows_run_the_quantized_experts_and_the_others_the_float_ones(e2e):
    """``moerunner@fp8_block`` runs the experts quantized once into fp8_block (float weights
    kept); switching to another implementation runs the float weights again, and back to the
    quantized row reuses the same quantized tensors."""
    from moerunner.integrations._hf_experts import quantized_weights

    model = e2e.build_model("deepseek-v3", 1, 128, True, torch.float32, "cpu")
    experts = [m for _, m in e2e.mt.experts_modules(model)]
    name = e2e.mt.register()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))

    def logits(impl):
        e2e.use_impl(model, impl, name if impl.startswith("moerunner") else impl)
        with torch.no_grad():
            return model(ids).logits

    float_logits = logits("moerunner")
    assert all(quantized_weights(m) is None for m in experts)
    quant_logits = logits("moerunner@fp8_block")
    held = [quantized_weights(m) for m in experts]
    assert all(w is not None and w.w13.scheme.name == "fp8_block" for w in held)
    assert not torch.equal(quant_logits, float_logits)  # fp8 rounding reaches the logits
    assert torch.equal(logits("grouped_mm"), logits("grouped_mm"))
    assert all(quantized_weights(m) is None for m in experts)
    assert torch.allclose(logits("moerunner"), float_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits("moerunner@fp8_block"), quant_logits)
    assert all(quantized_weights(m) is h for m, h in zip(experts, held, strict=True))
    assert e2e.impl_scheme("moerunner:triton@mxfp4+auto") == ("moerunner:triton+auto", "mxfp4")
    assert e2e.base_impl("moerunner:triton@mxfp4+auto") == "moerunner:triton"


def test_routers_rows_fuse_the_routers_and_the_others_run_their_own(e2e):
    """``...+routers`` runs the MoE blocks' routers on moerunner's routing (``fuse_routers``);
    switching to any other implementation restores the routers' own forwards."""
    model = e2e.build_model("deepseek-v3", 2, 128, True, torch.float32, "cpu")
    routers = [block.gate for _, block in model.named_modules() if hasattr(block, "experts")]
    name = e2e.mt.register()
    for impl, fused in [("moerunner@fp8_block+routers", True), ("grouped_mm", False)] * 2:
        e2e.use_impl(model, impl, name if impl.startswith("moerunner") else impl)
        assert all(("forward" in r.__dict__) == fused for r in routers), impl
    scheme = e2e.impl_scheme("moerunner:triton@fp8_block+routers")
    assert scheme == ("moerunner:triton", "fp8_block")
    assert e2e.base_impl("moerunner+relayout+routers") == "moerunner"
