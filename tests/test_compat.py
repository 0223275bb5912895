"""moerunner.compat.vllm / .sglang against the native API on the same inputs, and their
quantized paths against the float64 reference with each format's bound."""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import ExpertWeights, MoeInputError, quantize, reference_moe
from moerunner.compat import sglang, vllm
from moerunner.quant import QuantizedWeight
from moerunner.testing import DTYPE_BOUND, assert_close, error_bound

E, H, I, T = 4, 128, 64, 6


def _problem(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    return x, logits, w13, w2


def _native(x, w13, w2, logits, k=2, **kw):
    topk = moerunner.select_experts(logits, k, renormalize=True)
    return topk, moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, **kw)


# -- vLLM ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_fused_experts_equals_native(dtype):
    x, logits, w13, w2 = _problem(1, dtype)
    b1, b2 = torch.randn(E, 2 * I).to(dtype), torch.randn(E, H).to(dtype)
    topk, native = _native(x, w13, w2, logits, w13_bias=b1, w2_bias=b2)
    out = vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, w1_bias=b1, w2_bias=b2)
    assert torch.equal(out, native)


def test_vllm_inplace_and_output():
    x, logits, w13, w2 = _problem(2)
    topk, native = _native(x, w13, w2, logits)
    into = torch.empty_like(x)
    got = vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, output=into)
    assert got is into and torch.equal(into, native)
    h = x.clone()
    got = vllm.fused_experts(h, w13, w2, topk.weights, topk.ids, inplace=True)
    assert got is h and torch.equal(h, native)
    with pytest.raises(MoeInputError, match="output"):
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, output=torch.empty(T, H + 1))
    with pytest.raises(MoeInputError, match="pass one"):
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, inplace=True, output=into)


def test_vllm_swigluoai_is_interleaved_swiglu_oai():
    x, logits, w13, w2 = _problem(3)
    topk, native = _native(x, w13, w2, logits, activation="swiglu_oai", gate_up_interleaved=True)
    out = vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, activation="swigluoai")
    assert torch.equal(out, native)
    with pytest.raises(MoeInputError, match="accepted"):
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, activation="swiglu")


def test_vllm_expert_map_global_ids():
    """Rank 1 of 2 holds global experts 4..7 as local 0..3; the others' slots contribute 0."""
    x, _, w13, w2 = _problem(4)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(T, 2 * E, generator=g)
    topk = moerunner.select_experts(logits, 3)
    expert_map = torch.tensor([-1] * E + list(range(E)), dtype=torch.int32)
    out = vllm.fused_experts(
        x, w13, w2, topk.weights, topk.ids, global_num_experts=2 * E, expert_map=expert_map
    )
    local = torch.where(topk.ids >= E, topk.ids - E, torch.full_like(topk.ids, -1))
    ref = reference_moe(x, ExpertWeights(w13, w2), topk.weights, local)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="expert_map")
    with pytest.raises(MoeInputError, match="global_num_experts"):
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, global_num_experts=2 * E)
    with pytest.raises(MoeInputError, match="entries"):
        vllm.fused_experts(
            x, w13, w2, topk.weights, topk.ids, global_num_experts=3 * E, expert_map=expert_map
        )
    bad = topk.ids.clone()
    bad[0, 0] = 2 * E
    with pytest.raises(MoeInputError):
        vllm.fused_experts(x, w13, w2, topk.weights, bad, expert_map=expert_map)


def test_vllm_routing_calls():
    x, logits, w13, w2 = _problem(5)
    w, ids, token_expert = vllm.fused_topk(x, logits, 2, True)
    topk = moerunner.select_experts(logits, 2, renormalize=True)
    assert torch.equal(w, topk.weights) and torch.equal(ids, topk.ids)
    assert token_expert.tolist() == [[t, T + t] for t in range(T)]
    assert vllm.fused_topk(x, logits, 2, False, indices_type=torch.int64)[1].dtype == torch.int64
    # grouped_topk: DeepSeek-V2 (best score per group) without a bias, V3 with one.
    v2 = vllm.grouped_topk(x, logits, 2, False, 2, 1, routed_scaling_factor=2.0)
    ref = moerunner.select_experts(
        logits, 2, num_expert_group=2, topk_group=1, routed_scaling_factor=2.0, group_score="max"
    )
    assert torch.equal(v2[0], ref.weights) and torch.equal(v2[1], ref.ids)
    bias = torch.randn(E)
    v3 = vllm.grouped_topk(
        x, logits, 2, True, 2, 1, scoring_func="sigmoid", e_score_correction_bias=bias
    )
    ref = moerunner.select_experts(
        logits, 2, scoring_func="sigmoid", renormalize=True, num_expert_group=2, topk_group=1,
        correction_bias=bias,
    )  # fmt: skip
    assert torch.equal(v3[0], ref.weights) and torch.equal(v3[1], ref.ids)
    # fused_moe: route then experts.
    out = vllm.fused_moe(x, w13, w2, logits, 2, True)
    assert torch.equal(out, _native(x, w13, w2, logits)[1])
    grouped = vllm.fused_moe(
        x, w13, w2, logits, 2, False, use_grouped_topk=True, num_expert_group=2, topk_group=1
    )
    ref = moerunner.select_experts(logits, 2, num_expert_group=2, topk_group=1, group_score="max")
    assert torch.equal(grouped, moerunner.fused_moe(x, w13, w2, ref.weights, ref.ids))


def test_vllm_custom_routing_and_llama4_weight_on_input():
    x, logits, w13, w2 = _problem(6)

    def llama4(hidden_states, gating_output, topk, renormalize):
        w, i = torch.topk(gating_output, topk, dim=-1)
        return torch.sigmoid(w.float()), i.to(torch.int32)

    out = vllm.fused_moe(x, w13, w2, logits, 1, False, custom_routing_function=llama4)
    topk = moerunner.select_experts(logits, 1, scoring_func="topk_sigmoid")
    # The function's fp32 sigmoid and select_experts' (float64, rounded once) may differ in
    # the last bit of a weight.
    native = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)
    torch.testing.assert_close(out, native, rtol=2e-6, atol=1e-7)
    on_input = vllm.fused_experts(
        x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True
    )
    native = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True
    )
    assert torch.equal(on_input, native)


def _fp8(w: torch.Tensor, scheme: str):
    q = quantize(w, scheme)
    return q.data, q.scale, q


