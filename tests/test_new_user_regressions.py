"""Regressions from a new user's walkthrough of the README and docs (2026-11-28, CPU).

Each test is one finding: a silent wrong answer, an internal error or an argument accepted
and ignored, now a clear error naming the argument (or the right answer).
"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import MoeInputError
from moerunner.compat import vllm
from moerunner.lora import MoeLoraWeights, lora_hooks


@pytest.mark.parametrize("width", [4, 16])
def test_a_router_of_another_width_than_the_weights_is_refused(width):
    """Logits over 4 experts used only experts 0-3 of 8; over 16, ids >= 8 were dropped."""
    w13, w2, x = torch.randn(8, 64, 64), torch.randn(8, 64, 32), torch.randn(6, 64)
    logits = torch.randn(6, width)
    with pytest.raises(MoeInputError, match=rf"router_logits last dim must be .*E=8, got {width}"):
        moerunner.fused_moe_from_logits(x, logits, w13, w2, 2)
    with pytest.raises(MoeInputError, match=rf"gating_output last dim must be .*E=8, got {width}"):
        vllm.fused_moe(x, w13, w2, logits, 2, True)


def test_vllm_router_width_counts_the_global_experts_of_an_expert_map():
    w13, w2, x = torch.randn(4, 64, 64), torch.randn(4, 64, 32), torch.randn(3, 64)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
    out = vllm.fused_moe(x, w13, w2, torch.randn(3, 8), 2, True, expert_map=expert_map)
    assert out.shape == x.shape
    with pytest.raises(MoeInputError, match="gating_output last dim must be .*E=8, got 4"):
        vllm.fused_moe(x, w13, w2, torch.randn(3, 4), 2, True, expert_map=expert_map)


def test_lora_factors_for_another_number_of_experts_are_refused():
    """Factors over 2 experts with 4 experts computed a wrong answer (relative error 0.46)."""
    e, h, i, r = 4, 32, 16, 4
    torch.manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    x = torch.randn(5, h)
    topk = moerunner.select_experts(torch.randn(5, e), 2)
    for experts in (2, 8):
        factors = MoeLoraWeights(
            torch.randn(1, experts, r, h),
            torch.randn(1, experts, 2 * i, r),
            torch.randn(1, experts, r, i),
            torch.randn(1, experts, h, r),
        )
        hooks = lora_hooks(factors, torch.zeros(5, dtype=torch.int64))
        with pytest.raises(MoeInputError, match=rf"made for {experts} experts.*E={e}"):
            moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, hooks=hooks)


def test_lora_adapter_id_errors_name_the_adapter_ids():
    factors = MoeLoraWeights(*(torch.randn(2, 4, *s) for s in ((4, 32), (32, 4), (4, 16), (32, 4))))
    with pytest.raises(MoeInputError, match=r"lora: adapter_ids must be in \[-1, L=2\)"):
        lora_hooks(factors, torch.tensor([0, 2]))


def test_tune_without_a_backend_that_runs_here_says_why_once(capsys):
    """No ok row used to end in an internal ``zip()`` error instead of the reasons; the
    backend's refusal is now a usage error before any measurement."""
    from moerunner.cli import main

    if moerunner.default_registry().backends["flashinfer"].available()[0]:
        pytest.skip("needs a machine where the flashinfer backend cannot run")
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--shape", "8,64,96,2", "--schemes", "bf16", "--backends",
              "flashinfer", "--device", "cpu", "--tokens", "1,16"])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "zip()" not in err, err
    assert "cannot time shape 8,64,96,2 in bf16 on cpu with flashinfer: not installed" in err


def test_bench_activation_without_a_shape_is_a_usage_error(capsys):
    from moerunner.cli import main

    for value in ("foo", "relu2"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--preset", "cpu-tiny", "--activation", value])
        assert exit_info.value.code == 2
        assert "--activation applies to --shape rows only" in capsys.readouterr().err


def test_quantized_experts_refuse_other_implementations_with_a_clear_error():
    """After quantize_experts released the float weights, transformers' own implementations
    failed inside transformers with an IndexError."""
    transformers = pytest.importorskip("transformers")
    import moerunner.integrations.transformers as mt
    from moerunner.integrations.tiny_models import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    mt.quantize_experts(model, "int8_w8a16")
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        with pytest.raises(MoeInputError, match="use_moerunner"):
            model(ids)
        mt.use_moerunner(model)
        logits = model(ids).logits
        assert bool(logits.isfinite().all())
        model.set_experts_implementation("eager")
        with pytest.raises(MoeInputError, match="quantized only.*'eager'"):
            model(ids)


def test_unknown_backends_and_bad_layer_arguments_fail_where_they_are_given():
    """These were accepted and failed only at the first call (or never)."""
    cfg = moerunner.MoeConfig(8, 32, 16, 2)
    with pytest.raises(moerunner.BackendUnavailableError, match="'foo' is not registered"):
        moerunner.MoE(cfg, backend="foo")
    with pytest.raises(moerunner.BackendUnavailableError, match="'foo' is not registered"):
        moerunner.MoeRunner("foo")
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match="dtype must be one of the experts' float dtypes"):
            moerunner.MoE(cfg, dtype=dtype)
    with pytest.raises(MoeInputError, match="on_overflow must be one of"):
        moerunner.MoE(cfg, on_overflow="foo")
    # combine_dtype (the all_to_all dispatcher's return precision) names what it takes
    with pytest.raises(TypeError, match="combine_dtype must be None or one of"):
        moerunner.MoE(cfg, combine_dtype="fp32")
    with pytest.raises(TypeError, match="combine_dtype must be None or one of"):
        moerunner.MoE(cfg, combine_dtype=torch.float64)
    with pytest.raises(MoeInputError, match="option of the 'all_to_all' dispatcher; 'standard'"):
        moerunner.MoE(cfg, combine_dtype=torch.float32)


