"""Who owns what after ``prepare``: storage bytes reachable from the weights and the prepared
weights (``moerunner.memory.storage_bytes``, each storage counted once).

The caller owns the canonical weights; the prepared weights own what the backend made and
share what it reads as stored. The triton backend re-lays packed e2m1 weights (the fragment
layout) and keeps no reference to the canonical ones, so dropping them frees the packed data
and one copy of the experts remains. The prepare runs on CPU; the kernels run in the Triton
interpreter (fp32, tiny shapes).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.memory import storage_bytes, storages
from moerunner.routing import TopK
from moerunner.runner import prepare_for_backend, prepared_for
from moerunner.weights import ExpertWeights

triton_pkg = pytest.importorskip("moerunner.backends.triton")

from moerunner.backends.triton import TritonBackend  # noqa: E402

E, H, I = 4, 256, 128  # rows and K already whole fragment tiles: re-laid = canonical size
ACT = moerunner.Activation("swiglu_oai")


def _mxfp4_weights() -> ExpertWeights:
    torch.manual_seed(0)
    return ExpertWeights(
        moerunner.quantize(torch.randn(E, 2 * I, H) * 0.05, "mxfp4"),
        moerunner.quantize(torch.randn(E, H, I) * 0.05, "mxfp4"),
    )


def test_prepared_mxfp4_weights_let_the_caller_free_the_packed_source():
    weights = _mxfp4_weights()
    spec = weights.spec(ACT)
    source = storage_bytes(weights)
    prepared = prepare_for_backend(TritonBackend(), weights, spec)
    assert prepared.source is None
    own = storage_bytes(prepared)
    # Re-laid data and scales are the prepared weights' own: nothing shared with the source.
    assert not set(storages(weights)) & set(storages(prepared))
    assert own >= source  # the fragment layout pads; here only the scale rows (16 bytes)
    assert storage_bytes(weights, prepared) == source + own  # two copies while both live
    data = weakref.ref(weights.w13.data)
    del weights
    gc.collect()
    assert data() is None  # the canonical packed bytes are freed
    assert storage_bytes(prepared) == own  # one copy of the experts remains


def test_memo_holds_the_prepared_copy_while_the_weights_live():
    # prepared_for memoises on w13: while the caller holds the canonical weights the memo
    # holds the re-laid copy beside them; dropping the weights drops both.
    weights = _mxfp4_weights()
    spec = weights.spec(ACT)
    x = torch.zeros(0, H)
    problem = MoeProblem.of(x, weights, spec, "standard")
    source = storage_bytes(weights)
    prepared = prepared_for(moerunner.MoeRunner("triton"), weights, problem, spec)
    assert storage_bytes(weights) == source + storage_bytes(prepared)
    again = prepared_for(moerunner.MoeRunner("triton"), weights, problem, spec)
    assert again is prepared
    data = weakref.ref(weights.w13.data)
    del weights, prepared, again
    gc.collect()
    assert data() is None


@pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(),
    reason="triton backend cannot run here",
)
def test_prepared_weights_run_after_the_source_is_dropped():
    weights = _mxfp4_weights()
    spec = weights.spec(ACT)
    torch.manual_seed(1)
    x = torch.randn(3, H)
    topk = moerunner.select_experts(torch.randn(3, E), 2)
    expected = moerunner.fused_moe(
        x, weights.w13, weights.w2, topk.weights, topk.ids, activation=ACT, backend="torch"
    )
    runner = moerunner.MoeRunner("triton")
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    del weights
    gc.collect()
    out = runner.run(StandardDispatchOutput(x, TopK(topk.weights, topk.ids)), prepared)
    # Same fp32 math as the torch emulation up to accumulation order.
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(),
    reason="triton backend cannot run here",
)
def test_triton_reads_transposed_plain_weights_in_place():
    # GPT-OSS stores experts [E, K, N]; the kernels take the canonical-shaped view's strides.
    torch.manual_seed(2)
    w13 = torch.randn(E, H, 2 * I).transpose(1, 2) * 0.05  # [E, 2I, H], K-major
    w2 = torch.randn(E, I, H).transpose(1, 2) * 0.05  # [E, H, I], K-major
    weights = ExpertWeights(w13, w2)
    spec = weights.spec(ACT)
    prepared = prepare_for_backend(TritonBackend(), weights, spec)
    # The same memory through the same strides (w13 through an alias: ``_memo_free``).
    for name, w in (("w13", w13), ("w2", w2)):
        held = prepared.tensors[name].data
        assert (held.data_ptr(), held.stride()) == (w.data_ptr(), w.stride())
    assert storage_bytes(weights, prepared) == storage_bytes(weights)  # no copy
    x = torch.randn(5, H)
    topk = moerunner.select_experts(torch.randn(5, E), 2)
    out = moerunner.MoeRunner("triton").run(StandardDispatchOutput(x, topk), prepared)
    dense = moerunner.fused_moe(
        x,
        w13.contiguous(),
        w2.contiguous(),
        topk.weights,
        topk.ids,
        activation=ACT,
        backend="triton",
    )
    # The same fp32 products, loaded through other strides.
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
def test_memo_of_plain_weights_dies_with_them_without_the_collector(strided):
    """Plain weights the kernels read in place (views of them in the prepared form) are freed
    by reference counting: the form holds views of an alias of w13, not of w13, whose memo
    holds the form (a view keeps its base alive from C++, out of the collector's sight)."""
    torch.manual_seed(3)
    if strided:
        w13, w2 = torch.randn(E, H, 2 * I).transpose(1, 2), torch.randn(E, I, H).transpose(1, 2)
    else:
        w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    weights = ExpertWeights(w13, w2)
    spec = weights.spec(ACT)
    problem = MoeProblem.of(torch.zeros(0, H), weights, spec, "standard")
    prepared_for(moerunner.MoeRunner("triton"), weights, problem, spec)
    storage = weakref.ref(w13.untyped_storage())
    gc.disable()
    try:
        del weights, w13, w2
        assert storage() is None
    finally:
        gc.enable()
