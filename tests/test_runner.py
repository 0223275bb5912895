"""Runner bookkeeping: dispatch formats through the permutes, T = 0, preparation caching."""

from __future__ import annotations

import contextlib

import pytest
import torch
from cases import TOLERANCE, Case

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import (
    MaskedDispatchOutput,
    PermutedDispatchOutput,
    StandardDispatchOutput,
)
from moerunner.routing import TopK
from moerunner.testing import assert_close


def _prepared(runner, x, weights, fmt="standard", activation="silu"):
    spec = weights.spec(moerunner.Activation(activation))
    return runner.prepare(weights, MoeProblem.of(x, weights, spec, fmt), spec)


def test_permuted_format_matches_per_expert_reference():
    x, weights, tw, ids = Case("p", tokens=9, experts=4).build(torch.float32)
    # Build the grouped layout by hand: rows sorted by expert, offsets per expert.
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rows = x[order // ids.shape[1]]
    counts = torch.bincount(flat, minlength=4)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    padded = torch.cat([rows, torch.randn(3, rows.shape[1])])  # 3 padding rows at the end
    runner = moerunner.MoeRunner("torch")
    y = runner.run(
        PermutedDispatchOutput(padded, offsets), _prepared(runner, x, weights, "permuted")
    )
    assert y.shape == padded.shape
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:])), "padding rows must come back zero"
    # Each grouped row = its expert applied to its token (weight 1).
    ones = torch.ones(1, 1)
    for m in range(rows.shape[0]):
        e = int(flat[order[m]])
        ref = moerunner.reference_moe(rows[m : m + 1], weights, ones, torch.tensor([[e]]))
        assert_close(y[m : m + 1], ref, TOLERANCE[torch.float32])


def test_masked_format_matches_reference():
    x, weights, _, _ = Case("m", tokens=6, experts=4).build(torch.float32)
    capacity = 5
    counts = torch.tensor([2, 0, 5, 1], dtype=torch.int32)
    hidden_ECH = torch.randn(4, capacity, x.shape[1])
    runner = moerunner.MoeRunner("torch")
    y = runner.run(
        MaskedDispatchOutput(hidden_ECH, counts), _prepared(runner, x, weights, "masked")
    )
    assert y.shape == (4, capacity, x.shape[1])
    for e in range(4):
        n = int(counts[e])
        assert torch.equal(y[e, n:], torch.zeros_like(y[e, n:]))
        if n:
            ref = moerunner.reference_moe(
                hidden_ECH[e, :n], weights, torch.ones(n, 1), torch.full((n, 1), e)
            )
            assert_close(y[e, :n], ref, TOLERANCE[torch.float32])


def test_empty_batch_launches_nothing():
    calls = []
    registry = moerunner.default_registry()
    local = moerunner.Registry(permutes=dict(registry.permutes))
    local.register_backend(
        registry.backends["torch"].variant(fused_ops={}, core=lambda *a: calls.append(a))
    )
    x, weights, tw, ids = Case("T0", tokens=0).build(torch.float32)
    runner = moerunner.MoeRunner("torch", registry=local)
    prepared = _prepared(runner, x, weights)
    for d in (
        StandardDispatchOutput(x, TopK(tw, ids)),
        PermutedDispatchOutput(x, torch.zeros(5, dtype=torch.int64)),
        MaskedDispatchOutput(torch.zeros(4, 0, x.shape[1]), torch.zeros(4, dtype=torch.int32)),
    ):
        out = runner.run(d, prepared)
        assert out.shape == d.hidden_states.shape
    assert calls == []


def test_functional_api_prepares_once_and_follows_inplace_updates():
    x, weights, tw, ids = Case("c").build(torch.float32)
    prepares = []
    backend = moerunner.default_registry().backends["torch"]
    original = backend.prepare_weights

    def counting(*a, **k):
        prepares.append(1)
        return original(*a, **k)

    backend.prepare_weights = counting
    try:
        first = moerunner.fused_moe(x, weights.w13, weights.w2, tw, ids, backend="torch")
        moerunner.fused_moe(x, weights.w13, weights.w2, tw, ids, backend="torch")
        assert len(prepares) == 1
        with torch.no_grad():
            weights.w13.mul_(2.0)  # in-place change bumps the version: prepare again
        second = moerunner.fused_moe(x, weights.w13, weights.w2, tw, ids, backend="torch")
        assert len(prepares) == 2 and not torch.allclose(first, second)
    finally:
        del backend.prepare_weights


def test_runner_reports_choice():
    x, weights, tw, ids = Case("r").build(torch.float32)
    runner = moerunner.MoeRunner("auto")
    _prepared(runner, x, weights)
    assert runner.backend == "torch"
    assert "torch" in runner.selection.verdicts and runner.selection.reason


def test_runner_rejects_non_string_backend():
    with pytest.raises(TypeError, match="backend"):
        moerunner.MoeRunner(3)


def test_layer_quantize_requires_known_scheme():
    layer = moerunner.MoE(moerunner.MoeConfig(4, 32, 16, 2))
    with pytest.raises(ValueError, match="scheme"):
        layer.quantize_("fp7_magic")


