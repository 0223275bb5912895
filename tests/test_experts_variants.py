"""Experts-call variants against the float64 reference: the route-then-experts call, w13 in
up-then-gate order (plain and quantized, torch and triton), per-expert swiglu_oai
parameters, and the routing weight applied to the input (Llama-4)."""

from __future__ import annotations

import pytest
import torch
from cases import interpreted_triton

import moerunner
from moerunner import Activation, ExpertWeights, MoeInputError, quantize, reference_moe
from moerunner.errors import BackendUnavailableError
from moerunner.testing import DTYPE_BOUND, assert_close, error_bound

E, H, I, T = 4, 64, 32, 7


def _problem(seed: int = 0, dtype=torch.float32, i: int = I, h: int = H):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    w13 = (torch.randn(E, 2 * i, h, generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(E, h, i, generator=g) * i**-0.5).to(dtype)
    return x, logits, w13, w2


def _swap(w: torch.Tensor) -> torch.Tensor:
    half = w.shape[1] // 2
    return torch.cat((w[:, half:], w[:, :half]), dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_from_logits_equals_two_step_and_reference(dtype):
    x, logits, w13, w2 = _problem(1, dtype)
    kw = dict(scoring_func="sigmoid", renormalize=True, num_expert_group=2, topk_group=1)
    out = moerunner.fused_moe_from_logits(x, logits, w13, w2, 2, activation="gelu", **kw)
    topk = moerunner.select_experts(logits, 2, **kw)
    two_step = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="gelu")
    assert torch.equal(out, two_step)
    ref = reference_moe(x, ExpertWeights(w13, w2), topk.weights, topk.ids, "gelu")
    assert_close(out, ref, DTYPE_BOUND[dtype], what="fused_moe_from_logits")


def test_fused_moe_from_logits_rejects_unknown_keyword():
    x, logits, w13, w2 = _problem()
    with pytest.raises(TypeError, match="unknown argument"):
        moerunner.fused_moe_from_logits(x, logits, w13, w2, 2, top_k_group=1)
    with pytest.raises(MoeInputError, match="rows"):
        moerunner.fused_moe_from_logits(x[:3], logits, w13, w2, 2)


def test_fused_moe_from_logits_empty_batch():
    x, logits, w13, w2 = _problem()
    out = moerunner.fused_moe_from_logits(x[:0], logits[:0], w13, w2, 2)
    assert out.shape == (0, H)


# -- w13 order ---------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_up_gate_order_torch_plain(activation):
    x, logits, w13, w2 = _problem(2)
    b13 = torch.randn(E, 2 * I)
    topk = moerunner.select_experts(logits, 2)
    out = moerunner.fused_moe(
        x, _swap(w13), w2, topk.weights, topk.ids, activation=activation,
        w13_bias=_swap(b13), w13_order="up_gate", backend="torch",
    )  # fmt: skip
    # Independent: the reference reads the rows in up-then-gate order itself.
    ref = reference_moe(
        x, ExpertWeights(_swap(w13), w2, _swap(b13), w13_order="up_gate"), topk.weights,
        topk.ids, activation,
    )  # fmt: skip
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="up_gate")
    native = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation=activation, w13_bias=b13
    )
    torch.testing.assert_close(out, native, rtol=0, atol=0)


def test_up_gate_swapped_once_and_memoised():
    x, logits, w13, w2 = _problem(3)
    topk = moerunner.select_experts(logits, 2)
    up_gate = _swap(w13)
    runner = moerunner.MoeRunner("torch")
    weights = ExpertWeights(up_gate, w2, w13_order="up_gate")
    from moerunner.api import run_experts

    act = Activation("silu")
    run_experts(runner, weights, x, topk.weights, topk.ids, act)
    cache = up_gate._moerunner_prepared
    (prepared,) = cache.values()
    assert torch.equal(prepared.tensors["w13"], w13)  # gate rows first once prepared
    run_experts(runner, weights, x, topk.weights, topk.ids, act)
    assert next(iter(cache.values())) is prepared
    # The same tensor declared in the other order is prepared anew, not served stale; both
    # forms are kept (calls that alternate orders prepare each once).
    moerunner.fused_moe(x, up_gate, w2, topk.weights, topk.ids, backend="torch")
    forms = list(cache.values())
    assert len(forms) == 2 and forms[0] is prepared and forms[1] is not prepared


