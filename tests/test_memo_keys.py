"""Cache keys of derived data never match a later tensor at a freed one's address.

A probe served stale results wherever a key named memory by its address (and an object by
its ``id``) while the cached value held a copy: a replaced bias of an up-then-gate ``w13``
(rows swapped into a copy), the quantized copy of ``keep_float_weights`` after a
parametrized weight's edit or a second ``.data`` assignment, the fused shared MLP of the
transformers integration. A new tensor over the same memory is made here deterministically
(two tensors over one numpy array, the first dropped): its values changed, its address and
in-place version equal. Results are compared with the float64 reference.
"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch

import moerunner
from moerunner.memo import tensor_key, view_key
from moerunner.runner import tensor_state
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights

np = pytest.importorskip("numpy")

E, H, I, K, T = 4, 32, 16, 2, 5


def test_keys_of_a_freed_storage_never_equal_a_later_one_at_its_address():
    memory = np.zeros((4, 8), dtype=np.float32)
    first = torch.from_numpy(memory)
    keys = (tensor_key(first), view_key(first), tensor_state(first))
    address = first.data_ptr()
    del first
    gc.collect()
    second = torch.from_numpy(memory)
    assert second.data_ptr() == address  # the same memory, a new storage
    now = (tensor_key(second), view_key(second), tensor_state(second))
    for got, was in zip(now, keys, strict=True):
        assert got != was
    assert view_key(second) == view_key(second)  # while it lives, equal


def test_keys_survive_pickling_and_copying_as_keys_that_match_nothing():
    """A key kept on a module is saved and deep-copied with it: it pickles (weak references
    do not) and its copy matches no tensor."""
    t = torch.randn(3)
    key = tensor_key(t)
    for other in (pickle.loads(pickle.dumps(key)), copy.deepcopy(key)):
        assert other != key and other != tensor_key(t)


def _reference(x, w13, w2, b13, topk, order):
    weights = ExpertWeights(w13.double(), w2.double(), b13.double(), None, w13_order=order)
    return moerunner.reference_moe(x.double(), weights, topk.weights, topk.ids, "silu")


def test_a_new_bias_over_a_freed_ones_memory_is_prepared_anew():
    """``w13_order="up_gate"``: the prepared form holds the bias with its rows swapped (a
    copy); a new bias at the old one's address and version was served that copy."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5, torch.randn(E, H, I, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    memory = np.random.default_rng(0).standard_normal((E, 2 * I)).astype(np.float32)
    for step in range(3):
        memory[:] = np.random.default_rng(step + 1).standard_normal((E, 2 * I))
        bias = torch.from_numpy(memory)
        out = moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, w13_bias=bias, w13_order="up_gate"
        )
        want = _reference(x, w13, w2, bias, topk, "up_gate")
        assert_close(out, want, DTYPE_BOUND[torch.float32], what=f"step {step}")
        del bias


class _Scaled(torch.nn.Module):
    def forward(self, w):
        return w * 1.0


def test_keep_float_weights_follows_a_parametrized_weights_edits():
    """A parametrized w13 is a new tensor on every access (version 0, often the same
    address): edits of its original never quantized again."""
    import torch.nn.utils.parametrize as parametrize

    cfg = moerunner.MoeConfig(E, H, I, K, routing=moerunner.RoutingConfig(renormalize=True))
    torch.manual_seed(0)
    layer = moerunner.MoE(cfg)
    parametrize.register_parametrization(layer, "w13", _Scaled())
    layer.quantize_("int8_w8a16", keep_float_weights=True)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    with torch.no_grad():
        for _ in range(3):
            layer.parametrizations.w13.original.mul_(2.0)
            fresh = moerunner.MoE(cfg)
            fresh.w13.copy_(layer.w13)
            fresh.w2.copy_(layer.w2)
            fresh.quantize_("int8_w8a16")
            torch.testing.assert_close(layer(x, logits), fresh(x, logits), rtol=0, atol=0)
