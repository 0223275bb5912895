"""Alignment padding done once in preparation: results equal the unpadded reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import TOLERANCE, Case

import moerunner
from moerunner.backends.base import MoeProblem
from moerunner.backends.torch_native import TorchBackend
from moerunner.dispatch.formats import StandardDispatchOutput
from moerunner.routing import TopK
from moerunner.testing import assert_close


class AlignedTorch(TorchBackend):
    """The torch backend, declaring the alignment a tensor-core kernel would need."""

    def __init__(self, align_h: int, align_i: int) -> None:
        super().__init__()
        self.name = "aligned"
        self.capabilities = dataclasses.replace(self.capabilities, align_h=align_h, align_i=align_i)


def _run(case: Case, weights, x, tw, ids, align_h: int, align_i: int):
    base = moerunner.default_registry()
    registry = moerunner.Registry(permutes=dict(base.permutes))
    registry.register_backend(AlignedTorch(align_h, align_i).variant(fused_ops={}))
    runner = moerunner.MoeRunner("aligned", registry=registry)
    spec = weights.spec(moerunner.Activation(case.activation))
    prepared = runner.prepare(weights, MoeProblem.of(x, weights, spec, "standard"), spec)
    out = runner.run(StandardDispatchOutput(x, TopK(tw, ids)), prepared)
    return out, prepared


PLAIN = [
    Case("gated_I61_H40", inter=61, hidden=40, bias=True),
    Case(
        "interleaved_swiglu",
        inter=61,
        hidden=40,
        bias=True,
        activation="swiglu_oai",
        interleaved=True,
    ),
    Case("relu2_I961", inter=961, hidden=40, activation="relu2"),
    Case("gelu_I17", inter=17, activation="gelu", routing="with_skips"),
]


@pytest.mark.parametrize("case", PLAIN, ids=[c.name for c in PLAIN])
def test_padding_is_exact_for_plain_weights(case):
    x, weights, tw, ids = case.build(torch.float32)
    out, prepared = _run(case, weights, x, tw, ids, align_h=16, align_i=16)
    assert out.shape == x.shape
    assert prepared.spec.intermediate_size % 16 == 0 and prepared.spec.hidden_size % 16 == 0
    assert any("padded I" in note for note in prepared.notes)
    ref = moerunner.reference_moe(x, weights, tw, ids, case.activation)
    assert_close(out, ref, TOLERANCE[torch.float32])


def test_gate_and_up_halves_are_padded_separately():
    case = Case("halves", inter=5, hidden=16, experts=2)
    x, weights, tw, ids = case.build(torch.float32)
    _, prepared = _run(case, weights, x, tw, ids, align_h=1, align_i=8)
    w13 = prepared.tensors["w13"]
    assert w13.shape == (2, 16, 16)
    assert torch.equal(w13[:, :5], weights.w13[:, :5]) and torch.equal(
        w13[:, 8:13], weights.w13[:, 5:]
    )
    assert not w13[:, 5:8].any() and not w13[:, 13:].any()
    assert "gate and up halves separately" in prepared.notes[0]


@pytest.mark.parametrize(
    "scheme, align_i", [("fp8_channel", 16), ("mxfp4", 32), ("int4_g32", 32), ("fp8_block", 128)]
)
def test_padding_quantized_weights(scheme, align_i):
    # relu2 (one segment) so fp8_block's 128-row blocks can grow at the end of N.
    case = Case("q", inter=96, hidden=64, activation="relu2", tokens=5)
    x, plain, tw, ids = case.build(torch.float32)
    weights = moerunner.ExpertWeights(
        moerunner.quantize(plain.w13, scheme), moerunner.quantize(plain.w2, scheme)
    )
    out, prepared = _run(case, weights, x, tw, ids, align_h=1, align_i=align_i)
    assert prepared.spec.intermediate_size % align_i == 0
    ref = moerunner.reference_moe(x, weights, tw, ids, case.activation)
    assert_close(out, ref, 5e-3)


def test_impossible_quantized_padding_is_a_clear_error():
    # fp8_block gate/up halves of 96 rows are not whole 128-row blocks: cannot pad separately.
    case = Case("q", inter=96, hidden=128, tokens=3)
    x, plain, tw, ids = case.build(torch.float32)
    weights = moerunner.ExpertWeights(
        moerunner.quantize(plain.w13, "fp8_block"), moerunner.quantize(plain.w2, "fp8_block")
    )
    with pytest.raises(ValueError, match="block"):
        _run(case, weights, x, tw, ids, align_h=1, align_i=128)