@pytest.mark.parametrize(
    "scheme, i",
    [("fp8_channel", I), ("int4_g32_zp", I), ("mxfp4", I), ("fp8_block", 128), ("nvfp4", I)],
)
def test_up_gate_order_quantized(scheme, i):
    x, logits, w13, w2 = _problem(4, i=i, h=128)
    topk = moerunner.select_experts(logits, 2)
    q13, q2 = quantize(w13, scheme), quantize(w2, scheme)
    q13_up_gate = quantize(_swap(w13), scheme)  # quantized in up-then-gate order
    out = moerunner.fused_moe(
        x, q13_up_gate, q2, topk.weights, topk.ids, w13_order="up_gate", backend="torch"
    )
    ref = reference_moe(
        x, ExpertWeights(q13_up_gate, q2, w13_order="up_gate"), topk.weights, topk.ids
    )
    bound = error_bound(torch.float32, q13.scheme.quantizes_activations)
    assert_close(out, ref, bound, what=f"up_gate {scheme}")
    # Scales moved with their rows: the same codes as quantizing in gate-then-up order
    # (row-wise and K-wise scales do not depend on row order).
    native = moerunner.fused_moe(x, q13, q2, topk.weights, topk.ids, backend="torch")
    torch.testing.assert_close(out, native, rtol=0, atol=0)


def test_up_gate_block_scales_straddling_halves_raise():
    x, logits, w13, w2 = _problem(5, i=64, h=128)
    topk = moerunner.select_experts(logits, 2)
    q13 = quantize(_swap(w13), "fp8_block")  # 128-row blocks, I = 64: a block holds both
    with pytest.raises(MoeInputError, match="straddles"):
        moerunner.fused_moe(
            x, q13, quantize(w2, "fp8_block"), topk.weights, topk.ids, w13_order="up_gate"
        )


def test_w13_order_values_and_alias():
    _, _, w13, w2 = _problem()
    assert ExpertWeights(w13, w2, gate_up_interleaved=True).w13_order == "interleaved"
    assert ExpertWeights(w13, w2, w13_order="interleaved").gate_up_interleaved is True
    with pytest.raises(MoeInputError, match="w13_order"):
        ExpertWeights(w13, w2, w13_order="gate-up")
    with pytest.raises(MoeInputError, match="pass one"):
        ExpertWeights(w13, w2, gate_up_interleaved=True, w13_order="up_gate")
    x = torch.randn(2, H)
    with pytest.raises(MoeInputError, match="gated"):
        moerunner.fused_moe(
            x, w13[:, :I], w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32),
            activation="relu2", w13_order="up_gate",
        )  # fmt: skip


# -- per-expert swiglu ---------------------------------------------------------------------


def _swiglu_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    alpha = 1.0 + torch.rand(E, generator=g)
    beta = torch.rand(E, generator=g) * 2
    limit = 0.5 + torch.rand(E, generator=g) * 2  # small limits: the clamps are active
    return alpha, beta, limit


