"""Pre-routed calls replayed behind one key lookup (``moerunner.call_steps``).

CPU tests check the bookkeeping with a stand-in fused op: when a step is made, served,
dropped or not made. GPU tests check that ``fused_moe`` and the transformers experts
function, once stepped, compute exactly what the ordinary path computes (the same plan of
the same kernels: bit for bit), follow weight edits, keep the id check, and never sync.
"""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import call_steps
from moerunner.registry import Registry
from moerunner.runner import MoeRunner, prepared_memo
from moerunner.weights import ExpertWeights

E, H, I, K = 8, 256, 128, 2


def _weights(device, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(device=device, dtype=dtype)
    return w13, w2


def _routing(tokens, device, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g).to(device)
    return moerunner.select_experts(logits, K, renormalize=True)


def test_the_registry_generation_moves_whenever_choices_are_dropped():
    registry = Registry()
    before = registry.generation
    registry.forget_choices()
    registry.register_permute("standard", lambda *a: None, lambda *a: None)
    assert registry.generation == before + 2


def test_no_step_key_off_the_gpu_or_for_runners_with_their_own_choices():
    x = torch.randn(3, H)
    topk = _routing(3, "cpu")
    weights = ExpertWeights(*_weights("cpu", torch.float32))
    args = (weights, x, topk.weights, topk.ids, moerunner.Activation("silu"), False)
    assert call_steps.step_key(MoeRunner("auto"), *args) is None
    assert call_steps.step_key(MoeRunner("auto", preference={"cpu": ("torch",)}), *args) is None


class _Step:
    """A stand-in step: returns a marker tensor, counts its replays."""

    def __init__(self, out):
        self.out, self.runs = out, 0

    def run(self, hidden, ids, route_w):
        self.runs += 1
        return self.out


class _Fused:
    """A stand-in fused op offering steps (``call_step``), or none (``offers=False``)."""

    def __init__(self, offers=True):
        self.made = 0
        if offers:
            self.call_step = self._make

    def _make(self, hidden, ids, route_w, prepared, checks_ids):
        self.made += 1
        return _Step(torch.full_like(hidden, 7.0))


def _prepared_call(weights, x, topk):
    """One ordinary CPU call: it leaves the prepared-forms memo on the weights."""
    with torch.no_grad():
        moerunner.fused_moe(x, weights.w13, weights.w2, topk.weights, topk.ids, backend="torch")


def test_a_step_serves_its_key_until_a_weight_changes():
    w13, w2 = _weights("cpu", torch.float32)
    weights = ExpertWeights(w13, w2)
    x = torch.randn(3, H)
    topk = _routing(3, "cpu")
    _prepared_call(weights, x, topk)
    key = ("some", "key")
    fused = _Fused()
    call_steps.make_step(key, weights, fused, x, topk.weights, topk.ids, None, False)
    out = call_steps.replay_step(key, ExpertWeights(w13, w2), x, topk.weights, topk.ids)
    assert out is not None and bool((out == 7).all()) and fused.made == 1
    assert call_steps.replay_step(("other",), weights, x, topk.weights, topk.ids) is None
    with torch.no_grad():
        w13.mul_(2)  # in place: the memo is stale, so no step serves
    assert prepared_memo(weights) is None
    assert call_steps.replay_step(key, weights, x, topk.weights, topk.ids) is None
    _prepared_call(weights, x, topk)  # prepares again and drops the old steps
    assert call_steps.replay_step(key, weights, x, topk.weights, topk.ids) is None
    call_steps.make_step(key, weights, fused, x, topk.weights, topk.ids, None, False)
    assert call_steps.replay_step(key, weights, x, topk.weights, topk.ids) is not None
    w2.data = w2.data.clone()  # a new address
    assert call_steps.replay_step(key, weights, x, topk.weights, topk.ids) is None
    other_w2 = ExpertWeights(w13, w2.clone())  # another w2 object beside the same w13
    assert prepared_memo(other_w2) is None


def test_a_fused_op_without_steps_is_asked_a_bounded_number_of_times():
    w13, w2 = _weights("cpu", torch.float32)
    weights = ExpertWeights(w13, w2)
    x = torch.randn(2, H)
    topk = _routing(2, "cpu")
    _prepared_call(weights, x, topk)
    key = ("k",)
    for _ in range(call_steps.STEP_TRIES + 2):
        call_steps.make_step(
            key, weights, _Fused(offers=False), x, topk.weights, topk.ids, None, False
        )
    assert prepared_memo(weights).steps[key] == call_steps.STEP_TRIES
    fused = _Fused()
    for i in range(call_steps.STEPS_MAX + 5):  # least recently used dropped first
        call_steps.make_step(("k", i), weights, fused, x, topk.weights, topk.ids, None, False)
    steps = prepared_memo(weights).steps
    assert len(steps) == call_steps.STEPS_MAX and ("k", 0) not in steps


def test_no_step_is_made_for_strided_routing_weights():
    w13, w2 = _weights("cpu", torch.float32)
    weights = ExpertWeights(w13, w2)
    x = torch.randn(4, H)
    topk = _routing(4, "cpu")
    _prepared_call(weights, x, topk)
    strided = torch.randn(K, 4).t()
    fused = _Fused()
    call_steps.make_step(("s",), weights, fused, x, strided, topk.ids, None, False)
    assert fused.made == 0
    assert call_steps.replay_step(("s",), weights, x, strided, topk.ids) is None  # no raise


# -- GPU ------------------------------------------------------------------------------------


def _steps_of(weights):
    memo = prepared_memo(weights)
    return [] if memo is None else [s for s in memo.steps.values() if not isinstance(s, int)]


def _fresh(x, w13, w2, topk, **kw):
    """The ordinary path: the same call on new weight objects (no memo, no step)."""
    return moerunner.fused_moe(x, w13.clone(), w2.clone(), topk.weights, topk.ids, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 9, 300])
