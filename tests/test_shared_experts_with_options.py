"""Shared experts beside the other options of a call: routing weights on the input
(Llama-4), up-then-gate rows, per-expert activation parameters, hooks, the logits entry
point, and a layer built from weights (a probe of shared experts and hooks, 2026-12-06);
then the activation parameters themselves beside hooks and gradients (a probe of
activations, the same day).

References are computed here in float64 from the same weights: every token's routed experts
plus each shared expert as a dense MLP of the unscaled input. fp32 on the torch backend is
held to 1e-5 of the largest output (fp32 sums over H = 32 and I = 16 rows).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moerunner
from moerunner import MoeInputError, SharedExperts
from moerunner.hooks import MoeHooks

E, H, I, T = 4, 32, 16, 5


def _mlp(x, w13, w2):
    h = x @ w13.T
    return (F.silu(h[..., :I]) * h[..., I:]) @ w2.T


def _case(seed=0, k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / 6
    w2 = torch.randn(E, H, I, generator=g) / 4
    shared = SharedExperts(
        torch.randn(1, 2 * I, H, generator=g) / 6, torch.randn(1, H, I, generator=g) / 6
    )
    scoring = "topk_sigmoid" if k == 1 else "softmax"
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), k, scoring_func=scoring)
    return x, w13, w2, shared, topk


def _reference(x, w13, w2, shared, topk, weight_on_input=False):
    X = x.double()
    out = _mlp(X, shared.w13[0].double(), shared.w2[0].double())  # unscaled input
    for t in range(T):
        for s in range(topk.ids.shape[1]):
            e, w = int(topk.ids[t, s]), float(topk.weights[t, s])
            if weight_on_input:
                out[t] += _mlp(X[t] * w, w13[e].double(), w2[e].double())
            else:
                out[t] += w * _mlp(X[t], w13[e].double(), w2[e].double())
    return out


def _close(got, want, tol=1e-5):
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weight_on_input_scales_the_routed_input_only(backend):
    """Llama-4: the shared expert ran on the weighted input too (0.55 off its own MoE)."""
    if backend == "triton":
        pytest.importorskip("triton")
    x, w13, w2, shared, topk = _case(k=1)
    out = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, backend=backend,
        apply_router_weight_on_input=True, shared_experts=shared,
    )  # fmt: skip
    _close(out, _reference(x, w13, w2, shared, topk, weight_on_input=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_up_then_gate_rows_with_shared_experts(backend):
    """The routed experts with their shared ones ran gate and up swapped (0.75 relative
    error)."""
    if backend == "triton":
        pytest.importorskip("triton")
    x, w13, w2, shared, topk = _case()
    up_gate = torch.cat([w13[:, I:], w13[:, :I]], 1)
    out = moerunner.fused_moe(
        x, up_gate, w2, topk.weights, topk.ids, backend=backend, w13_order="up_gate",
        shared_experts=shared,
    )  # fmt: skip
    _close(out, _reference(x, w13, w2, shared, topk))


def test_per_expert_activation_parameters_with_shared_experts_are_named():
    x, w13, w2, shared, topk = _case()
    with pytest.raises(MoeInputError, match="per-expert activation parameters"):
        moerunner.fused_moe(
            x,
            w13,
            w2,
            topk.weights,
            topk.ids,
            activation="swiglu_oai",
            swiglu_alpha=torch.full((E,), 1.702),
            shared_experts=shared,
        )  # fmt: skip  (an IndexError inside the activation before)


def test_hooks_do_not_reach_the_shared_experts():
    """A down hook adding 1 per row was applied once per chunk of the shared expert (then
    extra slots of the routed call), and per-expert data indexed past E. The shared experts
    run in a call of their own, which the hooks never see."""
    x, w13, w2, shared, topk = _case()
    seen = []

    def down(y, a, rows):
        seen.append(int(rows.expert.max()))
        bias = torch.ones(E, H)[rows.expert.clamp(min=0)]  # per-expert data
        return y + bias

    out = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, backend="torch", shared_experts=shared,
        hooks=MoeHooks(down=down, num_experts=E),
    )  # fmt: skip
    want = _reference(x, w13, w2, shared, topk) + topk.weights.sum(1, keepdim=True).double()
    _close(out, want)
    assert seen and max(seen) < E


def test_a_hook_result_outside_its_contract_is_named():
    x, w13, w2, _, topk = _case()
    call = lambda hook: moerunner.fused_moe(  # noqa: E731
        x, w13, w2, topk.weights, topk.ids, backend="torch", hooks=MoeHooks(gate_up=hook)
    )
    with pytest.raises(TypeError, match="gate_up must return a floating tensor, got torch.bool"):
        call(lambda h, a, r: h > 0)
    with pytest.raises(MoeInputError, match="gate_up must return a tensor on cpu"):
        call(lambda h, a, r: torch.empty_like(h, device="meta"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_transposed_hook_result_is_read_by_its_values(backend):
    """triton read a column-major result by its row stride (6.5 off)."""
    if backend == "triton":
        pytest.importorskip("triton")
    x, w13, w2, _, topk = _case()
    double = torch.eye(2 * I) * 2.0
    out = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, backend=backend,
        hooks=MoeHooks(gate_up=lambda h, a, r: (double @ h.T).T),
    )  # fmt: skip
    zero = SharedExperts(torch.zeros(1, 2 * I, H), torch.zeros(1, H, I))
    _close(out, _reference(x, 2 * w13, w2, zero, topk))


def test_logits_entry_point_takes_shared_experts_and_hooks():
    """Its docstring says every other keyword is fused_moe's; these two were refused."""
    x, w13, w2, shared, _ = _case()
    logits = torch.randn(T, E)
    out = moerunner.fused_moe_from_logits(
        x, logits, w13, w2, 2, shared_experts=shared, hooks=MoeHooks(), backend="torch"
    )
    topk = moerunner.select_experts(logits, 2)
    _close(out, _reference(x, w13, w2, shared, topk))


