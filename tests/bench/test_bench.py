"""moerunner bench: roofline accounting by hand, presets against transformers' configs, and the
CPU command end to end on a tiny preset (table, JSON that reloads, PNG)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from moerunner.bench import presets, roofline, timing
from moerunner.bench.presets import BenchShape
from moerunner.bench.roofline import DeviceCeilings, RowCost
from moerunner.bench.sweep import check_against_reference, draw_routing
from moerunner.cli import bench as cli_bench
from moerunner.weights import ExpertWeights

TINY = BenchShape("t", 8, 64, 96, 2)  # gated: w13 [8, 192, 64], w2 [8, 64, 96]


@pytest.mark.parametrize(
    "scheme, w13_bytes, w2_bytes",
    [
        ("bf16", 192 * 64 * 2, 64 * 96 * 2),
        ("fp32", 192 * 64 * 4, 64 * 96 * 4),
        # e4m3 data + fp32 scale per 128x128 block: ceil(192/128) * ceil(64/128) = 2 blocks
        ("fp8_block", 192 * 64 + 2 * 4, 64 * 96 + 1 * 4),
        # e2m1 packed two per byte + one e8m0 byte per 32 along K
        ("mxfp4", 192 * 32 + 192 * 2, 64 * 48 + 64 * 3),
        # e2m1 + one e4m3 byte per 16 along K + fp32 global scale per expert
        ("nvfp4", 192 * 32 + 192 * 4 + 4, 64 * 48 + 64 * 6 + 4),
        # int4 + fp32 scale and uint8 zero point per group of 32
        ("int4_g32_zp", 192 * 32 + 192 * 2 * 5, 64 * 48 + 64 * 3 * 5),
        ("fp8_channel", 192 * 64 + 192 * 4, 64 * 96 + 64 * 4),
    ],
)
def test_weight_bytes_per_expert_by_hand(scheme, w13_bytes, w2_bytes):
    assert roofline.weight_bytes_per_expert(192, 64, scheme) == w13_bytes
    assert roofline.weight_bytes_per_expert(64, 96, scheme) == w2_bytes


def test_row_cost_by_hand():
    cost = roofline.row_cost(TINY, "bf16", 4, 3, 8, torch.bfloat16)
    weights = 3 * (192 * 64 * 2 + 64 * 96 * 2)  # only the 3 experts hit
    activations = 2 * 4 * 64 * 2  # hidden in + output out, bf16
    routing = 4 * 2 * 8  # fp32 weight + int32 id per slot
    assert cost.bytes == weights + activations + routing
    assert cost.flops == 2 * 8 * (192 * 64 + 64 * 96)
    assert cost.experts_hit == 3
    biased = BenchShape("b", 8, 64, 96, 2, "swiglu_oai", bias=True, gate_up_interleaved=True)
    extra = roofline.row_cost(biased, "bf16", 4, 3, 8, torch.bfloat16).bytes - cost.bytes
    assert extra == 3 * (192 + 64) * 2  # bias rows of the hit experts
    relu2 = BenchShape("r", 8, 64, 96, 2, "relu2")  # non-gated: w13 has I rows
    assert roofline.row_cost(relu2, "bf16", 1, 1, 2, torch.bfloat16).flops == 2 * 2 * (
        96 * 64 + 64 * 96
    )


def test_floor_is_the_slower_of_memory_and_compute():
    ceilings = DeviceCeilings("x", copy_gbps=1.0, peak_tflops={"bf16": 1.0, "fp8": 2.0})
    assert roofline.floor_seconds(RowCost(10**9, 10**9, 1), ceilings, "bf16") == 1.0
    assert roofline.floor_seconds(RowCost(10, 4 * 10**12, 1), ceilings, "fp8") == 2.0
    assert ceilings.peak_for("fp32") == 2.0  # not measured: the best measured peak
    assert roofline.compute_format("fp8_block") == "fp8"
    assert roofline.compute_format("mxfp4") == "bf16"  # W4A16 multiplies in bf16
    assert roofline.compute_format("fp32") == "fp32"


def test_presets_match_transformers_configs():
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        MixtralConfig,
        PhimoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    n = NemotronHConfig()
    # preset -> (config, its names of E, H, I and k)
    expected = {
        "mixtral-8x7b": (MixtralConfig(), "num_local_experts", "intermediate_size"),
        "qwen3-30b-a3b": (Qwen3MoeConfig(), "num_experts", "moe_intermediate_size"),
        "deepseek-v3": (DeepseekV3Config(), "n_routed_experts", "moe_intermediate_size"),
        "gpt-oss-120b": (GptOssConfig(), "num_local_experts", "intermediate_size"),
        "nemotron-h": (n, "n_routed_experts", "moe_intermediate_size"),
        "qwen1.5-moe-a2.7b": (Qwen2MoeConfig(), "num_experts", "moe_intermediate_size"),
        "phi-3.5-moe": (PhimoeConfig(), "num_local_experts", "intermediate_size"),
    }
    p = presets.PRESETS
    for name, (cfg, experts, inter) in expected.items():
        got = (p[name].num_experts, p[name].hidden_size, p[name].intermediate_size, p[name].top_k)
        want = (
            getattr(cfg, experts),
            cfg.hidden_size,
            getattr(cfg, inter),
            cfg.num_experts_per_tok,
        )
        assert got == want, name
    assert n.mlp_hidden_act == p["nemotron-h"].activation == "relu2"
    assert p["nemotron-h-tp8"].intermediate_size == 961  # 7688 / 8: not a multiple of 16


def test_tp_and_shape_parsing():
    s = presets.parse_shape("64,4096,2048,6")
    assert (s.num_experts, s.hidden_size, s.intermediate_size, s.top_k) == (64, 4096, 2048, 6)
    assert presets.shard_intermediate(s, 4).intermediate_size == 512
    with pytest.raises(ValueError, match="does not divide"):
        presets.shard_intermediate(s, 3)
    with pytest.raises(ValueError, match="E,H,I,k"):
        presets.parse_shape("1,2,3")
    with pytest.raises(ValueError, match="accepted"):
        presets.get_preset("nope")


def test_routing_is_fresh_distinct_and_skewed():
    gen = torch.Generator().manual_seed(0)
    shape = BenchShape("z", 64, 8, 8, 4)
    uniform = draw_routing(4000, shape, "uniform", gen, 1.2)
    zipf = draw_routing(4000, shape, "zipf", gen, 1.2)
    for topk in (uniform, zipf):
        assert topk.ids.dtype == torch.int32
        assert (topk.ids.sort(1).values.diff(dim=1) > 0).all()  # k distinct experts
        torch.testing.assert_close(topk.weights.sum(1), torch.ones(4000))
    top_share = lambda ids: torch.bincount(ids.flatten().long()).max().item() / ids.numel()  # noqa: E731
    assert top_share(zipf.ids) > 3 * top_share(uniform.ids)


def test_reference_check_flags_a_wrong_output():
    gen = torch.Generator().manual_seed(1)
    w13 = torch.randn(8, 192, 64, generator=gen) / 8
    w2 = torch.randn(8, 64, 96, generator=gen) / 10
    x = torch.randn(5, 64, generator=gen)
    topk = draw_routing(5, TINY, "uniform", gen, 1.2)
    weights = ExpertWeights(w13, w2)
    from moerunner import reference_moe

    good = reference_moe(x, weights, topk.weights, topk.ids).float()
    max_rel, _, n = check_against_reference(good, x, topk, weights, TINY, 1 << 30)
    assert max_rel < 1e-6 and n == 5
    # A budget of one expert still checks at least one token, on the experts it hits only.
    _, _, n = check_against_reference(good, x, topk, weights, TINY, 1)
    assert n == 1
    bad = good.clone()
    bad[0] *= 1.1
    assert check_against_reference(bad, x, topk, weights, TINY, 1 << 30)[0] > 1e-2


def test_interleaved_timing_rotates_alternates_cases_and_keeps_ratios():
    calls = []

    def make(key, seconds):
        def run(i):
            calls.append((key, i))
            time.sleep(seconds)

        return run

    runs = {"a": make("a", 0.001), "b": make("b", 0.004), "c": make("c", 0.0)}
    out = timing.time_interleaved_cpu(runs, 4, min_time_s=0.0, min_reps=5, max_reps=30)
    # 5 rounds asked, rounded up to lcm(3 implementations, 4 cases) = 12.
    assert set(out) == {"a", "b", "c"} and all(t.samples == 12 for t in out.values())
    timed = calls[-36:]  # after the warm-up and the estimating round
    for r in range(12):  # first key rotating
        keys = [k for k, _ in timed[3 * r : 3 * r + 3]]
        assert keys == (["a", "b", "c"] * 2)[r % 3 : r % 3 + 3]
    assert [i for _, i in timed] == [c % 4 for c in range(36)]  # consecutive calls differ
    for key in "abc":  # every implementation runs every case equally often
        assert sorted(i for k, i in timed if k == key) == sorted(list(range(4)) * 3)
    # sleep() lasts at least its argument; each median belongs to its own implementation.
    assert out["b"].seconds >= 0.004 and out["a"].seconds >= 0.001
    assert out["c"].seconds < out["b"].seconds


def test_queued_steps_time_runs_of_steps_between_synchronisations(monkeypatch):
    """``time_steps_queued``: each sample is ``per_rep`` steps in a row (case indices in
    turn) between two synchronisations on CUDA, seconds per step; none on the CPU."""
    import time

    calls, syncs = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(len(calls)))

    def step(key, seconds):
        def run(i):
            calls.append((key, i))
            time.sleep(seconds)

        return run

    runs = {"a": step("a", 0.001), "b": step("b", 0.005)}
    out = timing.time_steps_queued(runs, 3, torch.device("cuda"), per_rep=4, reps=2)
    assert set(out) == {"a", "b"} and all(t.samples == 2 for t in out.values())
    assert [i for k, i in calls if k == "a"] == [0, 1, 2] + [0, 1, 2, 0] * 2  # warm-up, reps
    assert syncs == [3, 7, 7, 11, 14, 18, 18, 22]  # around each run of 4 steps, not each step
    assert out["b"].seconds >= 0.005 and out["a"].seconds >= 0.001
    assert out["a"].seconds < out["b"].seconds
    syncs.clear()
    timing.time_steps_queued(runs, 3, torch.device("cpu"), per_rep=2, reps=1)
    assert syncs == []


def test_ceilings_cache_is_per_torch_build(tmp_path, monkeypatch):
    # Another build's cached peaks are not reused: the key names the build, so the call
    # measures (stubbed here) and adds its own entry beside the old one.
    cache = tmp_path / "ceilings.json"
    old_key = "cpu:x:1threads:torch0.0"
    cache.write_text(
        json.dumps(
            {
                old_key: {
                    "device": old_key,
                    "copy_gbps": 1.0,
                    "peak_tflops": {"fp32": 0.01, "bf16": 0.01},
                }
            }
        )
    )
    fresh = roofline.DeviceCeilings("now", 50.0, {"fp32": 0.5, "bf16": 2.0})
    monkeypatch.setattr(roofline, "measure_ceilings", lambda device: fresh)
    monkeypatch.setattr(roofline.torch, "__version__", "9.9.9")
    got = roofline.load_or_measure(torch.device("cpu"), cache)
    assert got == fresh and "torch9.9.9" in roofline.device_key(torch.device("cpu"))
    assert set(json.loads(cache.read_text())) == {old_key, roofline.device_key(torch.device("cpu"))}


def test_cli_end_to_end_on_cpu(tmp_path, capsys):
    cache = tmp_path / "ceilings.json"
    key = roofline.device_key(torch.device("cpu"))
    cache.write_text(
        json.dumps(
            {key: {"device": key, "copy_gbps": 10.0, "peak_tflops": {"fp32": 0.1, "bf16": 0.05}}}
        )
    )
    out = tmp_path / "r.json"
    argv = [
        "--preset",
        "cpu-tiny",
        "--tokens",
        "0,1,8",
        "--routing",
        "uniform,zipf",
        "--schemes",
        "bf16,fp32",
        "--preset-schemes",
        "cpu-tiny=fp8_block",
        "--device",
        "cpu",
        "--backends",
        "torch",
        "--min-time",
        "0.002",
        "--max-reps",
        "3",
        "--rotations",
        "2",
        "--ceilings",
        str(cache),
        "--json",
        str(out),
        "--png",
        str(tmp_path / "r.png"),
        "--md",
        str(tmp_path / "r.md"),
        "--quiet",
    ]
    assert cli_bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "hf:eager" in text and "hf:grouped_mm" in text and "torch" in text
    from moerunner.bench.report import load_json

    record, config, rows = load_json(out)
    assert record["argv"] == argv and record["environment"]["torch"] == torch.__version__
    assert config.shapes == (presets.PRESETS["cpu-tiny"],) and config.tokens == (0, 1, 8)
    assert eval(record["config"], {"BenchConfig": type(config), "BenchShape": BenchShape}) == config
    measured = [r for r in rows if r.status == "ok"]
    impls = {(r.impl, r.scheme) for r in measured}
    assert {
        ("torch", "bf16"),
        ("torch", "fp32"),
        ("torch", "fp8_block"),
        ("baseline:eager", "bf16"),
        ("baseline:grouped_mm", "fp32"),
    } <= impls
    for r in measured:
        if r.tokens:
            assert r.time_us > 0 and r.pct_roofline > 0 and r.checked_tokens > 0
            assert r.max_rel_err < 5e-2
            if not r.impl.startswith("baseline:"):
                assert set(r.speedup) == {"eager", "grouped_mm"}
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "cpu-tiny" in (tmp_path / "r.md").read_text()


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        cli_bench.main(["--preset", "nope", "--device", "cpu", "--quiet"])
    assert exc.value.code == 2 and "accepted" in capsys.readouterr().err
    assert cli_bench.main(["--ep-size", "2", "--quiet"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_timing_spread_and_its_warning():
    t = timing.summarize([1.0, 2.0, 3.0, 4.0, 100.0], "cpu")
    assert (t.seconds, t.min_s, t.max_s, t.samples) == (3.0, 1.0, 100.0, 5)
    assert (t.q1_s, t.q3_s) == (2.0, 4.0) and t.iqr_pct == pytest.approx(200 / 3)
    assert timing.summarize([2.0], "cpu").iqr_pct == 0.0
    from moerunner.bench import report
    from moerunner.bench.sweep import Row

    calm = Row("p", "bf16", "bf16", "torch", "uniform", 1, time_us=3.0, spread_pct=2.0)
    noisy = Row("p", "bf16", "bf16", "baseline:eager", "uniform", 1, time_us=3.0, spread_pct=40.0)
    assert report.spread_warning([calm], 10.0) is None
    warning = report.spread_warning([calm, noisy], 10.0)
    assert "1 of 2 rows" in warning and "40%" in warning
    text = report.table([calm, noisy], ("eager",), transformers_version=False)
    assert "spread%" in text.splitlines()[0] and "torch-eq:eager" in text and "hf:" not in text
    assert "hf:eager" in report.table([noisy], ("eager",), transformers_version="5.0")


def test_backends_side_by_side_with_ratios():
    from moerunner.bench import report
    from moerunner.bench.sweep import Row

    def row(impl, tokens, t, status="ok"):
        return Row("p", "bf16", "bf16", impl, "uniform", tokens, status=status, time_us=t)

    rows = [
        row("triton", 1, 40.0),
        row("flashinfer", 1, 50.0),
        row("baseline:eager", 1, 400.0),
        row("triton", 64, 80.0),
        row("flashinfer", 64, 60.0),
        row("triton", 4096, 900.0),
        row("flashinfer", 4096, float("nan"), status="failed"),
    ]
    lines = report.backends_side_by_side(rows).splitlines()
    assert lines[0].split() == [
        "preset",
        "scheme",
        "routing",
        "T",
        "triton",
        "us",
        "flashinfer",
        "us",
        "flashinfer/triton",
        "fastest",
    ]
    assert lines[1].split()[3:] == ["1", "40.0", "50.0", "1.25", "triton"]
    assert lines[2].split()[3:] == ["64", "80.0", "60.0", "0.75", "flashinfer"]
    assert lines[3].split()[3:] == ["4096", "900.0", "-", "-", "triton"]  # a failed row
    assert report.backends_side_by_side([rows[0], rows[2]]) == ""  # one backend: nothing


def test_copy_ceiling_is_the_best_block_median_after_the_warm_up():
    """The copy ceiling takes the fastest of its block medians (the best sustained rate; a
    single short median moved by 6 % between runs on one H100), after copying for the warm-up
    time."""
    medians = iter([4e-3, 1e-3, 2e-3])
    calls = []

    def fake_median(fn, device, repeats):
        calls.append(repeats)
        return next(medians)

    nbytes = 1 << 20
    t0 = time.perf_counter()
    gbps = roofline._copy_gbps(
        torch.device("cpu"), nbytes, 7, blocks=3, warm_s=0.05, timer=fake_median
    )
    assert time.perf_counter() - t0 >= 0.05
    assert calls == [7, 7, 7]
    assert gbps == pytest.approx(2 * nbytes / 1e-3 / 1e9)


@pytest.mark.parametrize("act", ["relu2", "silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul"])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_non_gated_baselines_compute_their_activation(act, impl):
    # bench's transformers baseline took only relu2 as non-gated: the *_no_mul activations
    # failed with a KeyError after the sweep had started.
    pytest.importorskip("transformers")
    import moerunner
    from moerunner.bench.baselines import build_baseline

    shape = BenchShape("n", 4, 32, 24, 2, act)
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 24, 32, generator=g) / 6, torch.randn(4, 32, 24, generator=g) / 5
    x = torch.randn(5, 32, generator=g)
    topk = moerunner.select_experts(torch.randn(5, 4, generator=g), 2)
    run, what = build_baseline(shape, impl, w13, w2)
    got = run(x, topk.ids.long(), topk.weights)
    want = moerunner.reference_moe(x, moerunner.ExpertWeights(w13, w2), topk.weights, topk.ids, act)
    assert "NemotronH" in what
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_trainable_baselines_compute_weight_gradients(impl, act):
    """The training-step benchmark's baselines train their weights as moerunner's step does
    (``trainable=True``): until it, transformers' modules held frozen copies, so their
    backward skipped the weight gradients that moerunner's computed. Gradients against
    float64 autograd of the reference; frozen modules still get none."""
    pytest.importorskip("transformers")
    import moerunner
    from moerunner.bench.baselines import build_baseline

    oai = act == "swiglu_oai"
    shape = BenchShape("t", 4, 32, 16, 2, act)
    g = torch.Generator().manual_seed(4)
    w13, w2 = torch.randn(4, 32, 32, generator=g) / 6, torch.randn(4, 32, 16, generator=g) / 4
    b13, b2 = (
        (torch.randn(4, 32, generator=g) / 8, torch.randn(4, 32, generator=g) / 8)
        if oai
        else (None, None)
    )
    x = torch.randn(5, 32, generator=g)
    topk = moerunner.select_experts(torch.randn(5, 4, generator=g), 2)
    run, what = build_baseline(shape, impl, w13, w2, b13, b2, trainable=True)
    run(x, topk.ids.long(), topk.weights).square().sum().backward()
    module = run.__closure__[0].cell_contents  # (the transformers module the callable runs)
    params = dict(module.named_parameters())
    w13_64, w2_64 = (w.double().requires_grad_() for w in (w13, w2))
    weights = moerunner.ExpertWeights(
        w13_64, w2_64, None if b13 is None else b13.double(), None if b2 is None else b2.double()
    )
    ref = moerunner.reference_moe(x.double(), weights, topk.weights.double(), topk.ids, act)
    ref.square().sum().backward()
    up, down = ("gate_up_proj", "down_proj")
    got13, got2 = params[up].grad, params[down].grad
    if oai:  # GPT-OSS stores [E, H, 2I] with gate/up interleaved and [E, I, H]
        i = 16
        order = torch.stack([torch.arange(i), torch.arange(i) + i], 1).reshape(-1)
        got13, want13, got2 = got13.transpose(1, 2), w13_64.grad[:, order], got2.transpose(1, 2)
    else:
        want13 = w13_64.grad
    torch.testing.assert_close(got13.double(), want13, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got2.double(), w2_64.grad, rtol=1e-4, atol=1e-5)
    frozen, _ = build_baseline(shape, impl, w13, w2, b13, b2)
    module = frozen.__closure__[0].cell_contents
    assert not any(p.requires_grad for p in module.parameters())