def _swiglu64(x, w13, w2, weights, ids, alpha, beta, limit):
    """out = sum_k w * W2 ((min(u, L) clamped to +-L + beta) * g' * sigmoid(alpha g')),
    g' = min(g, L), per expert's alpha, beta, L; written here in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            gate, up = h[:I].clamp(max=limit[e].item()), h[I:]
            up = up.clamp(-limit[e].item(), limit[e].item())
            a = (up + beta[e].item()) * gate * torch.sigmoid(alpha[e].double() * gate)
            out[t] += weights[t, k].double() * (w2[e].double() @ a)
    return out


def test_per_expert_swiglu_torch_matches_formula():
    x, logits, w13, w2 = _problem(6)
    w13 = w13 * 4  # larger GEMM1 outputs so the clamps bite
    alpha, beta, limit = _swiglu_params()
    topk = moerunner.select_experts(logits, 2)
    out = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai",
        swiglu_alpha=alpha, swiglu_beta=beta, swiglu_limit=limit,
    )  # fmt: skip
    expect = _swiglu64(x, w13, w2, topk.weights, topk.ids, alpha, beta, limit)
    assert_close(out, expect, DTYPE_BOUND[torch.float32], what="per-expert swiglu")
    act = Activation("swiglu_oai", alpha, limit, beta)
    ref = reference_moe(x, ExpertWeights(w13, w2), topk.weights, topk.ids, act)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="reference")
    # Permute path (grouped layout) agrees with the fused CPU path.
    from moerunner.api import validate_call
    from moerunner.dispatch.formats import StandardDispatchOutput

    weights = ExpertWeights(w13, w2)
    routing = validate_call(x, weights, topk.weights, topk.ids, act)
    runner = moerunner.MoeRunner("torch", force_permute=True)
    from moerunner.backends.base import MoeProblem

    spec = weights.spec(act)
    problem = MoeProblem.of(x, weights, spec, "standard")
    permuted = runner.run(
        StandardDispatchOutput(x, routing), runner.prepare(weights, problem, spec)
    )
    torch.testing.assert_close(permuted, out, rtol=1e-6, atol=1e-6)


def test_scalar_beta_and_defaults():
    x, logits, w13, w2 = _problem(7)
    topk = moerunner.select_experts(logits, 2)
    one = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai")
    beta1 = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai", swiglu_beta=1.0
    )
    assert torch.equal(one, beta1)
    half = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai", swiglu_beta=0.5
    )
    ref = reference_moe(
        x, ExpertWeights(w13, w2), topk.weights, topk.ids, Activation("swiglu_oai", beta=0.5)
    )
    assert_close(half, ref, DTYPE_BOUND[torch.float32], what="beta 0.5")


def test_per_expert_swiglu_checks():
    x, logits, w13, w2 = _problem()
    topk = moerunner.select_experts(logits, 2)
    call = dict(activation="swiglu_oai")
    with pytest.raises(MoeInputError, match=r"swiglu_alpha must have one value per expert"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, swiglu_alpha=torch.ones(3), **call)
    with pytest.raises(TypeError, match="swiglu_limit"):
        moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, swiglu_limit=torch.ones(E, 1), **call
        )
    with pytest.raises(MoeInputError, match="swiglu_limit must be > 0"):
        Activation("swiglu_oai", limit=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(MoeInputError, match="swiglu_oai"):
        Activation("silu", beta=0.5)
    # Tensor parameters compare by identity: hashable, usable as keys.
    alpha = torch.ones(E)
    assert Activation("swiglu_oai", alpha) == Activation("swiglu_oai", alpha)
    assert Activation("swiglu_oai", alpha) != Activation("swiglu_oai", alpha.clone())
    assert len({Activation("swiglu_oai", alpha), Activation("swiglu_oai", alpha)}) == 1


triton_pkg = pytest.importorskip("moerunner.backends.triton")
needs_triton = pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(), reason="no triton runtime"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
def test_per_expert_swiglu_triton_declines_auto_picks_torch():
    x, logits, w13, w2 = (t.to(DEVICE) for t in _problem(8))
    alpha = torch.full((E,), 1.702, device=DEVICE)
    topk = moerunner.select_experts(logits, 2)
    call = dict(activation="swiglu_oai", swiglu_alpha=alpha)
    with pytest.raises(BackendUnavailableError, match="per-expert"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="triton", **call)
    with pytest.raises(BackendUnavailableError, match="per-expert"):
        moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, backend="triton", activation="swiglu_oai",
            swiglu_beta=0.5,
        )  # fmt: skip
    runner = moerunner.MoeRunner("auto")
    from moerunner.api import run_experts

    act = Activation("swiglu_oai", alpha)
    run_experts(runner, ExpertWeights(w13, w2), x, topk.weights, topk.ids, act)
    assert runner.backend == "torch"


@needs_triton
def test_up_gate_order_triton_fp32():
    x, logits, w13, w2 = (t.to(DEVICE) for t in _problem(9, i=16, h=32))
    topk = moerunner.select_experts(logits, 2)
    out = moerunner.fused_moe(
        x, _swap(w13), w2, topk.weights, topk.ids, w13_order="up_gate", backend="triton"
    )
    ref = reference_moe(
        x, ExpertWeights(_swap(w13), w2, w13_order="up_gate"), topk.weights, topk.ids
    )
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="triton up_gate")


# -- routing weight on the input ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_apply_router_weight_on_input(backend):
    device = DEVICE if backend == "triton" else "cpu"
    x, logits, w13, w2 = (t.to(device) for t in _problem(10, i=16, h=32))
    topk = moerunner.select_experts(logits, 1, scoring_func="topk_sigmoid")
    out = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True, backend=backend
    )
    # Formula: expert(w * x) with unit output weight; the scaled input is rounded to fp32 once.
    scaled = x.double() * topk.weights.double()
    ref = reference_moe(scaled, ExpertWeights(w13, w2), torch.ones_like(topk.weights), topk.ids)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what="weight on input")
    # Not the same as weighting the output (silu is not linear).
    plain = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend=backend)
    assert not torch.allclose(plain, out, rtol=1e-3, atol=1e-4)


def test_apply_router_weight_on_input_needs_top1_and_empty_ok():
    x, logits, w13, w2 = _problem(11)
    topk = moerunner.select_experts(logits, 2)
    with pytest.raises(MoeInputError, match="top_k == 1"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, apply_router_weight_on_input=True)
    empty = moerunner.fused_moe(
        x[:0], w13, w2, topk.weights[:0, :1], topk.ids[:0, :1], apply_router_weight_on_input=True
    )
    assert empty.shape == (0, H)


def _swiglu_step_f64(x, w13, w2, topk, limit):
    """float64: min(silu(gate), L) * clamp(up, -L, L) on gate-then-up halves, written out."""
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk.weights[t].double(), topk.ids[t].tolist(), strict=True):
            h = w13[e].double() @ x[t].double()
            gate, up = h[:i], h[i:]
            act = torch.clamp(gate / (1 + torch.exp(-gate)), max=limit) * up.clamp(-limit, limit)
            out[t] += w * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swiglu_step_clamps_after_the_activation(backend):
    # Step-3.5 / Step-3.7 and Bailing-hybrid clamp silu's output (vLLM's swiglustep), where
    # swiglu_oai clamps the gate before it: inputs past the limit tell the two apart.
    if backend == "triton":
        if not interpreted_triton():
            pytest.skip("CPU tensors: the triton backend runs them under its interpreter only")
    g = torch.Generator().manual_seed(21)
    E, H, I, T = 4, 32, 16, 7
    x = torch.randn(T, H, generator=g) * 8
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), 2)
    want = _swiglu_step_f64(x, w13, w2, topk, 2.0)
    assert bool((torch.nn.functional.silu(x @ w13[0, :I].T) > 2.0).any())  # the clamp is hit
    got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="swiglu_step",
                              swiglu_limit=2.0, backend=backend)  # fmt: skip
    assert_close(got, want, DTYPE_BOUND[torch.float32])
    before = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai",
                                 swiglu_alpha=1.0, swiglu_limit=2.0, swiglu_beta=0.0)  # fmt: skip
    assert not torch.allclose(before, got, rtol=1e-3, atol=1e-3)  # another function
    with pytest.raises(MoeInputError, match="swiglu_limit only"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="swiglu_step",
                            swiglu_alpha=1.0)  # fmt: skip
    with pytest.raises(MoeInputError, match="swiglu_limit"):
        Activation("swiglu_step", limit=-1.0)


# -- situ (Kimi-K3) ------------------------------------------------------------------------

SITU_PARAMS = {  # id: (Activation keywords, beta, linear beta) as the formula below reads them
    "kimi_k3": ({}, 4.0, 25.0),
    "no_linear": ({"situ_beta": 3.0, "situ_linear_beta": None}, 3.0, None),
    "beta_1.5_linear_6": ({"situ_beta": 1.5, "situ_linear_beta": 6.0}, 1.5, 6.0),
}
_TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        not interpreted_triton(), reason="CPU tensors: triton runs them under its interpreter"
    ),
)


def _situ_f64(x, w13, w2, weights, ids, beta, linear_beta, b13=None):
    """float64, written out from the definition: beta tanh(g / beta) sigmoid(g) * up' on
    gate-then-up halves, up' = L tanh(up / L) (up itself for L None)."""
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            if b13 is not None:
                h = h + b13[e].double()
            gate, up = h[:i], h[i:]
            if linear_beta is not None:
                up = linear_beta * torch.tanh(up / linear_beta)
            act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up
            out[t] += weights[t, k].double() * (w2[e].double() @ act)
    return out


