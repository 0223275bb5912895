"""torch.compile(fullgraph=True) of the MoE layer on CPU, against eager."""

from __future__ import annotations

import torch

import moerunner


def test_layer_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    cfg = moerunner.MoeConfig(
        8,
        32,
        24,
        2,
        activation=moerunner.Activation("swiglu_oai"),
        bias=True,
        gate_up_interleaved=True,
        routing=moerunner.RoutingConfig(renormalize=True),
    )
    layer = moerunner.MoE(cfg)
    with torch.no_grad():
        layer.w13_bias.normal_()
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in (5, 0, 3):
        x, logits = torch.randn(tokens, 32), torch.randn(tokens, 8)
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=1e-5, atol=1e-5)


def test_fused_experts_op_passes_opcheck():
    x, w13, w2 = torch.randn(4, 16), torch.randn(3, 16, 16), torch.randn(3, 16, 8)
    topk = moerunner.select_experts(torch.randn(4, 3), 2)
    torch.library.opcheck(
        torch.ops.moerunner.fused_experts.default,
        (x, w13, w2, topk.weights, topk.ids, None, None, "silu", None, None, False, "torch"),
        test_utils=("test_schema", "test_faketensor"),
    )
