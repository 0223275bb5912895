"""The custom ops under Python dispatch modes: ``FlopCounterMode`` (a training loop's MFU),
``opcheck``'s schema and fake-tensor modes. The backward ops differentiate through
``torch.func`` inside their implementation, which a dispatch mode cut off from its dispatch
keys ("Cannot access storage of TensorWrapper"); and the counter counted the MoE layer as
zero FLOPs (opaque ops; ``aten._grouped_mm`` without a count)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import moerunner
from moerunner import ops
from moerunner.lora import MoeLoraWeights, lora_hooks, op_arguments
from moerunner.quant import quantize

T, H, I, E, K = 6, 32, 16, 4, 2


def _dense_flops(pairs: int, n13: int, hidden: int, inter: int) -> int:
    # two per multiply-add: [pairs, H] x [H, N13] and [pairs, I] x [I, H]
    return 2 * pairs * hidden * n13 + 2 * pairs * inter * hidden


def _plain(grad: bool = True):
    torch.manual_seed(0)
    x = torch.randn(T, H, requires_grad=grad)
    w13 = (torch.randn(E, 2 * I, H) * H**-0.5).requires_grad_(grad)
    w2 = (torch.randn(E, H, I) * I**-0.5).requires_grad_(grad)
    topk = moerunner.select_experts(torch.randn(T, E), K, renormalize=True)
    weights = topk.weights.clone().requires_grad_(grad)
    return x, w13, w2, weights, topk.ids


def _settings(backend: str = "torch") -> tuple:
    return (None, None, "silu", None, None, False, backend)


def test_plain_op_counts_forward_and_backward_gemms():
    x, w13, w2, weights, ids = _plain()
    with FlopCounterMode(display=False) as forward:
        out = torch.ops.moerunner.fused_experts(x, w13, w2, weights, ids, *_settings())
    fwd = _dense_flops(T * K, 2 * I, H, I)
    assert forward.get_total_flops() == fwd
    with FlopCounterMode(display=False) as backward:
        out.square().sum().backward()
    # every GEMM's input and weight gradients: twice the forward
    assert backward.get_total_flops() == 2 * fwd


def test_backward_counts_only_the_gradients_taken():
    x, w13, w2, weights, ids = _plain(grad=False)
    w2.requires_grad_()
    out = torch.ops.moerunner.fused_experts(x, w13, w2, weights, ids, *_settings())
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == 2 * T * K * I * H  # the down GEMM's weight gradient
    x, w13, w2, weights, ids = _plain(grad=False)
    x.requires_grad_()
    out = torch.ops.moerunner.fused_experts(x, w13, w2, weights, ids, *_settings())
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert counter.get_total_flops() == _dense_flops(T * K, 2 * I, H, I)  # both input grads


def test_gradients_under_a_dispatch_mode_match_those_without():
    x, w13, w2, weights, ids = _plain()
    inputs = (x, w13, w2, weights)
    out = torch.ops.moerunner.fused_experts(x, w13, w2, weights, ids, *_settings())
    expected = torch.autograd.grad(out.square().sum(), inputs)
    with FlopCounterMode(display=False):
        out = torch.ops.moerunner.fused_experts(x, w13, w2, weights, ids, *_settings())
        got = torch.autograd.grad(out.square().sum(), inputs)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)  # the same computation


def test_quantized_op_gradients_and_count_under_a_dispatch_mode():
    x, _, _, weights, ids = _plain()
    q13 = quantize(torch.randn(E, 2 * I, H), "int8_w8a16")
    q2 = quantize(torch.randn(E, H, I), "int8_w8a16")
    args = (
        *(ops.quantized_tensors(q13), ops.quantized_tensors(q2)),
        *(q13.scheme.name, list(q13.shape), q2.scheme.name, list(q2.shape)),
        weights,
        ids,
        *_settings(),
    )
    out = torch.ops.moerunner.fused_experts_quantized(x, *args)
    expected = torch.autograd.grad(out.square().sum(), (x, weights))
    with FlopCounterMode(display=False) as counter:
        out = torch.ops.moerunner.fused_experts_quantized(x, *args)
        got = torch.autograd.grad(out.square().sum(), (x, weights))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # forward, then both input gradients (frozen weights: no weight gradient)
    assert counter.get_total_flops() == 2 * _dense_flops(T * K, 2 * I, H, I)


def test_transposed_and_lora_calls_count_their_shapes():
    x, w13, w2, weights, ids = _plain(grad=False)
    with FlopCounterMode(display=False) as counter:
        torch.ops.moerunner.fused_experts_transposed(
            x, w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(), weights, ids,
            *_settings(),
        )  # fmt: skip
    assert counter.get_total_flops() == _dense_flops(T * K, 2 * I, H, I)
    r13, r2, adapters = 4, 2, 3
    lora = MoeLoraWeights(
        torch.randn(adapters, E, r13, H),
        torch.randn(adapters, E, 2 * I, r13),
        torch.randn(adapters, E, r2, I),
        torch.randn(adapters, E, H, r2),
    )
    lora_args = op_arguments(lora_hooks(lora, torch.tensor([0, 1, 2, -1, 0, 1])))
    with FlopCounterMode(display=False) as counter:
        torch.ops.moerunner.fused_experts(x, w13, w2, weights, ids, *_settings(), True, *lora_args)
    delta = 2 * T * K * (r13 * (H + 2 * I) + r2 * (I + H))
    assert counter.get_total_flops() == _dense_flops(T * K, 2 * I, H, I) + delta


def test_layer_training_step_counts_its_experts():
    torch.manual_seed(0)
    layer = moerunner.MoE(moerunner.MoeConfig(E, H, I, K), dtype=torch.float32)
    x, logits = torch.randn(T, H, requires_grad=True), torch.randn(T, E)
    with FlopCounterMode(display=False) as counter:
        layer(x, logits).sum().backward()
    # forward, input and weight gradients of both GEMMs; the router's logits come in
    assert counter.get_total_flops() == 3 * _dense_flops(T * K, 2 * I, H, I)


@pytest.mark.parametrize(
    ("a", "b", "offs", "expected"),
    [
        ((10, 4), (3, 4, 5), (3,), 2 * 10 * 4 * 5),  # rows grouped: forward
        ((4, 10), (10, 5), (3,), 2 * 4 * 10 * 5),  # K grouped: weight gradient
        ((3, 2, 4), (3, 4, 5), None, 2 * 3 * 2 * 4 * 5),  # batched
        ((3, 2, 4), (4, 15), (3,), 2 * 2 * 4 * 15),  # N grouped
    ],
)
def test_grouped_mm_count_sums_its_groups(a, b, offs, expected):
    from moerunner.op_flops import grouped_mm_flops

    assert grouped_mm_flops(a, b, offs) == expected


def test_backward_ops_pass_opcheck():
    x, w13, w2, weights, ids = _plain(grad=False)
    grad_out = torch.randn(T, H)
    plain = (grad_out, x, w13, w2, weights, ids, None, None, "silu", None, None, False, False)
    torch.library.opcheck(
        torch.ops.moerunner.fused_experts_backward.default, (*plain, [True] * 4 + [False] * 2)
    )
    q13 = quantize(torch.randn(E, 2 * I, H), "int8_w8a16")
    q2 = quantize(torch.randn(E, H, I), "int8_w8a16")
    quantized = (
        *(grad_out, x, ops.quantized_tensors(q13), ops.quantized_tensors(q2)),
        *(q13.scheme.name, list(q13.shape), q2.scheme.name, list(q2.shape)),
        *(weights, ids, None, None, "silu", None, None, False, [True, True]),
    )
    torch.library.opcheck(torch.ops.moerunner.fused_experts_quantized_backward.default, quantized)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_training_step_under_flop_counter(backend):
    """On CUDA in bf16 the layer trains through the custom op (triton: its kernels forward,
    the recomputed backward), or the grouped GEMMs (torch): same gradients under the counter
    as without it, and forward plus both gradients of both GEMMs counted."""
    torch.manual_seed(0)
    cfg = moerunner.MoeConfig(8, 256, 128, 2)
    layer = moerunner.MoE(cfg, backend=backend, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(64, 8, device="cuda")
    layer(x, logits).float().square().sum().backward()
    expected = [p.grad.clone() for p in (x, layer.w13, layer.w2)]
    for p in (x, layer.w13, layer.w2):
        p.grad = None
    with FlopCounterMode(display=False) as counter:
        layer(x, logits).float().square().sum().backward()
    for p, e in zip((x, layer.w13, layer.w2), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    assert counter.get_total_flops() == 3 * _dense_flops(64 * 2, 256, 256, 128)


@pytest.mark.parametrize("trained", ["lora only", "lora and input"])
def test_lora_backward_count_matches_the_eager_autograd_work(trained):
    """The op's count of a LoRA backward equals what autograd computes on the eager torch
    path (every token on an adapter, so both paths do the same work): a factor's gradient
    needs grad x B, which the count took only where the input gradient was taken too."""
    x, w13, w2, weights, ids = _plain(grad=False)
    x.requires_grad_(trained == "lora and input")
    r13, r2 = 4, 2
    torch.manual_seed(3)
    lora = MoeLoraWeights(
        *(
            t.requires_grad_()
            for t in (
                torch.randn(2, E, r13, H), torch.randn(2, E, 2 * I, r13),
                torch.randn(2, E, r2, I), torch.randn(2, E, H, r2),
            )
        )
    )  # fmt: skip
    adapters = torch.tensor([0, 1, 0, 1, 1, 0])
    counts = []
    for op in (False, True):
        hooks = lora_hooks(lora, adapters)
        with FlopCounterMode(display=False) as counter:
            if op:
                args = op_arguments(hooks)
                out = torch.ops.moerunner.fused_experts(
                    x, w13, w2, weights, ids, *_settings(), True, *args
                )
            else:
                out = moerunner.fused_moe(x, w13, w2, weights, ids, hooks=hooks, backend="torch")
            out.square().sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1]