def _situ_problem(seed: int, dtype=torch.float32, scale: float = 3.0):
    """T=5, E=4, top-2, H=32, I=16; inputs scaled so |gate| passes the betas."""
    g = torch.Generator().manual_seed(seed)
    e, h, i, t = 4, 32, 16, 5
    x = (torch.randn(t, h, generator=g) * scale).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype)
    topk = moerunner.select_experts(torch.randn(t, e, generator=g), 2)
    return x, w13, w2, topk


@pytest.mark.parametrize("params", list(SITU_PARAMS), ids=list(SITU_PARAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["torch", _TRITON])
def test_situ_matches_its_float64_formula(backend, dtype, params):
    kwargs, beta, linear_beta = SITU_PARAMS[params]
    act = Activation("situ", **kwargs)
    x, w13, w2, topk = _situ_problem(31, dtype)
    assert bool(((x.float() @ w13[0, :16].float().T).abs() > beta).any())  # the cap bends
    got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation=act, backend=backend)
    want = _situ_f64(x, w13, w2, topk.weights, topk.ids, beta, linear_beta)
    assert got.dtype == dtype
    assert_close(got, want, DTYPE_BOUND[dtype], what=f"situ {backend}")
    ref = reference_moe(x, ExpertWeights(w13, w2), topk.weights, topk.ids, act)
    assert_close(ref, want, 1e-12, what="reference")
    silu = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend=backend)
    assert not torch.allclose(silu, got, rtol=1e-2, atol=1e-2)  # another function


