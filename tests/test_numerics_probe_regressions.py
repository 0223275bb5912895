"""Regressions of a probe of numerical edge cases (ids of every dtype, the peers' result
buffers, fp16 range): each failed on the code before its fix with an internal exception, a
raw PyTorch error after the whole computation, or a silently wrong id."""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import ExpertWeights, MoeInputError, reference_moe
from moerunner.compat import vllm
from moerunner.lora import MoeLoraWeights, lora_hooks
from moerunner.testing import DTYPE_BOUND, assert_close

T, H, I, E, K = 4, 16, 8, 4, 2


def _problem():
    torch.manual_seed(0)
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5
    topk = moerunner.select_experts(torch.randn(T, E), K, renormalize=True)
    return x, w13, w2, topk.weights, topk.ids


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("check_ids", [True, False])
def test_ids_of_unsigned_dtypes_past_uint8_are_refused_by_name(dtype, check_ids):
    # uint16/32/64 ids failed inside the id check ('"aminmax_cpu" not implemented for
    # UInt16'); unchecked, a uint64 id of 2**32 + 1 wrapped to expert 1 in the int32 cast.
    x, w13, w2, weights, ids = _problem()
    with pytest.raises(TypeError, match=r"topk_ids must be int64, int32, int16, int8 or uint8"):
        moerunner.fused_moe(x, w13, w2, weights, ids.to(dtype), check_ids=check_ids)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_ids_of_every_accepted_dtype_compute_the_reference(dtype):
    x, w13, w2, weights, ids = _problem()
    out = moerunner.fused_moe(x, w13, w2, weights, ids.to(dtype))
    assert_close(
        out, reference_moe(x, ExpertWeights(w13, w2), weights, ids), DTYPE_BOUND[torch.float32]
    )


def test_unchecked_int64_ids_past_int32_are_skipped_not_wrapped():
    x, w13, w2, weights, ids = _problem()
    wide = ids.long()
    wide[0, 0] = 2**32 + 1  # would be expert 1 once cast to int32
    out = moerunner.fused_moe(x, w13, w2, weights, wide, check_ids=False)
    skipped = ids.clone()
    skipped[0, 0] = -1
    assert_close(
        out, reference_moe(x, ExpertWeights(w13, w2), weights, skipped), DTYPE_BOUND[torch.float32]
    )


def test_peer_expert_map_and_its_ids_take_the_same_dtypes():
    # The vLLM expert_map path kept its own looser checks: uint32 ids or map failed inside
    # aminmax, and bool ids ran as experts 0 and 1.
    x, w13, w2, weights, ids = _problem()
    emap = torch.arange(E, dtype=torch.int32)
    for dtype in (torch.uint32, torch.bool):
        with pytest.raises(TypeError, match="topk_ids must be a tensor of int64"):
            vllm.fused_experts(x, w13, w2, weights, ids.to(dtype), expert_map=emap)
    with pytest.raises(MoeInputError, match="expert_map must be a 1-D .* of int64"):
        vllm.fused_experts(x, w13, w2, weights, ids, expert_map=emap.to(torch.uint32))


def test_lora_adapter_ids_of_unsigned_dtypes_past_uint8_are_refused():
    lora = MoeLoraWeights(
        torch.randn(2, E, 2, H), torch.randn(2, E, 2 * I, 2), torch.randn(2, E, 2, I),
        torch.randn(2, E, H, 2),
    )  # fmt: skip
    with pytest.raises(MoeInputError, match=r"adapter_ids must be a 1-D \[T\] tensor of int64"):
        lora_hooks(lora, torch.zeros(T, dtype=torch.uint32))