@pytest.mark.parametrize("mode", ["tensor", "channel", "block", "tensor_static"])
def test_vllm_fp8(mode):
    x, logits, w13, w2 = _problem(7, torch.bfloat16)
    topk = moerunner.select_experts(logits, 2)
    scheme = {"tensor": "fp8_tensor", "channel": "fp8_channel", "block": "fp8_block"}.get(
        mode, "fp8_tensor"
    )
    d1, s1, q1 = _fp8(w13, scheme)
    d2, s2, q2 = _fp8(w2, scheme)
    kw = {}
    if mode == "channel":  # vLLM stores per-channel scales as [E, N, 1]
        s1, s2 = s1[..., None], s2[..., None]
        kw["per_channel_quant"] = True
    if mode == "block":
        kw["block_shape"] = [128, 128]
    if mode == "tensor_static":
        a1, a2 = torch.tensor([0.02]), torch.tensor([0.01])
        kw.update(a1_scale=a1, a2_scale=a2)
        q1 = quantize(w13, "fp8_tensor_static", input_scale=a1)
        q2 = quantize(w2, "fp8_tensor_static", input_scale=a2)
    out = vllm.fused_experts(
        x, d1, d2, topk.weights, topk.ids, use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2, **kw
    )
    native = moerunner.fused_moe(x, q1, q2, topk.weights, topk.ids)
    assert torch.equal(out, native)
    ref = reference_moe(x, ExpertWeights(q1, q2), topk.weights, topk.ids)
    assert_close(out, ref, error_bound(torch.bfloat16, True), what=f"fp8 {mode}")


def test_vllm_fp8_per_tensor_weights_with_per_token_activations():
    # vLLM's quant config keeps the weights' granularity (per_out_ch_quant) apart from the
    # activations' (per_act_token_quant): per-tensor [E] weight scales with per-token
    # activations were refused ("w1_scale must have shape [E, N]").
    x, logits, w13, w2 = _problem(44, torch.bfloat16)
    topk = moerunner.select_experts(logits, 2)
    d1, s1, _ = _fp8(w13, "fp8_tensor")
    d2, s2, _ = _fp8(w2, "fp8_tensor")
    out = vllm.fused_experts(
        x, d1, d2, topk.weights, topk.ids, use_fp8_w8a8=True, per_channel_quant=True,
        w1_scale=s1, w2_scale=s2,
    )  # fmt: skip
    rows = [
        QuantizedWeight("fp8_channel", tuple(d.shape), d, s[:, None].expand(d.shape[:2]).clone())
        for d, s in ((d1, s1), (d2, s2))
    ]  # the per-channel scheme with every row of an expert at its one scale
    assert torch.equal(out, moerunner.fused_moe(x, *rows, topk.weights, topk.ids))
    ref = reference_moe(x, ExpertWeights(*rows), topk.weights, topk.ids)
    assert_close(out, ref, error_bound(torch.bfloat16, True), what="fp8 tensor x token")


def test_vllm_fp8_shares_weight_data():
    x, logits, w13, w2 = _problem(8, torch.bfloat16)
    from moerunner.compat._common import QuantArgs, peer_weights

    d1, s1, _ = _fp8(w13, "fp8_block")
    d2, s2, _ = _fp8(w2, "fp8_block")
    q = QuantArgs(use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2, block_shape=[128, 128])
    q13, q2 = peer_weights("test", d1, d2, q)
    assert q13.data.data_ptr() == d1.data_ptr() and q13.scale.data_ptr() == s1.data_ptr()


@pytest.mark.parametrize("mode", ["int8_w8a8", "int8_w8a16"])
def test_vllm_int8(mode):
    x, logits, w13, w2 = _problem(9, torch.bfloat16)
    topk = moerunner.select_experts(logits, 2)
    scheme = "int8" if mode == "int8_w8a8" else "int8_w8a16"
    q1, q2 = quantize(w13, scheme), quantize(w2, scheme)
    kw = {f"use_{mode}": True, "w1_scale": q1.scale[..., None], "w2_scale": q2.scale}
    if mode == "int8_w8a8":
        kw["per_channel_quant"] = True
    out = vllm.fused_experts(x, q1.data, q2.data, topk.weights, topk.ids, **kw)
    assert torch.equal(out, moerunner.fused_moe(x, q1, q2, topk.weights, topk.ids))
    ref = reference_moe(x, ExpertWeights(q1, q2), topk.weights, topk.ids)
    assert_close(out, ref, error_bound(torch.bfloat16, mode == "int8_w8a8"), what=mode)


@pytest.mark.parametrize("zp", [False, True])
def test_vllm_int4_w4a16(zp):
    x, logits, w13, w2 = _problem(10, torch.bfloat16)
    topk = moerunner.select_experts(logits, 2)
    scheme = "int4_g32_zp" if zp else "int4_g32"
    q1, q2 = quantize(w13, scheme), quantize(w2, scheme)

    def pack_zp(z):  # vLLM: two 4-bit zero points per byte along N, low nibble = even row
        return z[:, 0::2] | (z[:, 1::2] << 4)

    kw = dict(
        use_int4_w4a16=True,
        block_shape=[0, 32],
        w1_scale=q1.scale.to(torch.bfloat16) if not zp else q1.scale,
        w2_scale=q2.scale,
    )
    if zp:
        kw.update(w1_zp=pack_zp(q1.zero_point), w2_zp=pack_zp(q2.zero_point))
    out = vllm.fused_experts(x, q1.data, q2.data, topk.weights, topk.ids, **kw)
    if not zp:  # the bf16 scales of w1 were rounded: compare against those
        q1 = type(q1)(q1.scheme, q1.shape, q1.data, q1.scale.to(torch.bfloat16).float())
    assert torch.equal(out, moerunner.fused_moe(x, q1, q2, topk.weights, topk.ids))
    ref = reference_moe(x, ExpertWeights(q1, q2), topk.weights, topk.ids)
    assert_close(out, ref, error_bound(torch.bfloat16, False), what="int4")


def test_vllm_unmapped_arguments_raise_naming_them():
    x, logits, w13, w2 = _problem(11)
    topk = moerunner.select_experts(logits, 2)
    call = (x, w13, w2, topk.weights, topk.ids)
    with pytest.raises(MoeInputError, match="w1_scale"):
        vllm.fused_experts(*call, w1_scale=torch.ones(E))
    with pytest.raises(MoeInputError, match="use_fp8_w8a8 and use_int8_w8a8"):
        vllm.fused_experts(*call, use_fp8_w8a8=True, use_int8_w8a8=True)
    with pytest.raises(MoeInputError, match="per_channel_quant"):
        q = quantize(w13, "int8")
        vllm.fused_experts(
            x, q.data, quantize(w2, "int8").data, topk.weights, topk.ids, use_int8_w8a8=True,
            w1_scale=torch.ones(E), w2_scale=torch.ones(E),
        )  # fmt: skip
    with pytest.raises(MoeInputError, match="quant_config"):
        vllm.fused_experts(*call, quant_config=object())
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        vllm.fused_experts(*call, use_fp8_w8a8=True, w1_scale=torch.ones(E), w2_scale=torch.ones(E))
    with pytest.raises(MoeInputError, match="block_shape"):
        q4 = quantize(w13, "int4_g32")
        vllm.fused_experts(
            x, q4.data, quantize(w2, "int4_g32").data, topk.weights, topk.ids,
            use_int4_w4a16=True, w1_scale=q4.scale, w2_scale=torch.ones(1),
        )  # fmt: skip


