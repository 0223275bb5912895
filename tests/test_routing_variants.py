"""Routing variants of select_experts, each against its formula written here in float64:
DeepSeek-V2 grouped top-k (groups ranked by their best score), Llama-4 (top-k of the raw
logits, sigmoid of the chosen logits), a user routing function; and the Triton routing
kernel on the new rules (same bits as the torch path, under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from moerunner import MoeInputError, RoutingConfig, select_experts


def _logits(t: int, e: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed))


def _grouped_max64(logits, top_k, groups, keep, scoring, renormalize, scale):
    """DeepSeek-V2: scores; a group's score is its best score; the ``keep`` best groups stay
    eligible; top-k of the eligible scores; optional renormalisation; times ``scale``."""
    x = logits.double()
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    t, e = scores.shape
    per = e // groups
    out_w = torch.zeros(t, top_k, dtype=torch.float64)
    out_i = torch.zeros(t, top_k, dtype=torch.int64)
    for row in range(t):
        gscore = [max(scores[row, g * per : (g + 1) * per].tolist()) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -gscore[g])[:keep]
        eligible = [i for g in kept for i in range(g * per, (g + 1) * per)]
        chosen = sorted(eligible, key=lambda i: -scores[row, i].item())[:top_k]
        w = scores[row, chosen]
        if renormalize:
            w = w / w.sum()
        out_w[row], out_i[row] = w * scale, torch.tensor(chosen)
    return out_w, out_i


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_group_score_max_matches_deepseek_v2_formula(scoring, renormalize):
    logits = _logits(11, 16, seed=3)
    topk = select_experts(
        logits,
        3,
        scoring_func=scoring,
        renormalize=renormalize,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
        group_score="max",
        backend="torch",
    )
    w64, ids = _grouped_max64(logits, 3, 4, 2, scoring, renormalize, 16.0)
    # Sets of experts per token equal; weights in slot order equal up to the fp32 rounding
    # of the scores (2^-24 relative) and the scaling in fp32.
    assert torch.equal(topk.ids.long(), ids)
    torch.testing.assert_close(topk.weights.double(), w64, rtol=1e-6, atol=0)


def test_group_score_max_differs_from_top2_sum():
    """A case where the two rules keep different groups: group 0 has one high score, group 1
    two slightly lower ones (2 e^4.5 > e^5 + e^-9, e^5 > e^4.5)."""
    logits = torch.tensor([[5.0, -9.0, 4.5, 4.5]])
    kw = dict(num_expert_group=2, topk_group=1, backend="torch")
    assert select_experts(logits, 1, group_score="max", **kw).ids.tolist() == [[0]]
    assert select_experts(logits, 1, group_score="top2_sum", **kw).ids.tolist() == [[2]]


@pytest.mark.parametrize("top_k", [1, 2])
def test_topk_sigmoid_matches_llama4_formula(top_k):
    logits = _logits(9, 8, seed=5)
    topk = select_experts(logits, top_k, scoring_func="topk_sigmoid", backend="torch")
    x = logits.double()
    ids = torch.stack(
        [torch.tensor(sorted(range(8), key=lambda i: -x[t, i].item())[:top_k]) for t in range(9)]
    )
    weights = 1.0 / (1.0 + torch.exp(-x.gather(1, ids)))
    assert torch.equal(topk.ids.long(), ids)
    # sigmoid computed in float64 and rounded once to float32: within 2^-24 relative.
    torch.testing.assert_close(topk.weights.double(), weights, rtol=2**-24, atol=0)


def test_topk_sigmoid_chooses_on_logits_not_saturated_scores():
    """Two logits whose sigmoids round to the same float32 (1.0): the larger logit wins."""
    logits = torch.tensor([[30.0, 40.0, -1.0]])
    topk = select_experts(logits, 1, scoring_func="topk_sigmoid", backend="torch")
    assert topk.ids.tolist() == [[1]]
    assert topk.weights.tolist() == [[1.0]]


def test_custom_routing_function_called_with_vllm_arguments():
    seen = {}

    def route(hidden_states, router_logits, top_k, renormalize):
        seen.update(h=hidden_states, k=top_k, r=renormalize)
        w, i = torch.topk(router_logits, top_k, dim=-1)
        return torch.sigmoid(w).to(torch.bfloat16), i  # int64 ids, bf16 weights: converted

    x = torch.randn(4, 6)
    logits = _logits(4, 5)
    topk = select_experts(
        logits, 2, renormalize=True, custom_routing_function=route, hidden_states=x
    )
    assert seen["h"] is x and seen["k"] == 2 and seen["r"] is True
    assert topk.ids.dtype == torch.int32 and topk.weights.dtype == torch.float32
    w, i = torch.topk(logits, 2, dim=-1)
    assert torch.equal(topk.ids, i.int())
    assert torch.equal(topk.weights, torch.sigmoid(w).to(torch.bfloat16).float())


@pytest.mark.parametrize(
    "result, match",
    [
        (lambda lg, k: None, "must return"),
        (lambda lg, k: (torch.ones(lg.shape[0], k + 1), torch.zeros(lg.shape[0], k + 1)), "shape"),
        (lambda lg, k: (torch.ones(lg.shape[0], k), torch.zeros(lg.shape[0], k)), "int64, int32"),
        (lambda lg, k: (torch.ones(lg.shape[0], k, dtype=torch.int32),) * 2, "floating"),
        (lambda lg, k: ([1.0], torch.zeros(lg.shape[0], k, dtype=torch.int32)), "not a tensor"),
    ],
)
def test_custom_routing_function_output_checked(result, match):
    def route(hidden_states, router_logits, top_k, renormalize):
        return result(router_logits, top_k)

    with pytest.raises((MoeInputError, TypeError), match=match):
        select_experts(_logits(3, 4), 2, custom_routing_function=route)


def test_custom_routing_function_excludes_builtin_rules():
    with pytest.raises(MoeInputError, match="num_expert_group"):
        select_experts(
            _logits(3, 4),
            1,
            custom_routing_function=lambda *a: None,
            num_expert_group=2,
            topk_group=1,
        )


def test_group_score_rejects_unknown():
    with pytest.raises(MoeInputError, match="group_score"):
        select_experts(_logits(2, 4), 1, num_expert_group=2, topk_group=1, group_score="sum")


def test_routing_config_carries_group_score():
    assert RoutingConfig(group_score="max").group_score == "max"


triton_pkg = pytest.importorskip("moerunner.backends.triton")


@pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(), reason="no triton runtime"
)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scoring_func="softmax", num_expert_group=4, topk_group=2, group_score="max"),
        dict(
            scoring_func="sigmoid",
            renormalize=True,
            num_expert_group=4,
            topk_group=3,
            group_score="max",
            routed_scaling_factor=2.5,
        ),
        dict(scoring_func="topk_sigmoid"),
        dict(scoring_func="topk_sigmoid", num_expert_group=2, topk_group=1),
    ],
    ids=["v2-softmax", "max-sigmoid-renorm", "llama4", "llama4-grouped"],
)
def test_triton_routing_kernel_same_bits(kwargs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = _logits(7, 16, seed=11).to(device)
    ref = select_experts(logits, 2, backend="torch", **kwargs)
    got = select_experts(logits, 2, backend="triton", **kwargs)
    assert torch.equal(ref.ids.cpu(), got.ids.cpu())
    assert torch.equal(ref.weights.cpu().view(torch.int32), got.weights.cpu().view(torch.int32))