def _peer_call(x, w13, w2, weights, ids, **kwargs):
    return vllm.fused_experts(x, w13, w2, weights, ids, **kwargs)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("output expanded", r"output stores some elements more than once"),
        ("hidden expanded", r"hidden_states stores some elements more than once"),
        ("leaf requiring grad", r"hidden_states is a leaf tensor that requires grad"),
        ("inference tensor", r"hidden_states is an inference tensor"),
        ("output of another dtype", r"output must be torch.float32 \[4, 16\]"),
    ],
)
def test_peer_result_buffers_that_cannot_take_the_result_are_refused_first(
    case, match, monkeypatch
):
    # These raised PyTorch's own RuntimeError from the final copy, after the experts ran.
    x, w13, w2, weights, ids = _problem()
    calls = []
    real = moerunner.compat._common.fused_moe
    monkeypatch.setattr(
        moerunner.compat._common, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    if case == "output expanded":
        kwargs = {"output": torch.empty(1, H).expand(T, H)}
    elif case == "output of another dtype":
        kwargs = {"output": torch.empty(T, H, dtype=torch.float16)}
    else:
        kwargs = {"inplace": True}
        if case == "hidden expanded":
            x = x[:1].expand(T, H)
        elif case == "leaf requiring grad":
            x = x.clone().requires_grad_()
        else:
            with torch.inference_mode():
                x = x.clone()
    with pytest.raises(MoeInputError, match=match):
        _peer_call(x, w13, w2, weights, ids, **kwargs)
    assert not calls  # refused before the experts ran


def test_peer_result_buffers_that_can_take_it_still_do():
    x, w13, w2, weights, ids = _problem()
    expected = reference_moe(x, ExpertWeights(w13, w2), weights, ids)
    out = torch.empty(T, H)
    assert _peer_call(x, w13, w2, weights, ids, output=out) is out
    assert_close(out, expected, DTYPE_BOUND[torch.float32])
    with torch.no_grad():  # a leaf that requires grad may be written under no_grad
        leaf = x.clone().requires_grad_()
        assert _peer_call(leaf, w13, w2, weights, ids, inplace=True) is leaf
    assert_close(leaf.detach(), expected, DTYPE_BOUND[torch.float32])
    with torch.inference_mode():
        inference = x.clone()
        _peer_call(inference, w13, w2, weights, ids, inplace=True)
    assert_close(inference, expected, DTYPE_BOUND[torch.float32])


def test_peer_result_buffer_checks_keep_a_fullgraph_compile():
    """SGLang's default config writes into hidden_states: the buffer checks must not break
    torch.compile(fullgraph=True) (tensor.is_inference() is not traceable)."""
    from moerunner.compat import sglang

    torch._dynamo.reset()
    x, w13, w2, _, _ = _problem()
    logits = torch.randn(T, E)

    def experts(h, logits):
        return sglang.fused_experts(
            h, w13, w2, sglang.select_experts(h, logits, sglang.TopKConfig(top_k=K))
        )

    expected = experts(x.clone(), logits)
    h = x.clone()
    got = torch.compile(experts, fullgraph=True)(h, logits)
    torch.testing.assert_close(got, expected)
    assert torch.equal(h, got)  # written in place, as SGLang's default


triton_pkg = pytest.importorskip("moerunner.backends.triton")


def _past_fp16_range(case: str):
    """One token, one expert, whose gate (``gate``: 9e4) or unweighted output (``output``:
    1e5, weighted 0.1) lies past fp16's 65504 while the token's result fits."""
    x, w13, w2 = torch.zeros(1, 16), torch.zeros(1, 32, 16), torch.eye(16, 16)[None] * 1e-3
    weights = torch.ones(1, 1)
    if case == "gate":
        x[0, 0], x[0, 1] = 1.0, 3.0
        w13[0, :16, 1], w13[0, 16:, 0] = 30000.0, 0.5  # gate 9e4, up 0.5
    else:
        x[0, 0] = 1.0
        w13[0, 0, 0], w13[0, 16, 0] = 10.0, 1.0  # silu(10) * 1 ~ 10 on the first channel
        w2 = torch.zeros(1, 16, 16)
        w2[0, :, 0] = 1e4  # ~1e5 per output before the routing weight
        weights = torch.full((1, 1), 0.1)
    return x, w13, w2, weights, torch.zeros(1, 1, dtype=torch.int32)


@pytest.mark.skipif(
    not triton_pkg.interpreted() and not torch.cuda.is_available(), reason="no triton runtime"
)
@pytest.mark.parametrize("case", ["gate", "output"])
def test_triton_kernels_keep_fp16_values_past_its_range_finite(case):
    # The documented difference of the fp16 paths (docs/architecture.md, "Backends"): the
    # triton kernels keep their float32 accumulators through the activation and the routing
    # weight, so a value past fp16's range whose weighted result fits stays finite there.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w13, w2, weights, ids = _past_fp16_range(case)
    args = [t.to(device) for t in (x.half(), w13.half(), w2.half(), weights, ids)]
    out = moerunner.fused_moe(*args, backend="triton")
    expected = reference_moe(x.double(), ExpertWeights(w13.double(), w2.double()), weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-3, atol=1e-3)