triton_pkg = pytest.importorskip("moerunner.backends.triton")


@pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(), reason="no triton runtime"
)
def test_vllm_fused_experts_triton_fp32():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 32, generator=g).to(device)
    w13 = (torch.randn(E, 32, 32, generator=g) * 0.2).to(device)
    w2 = (torch.randn(E, 32, 16, generator=g) * 0.2).to(device)
    topk = moerunner.select_experts(torch.randn(3, E, generator=g).to(device), 2)
    out = vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, backend="triton")
    native = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="triton")
    assert torch.equal(out, native)
    ref = reference_moe(x, ExpertWeights(w13, w2), topk.weights, topk.ids)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="triton")


# -- SGLang --------------------------------------------------------------------------------


def test_sglang_select_experts_and_fused_experts():
    x, logits, w13, w2 = _problem(13)
    cfg = sglang.TopKConfig(top_k=2, renormalize=True)
    topk_output = sglang.select_experts(x, logits, cfg)
    assert isinstance(topk_output, sglang.StandardTopKOutput)
    assert topk_output.router_logits is logits
    topk, native = _native(x, w13, w2, logits)
    assert torch.equal(topk_output.topk_ids, topk.ids)
    # SGLang's default MoeRunnerConfig is in place: the result lands in hidden_states.
    h = x.clone()
    got = sglang.fused_experts(h, w13, w2, topk_output)
    assert got is h and torch.equal(h, native)
    out = sglang.fused_moe(x, w13, w2, topk_output, sglang.MoeRunnerConfig(inplace=False))
    assert torch.equal(out, native) and not torch.equal(x, native)


def test_sglang_grouped_scaling_and_padding():
    x, logits, w13, w2 = _problem(14)
    bias = torch.randn(E)
    cfg = sglang.TopKConfig(
        top_k=2, use_grouped_topk=True, num_expert_group=2, topk_group=1, correction_bias=bias,
        scoring_func="sigmoid", routed_scaling_factor=2.5,
    )  # fmt: skip
    out = sglang.select_experts(x, logits, cfg)
    ref = moerunner.select_experts(
        logits, 2, scoring_func="sigmoid", renormalize=True, correction_bias=bias,
        num_expert_group=2, topk_group=1,
    )  # fmt: skip
    assert torch.equal(out.topk_weights, ref.weights)  # factor not applied to the weights
    applied = sglang.select_experts(
        x,
        logits,
        sglang.TopKConfig(**{**cfg.__dict__, "apply_routed_scaling_factor_on_output": True}),
    )
    torch.testing.assert_close(applied.topk_weights, ref.weights * 2.5, rtol=0, atol=0)
    # Expert output scaled by MoeRunnerConfig.routed_scaling_factor.
    runner_cfg = sglang.MoeRunnerConfig(inplace=False, routed_scaling_factor=2.5)
    scaled = sglang.fused_experts(x, w13, w2, out, runner_cfg)
    native = moerunner.fused_moe(x, w13, w2, ref.weights * 2.5, ref.ids)
    assert torch.equal(scaled, native)
    padded = sglang.select_experts(x, logits, cfg, num_token_non_padded=torch.tensor(4))
    assert (padded.topk_ids[4:] == -1).all() and torch.equal(padded.topk_ids[:4], ref.ids[:4])


def test_sglang_gpt_oss_swiglu_and_biases():
    x, logits, w13, w2 = _problem(15)
    b1, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    topk = moerunner.select_experts(logits, 2)
    cfg = sglang.MoeRunnerConfig(inplace=False, gemm1_alpha=1.5, gemm1_clamp_limit=5.0)
    out = sglang.fused_experts(x, w13, w2, (topk.weights, topk.ids, None), cfg, b1, b2)
    native = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai", gate_up_interleaved=True,
        swiglu_alpha=1.5, swiglu_limit=5.0, w13_bias=b1, w2_bias=b2,
    )  # fmt: skip
    assert torch.equal(out, native)


def test_sglang_unmapped_arguments_raise():
    x, logits, w13, w2 = _problem(16)
    topk_output = sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2))
    with pytest.raises(MoeInputError, match="no_combine"):
        sglang.fused_experts(x, w13, w2, topk_output, sglang.MoeRunnerConfig(no_combine=True))
    with pytest.raises(MoeInputError, match="num_fused_shared_experts"):
        sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2, num_fused_shared_experts=1))
    with pytest.raises(MoeInputError, match="activation"):
        sglang.fused_experts(
            x, w13[:, :I], w2, topk_output, sglang.MoeRunnerConfig(activation="situ")
        )


def test_sglang_custom_routing_function_keywords():
    x, logits, w13, w2 = _problem(17)

    def route(*, hidden_states, gating_output, topk, renormalize):
        w, i = torch.topk(gating_output, topk, dim=-1)
        return torch.softmax(w, dim=-1), i

    out = sglang.select_experts(
        x, logits, sglang.TopKConfig(top_k=2, custom_routing_function=route)
    )
    topk = moerunner.select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(out.topk_weights, topk.weights, rtol=1e-6, atol=0)
    assert torch.equal(out.topk_ids, topk.ids)


# -- the peers' semantics where they are easy to miss ----------------------------------------


def _deepseek_v3_routing_f64(logits, bias, k, groups, topk_group):
    """SGLang's / vLLM's biased grouped top-k in float64, written from their sources:
    sigmoid scores, groups ranked by the sum of their two best biased scores, top-k of the
    biased scores in the kept groups, weights = unbiased scores renormalized."""
    scores = torch.sigmoid(logits.double())
    biased = scores + bias.double()
    t, e = scores.shape
    group_best = biased.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros(t, groups, dtype=torch.bool)
    kept.scatter_(1, group_best.topk(topk_group, dim=-1).indices, True)
    kept = kept[:, :, None].expand(t, groups, e // groups).reshape(t, e)
    ids = biased.masked_fill(~kept, float("-inf")).topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True), ids


def test_sglang_biased_grouped_topk_scores_with_sigmoid_whatever_scoring_func():
    # SGLang's DeepSeek-V3 layer passes correction_bias with the TopKConfig default
    # scoring_func ("softmax"); its biased_grouped_topk scores with sigmoid regardless.
    g = torch.Generator().manual_seed(40)
    e, t = 16, 5
    x, logits, bias = torch.randn(t, 8, generator=g), torch.randn(t, e, generator=g), None
    bias = torch.randn(e, generator=g) * 0.5
    cfg = sglang.TopKConfig(
        top_k=4, use_grouped_topk=True, num_expert_group=4, topk_group=2, correction_bias=bias
    )
    out = sglang.select_experts(x, logits, cfg)
    w_ref, ids_ref = _deepseek_v3_routing_f64(logits, bias, 4, 4, 2)
    assert torch.equal(out.topk_ids.long().sort(-1).values, ids_ref.sort(-1).values)
    order = out.topk_ids.long().argsort(-1)
    got = out.topk_weights.double().gather(1, order)
    want = w_ref.gather(1, ids_ref.argsort(-1))
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)  # float32 weights