def test_the_transformers_integration_checks_its_backend_name_when_given():
    transformers = pytest.importorskip("transformers")
    import moerunner.integrations.transformers as mt
    from moerunner.integrations.tiny_models import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    with pytest.raises(moerunner.BackendUnavailableError, match="'foo' is not registered"):
        mt.use_moerunner(model, backend="foo")
    with pytest.raises(moerunner.BackendUnavailableError, match="'foo' is not registered"):
        mt.register("moerunner_foo", backend="foo")
    with pytest.raises(TypeError, match="relayout must be True or False"):
        mt.use_moerunner(model, relayout="yes")


def test_custom_routing_ids_out_of_range_are_refused_by_select_experts():
    def route(hidden, logits, top_k, renormalize):
        return torch.ones(logits.shape[0], top_k), torch.full((logits.shape[0], top_k), 99)

    with pytest.raises(MoeInputError, match=r"custom_routing_function: topk_ids .*E=8"):
        moerunner.select_experts(
            torch.randn(3, 8), 2, custom_routing_function=route, hidden_states=torch.randn(3, 4)
        )


def test_alternating_orders_or_activations_prepare_each_form_once_without_a_warning():
    """Calls alternating w13's order (or an activation with biases and one without) on the
    same weight objects re-prepared every call and warned that the caller passed new
    tensor objects each time."""
    import warnings

    from moerunner.runner import _CACHE_ATTR

    torch.manual_seed(0)
    w13, w2, x = torch.randn(4, 32, 16), torch.randn(4, 16, 16), torch.randn(3, 16)
    topk = moerunner.select_experts(torch.randn(3, 4), 2)
    outs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            for order in ("gate_up", "interleaved"):
                out = moerunner.fused_moe(
                    x, w13, w2, topk.weights, topk.ids, w13_order=order, backend="torch"
                )
                assert torch.equal(outs.setdefault(order, out), out)
    assert len(getattr(w13, _CACHE_ATTR)) == 2
    bias = torch.zeros(4, 32)
    for _ in range(3):  # an in-place bias edit leaves one form of that variant, not copies
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, w13_bias=bias, backend="torch")
        bias.add_(0.5)
    assert len(getattr(w13, _CACHE_ATTR)) == 3
    with_bias = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, w13_bias=bias, backend="torch"
    )
    fresh = moerunner.fused_moe(
        x, w13.clone(), w2, topk.weights, topk.ids, w13_bias=bias.clone(), backend="torch"
    )
    assert torch.equal(with_bias, fresh)


def test_smaller_messages_and_records():
    """An unusable named backend's error leads with a one-line summary of the request (it
    led with a 700-character repr); LoRA factors print their shapes, not their values; a
    transposed weight pair is named as such; grouped routing that cannot split the experts
    fails when the config is built; demo's JSON holds numbers."""
    import dataclasses
    import io
    import json
    from contextlib import redirect_stdout

    from moerunner.cli import main

    e, h, i = 4, 64, 48
    x = torch.randn(2, h)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    registry = moerunner.default_registry().copy()
    torch_backend = registry.backends["torch"]
    registry.register_backend(  # a backend that serves no device: rejected on any machine
        torch_backend.variant(
            name="refuses",
            capabilities=dataclasses.replace(torch_backend.capabilities, devices=frozenset()),
        )
    )
    with pytest.raises(moerunner.BackendUnavailableError) as info:
        moerunner.MoeRunner("refuses", registry=registry).select(
            moerunner.backends.base.MoeProblem.of(
                x,
                moerunner.ExpertWeights(torch.randn(e, 2 * i, h), torch.randn(e, h, i)),
                moerunner.ExpertWeights(torch.randn(e, 2 * i, h), torch.randn(e, h, i)).spec(
                    moerunner.Activation("silu")
                ),
                "standard",
            )
        )
    first = str(info.value).splitlines()[0]
    assert "E=4 H=64 I=48" in first and "QuantScheme(" not in first and len(first) < 200
    lora = MoeLoraWeights(*(torch.randn(2, e, *s) for s in ((4, h), (2 * i, 4), (4, i), (h, 4))))
    assert repr(lora).startswith("MoeLoraWeights(w13_a=[2, 4, 4, 64]") and "tensor(" not in repr(
        lora
    )
    with pytest.raises(MoeInputError, match=r"transposed\? w13 must be \[E, 2I, H\]"):
        moerunner.fused_moe(
            x, torch.randn(e, h, 2 * i), torch.randn(e, h, i), torch.rand(2, 2), ids
        )
    with pytest.raises(MoeInputError, match="num_expert_group=3 must divide E=8"):
        moerunner.MoeConfig(
            8, 32, 16, 2, routing=moerunner.RoutingConfig(num_expert_group=3, topk_group=1)
        )
    out = io.StringIO()
    with redirect_stdout(out):
        main(["demo", "--tokens", "4", "--hidden", "64", "--intermediate", "32", "--json", "-"])
    rows = json.loads(out.getvalue())["rows"]
    torch_row = next(r for r in rows if r["backend"] == "torch")
    assert isinstance(torch_row["max_rel_err"], float) and isinstance(torch_row["median_ms"], float)