@pytest.mark.parametrize("linear_beta", [25.0, None], ids=["linear_25", "no_linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["torch", _TRITON])
def test_situ_large_inputs_stay_finite(backend, dtype, linear_beta):
    # GEMM1 outputs of +-200 (the bias): tanh written as exp(2x) ratios overflows to NaN
    # there in float32; sigmoid(-200) underflows to 0.
    x, w13, w2, topk = _situ_problem(32, dtype, scale=1.0)
    sign = torch.where(torch.arange(32) % 3 == 0, -1.0, 1.0)
    b13 = (200.0 * sign.expand(4, 32) * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]).to(dtype)
    act = Activation("situ", situ_linear_beta=linear_beta)
    got = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation=act, w13_bias=b13, backend=backend
    )
    assert bool(torch.isfinite(got).all())
    want = _situ_f64(x, w13, w2, topk.weights, topk.ids, 4.0, linear_beta, b13)
    assert_close(got, want, DTYPE_BOUND[dtype], what=f"situ +-200 {backend}")
    ref = reference_moe(x, ExpertWeights(w13, w2, b13), topk.weights, topk.ids, act)
    assert_close(ref, want, 1e-12, what="reference")


@pytest.mark.parametrize("backend", ["torch", _TRITON])
def test_situ_hooked_sequence(backend):
    # The hooked sequence applies the activation in a launch of its own (triton:
    # activation_kernel), after the hook: doubling GEMM1's output is doubling w13.
    from moerunner.hooks import MoeHooks

    x, w13, w2, topk = _situ_problem(33)
    act = Activation("situ", situ_beta=2.0, situ_linear_beta=3.0)
    got = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation=act, backend=backend,
        hooks=MoeHooks(gate_up=lambda h, a, rows: h * 2),
    )  # fmt: skip
    want = _situ_f64(x, w13 * 2, w2, topk.weights, topk.ids, 2.0, 3.0)
    assert_close(got, want, DTYPE_BOUND[torch.float32], what=f"hooked situ {backend}")


