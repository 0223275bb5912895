"""Regressions of a probe of moerunner in a long-running multi-threaded process (CPU, torch
backend; outputs against the float64 reference). The races are forced deterministically:
a patched step waits on an event while another thread runs into the window."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch

import moerunner
import moerunner.runner as runner_module
from moerunner import ExpertWeights, reference_moe
from moerunner.testing import DTYPE_BOUND, assert_close

E, H, I, K, T = 8, 64, 32, 2, 4
BOUND = DTYPE_BOUND[torch.float32]


def _routing():
    weights = torch.full((T, K), 0.5)
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
    return weights, ids


def _reference(x, w13, w2, weights, ids):
    return reference_moe(x.double(), ExpertWeights(w13, w2), weights, ids)


def test_threads_sharing_w13_each_run_their_own_w2(monkeypatch):
    """Two threads with one w13 and their own w2: the form prepared from one w2 could be
    stored under the other's weight state (check, prepare and store were not one step), and
    every later call on those weights ran the wrong w2 (max error 818 in the probe)."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2_old, w2_new = torch.randn(E, H, I, generator=g), torch.randn(E, H, I, generator=g)
    x = torch.randn(T, H, generator=g)
    weights, ids = _routing()
    entered, go = threading.Event(), threading.Event()
    prepare = runner_module.prepare_for_backend

    def slow_for_old(backend, expert_weights, spec):
        if expert_weights.w2 is w2_old:
            entered.set()
            go.wait(10)
        return prepare(backend, expert_weights, spec)

    monkeypatch.setattr(runner_module, "prepare_for_backend", slow_for_old)

    def call(w2):
        return moerunner.fused_moe(x, w13, w2, weights, ids, backend="torch")

    old = threading.Thread(target=call, args=(w2_old,))
    old.start()
    assert entered.wait(10)
    new = threading.Thread(target=call, args=(w2_new,))
    new.start()
    new.join(0.3)  # (waits for the first thread's preparation now)
    go.set()
    old.join(10)
    new.join(10)
    assert_close(call(w2_new), _reference(x, w13, w2_new, weights, ids), BOUND)
    assert_close(call(w2_old), _reference(x, w13, w2_old, weights, ids), BOUND)


def test_a_key_of_a_storage_that_died_still_hashes():
    """Keys name storages by weak references, hashed on first use: one first hashed after
    its storage was freed (a weight sync assigning .data while another thread called)
    raised "weak object has gone away" from inside the caches."""
    from moerunner.memo import object_ref

    storage = torch.randn(16).untyped_storage()
    ref = object_ref(storage)
    expected = hash(storage)
    del storage
    gc.collect()
    assert hash(ref) == expected
    assert ref() is None


def test_weights_changed_after_data_writes_does_not_warn_of_repeats(monkeypatch):
    """The documented weight sync (``.data`` write, then ``weights_changed()``) looked like
    the same unchanged weights prepared again and again, and the third one warned that the
    caller passed new tensor objects per call."""
    monkeypatch.setattr(runner_module, "_REPEATS_WARNED", [False])
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    layer = moerunner.MoE(cfg, backend="torch")
    x, logits = torch.randn(T, H), torch.randn(T, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            layer.w13.data.copy_(torch.randn_like(layer.w13))
            layer.weights_changed()
            with torch.no_grad():
                out = layer(x, logits)
    topk = moerunner.select_experts(logits, K)
    want = _reference(x, layer.w13.detach(), layer.w2.detach(), topk.weights, topk.ids)
    assert_close(out, want, BOUND)


def test_an_edit_while_quantize_reads_the_floats_is_quantized_later(monkeypatch):
    """``quantize_(keep_float_weights=True)`` recorded the floats' state after quantizing
    them, so an edit landing in between (another thread's ``copy_`` or load) counted as
    quantized already and the copy stayed stale for good."""
    import moerunner.quant as quant

    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    torch.manual_seed(0)
    layer = moerunner.MoE(cfg, backend="torch")
    new_w13 = torch.randn_like(layer.w13)
    quantize = quant.quantize

    def edit_after_w13(weight, scheme, **kw):
        out = quantize(weight, scheme, **kw)
        if weight.shape == layer.w13.shape:
            with torch.no_grad():
                layer.w13.copy_(new_w13)  # lands after w13 was read
        return out

    monkeypatch.setattr(quant, "quantize", edit_after_w13)
    layer.quantize_("int8_w8a16", keep_float_weights=True)
    monkeypatch.setattr(quant, "quantize", quantize)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    with torch.no_grad():
        out = layer(x, logits)
    fresh = moerunner.MoE(cfg, backend="torch")
    fresh.load_state_dict(layer.state_dict())
    fresh.quantize_("int8_w8a16")
    with torch.no_grad():
        assert torch.equal(out, fresh(x, logits))


def test_a_first_call_waits_for_another_threads_relayout(monkeypatch):
    """The first inference call of a transposed (GPT-OSS) experts layer re-lays its memory
    in place; another thread's first call returned at once and read the memory while it
    was being rewritten (wrong logits in 15-20 of 180 concurrent first calls)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from moerunner.integrations import _relayout
    from moerunner.integrations.tiny_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss")).eval()
    experts = model.model.layers[0].mlp.experts
    started, release = threading.Event(), threading.Event()
    relayout = _relayout.relayout

    def slow(module, layout, *args, **kwargs):
        started.set()
        release.wait(10)
        return relayout(module, layout, *args, **kwargs)

    monkeypatch.setattr(_relayout, "relayout", slow)
    seen = []

    def first_call(record: bool):
        with torch.no_grad():
            _relayout.auto_relayout(experts)
        if record:
            seen.append(_relayout.in_layout(experts.gate_up_proj, "canonical"))

    first = threading.Thread(target=first_call, args=(False,))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=first_call, args=(True,))
    second.start()
    second.join(0.3)
    assert seen == []  # still waiting (it returned at once, in the stored layout)
    release.set()
    first.join(10)
    second.join(10)
    assert seen == [True]


def test_the_registry_keeps_a_bounded_number_of_choices():
    """Every distinct problem's backend choice was kept for the life of the registry
    (about 1.2 KB each: 3000 shapes held 3.5 MB)."""
    from moerunner.backends.base import MoeProblem
    from moerunner.registry import Registry
    from moerunner.runner import default_registry

    registry = Registry(backends=dict(default_registry().backends))
    for hidden in range(16, 16 * (registry.MAX_SELECTIONS + 40), 16):
        problem = MoeProblem("cpu", torch.float32, "bf16", "silu", "standard", hidden, 32, 4)
        assert registry.select(problem, "torch").backend.name == "torch"
    assert len(registry._selections) == registry.MAX_SELECTIONS
