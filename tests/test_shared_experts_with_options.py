"""Shared experts beside the other options of a call: routing weights on the input
(Llama-4), up-then-gate rows, per-expert activation parameters, hooks, the logits entry
point, and a layer built from weights (a probe of shared experts and hooks, 2026-12-06).

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
    """The expert table dropped the row order: the routed experts ran gate and up swapped
    (0.75 relative error)."""
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
    """A down hook adding 1 per row was applied once per chunk the table split the shared
    expert into, and per-expert data indexed past E. Now the shared rows reach a hook as
    rows of no expert (-1) and its result for them is dropped."""
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