def test_sglang_topk_module_as_its_models_build_and_call_it():
    # SGLang's MoE models build TopK(...) and call self.topk(hidden_states, router_logits);
    # its layers branch on topk_output.format and assign config fields after building.
    g = torch.Generator().manual_seed(42)
    e, t = 16, 5
    x, logits = torch.randn(t, 8, generator=g), torch.randn(t, e, generator=g)
    bias = torch.nn.Parameter(torch.randn(e, generator=g) * 0.5)
    topk = sglang.TopK(
        top_k=4, layer_id=3, use_grouped_topk=True, num_expert_group=4, topk_group=2,
        renormalize=True, correction_bias=bias, quant_config=None, routed_scaling_factor=2.5,
        apply_routed_scaling_factor_on_output=False,
        output_format=sglang.TopKOutputFormat.STANDARD,
    )  # fmt: skip
    out = topk(x, logits)
    assert out.format.is_standard() and not out.format.is_bypassed()
    w_ref, ids_ref = _deepseek_v3_routing_f64(logits, bias.detach(), 4, 4, 2)
    assert torch.equal(out.topk_ids.long().sort(-1).values, ids_ref.sort(-1).values)
    order = out.topk_ids.long().argsort(-1)
    got = out.topk_weights.double().gather(1, order)
    torch.testing.assert_close(got, w_ref.gather(1, ids_ref.argsort(-1)), rtol=2e-7, atol=0)
    topk.topk_config.torch_native = True  # as SGLang's forward_native does
    padded = topk(x, logits, num_token_non_padded=torch.tensor(3))
    assert (padded.topk_ids[3:] == -1).all() and torch.equal(padded.topk_ids[:3], out.topk_ids[:3])
    with pytest.raises(TypeError, match="zero_expert_num"):
        sglang.TopK(top_k=2, zero_expert_num=1)


def test_sglang_runner_config_fields_assigned_after_building_take_effect():
    x, logits, w13, w2 = _problem(43)
    topk_output = sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2))
    cfg = sglang.MoeRunnerConfig()
    cfg.inplace = False  # SGLang's FusedMoE does this for some runners
    h = x.clone()
    out = sglang.fused_experts(h, w13, w2, topk_output, cfg)
    assert out is not h and torch.equal(h, x)
    _, native = _native(x, w13, w2, logits)
    assert torch.equal(out, native)


def test_sglang_gemm1_alpha_or_limit_alone_is_refused():
    x, logits, w13, w2 = _problem(41)
    topk_output = sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2))
    for only in ({"gemm1_alpha": 1.702}, {"gemm1_clamp_limit": 7.0}, {"gemm1_alpha": 0.0}):
        cfg = sglang.MoeRunnerConfig(inplace=False, **only)
        with pytest.raises(MoeInputError, match=f"{next(iter(only))} without"):
            sglang.fused_experts(x, w13, w2, topk_output, cfg)


def test_sglang_output_format_enum_standard_is_accepted():
    import enum

    class TopKOutputFormat(enum.Enum):  # SGLang's enum, as its model files pass it
        STANDARD = enum.auto()
        TRITON_KERNEL = enum.auto()

    x, logits, _, _ = _problem(42)
    cfg = sglang.TopKConfig(top_k=2, output_format=TopKOutputFormat.STANDARD)
    plain = sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2))
    assert torch.equal(sglang.select_experts(x, logits, cfg).topk_ids, plain.topk_ids)
    with pytest.raises(MoeInputError, match="output_format"):
        sglang.select_experts(
            x, logits, sglang.TopKConfig(top_k=2, output_format=TopKOutputFormat.TRITON_KERNEL)
        )


def test_router_weight_on_input_with_a_gemm1_bias_is_refused_by_both_shims():
    # The peers compute w * (x W1^T + b1); moerunner's input weighting would give
    # (w * x) W1^T + b1: different numbers, so the pair is an error, not a silent mismatch.
    x, logits, w13, w2 = _problem(43)
    topk = moerunner.select_experts(logits, 1)
    b1 = torch.randn(E, 2 * I)
    with pytest.raises(MoeInputError, match="apply_router_weight_on_input"):
        vllm.fused_experts(
            x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True, w1_bias=b1
        )
    cfg = sglang.MoeRunnerConfig(inplace=False, apply_router_weight_on_input=True)
    with pytest.raises(MoeInputError, match="apply_router_weight_on_input"):
        sglang.fused_experts(x, w13, w2, (topk.weights, topk.ids), cfg, b1)
    # Without the GEMM1 bias the two agree, and so does the shim with a GEMM2 bias.
    b2 = torch.randn(E, H)
    out = vllm.fused_experts(
        x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True, w2_bias=b2
    )
    native = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True, w2_bias=b2
    )
    assert torch.equal(out, native)


class _QuantConfig:
    """The properties of vLLM's FusedMoEQuantConfig that its fused_experts reads."""

    def __init__(self, **given):
        defaults = dict.fromkeys(
            ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16",
             "per_act_token_quant", "use_mxfp4_w4a16"), False,
        )  # fmt: skip
        names = ("w1_scale", "w2_scale", "w1_zp", "w2_zp", "a1_scale", "a2_scale")
        defaults.update(dict.fromkeys(names + ("block_shape", "w1_bias", "w2_bias")))
        defaults["ocp_mx_scheme"] = None
        self.__dict__.update({**defaults, **given})


def test_vllm_quant_config_equals_the_flat_arguments():
    x, logits, w13, w2 = _problem(44)
    topk = moerunner.select_experts(logits, 2)
    call = (x, w13, w2, topk.weights, topk.ids)
    b1, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    biased = vllm.fused_experts(*call, quant_config=_QuantConfig(w1_bias=b1, w2_bias=b2))
    assert torch.equal(biased, vllm.fused_experts(*call, w1_bias=b1, w2_bias=b2))
    q1, q2 = quantize(w13, "fp8_block"), quantize(w2, "fp8_block")
    qcall = (x, q1.data, q2.data, topk.weights, topk.ids)
    block = _QuantConfig(
        use_fp8_w8a8=True, w1_scale=q1.scale, w2_scale=q2.scale, block_shape=[128, 128]
    )
    flat = vllm.fused_experts(
        *qcall, use_fp8_w8a8=True, w1_scale=q1.scale, w2_scale=q2.scale, block_shape=[128, 128]
    )
    assert torch.equal(vllm.fused_experts(*qcall, quant_config=block), flat)
    # Positionally, as vLLM's current fused_experts takes it (quant_config 11th).
    positional = vllm.fused_experts(*qcall, False, "silu", False, -1, None, block)
    assert torch.equal(positional, flat)
    with pytest.raises(MoeInputError, match="use_mxfp4_w4a16"):
        vllm.fused_experts(*call, quant_config=_QuantConfig(use_mxfp4_w4a16=True))
    with pytest.raises(MoeInputError, match="pass one"):
        vllm.fused_experts(*call, quant_config=_QuantConfig(), w1_bias=b1)