def test_shared_experts_given_to_from_weights_are_layer_state():
    """They were kept outside the module: state_dict held w13 / w2 only, and after
    ``.to(torch.bfloat16)`` every call raised, blaming the shared weights' fp32."""
    from moerunner.weights import ExpertWeights

    x, w13, w2, shared, topk = _case()
    gate = torch.randn(1, H) / 4
    shared = SharedExperts(shared.w13, shared.w2, gate)
    layer = moerunner.MoE.from_weights(
        ExpertWeights(w13, w2), shared_experts=shared, backend="torch"
    )
    assert {"shared_w13", "shared_w2", "shared_gate"} <= set(layer.state_dict())
    assert layer.shared_w13.data_ptr() == shared.w13.data_ptr()  # no copy
    want = _reference(x, w13, w2, SharedExperts(shared.w13, shared.w2), topk)
    want -= _mlp(x.double(), shared.w13[0].double(), shared.w2[0].double())
    want += torch.sigmoid(x.double() @ gate[0].double())[:, None] * _mlp(
        x.double(), shared.w13[0].double(), shared.w2[0].double()
    )
    with torch.no_grad():
        _close(layer(x, topk=topk), want)
        layer.to(torch.bfloat16)  # bf16: 2^-8 per rounding, a few roundings deep
        _close(layer(x.bfloat16(), topk=topk), want, tol=2e-2)


# -- activations (a probe of activations and biases, 2026-12-06) ---------------------------


