"""Routing and the experts' alignment in one launch (``_routing.route_aligned``, used by a
layer's replayed calls at decode sizes: ``_step.routed_sequence``).

The one launch must write what the two separate kernels write (``route``, then the
one-program ``align_rows`` on its ids), bit for bit, and a layer call through it must give
the ordinary path's output bit for bit. On CPU the kernels run under ``TRITON_INTERPRET=1``
with fp32/fp16 and tiny shapes; the ``gpu`` tests check the layer's replayed steps on real
launches and that a fused step makes one launch fewer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moerunner
from moerunner.reference import reference_moe
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights

triton_pkg = pytest.importorskip("moerunner.backends.triton")

from moerunner.backends.triton import (  # noqa: E402
    TritonBackend,
    TritonOptions,
    _align,
    _routing,
    _step,
    experts,
    workspaces,
)

if not triton_pkg.interpreted() and not torch.cuda.is_available():
    pytest.skip("triton backend cannot run here", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (num_experts, top_k, select_experts settings): E not a power of two in each.
ROUTINGS = {
    "softmax": (12, 3, dict(renormalize=True)),
    "softmax-plain": (6, 2, dict()),
    "sigmoid-bias-groups": (
        12,
        4,
        dict(
            scoring_func="sigmoid",
            renormalize=True,
            num_expert_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
    ),
}


def _logits_and_bias(tokens, num_experts, settings, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen).to(dtype).to(DEVICE)
    bias = None
    if settings.get("scoring_func") == "sigmoid":
        bias = (0.1 * torch.randn(num_experts, generator=gen)).to(DEVICE)
    return logits, bias


def _separate(logits, bias, top_k, settings, block_m):
    """Today's two launches: the routing kernel, then the one-program alignment."""
    num_experts = logits.shape[1]
    topk = _routing.route(logits, top_k, correction_bias=bias, **settings)
    ws = workspaces.alignment_workspace(topk.ids.numel(), num_experts, block_m, logits.device)
    for t in ws.values():
        t.fill_(-7)  # slots that neither path writes stay -7 in both
    _align.align_rows(
        topk.ids.view(-1),
        num_experts,
        block_m,
        ws["sorted_rows"],
        ws["block_expert"],
        ws["num_padded"],
        options=TritonOptions(),
    )
    return topk.weights, topk.ids, ws


def _fused(logits, bias, top_k, settings, block_m):
    tokens, num_experts = logits.shape
    weights = torch.full((tokens, top_k), -3.0, device=logits.device)
    ids = torch.full((tokens, top_k), -3, dtype=torch.int32, device=logits.device)
    ws = workspaces.alignment_workspace(ids.numel(), num_experts, block_m, logits.device)
    for t in ws.values():
        t.fill_(-7)
    layout = (ws["sorted_rows"], ws["block_expert"], ws["num_padded"])
    _routing.route_aligned(
        logits,
        bias,
        weights,
        ids,
        layout,
        block_m,
        options=TritonOptions(),
        top_k=top_k,
        **settings,
    )
    return weights, ids, ws


@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 64])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_one_launch_writes_what_the_two_kernels_write(routing, tokens):
    """ids, weights, sorted row ids, expert of each block and padded count: the same bits
    (8 and 9: the default bound and one past it; 64 tokens span several routing blocks)."""
    num_experts, top_k, settings = ROUTINGS[routing]
    logits, bias = _logits_and_bias(tokens, num_experts, settings, torch.float32, tokens)
    block_m = 16
    want_w, want_ids, want_ws = _separate(logits, bias, top_k, settings, block_m)
    got_w, got_ids, got_ws = _fused(logits, bias, top_k, settings, block_m)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    for name in ("sorted_rows", "block_expert", "num_padded"):
        assert torch.equal(got_ws[name], want_ws[name]), name
    # and the layout is the alignment of these ids (not only the same as the other kernel's)
    num_padded = int(got_ws["num_padded"])
    rows = got_ws["sorted_rows"][:num_padded].cpu()
    flat = got_ids.view(-1).cpu()
    real = rows < flat.numel()
    assert sorted(rows[real].tolist()) == list(range(flat.numel()))
    block_of_row = got_ws["block_expert"].cpu().repeat_interleave(block_m)[:num_padded]
    assert torch.equal(flat[rows[real].long()], block_of_row[real])
    assert num_padded % block_m == 0


def test_one_launch_reads_the_logits_in_their_dtype_and_row_stride():
    num_experts, top_k, settings = ROUTINGS["sigmoid-bias-groups"]
    wide, bias = _logits_and_bias(5, num_experts + 4, settings, torch.float16, 1)
    logits = wide[:, :num_experts]  # row stride E + 4
    bias = bias[:num_experts].contiguous()
    want = _separate(logits, bias, top_k, settings, 32)
    got = _fused(logits, bias, top_k, settings, 32)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    for name in ("sorted_rows", "block_expert", "num_padded"):
        assert torch.equal(got[2][name], want[2][name]), name