def test_vllm_older_positional_order_fails_instead_of_misreading():
    # vLLM 0.9 took use_fp8_w8a8 ninth, where the current release (and this shim) has
    # global_num_experts: a call in the old order must not run with a flag read as a count.
    x, logits, w13, w2 = _problem(45)
    topk = moerunner.select_experts(logits, 2)
    with pytest.raises(TypeError, match="keyword-only"):
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, False, "silu", False, False)
    with pytest.raises(TypeError):  # more positional arguments than vLLM's current eleven
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, False, "silu", False, -1, None,
                           None, False)  # fmt: skip


def test_vllm_moe_activation_enum_and_is_act_and_mul():
    import enum

    class MoEActivation(enum.Enum):  # vLLM's enum (values are its activation names)
        SILU = "silu"
        SWIGLUOAI = "swigluoai"
        RELU2_NO_MUL = "relu2_no_mul"
        SILU_NO_MUL = "silu_no_mul"

    x, logits, w13, w2 = _problem(46)
    topk = moerunner.select_experts(logits, 2)
    call = (x, w13, w2, topk.weights, topk.ids)
    for member in (MoEActivation.SILU, MoEActivation.SWIGLUOAI):
        got = vllm.fused_experts(*call, activation=member)
        assert torch.equal(got, vllm.fused_experts(*call, activation=member.value))
    plain = (x, w13[:, :I], w2, topk.weights, topk.ids)
    relu2 = vllm.fused_experts(*plain, activation=MoEActivation.RELU2_NO_MUL)
    # vLLM 0.10's spelling of the same: relu2 with is_act_and_mul=False.
    assert torch.equal(relu2, vllm.fused_experts(*plain, activation="relu2", is_act_and_mul=False))
    # non-gated silu: MoEActivation.SILU_NO_MUL, or vLLM 0.10's silu with is_act_and_mul=False
    silu = vllm.fused_experts(*plain, activation=MoEActivation.SILU_NO_MUL)
    assert torch.equal(silu, vllm.fused_experts(*plain, activation="silu", is_act_and_mul=False))


@pytest.mark.parametrize(
    ("peer", "function"),
    [
        ("silu", lambda h: h / (1 + torch.exp(-h))),
        ("gelu", lambda h: 0.5 * h * (1 + torch.erf(h / 2**0.5))),
        ("gelu_tanh", lambda h: 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5
                                                          * (h + 0.044715 * h**3)))),
    ],
)  # fmt: skip
def test_non_gated_activations_of_both_peers(peer, function):
    # vLLM's *_no_mul and SGLang's is_gated=False: w1 [E, I, H], act(x W1^T) W2^T, no up.
    x, logits, w13, w2 = _problem(50)
    w1 = w13[:, :I].contiguous()
    topk = moerunner.select_experts(logits, 2)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for w, e in zip(topk.weights[t].double(), topk.ids[t].tolist(), strict=True):
            want[t] += w * (function(x[t].double() @ w1[e].double().T) @ w2[e].double().T)
    bound = error_bound(torch.float32, False)
    got = vllm.fused_experts(x, w1, w2, topk.weights, topk.ids, activation=f"{peer}_no_mul")
    assert_close(got, want, bound)
    if peer != "gelu_tanh":  # SGLang's Triton runner has no non-gated gelu_tanh
        cfg = sglang.MoeRunnerConfig(inplace=False, activation=peer, is_gated=False)
        assert_close(sglang.fused_experts(x, w1, w2, (topk.weights, topk.ids), cfg), want, bound)


def test_vllm_fused_topk_sigmoid_scoring():
    x, logits, _, _ = _problem(47)
    w, ids, _ = vllm.fused_topk(x, logits, 2, True, scoring_func="sigmoid")
    scores = torch.sigmoid(logits.double())
    ref_w, ref_ids = scores.topk(2, dim=-1)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w.double(), ref_w / ref_w.sum(-1, keepdim=True), rtol=2e-7, atol=0)
    with pytest.raises(MoeInputError, match="scoring_func"):
        vllm.fused_topk(x, logits, 2, True, scoring_func="sqrtsoftplus")


def test_vllm_positional_activation_of_the_releases_without_inplace():
    # vLLM dropped fused_experts' inplace (mid-2026): activation is sixth. Read as inplace,
    # such a call ran silu whatever it named and overwrote hidden_states.
    import enum

    class MoEActivation(enum.Enum):
        GELU = "gelu"
        GELU_TANH = "gelu_tanh"

    x, logits, w13, w2 = _problem(47)
    topk = moerunner.select_experts(logits, 2)
    call = (x, w13, w2, topk.weights, topk.ids)
    kept = x.clone()
    want = reference_moe(x, ExpertWeights(w13, w2), topk.weights, topk.ids, "gelu")
    for activation in (MoEActivation.GELU, "gelu"):
        got = vllm.fused_experts(*call, activation)
        assert torch.equal(x, kept)  # not in place: the releases without inplace return anew
        assert_close(got, want, error_bound(torch.float32, False))
        assert not torch.allclose(got, vllm.fused_experts(*call, "silu"))
    tanh = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="gelu_tanh")
    for name in (MoEActivation.GELU_TANH, "gelu_tanh", "gelu_pytorch_tanh"):
        assert torch.equal(vllm.fused_experts(*call, name), tanh)
    # every positional argument of that order, against the same call by keyword
    assert torch.equal(
        vllm.fused_experts(*call, "gelu", False, E, None, None),
        vllm.fused_experts(*call, activation="gelu", global_num_experts=E),
    )
    # the older order (inplace sixth) still reads as before
    assert torch.equal(vllm.fused_experts(*call, False, "gelu"), vllm.fused_experts(*call, "gelu"))
    with pytest.raises(TypeError, match="multiple values for argument 'activation'"):
        vllm.fused_experts(*call, "gelu", activation="silu")
    with pytest.raises(TypeError, match="at most 10 positional"):
        vllm.fused_experts(*call, "gelu", False, -1, None, None, None)