@pytest.mark.parametrize("name", ["swiglu_oai", "swiglu_step"])
def test_a_per_expert_limit_has_the_clamps_gradient_at_the_limit(name):
    """``torch.minimum`` split the gradient of a value equal to a tensor limit in two (half
    of a float limit's, which is torch.clamp's and the models' own)."""
    x, w2 = torch.zeros(1, 8), torch.ones(1, 8, 1)
    w13, ids, w = torch.zeros(1, 2, 8), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    limit = 7.0 if name == "swiglu_oai" else 2.0
    grads = []
    for given in (limit, torch.tensor([limit])):
        bias = torch.tensor([[limit, limit]], requires_grad=True)  # gate = up = limit
        out = moerunner.fused_moe(
            x, w13, w2, w, ids, activation=name, swiglu_limit=given, w13_bias=bias
        )
        out[0, 0].backward()
        grads.append(bias.grad)
    # float64: d/d up of the clamped product at the limit, the clamp passing the gradient
    g = torch.tensor(limit, dtype=torch.float64, requires_grad=True)
    if name == "swiglu_oai":
        ref = (
            (g.clamp(max=limit) + 1)
            * torch.tensor(limit).double()
            * torch.sigmoid(1.702 * torch.tensor(limit).double())
        )
    else:
        ref = F.silu(torch.tensor(limit).double()).clamp(max=limit) * g.clamp(-limit, limit)
    ref.backward()
    assert torch.equal(grads[0], grads[1]), grads
    assert abs(float(grads[1][0, 1]) - float(g.grad)) <= 1e-5 * abs(float(g.grad))


def test_hooks_with_per_expert_activation_parameters_run():
    """The hooked torch sequence gave no row experts to the activation: a ValueError."""
    x, w13, w2, _, topk = _case()
    alpha = torch.tensor([1.0, 1.5, 2.0, 2.5])
    got = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, backend="torch", activation="swiglu_oai",
        swiglu_alpha=alpha, hooks=MoeHooks(gate_up=lambda h, a, r: h),
    )  # fmt: skip
    want = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, backend="torch", activation="swiglu_oai",
        swiglu_alpha=alpha,
    )  # fmt: skip
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_a_trained_activation_parameter_with_frozen_experts():
    """It reached the inference path, whose out= GEMMs have no autograd (a RuntimeError
    inside torch). Its gradient is held to float64 autograd of the same call."""
    x, w13, w2, _, topk = _case()
    alpha = torch.nn.Parameter(torch.full((E,), 1.702))
    out = moerunner.fused_moe(
        x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai", swiglu_alpha=alpha
    )
    out.sum().backward()
    a64 = alpha.detach().double().requires_grad_()
    ref = torch.zeros((), dtype=torch.float64)
    for t in range(T):  # swiglu_oai: clamp (limit 7), (up + 1) * gate * sigmoid(alpha gate)
        for s in range(topk.ids.shape[1]):
            e = int(topk.ids[t, s])
            h = w13[e].double() @ x[t].double()
            gate, up = h[:I].clamp(max=7.0), h[I:].clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(a64[e] * gate)
            ref = ref + float(topk.weights[t, s]) * (w2[e].double() @ act).sum()
    ref.backward()
    assert (alpha.grad.double() - a64.grad).abs().max() <= 1e-4 * a64.grad.abs().max()


def test_activation_and_row_order_arguments_are_typed():
    x, w13, w2, _, topk = _case()
    with pytest.raises(TypeError, match="activation must be a name or an Activation"):
        moerunner.MoeConfig(4, 8, 4, 2, activation=None)
    with pytest.raises(TypeError, match="gate_up_interleaved must be a bool"):
        moerunner.MoeConfig(4, 8, 4, 2, gate_up_interleaved="no")
    with pytest.raises(TypeError, match="gate_up_interleaved must be a bool"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, gate_up_interleaved="False")
    for limit in (torch.ones(E).numpy(), 10**400):
        with pytest.raises(TypeError, match="swiglu_limit must be a number"):
            moerunner.fused_moe(
                x, w13, w2, topk.weights, topk.ids, activation="swiglu_oai", swiglu_limit=limit
            )