@pytest.mark.gpu
@pytest.mark.parametrize("params", list(SITU_PARAMS), ids=list(SITU_PARAMS))
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_situ_triton_kernel_on_cuda(dtype, params):
    """The tests above hand triton CPU tensors (its interpreter): on the GPU machine they
    skip, so the compiled kernel is checked here, fused and in the hooked sequence."""
    from moerunner.hooks import MoeHooks

    kwargs, beta, linear_beta = SITU_PARAMS[params]
    act = Activation("situ", **kwargs)
    x, w13, w2, topk = _situ_problem(31, dtype)
    cuda = [t.cuda() for t in (x, w13, w2, topk.weights, topk.ids)]
    got = moerunner.fused_moe(*cuda, activation=act, backend="triton")
    want = _situ_f64(x, w13, w2, topk.weights, topk.ids, beta, linear_beta)
    assert got.dtype == dtype and got.is_cuda
    assert_close(got.cpu(), want, DTYPE_BOUND[dtype], what=f"situ triton cuda {params}")
    doubled = moerunner.fused_moe(
        *cuda, activation=act, backend="triton", hooks=MoeHooks(gate_up=lambda h, a, r: h * 2)
    )
    want = _situ_f64(x, w13 * 2, w2, topk.weights, topk.ids, beta, linear_beta)
    assert_close(doubled.cpu(), want, DTYPE_BOUND[dtype], what=f"hooked situ cuda {params}")


def test_situ_moe_layer_matches_reference():
    x, w13, w2, topk = _situ_problem(34)
    act = Activation("situ", situ_beta=3.0, situ_linear_beta=None)
    layer = moerunner.MoE.from_weights(ExpertWeights(w13, w2), activation=act, backend="torch")
    assert layer.config.activation == act
    with torch.no_grad():
        got = layer(x, topk=topk)
    want = _situ_f64(x, w13, w2, topk.weights, topk.ids, 3.0, None)
    assert_close(got, want, DTYPE_BOUND[torch.float32], what="MoE.from_weights situ")
    # A routed layer from a config naming the activation: Kimi-K3's parameters.
    config = moerunner.MoeConfig(4, 32, 16, 2, activation="situ")
    routed = moerunner.MoE(config, backend="torch")
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(35))
    with torch.no_grad():
        got = routed(x, logits)
    picked = moerunner.select_experts(logits, 2)
    want = _situ_f64(x, routed.w13, routed.w2, picked.weights, picked.ids, 4.0, 25.0)
    assert_close(got, want, DTYPE_BOUND[torch.float32], what="MoE situ")


@pytest.mark.parametrize("params", list(SITU_PARAMS), ids=list(SITU_PARAMS))
def test_situ_gradients_match_float64_autograd(params):
    kwargs, _, _ = SITU_PARAMS[params]
    act = Activation("situ", **kwargs)
    x, w13, w2, topk = _situ_problem(36)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, topk.weights)]
    out = moerunner.fused_moe(*leaves[:3], leaves[3], topk.ids, activation=act, backend="torch")
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(37))
    (out * cotangent).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w13, w2, topk.weights)]
    weights64 = ExpertWeights(leaves64[1], leaves64[2])
    ref = reference_moe(leaves64[0], weights64, leaves64[3], topk.ids, act)
    (ref * cotangent.double()).sum().backward()
    for name, got, want in zip(("x", "w13", "w2", "topk_weights"), leaves, leaves64, strict=True):
        assert_close(got.grad, want.grad, DTYPE_BOUND[torch.float32], what=f"d {name}")


def test_situ_parameters_through_the_custom_op():
    # The custom op (torch.compile, a layer training on another backend) carries scalar
    # alpha and limit, and rebuilds the Activation from them: situ's are stored there.
    from moerunner.ops import call_fused_experts

    x, w13, w2, topk = _situ_problem(38)
    for act in (Activation("situ", situ_beta=2.5, situ_linear_beta=None), Activation("situ")):
        direct = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation=act)
        carried = call_fused_experts(
            x, w13, w2, topk.weights, topk.ids, None, None, act.name, act.alpha, act.limit,
            False, "torch", True,
        )  # fmt: skip
        assert torch.equal(direct, carried), act


