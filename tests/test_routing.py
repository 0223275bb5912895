"""select_experts on hand-checked cases; family parity with transformers is in
test_transformers_parity.py."""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import MoeInputError, select_experts


def test_softmax_topk_renormalize_by_hand():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    topk = select_experts(logits, 2, renormalize=True)
    assert topk.ids.tolist() == [[3, 2]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(topk.weights, (e / e.sum())[None], rtol=0, atol=1e-7)
    assert topk.weights.dtype == torch.float32 and topk.ids.dtype == torch.int32


def test_softmax_without_renormalize_keeps_full_softmax_mass():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    topk = select_experts(logits, 2)
    probs = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(topk.weights[0], probs[[3, 2]])


def test_sigmoid_grouped_bias_only_chooses():
    # 4 experts in 2 groups; bias makes group 1 win the choice, weights stay unbiased sigmoid.
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.2]])
    bias = torch.tensor([0.0, 0.0, 5.0, 5.0])
    topk = select_experts(
        logits,
        2,
        scoring_func="sigmoid",
        renormalize=True,
        correction_bias=bias,
        num_expert_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    )
    assert sorted(topk.ids[0].tolist()) == [2, 3]
    s = torch.sigmoid(logits[0, [2, 3]])
    expected = s / (s.sum() + 1e-20) * 2.5
    got = topk.weights[0][torch.argsort(topk.ids[0])]
    torch.testing.assert_close(got, expected)


def test_group_score_is_sum_of_top_two():
    # Group 0: one huge score (sum of top-2 = 0.99+0.01); group 1: two medium (0.6+0.6).
    scores = torch.tensor([[0.99, 0.01, 0.6, 0.6]])
    logits = torch.logit(scores)
    topk = select_experts(logits, 1, scoring_func="sigmoid", num_expert_group=2, topk_group=1)
    assert topk.ids[0, 0].item() in (2, 3)


def test_empty_batch():
    topk = select_experts(
        torch.zeros(0, 8),
        2,
        scoring_func="sigmoid",
        correction_bias=torch.zeros(8),
        num_expert_group=4,
        topk_group=2,
    )
    assert topk.ids.shape == (0, 2) and topk.weights.shape == (0, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2, scoring_func="tanh"), "scoring_func"),
        (dict(top_k=2, num_expert_group=3, topk_group=1), "num_expert_group"),
        (dict(top_k=2, num_expert_group=2), "together"),
        (dict(top_k=2, correction_bias=torch.zeros(3)), "correction_bias"),
        (dict(top_k=3, num_expert_group=2, topk_group=1), "kept groups"),
    ],
)
def test_bad_routing_arguments(kwargs, match):
    with pytest.raises(MoeInputError, match=match):
        select_experts(torch.randn(3, 4), **kwargs)


def test_bad_routing_types():
    with pytest.raises(TypeError, match="top_k"):
        select_experts(torch.randn(3, 4), 2.0)
    with pytest.raises(TypeError, match="router_logits"):
        select_experts(torch.ones(3, 4, dtype=torch.int64), 2)
    with pytest.raises(MoeInputError, match="router_logits"):
        select_experts(torch.randn(3), 1)


