"""Regression tests of the bad-input probe (issue 25, "nothing silently wrong").

One test per defect of the probe report, named after it (``test_d1_...``), plus the
observations, the expert-parallel shard with top_k > E (item 4) and the bounded, per-stream
Triton workspaces (item 3). Results are compared with the float64 reference; Triton runs in
its CPU interpreter (fp32 / fp16: the interpreter computes bf16 wrongly).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from cases import interpreted_triton
from torch import nn

import moerunner
from moerunner import MoeInputError
from moerunner.testing import DTYPE_BOUND, assert_close, error_bound
from moerunner.weights import ExpertWeights

E, H, I = 4, 32, 16


def _triton():
    triton_pkg = pytest.importorskip("moerunner.backends.triton")
    if not interpreted_triton():  # these tests' tensors live on the CPU
        pytest.skip("CPU tensors: triton runs them under its interpreter only (CPU runs)")
    return triton_pkg


def _problem(tokens=5, dtype=torch.float32, experts=E, top_k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(experts, H, I, generator=g) / I**0.5).to(dtype)
    tk = moerunner.select_experts(torch.randn(tokens, experts, generator=g), top_k)
    return x, w13, w2, tk


def _reference(x, w13, w2, weights, ids, **kw):
    return moerunner.reference_moe(x, ExpertWeights(w13, w2, **kw), weights, ids)


# --------------------------------------------------------------------------------------------
# D1: transposed hidden states on the triton fused path.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_d1_transposed_hidden_triton(dtype):
    _triton()
    x, w13, w2, tk = _problem(dtype=dtype)
    x_t = x.t().contiguous().t()  # [T, H] with strides (1, T): column-major
    assert x_t.stride() == (1, x.shape[0])
    out = moerunner.fused_moe(x_t, w13, w2, tk.weights, tk.ids, backend="triton")
    assert out.is_contiguous()
    assert_close(out, _reference(x, w13, w2, tk.weights, tk.ids), DTYPE_BOUND[dtype], what="D1")
    # The layer, and the grouped (permute) path of the same backend.
    runner_out = _run_permute("triton", x_t, w13, w2, tk)
    assert_close(runner_out, _reference(x, w13, w2, tk.weights, tk.ids), DTYPE_BOUND[dtype])


def _run_permute(backend, x, w13, w2, tk):
    from moerunner.backends.base import MoeProblem
    from moerunner.dispatch.formats import StandardDispatchOutput

    weights = ExpertWeights(w13, w2)
    spec = weights.spec(moerunner.Activation("silu"))
    runner = moerunner.MoeRunner(backend, force_permute=True)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    return runner.run(StandardDispatchOutput(x, tk), prepared)


# --------------------------------------------------------------------------------------------
# D2 / D3: the prepared-weights cache sees .data assignment and QuantizedWeight edits.


def test_d2_data_assignment_is_seen():
    x, w13, w2, tk = _problem(tokens=8)
    y1 = moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, backend="torch")
    w2.data = w2.data * 2
    y2 = moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, backend="torch")
    assert_close(y2, _reference(x, w13, w2, tk.weights, tk.ids), DTYPE_BOUND[torch.float32])
    assert_close(y2, 2 * y1.double(), DTYPE_BOUND[torch.float32])
    # nn.Module.to(dtype) assigns .data of its parameters.
    module = nn.Module()
    module.w13, module.w2 = nn.Parameter(w13.clone()), nn.Parameter(w2.clone())
    with torch.no_grad():
        moerunner.fused_moe(x, module.w13, module.w2, tk.weights, tk.ids, backend="torch")
        module.to(torch.float16)
        y3 = moerunner.fused_moe(x.half(), module.w13, module.w2, tk.weights, tk.ids)
    ref = _reference(x.half(), module.w13.data, module.w2.data, tk.weights, tk.ids)
    assert_close(y3, ref, DTYPE_BOUND[torch.float16])
    # A bias edited in place.
    b2 = torch.zeros(E, H)
    moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, w2_bias=b2, backend="torch")
    b2.add_(1.0)
    y4 = moerunner.fused_moe(x, w13, w2, tk.weights, tk.ids, w2_bias=b2, backend="torch")
    ref4 = _reference(x, w13, w2, tk.weights, tk.ids, w2_bias=b2)
    assert_close(y4, ref4, DTYPE_BOUND[torch.float32])


@pytest.mark.parametrize("field", ["scale", "data", "reassigned"])
def test_d3_quantized_weight_edits_are_seen(field):
    x, w13, w2, tk = _problem(tokens=8)
    q13, q2 = moerunner.quantize(w13, "fp8_channel"), moerunner.quantize(w2, "fp8_channel")
    y1 = moerunner.fused_moe(x, q13, q2, tk.weights, tk.ids, backend="torch")
    if field == "scale":
        q13.scale.mul_(2)
    elif field == "data":
        q13.data.copy_(moerunner.quantize(-w13, "fp8_channel").data)
    else:
        q2.scale = q2.scale * 0.5
    y2 = moerunner.fused_moe(x, q13, q2, tk.weights, tk.ids, backend="torch")
    assert not torch.equal(y1, y2)
    ref = moerunner.reference_moe(x, ExpertWeights(q13, q2), tk.weights, tk.ids)
    assert_close(y2, ref, error_bound(torch.float32, True), what=f"D3 {field}")


# --------------------------------------------------------------------------------------------
# D4 / D5 and the "ids below -1" observation: expert-parallel dispatchers on 2 gloo ranks.

EP_E, EP_K, EP_T = 4, 2, 6


def _ep_case(rank: int):
    g = torch.Generator().manual_seed(5)
    weights = ExpertWeights(
        torch.randn(EP_E, 2 * I, H, generator=g) * H**-0.5,
        torch.randn(EP_E, H, I, generator=g) * I**-0.5,
    )
    g.manual_seed(50 + rank)
    x = torch.randn(EP_T, H, generator=g)
    ids = torch.rand(EP_T, EP_E, generator=g).argsort(dim=1)[:, :EP_K].to(torch.int32)
    return weights, x, moerunner.routing.TopK(torch.rand(EP_T, EP_K, generator=g), ids)


def _outcome(fn):
    try:
        return {"out": fn(), "error": None}
    except Exception as exc:  # noqa: BLE001  (the test checks which scenarios raise)
        return {"out": None, "error": (type(exc).__name__, str(exc))}


def _ep_scenarios(rank: int, world: int) -> dict:
    from moerunner.distributed_moe import ExpertParallelMoE
    from moerunner.routing import TopK

    weights, x, topk = _ep_case(rank)
    results = {}

    def layer(dispatcher, **kw):
        return ExpertParallelMoE.from_global(weights, dispatcher=dispatcher, backend="torch", **kw)

    def with_id(value):  # rank 1's token 0, slot 0 gets ``value``; rank 0 stays valid
        ids = topk.ids.clone()
        if rank == 1:
            ids[0, 0] = value
        return TopK(topk.weights, ids)

    for name, value in (("too_big", EP_E), ("far_too_big", EP_E + 3), ("below_minus_one", -5)):
        bad = with_id(value)
        results[f"masked_raise/{name}"] = _outcome(
            lambda b=bad: layer("masked", capacity=64, on_overflow="raise")(x, b)
        )

        def flag(b=bad):
            moe = layer("masked", capacity=64, on_overflow="flag")
            return moe(x, b), bool(moe.last_overflow)

        results[f"masked_flag/{name}"] = _outcome(flag)
        results[f"all_to_all/{name}"] = _outcome(lambda b=bad: layer("all_to_all")(x, b))

    # D5: hidden dtype differs across ranks.
    x_mixed = x.half() if rank == 1 else x
    results["dtype/raise"] = _outcome(
        lambda: layer("masked", capacity=64, on_overflow="raise")(x_mixed, topk)
    )
    results["dtype/flag_first_call"] = _outcome(
        lambda: layer("masked", capacity=64, on_overflow="flag")(x_mixed, topk)
    )

    def flag_after_warmup():
        moe = layer("masked", capacity=64, on_overflow="flag")
        moe(x, topk)  # every rank fp32: the wire dtype
        return moe(x_mixed, topk)

    results["dtype/flag_later"] = _outcome(flag_after_warmup)
    results["x"], results["topk"] = x, topk
    return results


@pytest.fixture(scope="module")
def ep_results():
    from distributed.worlds import run_world

    return run_world(_ep_scenarios, 2)


def _ep_reference(rank_result, ids=None, dtype=torch.float32):
    weights, _, _ = _ep_case(0)
    topk = rank_result["topk"]
    return moerunner.reference_moe(
        rank_result["x"].to(dtype), weights, topk.weights, topk.ids if ids is None else ids
    )


@pytest.mark.parametrize("name", ["too_big", "far_too_big"])
def test_d4_masked_out_of_range_ids(ep_results, name):
    for rank, r in enumerate(ep_results):
        error = r[f"masked_raise/{name}"]["error"]
        assert error is not None and error[0] == "MoeInputError", (rank, error)
        assert "expert ids must be in [-1, 4)" in error[1] and "rank 1: 1" in error[1]
        # Flag mode: the pair is dropped (never computed with the last expert), flag set.
        y, overflow = r[f"masked_flag/{name}"]["out"]
        assert overflow, f"rank {rank}: overflow flag not set"
        ids = r["topk"].ids.clone()
        if rank == 1:
            ids[0, 0] = -1
        assert_close(y, _ep_reference(r, ids), 1e-4, what=f"rank {rank}")


def test_d5_masked_dtype_differs_across_ranks(ep_results):
    for rank, r in enumerate(ep_results):
        # "raise": rank 1's own dtype check, carried by the header exchange to every rank
        error = r["dtype/raise"]["error"]
        assert error is not None and error[0] == "RankFailedError", (rank, error)
        assert "rank 1: TypeError: hidden_states dtype torch.float16" in error[1], error[1]
        error = r["dtype/flag_first_call"]["error"]
        assert error is not None and error[0] == "MoeInputError", (rank, error)
        assert "rank 0 passed float32, rank 1 passed float16" in error[1], error[1]
        # After the wire dtype is fixed, a rank's other dtype is converted: a correct result.
        y = r["dtype/flag_later"]["out"]
        dtype = torch.float16 if rank == 1 else torch.float32
        assert y.dtype == dtype
        assert_close(y, _ep_reference(r, dtype=dtype), DTYPE_BOUND[dtype], what=f"rank {rank}")


def test_observation_ids_below_minus_one_in_dispatchers(ep_results):
    """fused_moe rejects ids below -1; the dispatchers do not treat them as -1 either."""
    for rank, r in enumerate(ep_results):
        for key in ("all_to_all/below_minus_one", "masked_raise/below_minus_one"):
            error = r[key]["error"]
            assert error is not None and error[0] == "MoeInputError", (rank, key, error)
        for key in ("all_to_all/too_big", "all_to_all/far_too_big"):
            assert r[key]["error"] is not None and r[key]["error"][0] == "MoeInputError"
        assert r["masked_flag/below_minus_one"]["out"][1]  # flagged
    x, w13, w2, tk = _problem()
    ids = tk.ids.clone()
    ids[0, 0] = -5
    with pytest.raises(MoeInputError, match="topk_ids"):
        moerunner.fused_moe(x, w13, w2, tk.weights, ids)


# --------------------------------------------------------------------------------------------
# D6: router_logits columns against num_experts.


def test_d6_layer_checks_router_logits_width():
    layer = moerunner.MoE(
        moerunner.MoeConfig(num_experts=8, hidden_size=H, intermediate_size=I, top_k=2)
    )
    x = torch.randn(6, H)
    for width in (4, 11):
        with pytest.raises(MoeInputError, match="router_logits last dim must be num_experts E=8"):
            layer(x, torch.randn(6, width))
    assert layer(x, torch.randn(6, 8)).shape == (6, H)


# --------------------------------------------------------------------------------------------
# D8: a GPT-OSS checkpoint with another expert count than the model.


@pytest.mark.parametrize("delta", [-4, 2])
def test_d8_gpt_oss_checkpoint_expert_count(tmp_path, delta):
    pytest.importorskip("transformers")
    from integrations._tiny_models import build
    from safetensors.torch import save_file

    import moerunner.integrations.transformers as mt

    model = build("gpt_oss")
    tensors = {}
    for path, experts in mt.experts_modules(model):
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(experts, proj).detach().transpose(1, 2).contiguous()
            num = w.shape[0] + delta
            w = torch.cat([w, w])[:num]  # drop experts, or repeat some
            q = moerunner.quantize(w, "mxfp4")
            e, n, k = q.shape
            tensors[f"{path}.{proj}_blocks"] = q.data.reshape(e, n, k // 32, 16)
            tensors[f"{path}.{proj}_scales"] = q.scale
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MoeInputError, match=r"checkpoint's layer .* has E="):
        mt.load_gpt_oss_mxfp4(model, tmp_path)


# --------------------------------------------------------------------------------------------
# D9: plain-scheme QuantizedWeight on triton.


@pytest.mark.parametrize("scheme, dtype", [("fp32", torch.float32), ("fp16", torch.float16)])
def test_d9_plain_scheme_quantized_weight_triton(scheme, dtype):
    _triton()
    x, w13, w2, tk = _problem(dtype=dtype)
    q13, q2 = moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme)
    out = moerunner.fused_moe(x, q13, q2, tk.weights, tk.ids, backend="triton")
    assert_close(out, _reference(x, w13, w2, tk.weights, tk.ids), DTYPE_BOUND[dtype])


# --------------------------------------------------------------------------------------------
# D10: check_ids=False skips out-of-range ids on every backend, never wraps int64 ids.


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("force_permute", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_d10_unchecked_ids_are_skipped_not_wrapped(backend, force_permute, dtype, monkeypatch):
    if backend == "triton":
        _triton()
    if force_permute:  # the permute path (what the torch backend runs off the CPU)
        real = moerunner.api.MoeRunner
        monkeypatch.setattr(
            moerunner.api, "MoeRunner", lambda b, **kw: real(b, force_permute=True, **kw)
        )
    x, w13, w2, tk = _problem(tokens=6)
    ids = tk.ids.to(dtype)
    if dtype == torch.int64:
        ids[4, 0] = 2**32 + 1  # int32 wrap-around would make it expert 1
        ids[5, 1] = -(2**32) + 2  # ... and this one expert 2
    ids[1, 1] = E  # just past the last expert
    ids[2, 0] = E + 5
    ids[3, 1] = -7
    out = moerunner.fused_moe(x, w13, w2, tk.weights, ids, check_ids=False, backend=backend)
    skipped = ids.clone()
    skipped[(skipped < 0) | (skipped >= E)] = -1
    assert_close(out, _reference(x, w13, w2, tk.weights, skipped), DTYPE_BOUND[torch.float32])
    with pytest.raises(MoeInputError, match="topk_ids must be in"):
        moerunner.fused_moe(x, w13, w2, tk.weights, ids, backend=backend)


# --------------------------------------------------------------------------------------------
# D11: NaN (and infinite) correction_bias.


def test_d11_nan_correction_bias_is_rejected():
    bias = torch.zeros(8)
    bias[3] = float("nan")
    with pytest.raises(
        MoeInputError,
        match=r"NaN or infinite values \[nan\] at experts \[3\]",
    ):
        moerunner.select_experts(torch.randn(6, 8), 2, scoring_func="sigmoid", correction_bias=bias)
    from moerunner.routing import check_correction_bias_values

    with pytest.raises(MoeInputError, match="NaN"):
        check_correction_bias_values(bias)
    check_correction_bias_values(torch.zeros(8))
    for value in (float("inf"), float("-inf")):  # (ran silently: every / no token to expert 5)
        bias = torch.zeros(8)
        bias[5] = value
        with pytest.raises(MoeInputError, match=r"infinite values \[-?inf\] at experts \[5\]"):
            moerunner.select_experts(
                torch.randn(6, 8), 2, scoring_func="sigmoid", correction_bias=bias
            )
    # The layer checks its bias where it is set (load_state_dict), not per forward.
    routing = moerunner.RoutingConfig("sigmoid", True, correction_bias=True)
    cfg = moerunner.MoeConfig(8, H, I, 2, routing=routing)
    layer = moerunner.MoE(cfg, backend="torch")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(MoeInputError, match="correction_bias has NaN"):
        layer.load_state_dict({**state, "correction_bias": bias})
    layer.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# D12: gradients.


def _grad_inputs(dtype=torch.float64, bias=True):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=g, dtype=dtype)
    w13 = torch.randn(3, 12, 8, generator=g, dtype=dtype) / 3
    w2 = torch.randn(3, 8, 6, generator=g, dtype=dtype) / 3
    b13 = torch.randn(3, 12, generator=g, dtype=dtype) / 4 if bias else None
    b2 = torch.randn(3, 8, generator=g, dtype=dtype) / 4 if bias else None
    ids = torch.tensor([[0, 1], [2, -1], [1, 1], [0, 2], [2, 0]], dtype=torch.int32)
    wts = torch.rand(5, 2, generator=g, dtype=dtype)
    return x, w13, w2, b13, b2, wts, ids


def test_d12_gradients_torch_backend():
    """Gradients of fused_moe (fp32, torch backend) against autograd of the float64 reference."""
    x64, w13_64, w2_64, b13_64, b2_64, wts64, ids = _grad_inputs()
    leaves64 = [t.clone().requires_grad_(True) for t in (x64, w13_64, w2_64, b13_64, b2_64, wts64)]
    x, w13, w2, b13, b2, wts = leaves64
    ref = moerunner.reference_moe(x, ExpertWeights(w13, w2, b13, b2), wts, ids)
    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * probe).sum(), leaves64)

    leaves = [nn.Parameter(t.detach().float()) for t in leaves64[1:5]]
    x32 = x64.float().requires_grad_(True)
    wts32 = wts64.float().requires_grad_(True)
    out = moerunner.fused_moe(
        x32, leaves[0], leaves[1], wts32, ids, w13_bias=leaves[2], w2_bias=leaves[3]
    )
    assert out.requires_grad
    assert_close(out, ref, DTYPE_BOUND[torch.float32])
    grads = torch.autograd.grad((out * probe.float()).sum(), [x32, *leaves, wts32])
    names = ["hidden_states", "w13", "w2", "w13_bias", "w2_bias", "topk_weights"]
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert_close(got, want, 1e-5, what=f"d/d {name}")


def test_d12_grad_mode_clear_error_elsewhere():
    x, w13, w2, tk = _problem()
    w13p = nn.Parameter(w13)
    quantized = moerunner.quantize(w13, "fp8_channel"), moerunner.quantize(w2, "fp8_channel")
    # frozen quantized experts pass the gradient on (test_lora checks its values)
    assert moerunner.fused_moe(x.requires_grad_(True), *quantized, tk.weights, tk.ids).requires_grad
    x = x.detach()
    if _has_triton():
        with pytest.raises(MoeInputError, match="backend 'triton' has no backward.*no_grad"):
            moerunner.fused_moe(x, w13p, w2, tk.weights, tk.ids, backend="triton")
    with torch.no_grad():  # inference: every backend, no error
        out = moerunner.fused_moe(x, w13p, w2, tk.weights, tk.ids)
    assert not out.requires_grad
    assert_close(out, _reference(x, w13, w2, tk.weights, tk.ids), DTYPE_BOUND[torch.float32])


def _has_triton() -> bool:
    try:
        import moerunner.backends.triton as triton_pkg
    except ImportError:
        return False
    return triton_pkg.interpreted() or torch.cuda.is_available()


# --------------------------------------------------------------------------------------------
# D13: degenerate shapes.


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("check_ids", [True, False])
def test_d13_degenerate_shapes(backend, check_ids):
    if backend == "triton":
        _triton()
    kw = dict(backend=backend, check_ids=check_ids)
    x, w13, w2, tk = _problem(tokens=6)
    # top_k = 0: a sum over no slots.
    empty_w, empty_ids = tk.weights[:, :0], tk.ids[:, :0]
    out = moerunner.fused_moe(x, w13, w2, empty_w, empty_ids, **kw)
    assert out.shape == x.shape and not out.any()
    # H = 0: an empty [T, 0] row per token.
    x0 = x[:, :0]
    out = moerunner.fused_moe(x0, w13[:, :, :0], w2[:, :0, :], tk.weights, tk.ids, **kw)
    assert out.shape == (6, 0)
    # I = 0: a clear error, for every row count (the torch fp32 N-split path had 4-15 rows).
    for tokens in (1, 6, 20):
        x, w13, w2, tk = _problem(tokens=tokens)
        with pytest.raises(MoeInputError, match="intermediate size I must be >= 1"):
            moerunner.fused_moe(x, w13[:, :0, :], w2[:, :, :0], tk.weights, tk.ids, **kw)


# --------------------------------------------------------------------------------------------
# D14: every tensor's device is checked.


@pytest.mark.parametrize("which", ["w2", "w13_bias", "w2_bias", "topk_weights", "topk_ids"])
def test_d14_device_of_every_tensor(which):
    x, w13, w2, tk = _problem()
    args = dict(
        w2=w2,
        w13_bias=torch.zeros(E, 2 * I),
        w2_bias=torch.zeros(E, H),
        topk_weights=tk.weights,
        topk_ids=tk.ids,
    )
    args[which] = args[which].to("meta")
    with pytest.raises(MoeInputError, match=f"{which} is on meta"):
        moerunner.fused_moe(
            x,
            w13,
            args["w2"],
            args["topk_weights"],
            args["topk_ids"],
            w13_bias=args["w13_bias"],
            w2_bias=args["w2_bias"],
        )


# --------------------------------------------------------------------------------------------
# D15 (and D18): scale values checked at construction and import.


def _checkpoints():
    from moerunner.quant import checkpoints

    return checkpoints


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_d15_scale_values_rejected(value):
    ck = _checkpoints()
    w = torch.randn(2, 32, 64)
    # QuantizedWeight construction: fp32 per-channel scale.
    q = moerunner.quantize(w, "fp8_channel")
    bad = q.scale.clone()
    bad[1, 3] = value
    with pytest.raises(ValueError, match="scale: scales must be finite and > 0"):
        moerunner.quant.QuantizedWeight(q.scheme, q.shape, q.data, bad)
    # DeepSeek FP8: weight_scale_inv.
    qb = moerunner.quantize(w, "fp8_block")
    sinv = qb.scale.clone()
    sinv[0, 0, 0] = value
    with pytest.raises(ValueError, match="weight_scale_inv: scales must be"):
        ck.import_deepseek_fp8(qb.data, sinv)
    # ModelOpt NVFP4: weight_scale_2 (global) and the e4m3 block scales.
    qn = moerunner.quantize(w, "nvfp4")
    gs = qn.global_scale.clone()
    gs[1] = value
    with pytest.raises(ValueError, match="weight_scale_2: scales must be finite and > 0"):
        ck.import_modelopt_nvfp4(qn.data, qn.scale, gs)
    if value != 0.0 and not math.isinf(value):  # e4m3fn has no inf; 0 is a valid block scale
        block = qn.scale.clone()
        block[0, 0, 0] = value
        with pytest.raises(ValueError, match="weight_scale: scales must be finite and >= 0"):
            ck.import_modelopt_nvfp4(qn.data, block, qn.global_scale)


def test_d15_gpt_oss_nan_scale_code_and_expert_counts(tmp_path):
    from safetensors.torch import save_file

    ck = _checkpoints()
    q = moerunner.quantize(torch.randn(2, 32, 64), "mxfp4")
    blocks = q.data.reshape(2, 32, 2, 16)
    scales = q.scale.clone()
    scales[1, 0, 0] = 255
    with pytest.raises(ValueError, match="scales: e8m0 code 255"):
        ck.import_gpt_oss_mxfp4(blocks, scales)
    # A DeepSeek file with 4 experts read as 2: an error, not 2 experts.
    tensors = {}
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            qb = moerunner.quantize(torch.randn(1, 128, 128), "fp8_block")
            tensors[f"layer.{e}.{proj}.weight"] = qb.data[0]
            tensors[f"layer.{e}.{proj}.weight_scale_inv"] = qb.scale[0]
    save_file(tensors, str(tmp_path / "ds.safetensors"))
    path = tmp_path / "ds.safetensors"
    with pytest.raises(ValueError, match="num_experts=2, but the checkpoint also holds"):
        ck.deepseek_fp8_experts_from_safetensors(path, "layer.", num_experts=2)
    assert ck.deepseek_fp8_experts_from_safetensors(path, "layer.", 4)["w2"].shape[0] == 4


def test_d18_nvfp4_nan_scale_code_rejected():
    """The Triton interpreter decodes e4m3 code 0x7F as a finite scale (torch: NaN); such a
    code never reaches a kernel: construction and import reject it."""
    ck = _checkpoints()
    q = moerunner.quantize(torch.randn(2, 32, 64), "nvfp4")
    codes = q.scale.view(torch.uint8).clone()
    codes[0, 1, 2] = 0x7F
    nan_scale = codes.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="finite and >= 0"):
        moerunner.quant.QuantizedWeight(q.scheme, q.shape, q.data, nan_scale, q.global_scale)
    with pytest.raises(ValueError, match="weight_scale: scales must be"):
        ck.import_modelopt_nvfp4(q.data, nan_scale, q.global_scale)
    # quantize never makes one from finite weights, and NaN weights are refused too.
    w = torch.randn(2, 32, 64)
    w[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        moerunner.quantize(w, "nvfp4")


# --------------------------------------------------------------------------------------------
# D17: error messages name the argument.


def test_d17_errors_name_the_argument():
    x, w13, w2, tk = _problem()
    with pytest.raises(TypeError, match="swiglu_alpha must be a number"):
        moerunner.fused_moe(
            x, w13, w2, tk.weights, tk.ids, activation="swiglu_oai", swiglu_alpha="x"
        )
    with pytest.raises(MoeInputError, match="swiglu_alpha must be a finite number"):
        moerunner.fused_moe(
            x, w13, w2, tk.weights, tk.ids, activation="swiglu_oai", swiglu_alpha=float("nan")
        )
    logits = torch.randn(6, 8)
    with pytest.raises(TypeError, match="num_expert_group must be an int"):
        moerunner.select_experts(logits, 2, num_expert_group=2.0, topk_group=1)
    with pytest.raises(TypeError, match="correction_bias must be a torch.Tensor"):
        moerunner.select_experts(logits, 2, scoring_func="sigmoid", correction_bias=[0.0] * 8)
    with pytest.raises(ValueError, match="input_scale must be a scalar or one value per expert"):
        moerunner.quantize(torch.randn(2, 32, 64), "fp8_tensor_static", input_scale=torch.ones(3))
    ck = _checkpoints()
    qn = moerunner.quantize(torch.randn(2, 32, 64), "nvfp4")
    with pytest.raises(TypeError, match=r"weight_scale_2\[0\] must be a torch.Tensor"):
        ck.import_modelopt_nvfp4(list(qn.data), list(qn.scale), [float(v) for v in qn.global_scale])


# --------------------------------------------------------------------------------------------
# D19: MoE.quantize_ follows later edits of the float parameters.


def test_d19_quantize_follows_parameter_edits():
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=2)
    layer = moerunner.MoE(cfg, backend="torch").quantize_("fp8_channel", keep_float_weights=True)
    x, logits = torch.randn(6, H), torch.randn(6, E)
    tk = moerunner.select_experts(logits, 2)

    def expected():
        q = ExpertWeights(
            moerunner.quantize(layer.w13.detach(), "fp8_channel"),
            moerunner.quantize(layer.w2.detach(), "fp8_channel"),
        )
        return moerunner.reference_moe(x, q, tk.weights, tk.ids)

    bound = error_bound(torch.float32, True)
    assert_close(layer(x, logits), expected(), bound)
    with torch.no_grad():
        layer.w2.mul_(-3)  # in place
    assert_close(layer(x, logits), expected(), bound, what="after an in-place edit")
    layer.load_state_dict({k: v * 0.5 for k, v in layer.state_dict().items()})
    assert_close(layer(x, logits), expected(), bound, what="after load_state_dict")
    layer.w13.data = torch.randn(E, 2 * I, H) / H
    assert_close(layer(x, logits), expected(), bound, what="after .data assignment")


# --------------------------------------------------------------------------------------------
# Observation: ExpertWeights.scheme with mixed schemes.


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_observation_mixed_schemes(backend):
    if backend == "triton":
        _triton()
    x, w13, w2, tk = _problem()
    w13 = torch.randn(E, 2 * I, 128) / 11
    w2 = torch.randn(E, 128, I) / 4
    x = torch.randn(5, 128)
    q13, q2 = moerunner.quantize(w13, "fp8_channel"), moerunner.quantize(w2, "int8")
    weights = ExpertWeights(q13, q2)
    assert weights.scheme == "w13 fp8_channel, w2 int8"  # both named, each used by its GEMM
    assert (weights.w13_scheme.name, weights.w2_scheme.name) == ("fp8_channel", "int8")
    out = moerunner.fused_moe(x, q13, q2, tk.weights, tk.ids, backend=backend)
    ref = moerunner.reference_moe(x, weights, tk.weights, tk.ids)
    assert_close(out, ref, error_bound(torch.float32, True))


# --------------------------------------------------------------------------------------------
# Item 4: an expert-parallel rank's shard, top_k larger than its local experts.


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("check_ids", [True, False])
def test_item4_top_k_above_local_experts(backend, check_ids):
    if backend == "triton":
        _triton()
    import moerunner.ops  # noqa: F401  (registers torch.ops.moerunner.fused_experts)

    x, w13, w2, _ = _problem(tokens=7, experts=2)
    g = torch.Generator().manual_seed(9)
    wts = torch.rand(7, 4, generator=g)
    ids = torch.tensor(
        [[0, 1, -1, -1], [-1, -1, -1, -1], [1, -1, 0, -1], [0, 0, 1, 1], [-1, 1, -1, -1],
         [1, 1, 1, 1], [0, -1, -1, 1]],
        dtype=torch.int32,
    )  # fmt: skip
    ref = _reference(x, w13, w2, wts, ids)
    kw = dict(backend=backend, check_ids=check_ids)
    out = moerunner.fused_moe(x, w13, w2, wts, ids, **kw)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="fused_moe")
    op = torch.ops.moerunner.fused_experts(
        x, w13, w2, wts, ids, None, None, "silu", None, None, False, backend, check_ids
    )
    assert_close(op, ref, DTYPE_BOUND[torch.float32], what="custom op")
    with pytest.raises(MoeInputError, match="topk_ids must be in"):
        moerunner.fused_moe(x, w13, w2, wts, ids.clamp(min=0) + 1, backend=backend)


# --------------------------------------------------------------------------------------------
# Item 3: the Triton workspace cache is bounded in bytes and private to a thread and stream.


def _ws_cls():
    _triton()
    from moerunner.backends.triton import workspaces

    return workspaces


def _buffers(nbytes):
    return lambda: {"y": torch.empty(nbytes, dtype=torch.uint8)}


def test_item3_workspaces_bounded_in_bytes():
    workspaces = _ws_cls()
    assert workspaces.WORKSPACES.max_bytes == workspaces.WORKSPACE_LIMIT_BYTES > 0
    ws = workspaces.Workspaces(capacity=16, max_bytes=1000)
    cpu = torch.device("cpu")
    a = ws.get((cpu, "a"), _buffers(400))
    ws.get((cpu, "b"), _buffers(400))
    assert ws.get((cpu, "a"), _buffers(400)) is a  # a is now the most recently used
    ws.get((cpu, "c"), _buffers(400))  # over 1000 bytes: b (least recent) goes
    assert ws.nbytes == 800 <= ws.max_bytes
    assert [k[1:] for k in ws.entries] == [(cpu, "a"), (cpu, "c")]
    big = ws.get((cpu, "big"), _buffers(1001))  # larger than the bound alone: not kept
    assert big["y"].numel() == 1001 and ws.get((cpu, "big"), _buffers(1001)) is not big
    assert ws.nbytes == 800 and len(ws.entries) == 2
    for i in range(40):  # many small shapes: the entry count bound still holds
        ws.get((cpu, i), _buffers(1))
    assert len(ws.entries) == 16 and ws.nbytes == 16


def test_item3_workspaces_per_thread():
    workspaces = _ws_cls()
    ws = workspaces.Workspaces()
    key = (torch.device("cpu"), "per_slot", 8)
    mine = ws.get(key, _buffers(64))
    assert ws.get(key, _buffers(64)) is mine
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(ws.get(key, _buffers(64))))
    thread.start()
    thread.join()
    assert theirs[0] is not mine and theirs[0]["y"].data_ptr() != mine["y"].data_ptr()


def test_item3_workspaces_per_cuda_stream(monkeypatch):
    """Two CUDA streams of one thread get their own buffers (streams faked: CPU-testable)."""
    workspaces = _ws_cls()

    current = {"stream": 1}  # the current stream's handle
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", lambda index: current["stream"], raising=False
    )
    ws = workspaces.Workspaces()
    key = (torch.device("cuda", 0), "per_slot", 8)
    first = ws.get(key, _buffers(64))
    assert ws.get(key, _buffers(64)) is first
    current["stream"] = 2
    second = ws.get(key, _buffers(64))
    assert second is not first
    current["stream"] = 1
    assert ws.get(key, _buffers(64)) is first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_item3_permute_path_holds_one_grouped_buffer(dtype):
    """The torch core writes over the rows the pre-permute gathered: one T*k*H buffer."""
    from moerunner.backends import torch_native
    from moerunner.backends.base import MoeProblem
    from moerunner.dispatch import permute
    from moerunner.dispatch.formats import StandardDispatchOutput

    x, w13, w2, tk = _problem(tokens=9, dtype=dtype)
    weights = ExpertWeights(w13, w2)
    spec = weights.spec(moerunner.Activation("silu"))
    runner = moerunner.MoeRunner("torch", force_permute=True)
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    dispatch_output = StandardDispatchOutput(x, tk)
    grouped, ctx = permute.pre_permute_standard(dispatch_output, E)
    assert permute.is_scratch(grouped.hidden_states)
    rows_ptr = grouped.hidden_states.data_ptr()
    y = torch_native.torch_core(grouped.hidden_states, grouped.expert_offsets, prepared)
    assert y.data_ptr() == rows_ptr  # written in place
    out = permute.post_permute_standard(y, ctx, dispatch_output)
    assert_close(out, _reference(x, w13, w2, tk.weights, tk.ids), DTYPE_BOUND[dtype])
    assert_close(runner.run(dispatch_output, prepared), out.double(), 0.0)
    # Rows a caller owns (not marked) are never overwritten.
    mine = x[:4].clone()
    y2 = torch_native.torch_core(mine, torch.tensor([0, 4, 4, 4, 4]), prepared)
    assert torch.equal(mine, x[:4]) and y2.data_ptr() != mine.data_ptr()