@pytest.mark.parametrize("routing_dtypes", ["int32/fp32", "int64/bf16"])
def test_stepped_fused_moe_equals_the_ordinary_path(tokens, routing_dtypes):
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    w13, w2 = _weights(dev)
    topk = _routing(tokens, dev)
    if routing_dtypes == "int64/bf16":  # as transformers' routers give them
        topk = moerunner.TopK(weights=topk.weights.bfloat16(), ids=topk.ids.long())
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = _fresh(x, w13, w2, topk, backend="triton")
        for call in range(5):  # compile, record the plan, make the step, replay it
            got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="triton")
            torch.cuda.synchronize()
            assert torch.equal(got, want), (tokens, routing_dtypes, call)
    assert _steps_of(ExpertWeights(w13, w2)), "no step was made"


@pytest.mark.gpu
def test_a_stepped_call_follows_weight_edits_and_keeps_the_id_check():
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    w13, w2 = _weights(dev)
    topk = _routing(6, dev)
    x = torch.randn(6, H, device=dev, dtype=torch.bfloat16)

    def call():
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="triton")

    with torch.no_grad():
        for _ in range(4):
            first = call()
        assert _steps_of(ExpertWeights(w13, w2))
        w13.mul_(0.5)  # in place: the memo is stale, the ordinary path prepares again
        edited = call()
        assert torch.equal(edited, _fresh(x, w13, w2, topk, backend="triton"))
        assert not torch.equal(edited, first)
        for _ in range(3):
            assert torch.equal(call(), edited)
        moerunner.check_errors()
        topk.ids[2, 1] = E  # a bad id in the same tensor: the same key, the step replays
        call()
        with pytest.raises(moerunner.MoeInputError, match="topk_ids"):
            moerunner.check_errors()


@pytest.mark.gpu
def test_stepped_calls_do_not_sync():
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    w13, w2 = _weights(dev)
    topk = _routing(8, dev)
    x = torch.randn(8, H, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(4):
            moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):  # the id flags are read every 8th call, without waiting
                moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    moerunner.check_errors()


@pytest.mark.gpu
def test_the_transformers_experts_function_replays_steps():
    pytest.importorskip("triton")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import moerunner.integrations.transformers as mt

    dev = torch.device("cuda")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act="silu"
    )
    experts = Qwen3MoeExperts(cfg).to(device=dev, dtype=torch.bfloat16)
    w13, w2 = _weights(dev)  # transformers leaves the parameters uninitialised here
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
    forward = mt.make_experts_forward("triton")
    topk = _routing(5, dev)
    ids, weights = topk.ids.long(), topk.weights.bfloat16()
    x = torch.randn(5, H, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        first = forward(experts, x, ids, weights)
        assert bool(first.isfinite().all()) and bool(first.abs().sum() > 0)
        for _ in range(4):
            got = forward(experts, x, ids, weights)
            torch.cuda.synchronize()
            assert torch.equal(got, first)
        want = moerunner.fused_moe(
            x,
            experts.gate_up_proj.detach().clone(),
            experts.down_proj.detach().clone(),
            weights,
            ids,
            backend="triton",
            check_ids=False,
        )
    assert torch.equal(got, want)
    from moerunner.integrations._hf_experts import expert_weights

    with torch.no_grad():
        assert _steps_of(expert_weights(experts)[0])