def test_vllm_block_scales_without_block_shape_name_the_missing_argument():
    e, h, i = 4, 256, 128
    w1 = torch.randn(e, 2 * i, h).to(torch.float8_e4m3fn)
    w2 = torch.randn(e, h, i).to(torch.float8_e4m3fn)
    x, ids, weights = torch.randn(3, h), torch.zeros(3, 2, dtype=torch.int32), torch.rand(3, 2)
    with pytest.raises(MoeInputError, match=r"w1_scale \[4, 2, 2\] holds block scales.*block_"):
        vllm.fused_experts(
            x, w1, w2, weights, ids, use_fp8_w8a8=True,
            w1_scale=torch.ones(e, 2, 2), w2_scale=torch.ones(e, 2, 1),
        )  # fmt: skip


def test_layer_prepare_refuses_a_dtype_its_calls_would_refuse():
    """prepare(torch.bfloat16) on an fp32 layer succeeded; the first bf16 call then raised."""
    layer = moerunner.MoE(moerunner.MoeConfig(4, 32, 16, 2))
    with pytest.raises(TypeError, match="must equal hidden_states dtype torch.bfloat16"):
        layer.prepare(torch.bfloat16)
    layer.prepare(torch.float32)
    assert layer(torch.randn(3, 32), torch.randn(3, 4)).shape == (3, 32)


# -- valid but unusual inputs of fused_moe (a second walkthrough, same day) ---------------------


def _f64_moe(x, w13, w2, weights, ids):
    return moerunner.reference_moe(
        x, moerunner.ExpertWeights(w13.double(), w2.double()), weights, ids
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda e, n, k: torch.randn(e, 1, k).bfloat16().expand(e, n, k),  # broadcast rows
        lambda e, n, k: torch.randn(e, n, 1).bfloat16().expand(e, n, k),  # along K
        lambda e, n, k: torch.randn(e, 8 * n, 8 * k).bfloat16()[:, ::8, ::8],  # no unit stride
    ],
    ids=["rows_expanded", "k_expanded", "step8"],
)
def test_bf16_weights_without_a_unit_stride_run_on_the_torch_backend(make):
    # Was: an internal RuntimeError from torch._grouped_mm ("Invalid strides/sizes"): its
    # fitness check skipped unit strides and counted stride 0 as aligned.
    from moerunner.testing import DTYPE_BOUND, assert_close

    e, h, i = 4, 32, 16
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    w13, w2 = make(e, 2 * i, h), make(e, h, i)
    assert 1 not in w13.stride()[-2:] or 0 in w13.stride()  # the layouts under test
    x = (torch.randn(5, h, generator=g) * 0.2).bfloat16()
    topk = moerunner.select_experts(torch.randn(5, e, generator=g), 2, renormalize=True)
    out = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch")
    ref = _f64_moe(x, w13, w2, topk.weights, topk.ids)
    assert_close(out, ref, DTYPE_BOUND[torch.bfloat16])


def test_data_reassigned_to_the_same_memory_read_another_way_is_seen():
    # Was: the prepared weights were keyed on address, dtype, shape and version, so .data
    # set to a view of the same address with other strides reused the old matrices
    # (relative error 1.24).
    from moerunner.testing import DTYPE_BOUND, assert_close

    e, h, i = 4, 32, 16
    g = torch.Generator().manual_seed(2)
    big = torch.randn(e, 4 * i, h, generator=g) / h**0.5
    w13 = torch.nn.Parameter(big[:, : 2 * i], requires_grad=False)
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    x = torch.randn(6, h, generator=g)
    topk = moerunner.select_experts(torch.randn(6, e, generator=g), 2, renormalize=True)
    moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch")
    w13.data = big[:, ::2]  # same address and shape, every other row
    out = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch")
    assert_close(
        out, _f64_moe(x, big[:, ::2], w2, topk.weights, topk.ids), DTYPE_BOUND[torch.float32]
    )