def test_quantized_weights_are_prepared_once():
    x, plain, tw, ids = Case("q", hidden=64, inter=64).build(torch.float32)
    w13, w2 = moerunner.quantize(plain.w13, "mxfp4"), moerunner.quantize(plain.w2, "mxfp4")
    backend = moerunner.default_registry().backends["torch"]
    original, prepares = backend.prepare_weights, []
    backend.prepare_weights = lambda *a, **k: prepares.append(1) or original(*a, **k)
    try:
        for _ in range(3):
            moerunner.fused_moe(x, w13, w2, tw, ids, backend="torch")
    finally:
        del backend.prepare_weights
    assert len(prepares) == 1


def test_stages_are_named_in_profiler_traces():
    """Stage ranges appear while a profiler records (they are skipped otherwise)."""
    from moerunner.profiling import trace_range

    torch.manual_seed(0)
    w13, w2 = torch.randn(4, 32, 16) * 0.1, torch.randn(4, 16, 16) * 0.1
    x = torch.randn(3, 16)
    wts, ids = torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])
    assert isinstance(trace_range("x"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moerunner.fused_moe(x, w13, w2, wts, ids, backend="torch")
    names = {e.key for e in prof.key_averages()}
    assert any(n.startswith("moerunner.") for n in names), sorted(names)[:20]


def test_copies_of_weights_start_with_an_empty_prepared_cache():
    # The functional API memoises prepared weights on w13; a deepcopy or a saved copy of the
    # weights (a model copy, a checkpoint) carries none of them and prepares afresh.
    import copy
    import io

    from moerunner.runner import _CACHE_ATTR

    x, weights, tw, ids = Case("cache", tokens=4).build(torch.float32)
    out = moerunner.fused_moe(x, weights.w13, weights.w2, tw, ids, backend="torch")
    assert len(getattr(weights.w13, _CACHE_ATTR)) == 1
    w13_copy = copy.deepcopy(weights.w13)
    assert torch.equal(w13_copy, weights.w13) and len(getattr(w13_copy, _CACHE_ATTR)) == 0
    buf = io.BytesIO()
    torch.save(weights.w13, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded, weights.w13) and len(getattr(loaded, _CACHE_ATTR)) == 0
    again = moerunner.fused_moe(x, w13_copy, weights.w2, tw, ids, backend="torch")
    assert torch.equal(again, out)


def test_a_declining_fused_op_hands_the_call_to_the_permute_path():
    registry = moerunner.default_registry()
    declined = []
    local = moerunner.Registry(permutes=dict(registry.permutes))
    local.register_backend(
        registry.backends["torch"].variant(fused_ops={"standard": lambda d, p: declined.append(d)})
    )
    x, weights, tw, ids = Case("d", tokens=5).build(torch.float32)
    runner = moerunner.MoeRunner("torch", registry=local)
    out = runner.run(StandardDispatchOutput(x, TopK(tw, ids)), _prepared(runner, x, weights))
    assert len(declined) == 1
    ref = moerunner.reference_moe(x, weights, tw, ids)
    assert_close(out, ref, TOLERANCE[torch.float32], what="declined -> permute path")


def test_weights_prepared_again_per_call_are_named_once(monkeypatch):
    """A new tensor object over the same unchanged memory per call (``.detach()``, ``.data``)
    misses the prepared-weights memo every call: the third preparation warns, once per
    process. New weights that happen to reuse an address, and a layer switching grad mode
    (its parameters and their detached views: two objects), do not."""
    import warnings

    import moerunner.runner as runner_module

    monkeypatch.setattr(runner_module, "_REPEATS_WARNED", [False])
    x = torch.randn(3, 24)
    topk = moerunner.select_experts(torch.randn(3, 5), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):  # fresh weights each call (the allocator may reuse addresses)
            w13, w2 = torch.randn(5, 40, 24), torch.randn(5, 24, 20)
            moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch")
            del w13, w2
        layer = moerunner.MoE(moerunner.MoeConfig(5, 24, 20, 2))
        for call in range(4):
            with torch.set_grad_enabled(call % 2 == 0):
                layer(x, torch.randn(3, 5))
    w13, w2 = torch.randn(5, 40, 24), torch.randn(5, 24, 20)
    with pytest.warns(RuntimeWarning, match="prepared for 'torch' 3 times.*not param.data"):
        for _ in range(5):
            moerunner.fused_moe(x, w13.detach(), w2.detach(), topk.weights, topk.ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        moerunner.fused_moe(x, w13.detach(), w2.detach(), topk.weights, topk.ids)


def test_argument_checks_are_memoised_least_recently_used_first(monkeypatch):
    """A call's shape and dtype checks run once per signature; a signature in use stays
    memoised while a stream of others passes through (it was dropped oldest first, hits or
    not, so a server's steady decode shape was re-checked after 256 prefill lengths)."""
    import moerunner.api as api

    checks = []
    original = api._validate_arguments
    monkeypatch.setattr(api, "_checked", type(api._checked)())
    monkeypatch.setattr(
        api, "_validate_arguments", lambda *a, **k: (checks.append(a[0].shape[0]), original(*a))
    )
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)

    def call(tokens: int) -> None:
        topk = moerunner.select_experts(torch.randn(tokens, 4), 2)
        with torch.no_grad():
            moerunner.fused_moe(torch.randn(tokens, 8), w13, w2, topk.weights, topk.ids)

    call(1)  # the steady shape
    for tokens in range(2, api._CHECKED_MAX + 40):
        call(tokens)
        call(1)
    assert checks.count(1) == 1
    assert len(api._checked) == api._CHECKED_MAX