def test_layer_routes_like_select_experts():
    cfg = moerunner.MoeConfig(
        8,
        16,
        8,
        2,
        routing=moerunner.RoutingConfig("sigmoid", True, 4, 2, 2.5, correction_bias=True),
    )
    layer = moerunner.MoE(cfg)
    layer.correction_bias.copy_(torch.randn(8))
    x, logits = torch.randn(5, 16), torch.randn(5, 8)
    topk = select_experts(
        logits,
        2,
        scoring_func="sigmoid",
        renormalize=True,
        correction_bias=layer.correction_bias,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    ref = moerunner.reference_moe(
        x, moerunner.ExpertWeights(layer.w13.detach(), layer.w2.detach()), topk.weights, topk.ids
    )
    torch.testing.assert_close(layer(x, logits).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(routed_scaling_factor=None), TypeError, "routed_scaling_factor must be a float"),
        (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor must be a float"),
        (dict(routed_scaling_factor=torch.ones(8)), TypeError, "got torch.Tensor"),
        (dict(routed_scaling_factor=float("nan")), moerunner.MoeInputError, "must be > 0"),
        (dict(routed_scaling_factor=-1.0), moerunner.MoeInputError, "must be > 0"),
        (dict(renormalize="no"), TypeError, "renormalize must be a bool"),
        # float32 weights: inf or all zero (accepted before)
        (dict(routed_scaling_factor=1e39), moerunner.MoeInputError, "float32's normal range"),
        (dict(routed_scaling_factor=1e-46), moerunner.MoeInputError, "float32's normal range"),
    ],
)
def test_routing_values_are_checked_by_name(kwargs, error, match):
    """A NaN factor gave NaN weights silently, a string "no" renormalised, a tensor factor
    failed inside the arithmetic (RuntimeError): each is now refused by name, in
    select_experts and in RoutingConfig alike."""
    with pytest.raises(error, match=match):
        moerunner.select_experts(torch.randn(4, 8), 2, **kwargs)
    with pytest.raises(error, match=match):
        moerunner.RoutingConfig(**kwargs)


def test_an_integer_scaling_factor_is_accepted():
    logits = torch.randn(4, 8)
    a = moerunner.select_experts(logits, 2, routed_scaling_factor=2)
    b = moerunner.select_experts(logits, 2, routed_scaling_factor=2.0)
    assert torch.equal(a.weights, b.weights) and a.weights.dtype == torch.float32


def test_routing_config_refuses_an_unknown_score_where_it_is_built():
    """``scoring_func`` / ``group_score`` were accepted by the config and refused only at
    the layer's first call (a probe of the docs' claims, 2026-12-06)."""
    from moerunner import MoeInputError, RoutingConfig

    with pytest.raises(MoeInputError, match="RoutingConfig.scoring_func: got 'relu'"):
        RoutingConfig(scoring_func="relu")
    with pytest.raises(MoeInputError, match="RoutingConfig.group_score: got 'avg'"):
        RoutingConfig(group_score="avg")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(routed_scaling_factor=-1.0),
        dict(routed_scaling_factor=float("nan")),
        dict(renormalize="no"),
    ],
)
def test_routing_values_are_checked_under_torch_compile(kwargs):
    """Compiled, these were accepted silently (negative or NaN weights, "no" read as True):
    the checks were skipped while tracing. Constant arguments are checked there now (under
    fullgraph Dynamo reports the raise as Unsupported, its text ours)."""
    fn = torch.compile(lambda t: select_experts(t, 2, **kwargs), backend="eager")
    with pytest.raises((TypeError, MoeInputError)):
        fn(torch.randn(2, 8))


def test_a_traced_scaling_factor_still_compiles():
    def route(t, factor):
        return select_experts(t, 2, routed_scaling_factor=factor).weights

    logits = torch.randn(3, 8)
    compiled = torch.compile(route, fullgraph=True, backend="eager", dynamic=True)
    for factor in (2.5, 1.5):
        assert torch.equal(compiled(logits, factor), route(logits, factor))


def test_routing_type_errors_name_the_argument_and_its_type():
    np = pytest.importorskip("numpy")
    # was "renormalize must be a bool, got bool"
    with pytest.raises(TypeError, match="got numpy.bool"):
        select_experts(torch.randn(2, 8), 2, renormalize=np.bool_(True))
    # was an AttributeError of the dict
    for routing in ({"renormalize": True}, None):
        with pytest.raises(TypeError, match="routing must be a RoutingConfig"):
            moerunner.MoeConfig(8, 16, 16, 2, routing=routing)


def test_backend_is_checked_with_a_custom_routing_function():
    """Ignored before when a custom function was given."""

    def custom(hidden, logits, k, renormalize):
        return torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)

    with pytest.raises(MoeInputError, match="backend: got 'banana'"):
        select_experts(torch.randn(2, 8), 2, backend="banana", custom_routing_function=custom)