def test_which_calls_route_and_align_in_one_launch():
    options = TritonOptions()
    bound = options.route_align_max_tokens
    fuses = _step.fuses_routing_and_alignment
    assert not fuses(0, 8, 128, options)  # nothing to launch
    assert not fuses(1, 8, 128, options)  # one token: row blocks, no alignment at all
    assert fuses(2, 8, 128, options) and fuses(bound, 8, 128, options)
    assert not fuses(bound + 1, 8, 128, options)
    assert fuses(1, 8, 128, TritonOptions(row_blocks_max_tokens=0))
    assert not fuses(4, 8, 128, TritonOptions(route_align_max_tokens=0))  # off
    # one routing block only: 8 tokens at 128 experts, 4 at 256
    many = TritonOptions(route_align_max_tokens=1 << 20)
    for experts_, block in ((128, 8), (256, 4), (8, 128)):
        assert _routing.block_rows(block, experts_) == block
        assert fuses(block, 2, experts_, many) and not fuses(block + 1, 2, experts_, many)
    # the alignment's one-program form only (here below the routing block of 8 experts)
    per_token = 32
    limit = _align.SINGLE_PROGRAM_MAX_ROWS // per_token
    assert _routing.block_rows(limit + 1, 8) > limit
    assert fuses(limit, per_token, 8, many) and not fuses(limit + 1, per_token, 8, many)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="route_align_max_tokens"):
        TritonOptions(route_align_max_tokens=-1)
    with pytest.raises(TypeError, match="route_align_max_tokens"):
        TritonOptions(route_align_max_tokens=2.0)
    options = TritonOptions(route_align_max_tokens=0)
    assert eval(repr(options), {"TritonOptions": TritonOptions}) == options


def _prepared(num_experts, hidden, inter, dtype, options):
    torch.manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype).to(DEVICE)
    weights = ExpertWeights(w13, w2)
    act = moerunner.Activation("silu")
    return weights, TritonBackend(options).prepare_weights(weights, weights.spec(act))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 9])
@pytest.mark.parametrize("routing", ["softmax", "sigmoid-bias-groups"])
def test_a_routed_sequence_gives_the_ordinary_paths_output(routing, tokens, dtype):
    """The layer call's launches with routing and alignment fused equal the ordinary path
    (``select_experts`` on the triton kernel, then ``fused_standard``) bit for bit, and
    the float64 reference within the dtype's bound. Row blocks off so that one token
    aligns too."""
    num_experts, top_k, settings = ROUTINGS[routing]
    options = TritonOptions(row_blocks_max_tokens=0, route_align_max_tokens=16)
    assert _step.fuses_routing_and_alignment(tokens, top_k, num_experts, options)
    weights, prepared = _prepared(num_experts, 64, 32, dtype, options)
    logits, bias = _logits_and_bias(tokens, num_experts, settings, dtype, 5)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)

    topk = moerunner.select_experts(
        logits, top_k, correction_bias=bias, backend="triton", **settings
    )
    want = experts.fused_standard(x, topk.weights, topk.ids, prepared).clone()

    out = torch.empty_like(x)
    route_w = torch.empty((tokens, top_k), device=DEVICE)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=DEVICE)
    _step.routed_sequence(x, logits, bias, settings, top_k, prepared, out, route_w, ids)
    assert torch.equal(ids, topk.ids)
    assert torch.equal(route_w.view(torch.int32), topk.weights.view(torch.int32))
    assert torch.equal(out, want)
    ref = reference_moe(x, weights, route_w, ids)
    assert_close(out, ref, DTYPE_BOUND[dtype] * 10, DTYPE_BOUND[dtype], what=routing)


# -- GPU ------------------------------------------------------------------------------------


def _layer(dev, options, **routing):
    """A layer (same weights for every ``options``) whose experts run with ``options``."""
    cfg = moerunner.MoeConfig(
        20, 256, 128, 4, routing=moerunner.RoutingConfig(renormalize=True, **routing)
    )
    torch.manual_seed(0)
    layer = moerunner.MoE(cfg, backend="triton", dtype=torch.bfloat16, device=dev).eval()
    registry = moerunner.default_registry().copy()
    registry.register_backend(TritonBackend(options, name="triton-under-test"))
    layer.runner = moerunner.MoeRunner("triton-under-test", registry=registry)
    return layer


def _layer_steps(layer):
    return [s for s in layer._steps.values() if isinstance(s, _step.LayerStep)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2, 8, 9, 32])
@pytest.mark.parametrize("routing", ["softmax", "deepseek"])
def test_fused_steps_equal_unfused_steps_with_one_launch_fewer(routing, tokens):
    dev = torch.device("cuda")
    extra = (
        dict(
            scoring_func="sigmoid",
            num_expert_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            correction_bias=True,
        )
        if routing == "deepseek"
        else {}
    )
    fused_opts = TritonOptions(route_align_max_tokens=32)
    unfused_opts = dataclasses.replace(fused_opts, route_align_max_tokens=0)
    layers = {on: _layer(dev, fused_opts if on else unfused_opts, **extra) for on in (True, False)}
    for layer in layers.values():
        if layer.correction_bias is not None:
            layer.correction_bias.copy_(torch.linspace(-0.1, 0.1, 20, device=dev))
    with torch.inference_mode():
        for _call in range(6):  # compile, record the plans, make the steps, replay them
            x = torch.randn(tokens, 256, device=dev, dtype=torch.bfloat16)
            logits = torch.randn(tokens, 20, device=dev, dtype=torch.bfloat16)
            got = layers[True](x, logits)
            want = layers[False](x, logits)
            torch.cuda.synchronize()
            assert torch.equal(got, want)
    fused, unfused = (_layer_steps(layers[on]) for on in (True, False))
    assert fused and unfused
    assert len(fused[0].plan.launches) == len(unfused[0].plan.launches) - 1