def test_situ_parameters_and_identity():
    kimi = Activation("situ")
    assert (kimi.situ_beta, kimi.situ_linear_beta) == (4.0, 25.0)
    same = Activation("situ", situ_beta=4.0, situ_linear_beta=25.0)
    no_linear = Activation("situ", situ_beta=4.0, situ_linear_beta=None)
    beta3 = Activation("situ", situ_beta=3.0)
    assert kimi == same and hash(kimi) == hash(same)
    assert (beta3.situ_beta, beta3.situ_linear_beta, no_linear.situ_linear_beta) == (3, 25, None)
    assert len({kimi, same, no_linear, beta3, Activation("silu")}) == 4
    for act in (kimi, no_linear, beta3):  # repr pastes back
        assert eval(repr(act), {"Activation": Activation}) == act
    # The stored form, as fused_moe's swiglu_alpha / swiglu_limit set it (limit 0: none).
    assert Activation("situ", 4.0, 0.0) == no_linear
    assert Activation("situ", alpha=3.0) == beta3
    # Memoised preparations are keyed by the activation: one call each, none served stale.
    x, w13, w2, topk = _situ_problem(39)
    outs = [
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation=a, backend="torch")
        for a in (kimi, no_linear, beta3)
    ]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    keyword = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation="situ", swiglu_alpha=3.0
    )
    assert torch.equal(keyword, outs[2])


def test_situ_parameter_checks():
    x, w13, w2, topk = _situ_problem(40)
    with pytest.raises(MoeInputError, match="swiglu_beta"):
        Activation("situ", beta=0.5)
    with pytest.raises(MoeInputError, match="swiglu_beta"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="situ", swiglu_beta=1.0)
    for other in ("silu", "swiglu_oai", "swiglu_step", "relu2"):
        for name in ("situ_beta", "situ_linear_beta"):
            with pytest.raises(MoeInputError, match=f"{name} applies to activation 'situ'"):
                Activation(other, **{name: 2.0})
    for name in ("situ_beta", "situ_linear_beta"):
        for bad in (0.0, -1.0, float("nan"), float("inf"), float("-inf")):
            with pytest.raises(MoeInputError, match=name):
                Activation("situ", **{name: bad})
        for bad in ("2", True, [2.0], object()):
            with pytest.raises(TypeError, match=name):
                Activation("situ", **{name: bad})
        with pytest.raises(TypeError, match="per-expert"):  # scalars only
            Activation("situ", **{name: torch.full((4,), 2.0)})
    for bad in (-1.0, float("nan")):
        with pytest.raises(MoeInputError, match="situ_beta"):
            moerunner.fused_moe(
                x, w13, w2, topk.weights, topk.ids, activation="situ", swiglu_alpha=bad
            )
    with pytest.raises(TypeError, match="per-expert"):
        moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, activation="situ", swiglu_limit=torch.ones(4)
        )
    with pytest.raises(MoeInputError, match="situ_beta=2.0 and alpha=3.0"):
        Activation("situ", alpha=3.0, situ_beta=2.0)


def test_situ_in_compiled_code_is_one_graph():
    # fullgraph: the Activation is built while tracing (keywords) or passed in, and its
    # parameters ride the custom op's scalar alpha / limit (limit 0.0: no linear cap).
    torch._dynamo.reset()
    x, w13, w2, topk = _situ_problem(41)
    act = Activation("situ", situ_beta=2.5, situ_linear_beta=None)

    def by_value(x):
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation=act)

    def by_keywords(x):
        return moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, activation="situ", swiglu_alpha=2.5,
            swiglu_limit=0.0,
        )  # fmt: skip

    want = _situ_f64(x, w13, w2, topk.weights, topk.ids, 2.5, None)
    with torch.no_grad():
        for fn in (by_value, by_keywords):
            got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
            assert_close(got, want, DTYPE_BOUND[torch.float32], what=fn.__name__)