def _sglang_reference(x, w13, w2, topk, gate_up):
    """float64 experts sum with SGLang's activation ``gate_up(h) -> [rows, I]`` on GEMM1's
    full output (its Triton runner's activation branches, written out here)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(topk.weights[t].double(), topk.ids[t].tolist(), strict=True):
            out[t] += w * (gate_up((x[t] @ w13[e].T)[None])[0] @ w2[e].T)
    return out


def test_sglang_swiglu_fields_of_its_later_releases():
    # MoeRunnerConfig grew swiglu_limit (DeepSeek-V4), gate_up_interleaved (MiniMax-M3) and
    # gemm1_beta; fused_experts grew fuse_swiglu_interleaved. Inputs reach past the clamps.
    x, logits, w13, w2 = _problem(48)
    x = x * 30
    topk = moerunner.select_experts(logits, 2)
    call = (x, w13, w2, (topk.weights, topk.ids, logits))
    halves = lambda h: (h[:, :I], h[:, I:])  # noqa: E731
    pairs = lambda h: (h[:, 0::2], h[:, 1::2])  # noqa: E731
    bound = error_bound(torch.float32, False)

    def dsv4(h):  # swiglu_limit: clamp, then silu_and_mul, on halves
        g, u = halves(h)
        return torch.nn.functional.silu(g.clamp(max=10.0)) * u.clamp(-10.0, 10.0)

    cfg = sglang.MoeRunnerConfig(inplace=False, swiglu_limit=10.0)
    want = _sglang_reference(x, w13, w2, topk, dsv4)
    assert (x.double() @ w13[0].double().T).abs().max() > 10  # the clamp matters
    assert_close(sglang.fused_experts(*call, cfg), want, bound)

    def gpt_oss(split):  # gemm1_alpha + gemm1_clamp_limit
        def act(h):
            g, u = split(h)
            g, u = g.clamp(max=5.0), u.clamp(-5.0, 5.0)
            return g * torch.sigmoid(1.5 * g) * (u + 1)

        return act

    for interleaved, split in ((True, pairs), (False, halves)):
        cfg = sglang.MoeRunnerConfig(
            inplace=False, gemm1_alpha=1.5, gemm1_clamp_limit=5.0, gemm1_beta=1.0,
            gate_up_interleaved=interleaved, routing_method_type=1, layer=object(),
            use_tp_all_gather_activation=True,
        )  # fmt: skip
        want = _sglang_reference(x, w13, w2, topk, gpt_oss(split))
        assert_close(sglang.fused_experts(*call, cfg), want, bound)

    def fused_pairs(h):
        g, u = pairs(h)
        return torch.nn.functional.silu(g) * u

    cfg = sglang.MoeRunnerConfig(inplace=False)
    xb, w13b, w2b = (t.bfloat16() for t in (x, w13, w2))  # SGLang fuses for bf16 only
    want = _sglang_reference(xb, w13b, w2b, topk, fused_pairs)
    got = sglang.fused_experts(xb, w13b, w2b, call[3], cfg, fuse_swiglu_interleaved=True)
    assert_close(got, want, error_bound(torch.bfloat16, False))
    with pytest.raises(MoeInputError, match="fuse_swiglu_interleaved=True takes bf16"):
        sglang.fused_experts(*call, cfg, fuse_swiglu_interleaved=True)  # fp32 (was accepted)

    with pytest.raises(MoeInputError, match="gemm1_beta"):
        sglang.fused_experts(*call, sglang.MoeRunnerConfig(gemm1_beta=0.5, gemm1_alpha=1.5,
                                                           gemm1_clamp_limit=5.0))  # fmt: skip
    with pytest.raises(MoeInputError, match="pass one"):
        sglang.fused_experts(*call, sglang.MoeRunnerConfig(swiglu_limit=10.0, gemm1_alpha=1.5,
                                                           gemm1_clamp_limit=5.0))  # fmt: skip
    with pytest.raises(MoeInputError, match="swiglu_limit apply to the gated 'silu'"):
        sglang.fused_experts(*call, sglang.MoeRunnerConfig(swiglu_limit=10.0, activation="gelu"))
    with pytest.raises(MoeInputError, match="fuse_swiglu_interleaved"):
        sglang.fused_experts(*call, sglang.MoeRunnerConfig(swiglu_limit=10.0),
                             fuse_swiglu_interleaved=True)  # fmt: skip
    with pytest.raises(MoeInputError, match="fuse_swiglu_interleaved"):
        sglang.fused_experts(*call, sglang.MoeRunnerConfig(), torch.zeros(E, 2 * I),
                             fuse_swiglu_interleaved=True)  # fmt: skip
    with pytest.raises(MoeInputError, match="a1_q"):
        sglang.fused_experts(*call, sglang.MoeRunnerConfig(), a1_q=x)


def test_sglang_routing_fields_of_its_later_releases():
    x, logits, w13, w2 = _problem(49)
    cfg = sglang.TopKConfig(
        top_k=2, fused_shared_experts_scaling_factor=None, allow_routed_experts_capture=False
    )
    got = sglang.select_experts(x, logits, cfg, layer_id=3)
    want = sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2))
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.topk_weights, want.topk_weights)


def test_vllm_swiglustep_clamps_silu_at_7():
    # vLLM's swiglustep: silu(gate).clamp(max=7) * up.clamp(-7, 7), gate then up halves.
    x, logits, w13, w2 = _problem(51)
    x = x * 40
    topk = moerunner.select_experts(logits, 2)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for w, e in zip(topk.weights[t].double(), topk.ids[t].tolist(), strict=True):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            h = torch.nn.functional.silu(gate).clamp(max=7.0) * up.clamp(-7.0, 7.0)
            want[t] += w * (w2[e].double() @ h)
    assert bool((x.double() @ w13[0, :I].double().T > 7).any())  # the clamp is reached
    got = vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, "swiglustep")
    assert_close(got, want, error_bound(torch.float32, False))


def _clamped_swiglu_want(x, w13, w2, topk, alpha, beta, limit, interleaved=False):
    """float64: sum_j w_j * w2 @ (g * sigmoid(alpha * g) * (u + beta)), g = min(gate, L),
    u = clamp(up, -L, L); gate then up halves, or alternating rows."""
    want = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk.weights[t].double(), topk.ids[t].tolist(), strict=True):
            h = w13[e].double() @ x[t].double()
            gate, up = (h[0::2], h[1::2]) if interleaved else h.chunk(2)
            g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
            want[t] += w * (w2[e].double() @ (g * torch.sigmoid(alpha * g) * (u + beta)))
    return want


def test_vllm_quant_config_gemm1_activation_parameters():
    """vLLM's quant config carries the clamped SwiGLU's parameters (gemm1_alpha, gemm1_beta,
    gemm1_clamp_limit); they were not read, so a config with MiniMax-M3's values ran GPT-OSS's
    and a clamped SiLU ran unclamped, silently. swigluoai_uninterleave (gate then up
    halves) was refused."""
    x, logits, w13, w2 = _problem(52)
    x = x * 40  # GEMM1 values reach the clamp
    topk = moerunner.select_experts(logits, 2)
    call = (x, w13, w2, topk.weights, topk.ids)
    bound = error_bound(torch.float32, False)
    m3 = _QuantConfig(gemm1_alpha=1.5, gemm1_beta=0.5, gemm1_clamp_limit=3.0)
    got = vllm.fused_experts(*call, activation="swigluoai_uninterleave", quant_config=m3)
    assert_close(got, _clamped_swiglu_want(x, w13, w2, topk, 1.5, 0.5, 3.0), bound)
    # swigluoai keeps GPT-OSS's values: vLLM's Triton experts ignore the config's, its
    # FlashInfer experts apply them, so other values are refused; GPT-OSS's own are taken
    gpt_oss = _QuantConfig(gemm1_alpha=1.702, gemm1_beta=1.0, gemm1_clamp_limit=7.0)
    got = vllm.fused_experts(*call, activation="swigluoai", quant_config=gpt_oss)
    assert torch.equal(got, vllm.fused_experts(*call, activation="swigluoai"))
    with pytest.raises(MoeInputError, match="gemm1_alpha=1.5 with activation 'swigluoai'"):
        vllm.fused_experts(*call, activation="swigluoai", quant_config=m3)
    limited = _QuantConfig(gemm1_clamp_limit=5.0)
    # swigluoai_uninterleave takes all three (unset ones fall back differently by release)
    with pytest.raises(MoeInputError, match="gemm1_alpha, gemm1_beta unset"):
        vllm.fused_experts(*call, activation="swigluoai_uninterleave", quant_config=limited)
    # silu with a limit: silu(min(gate, L)) * clamp(up, -L, L)
    got = vllm.fused_experts(*call, activation="silu", quant_config=limited)
    assert_close(got, _clamped_swiglu_want(x, w13, w2, topk, 1.0, 0.0, 5.0), bound)
    assert not torch.allclose(got, vllm.fused_experts(*call, activation="silu"))
    # a config of a release without the properties, or with them unset: as before
    plain = vllm.fused_experts(*call, activation="silu", quant_config=_QuantConfig())
    assert torch.equal(plain, vllm.fused_experts(*call, activation="silu"))
    with pytest.raises(MoeInputError, match="gemm1_clamp_limit unset"):
        vllm.fused_experts(*call, activation="swigluoai_uninterleave")
    with pytest.raises(MoeInputError, match="gemm1_alpha"):
        vllm.fused_experts(*call, quant_config=_QuantConfig(gemm1_alpha=1.702))
    with pytest.raises(MoeInputError, match="gemm1_clamp_limit"):
        vllm.fused_experts(*call, activation="gelu", quant_config=limited)
    with pytest.raises(TypeError, match="gemm1_beta"):
        vllm.fused_experts(*call, activation="swigluoai", quant_config=_QuantConfig(gemm1_beta="1"))
    # gated-only activations have no is_act_and_mul=False form (the gated result was returned)
    for name in ("swigluoai", "swiglustep", "swigluoai_uninterleave"):
        with pytest.raises(MoeInputError, match="is_act_and_mul=False"):
            vllm.fused_experts(*call, activation=name, is_act_and_mul=False)


def _situ_want(x, w13, w2, topk, beta, linear_beta):
    """float64: beta tanh(g / beta) sigmoid(g) * Lb tanh(u / Lb) (u for Lb None), gate then
    up halves."""
    want = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk.weights[t].double(), topk.ids[t].tolist(), strict=True):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            soft = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
            if linear_beta is not None:
                up = linear_beta * torch.tanh(up / linear_beta)
            want[t] += w * (w2[e].double() @ (soft * up))
    return want


def test_peers_situ():
    """Kimi-K3's SiTU was refused by both shims. vLLM: Kimi-K3's betas (4, 25: vLLM reads
    them from the layer's config, which fused_experts is not given); SGLang's Triton runner:
    beta gemm1_alpha (unset 4), linear beta gemm1_clamp_limit (unset: none)."""
    x, logits, w13, w2 = _problem(55)
    x = x * 20  # GEMM1 values beyond the soft caps
    topk = moerunner.select_experts(logits, 2)
    bound = error_bound(torch.float32, False)
    got = vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, activation="situ")
    assert_close(got, _situ_want(x, w13, w2, topk, 4.0, 25.0), bound)
    with pytest.raises(MoeInputError, match="gemm1_alpha"):
        vllm.fused_experts(
            x, w13, w2, topk.weights, topk.ids, activation="situ",
            quant_config=_QuantConfig(gemm1_alpha=3.0),
        )  # fmt: skip
    pair = (topk.weights, topk.ids)
    for alpha, limit, beta, linear in ((None, None, 4.0, None), (3.0, 6.0, 3.0, 6.0)):
        cfg = sglang.MoeRunnerConfig(
            inplace=False, activation="situ", gemm1_alpha=alpha, gemm1_clamp_limit=limit
        )
        got = sglang.fused_experts(x, w13, w2, pair, cfg)
        assert_close(got, _situ_want(x, w13, w2, topk, beta, linear), bound)
    with pytest.raises(MoeInputError, match="swiglu_limit"):
        cfg = sglang.MoeRunnerConfig(inplace=False, activation="situ", swiglu_limit=7.0)
        sglang.fused_experts(x, w13, w2, pair, cfg)


def test_vllm_errors_name_the_argument_the_caller_passed():
    """An expert_map entry outside the local experts was reported as a topk_ids value the
    caller never passed; a malformed gating_output as router_logits; a call in vLLM 0.9's
    positional order as a bad quant_config."""
    x, _, w13, w2 = _problem(53)
    g = torch.Generator().manual_seed(53)
    topk = moerunner.select_experts(torch.randn(T, 2 * E, generator=g), 2)
    bad_map = torch.tensor([-1] * E + [0, 1, 2, E + 3], dtype=torch.int32)
    with pytest.raises(MoeInputError, match="expert_map"):
        vllm.fused_experts(
            x, w13, w2, topk.weights, topk.ids, global_num_experts=2 * E, expert_map=bad_map
        )
    for gating in (torch.randn(T), torch.randint(0, 4, (T, E))):
        for route in (vllm.fused_topk, vllm.grouped_topk):
            with pytest.raises(MoeInputError, match="gating_output"):
                route(x, gating, 2, True)
    with pytest.raises(TypeError, match="global_num_experts"):
        vllm.fused_experts(x, w13, w2, topk.weights, topk.ids, False, "silu", False, False,
                           False, False)  # fmt: skip


def test_weights_changed_after_writes_pytorch_does_not_count():
    """Scales the shim converts to float32 (bf16 here) are converted once per set of tensors,
    keyed on their in-place versions: a write through .data (weight loaders, RL weight
    syncs) or in place on an inference tensor left the old values in use, and there was no
    public way to say so. moerunner.weights_changed names the written tensors."""
    x, logits, w13, w2 = _problem(54)
    topk = moerunner.select_experts(logits, 2)
    q1, q2 = quantize(w13, "fp8_tensor"), quantize(w2, "fp8_tensor")
    s2 = q2.scale.to(torch.bfloat16)

    def call(s1):
        return vllm.fused_experts(
            x, q1.data, q2.data, topk.weights, topk.ids,
            use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2,
        )  # fmt: skip

    for inference in (False, True):
        with torch.inference_mode(inference):
            s1 = q1.scale.to(torch.bfloat16)
            before = call(s1)
            (s1.data if not inference else s1).mul_(2)
            assert torch.equal(call(s1), before)  # unseen, as documented
            moerunner.weights_changed(s1)
            after = call(s1)
            assert torch.equal(after, call(s1.clone()))  # what a fresh tensor gives
            assert not torch.allclose(after, before)
    # a QuantizedWeight names all of its tensors; other objects are refused by type
    moerunner.weights_changed(q1, w13)
    with pytest.raises(TypeError, match="weights_changed"):
        moerunner.weights_changed([w13])


@pytest.mark.parametrize("peer", ["vllm", "sglang"])
def test_quantized_peer_weights_are_built_and_prepared_once(peer, prepares):
    """The shims wrapped the caller's tensors in a new QuantizedWeight per call: each call
    read its scales (a device sync on a GPU) and prepared the weights again (a copy of the
    experts for the re-laying backends), and warned the caller to pass the same objects,
    which it did. Now the wrapper is memoised on the weight tensor; an in-place edit of a
    scale builds it again."""
    import warnings

    x, logits, w13, w2 = _problem(11, torch.bfloat16)
    topk = moerunner.select_experts(logits, 2)
    q1, q2 = quantize(w13, "int8"), quantize(w2, "int8")
    s1, s2 = q1.scale[..., None].clone(), q2.scale.clone()
    routed = sglang.select_experts(x, logits, sglang.TopKConfig(top_k=2))

    def call():
        if peer == "vllm":
            return vllm.fused_experts(
                x, q1.data, q2.data, topk.weights, topk.ids,
                use_int8_w8a8=True, per_channel_quant=True, w1_scale=s1, w2_scale=s2,
            )  # fmt: skip
        config = sglang.MoeRunnerConfig(inplace=False)
        return sglang.fused_experts(
            x, q1.data, q2.data, routed, config,
            use_int8_w8a8=True, per_channel_quant=True, w1_scale=s1, w2_scale=s2,
        )  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "prepared again" warning
        outs = [call() for _ in range(4)]
    assert len(prepares) == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    with torch.no_grad():
        s2.mul_(2.0)  # an in-place edit of a scale: built and prepared again
    doubled = call()
    assert len(prepares) == 2
    torch.testing.assert_close(doubled, 2 * outs[0], rtol=2e-2, atol=1e-2)


# --------------------------------------------------------------------------------------------
# A probe of the shims against float64 references of the peers' semantics (2026-12-06).


def test_sglang_unbiased_grouped_routing_scores_with_softmax():
    """SGLang's grouped top-k without a correction bias scores with softmax (a group's score
    its best); the shim passed scoring_func through, so "sigmoid" gave weights ~9x too big."""
    g = torch.Generator().manual_seed(7)
    x, logits = torch.randn(3, 16, generator=g), torch.randn(3, 64, generator=g)
    kw = dict(top_k=4, use_grouped_topk=True, topk_group=2, num_expert_group=8,
              renormalize=False)  # fmt: skip
    with pytest.raises(MoeInputError, match="scores with softmax"):
        sglang.select_experts(x, logits, sglang.TopKConfig(**kw, scoring_func="sigmoid"))
    out = sglang.select_experts(x, logits, sglang.TopKConfig(**kw))
    probs = logits.double().softmax(-1)
    keep = probs.view(3, 8, 8).amax(-1).topk(2, -1).indices
    mask = torch.zeros(3, 8, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(8, 1)
    weights, ids = probs.masked_fill(~mask, 0.0).topk(4, -1)
    assert torch.equal(out.topk_ids.long(), ids)
    assert_close(out.topk_weights, weights, 1e-6)


def test_scales_in_another_shape_of_the_same_size_are_refused():
    """Scales were checked by element count and reshaped: a transposed grid was read in the
    wrong order (outputs 0.09-0.9 off)."""
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(T, H, generator=g).bfloat16(), torch.randn(T, E, generator=g)
    tw, ti, _ = vllm.fused_topk(x, logits, 1, True)
    p1 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g)
    p2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g)
    s1, s2 = torch.rand(E, 2 * I, H // 64) * 0.01, torch.rand(E, H, I // 64) * 0.01
    kw = dict(use_int4_w4a16=True, w2_scale=s2, block_shape=[0, 64])
    with pytest.raises(MoeInputError, match=r"w1_scale must have shape \[4, 128, 2\]"):
        vllm.fused_experts(x, p1, p2, tw, ti, w1_scale=s1.transpose(1, 2).contiguous(), **kw)
    good = vllm.fused_experts(x, p1, p2, tw, ti, w1_scale=s1, **kw)
    trailing = vllm.fused_experts(x, p1, p2, tw, ti, w1_scale=s1[..., None], **kw)
    assert torch.equal(good, trailing)  # a trailing dim of 1 is the same layout


def test_router_weight_on_input_with_a_static_activation_scale_is_refused():
    """The peers differ (weight before or after quantizing with a1_scale): refused."""
    x, logits, w13, w2 = _problem(3, torch.bfloat16)
    tw, ti, _ = vllm.fused_topk(x, logits, 1, True)
    q1 = (w13.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    q2 = (w2.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    ones = torch.full((E,), 0.01)
    with pytest.raises(MoeInputError, match="static activation scale"):
        vllm.fused_experts(x, q1, q2, tw, ti, apply_router_weight_on_input=True,
                           use_fp8_w8a8=True, w1_scale=ones, w2_scale=ones,
                           a1_scale=torch.tensor(0.05), a2_scale=torch.tensor(0.05))  # fmt: skip


def test_sglang_routing_checks_tokens_and_takes_its_fields_by_keyword():
    x, logits, _, _ = _problem(4)
    with pytest.raises(
        MoeInputError, match=r"router_logits has T=6 rows but hidden_states has shape \[3, "
    ):
        sglang.select_experts(x[:3], logits, sglang.TopKConfig(top_k=2))
    with pytest.raises(TypeError):  # SGLang's field order differs: no positional fields
        sglang.TopKConfig(2, True)
