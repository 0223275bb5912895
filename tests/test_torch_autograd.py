"""The torch backend's differentiable path (``moerunner.backends.torch_autograd``): its
grouped-GEMM form against the float64 reference and against the per-expert form.

The float64 reference is ``reference_moe`` under autograd, on float64 twins of every leaf.
bf16 bound: ``DTYPE_BOUND`` (bf16 GEMM outputs, the activation in fp32). The two forms round
at the same points; they differ in the GEMMs' summation order only, so they agree within the
same bound.
"""

from __future__ import annotations

import pytest
import torch
from cases import OpCalls, undefined_rows_mm

import moerunner
from moerunner.backends import torch_autograd
from moerunner.backends.torch_native import TorchBackend, TorchOptions
from moerunner.config import ExpertSpec
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.topk import TopK

T, E, H, I, K = 11, 5, 32, 16, 3
BF16 = DTYPE_BOUND[torch.bfloat16]


def _case(device: str, biased: bool, act: str, seed: int = 0):
    """bf16 leaves (hidden states, w13, w2, routing weights, biases) and ids with skipped
    slots (-1) on ``device``."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if moerunner.Activation(act).gated else I
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, rows, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    ids = topk.ids.clone()
    ids[::4, 1] = -1  # skipped slots: rows that belong to no group
    b13 = torch.randn(E, rows, generator=g) * 0.1 if biased else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if biased else None
    leaves = [
        None if t is None else t.to(torch.bfloat16).to(device)
        for t in (x, w13, w2, topk.weights, b13, b2)
    ]
    return leaves, ids.to(device)


def _grads(leaves, ids, act, registry=None):
    got = [None if t is None else t.clone().requires_grad_() for t in leaves]
    x, w13, w2, tw, b13, b2 = got
    out = moerunner.fused_moe(
        x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2, registry=registry
    )
    proj = torch.linspace(-1, 1, H, dtype=torch.float64, device=out.device)
    (out.double() * proj).sum().backward()
    return out, [None if t is None else t.grad for t in got]


def _reference(leaves, ids, act):
    want = [None if t is None else t.detach().cpu().double().requires_grad_() for t in leaves]
    x, w13, w2, tw, b13, b2 = want
    weights = moerunner.ExpertWeights(w13, w2, b13, b2)
    out = moerunner.reference_moe(x, weights, tw, ids.cpu(), act)
    (out * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
    return out, [None if t is None else t.grad for t in want]


def _registry(device: str, grouped: bool) -> moerunner.Registry:
    """The torch backend with the grouped GEMM for ``device`` bf16, or nowhere."""
    registry = moerunner.default_registry().copy()
    pairs = frozenset({(device, torch.bfloat16)}) if grouped else frozenset()
    options = TorchOptions(grouped_mm=pairs, grouped_training=frozenset())
    registry.register_backend(TorchBackend(options), replace=True)
    return registry


@pytest.mark.parametrize("act,biased", [("silu", False), ("swiglu_oai", True), ("relu2", True)])
def test_grouped_form_matches_the_reference_and_the_per_expert_form(monkeypatch, act, biased):
    """The grouped form (two grouped GEMMs, no host read; CUDA bf16 by default, here on the
    CPU through ``TorchOptions.grouped_mm``) gives the float64 reference's values and
    gradients, and the per-expert form's, with skipped slots whose grouped rows belong to
    no group. CPU calls take it by default (``TorchOptions.grouped_training``)."""
    taken = []
    grouped = torch_autograd._grouped_differentiable
    monkeypatch.setattr(  # a spy: which form served each call
        torch_autograd, "_grouped_differentiable", lambda *a: taken.append(1) or grouped(*a)
    )
    leaves, ids = _case("cpu", biased, act)
    out, grads = _grads(leaves, ids, act, registry=_registry("cpu", True))
    assert taken == [1]
    per_expert, per_expert_grads = _grads(leaves, ids, act, registry=_registry("cpu", False))
    assert taken == [1]
    _grads(leaves, ids, act)  # the default options: grouped in CPU training (grouped_training)
    assert taken == [1, 1]
    ref, ref_grads = _reference(leaves, ids, act)
    assert_close(out, ref.detach(), BF16, what="values")
    assert_close(out, per_expert.double(), BF16, what="values against the per-expert form")
    _assert_grads(grads, ref_grads, per_expert_grads, "the per-expert form")


def _assert_grads(grads, ref_grads, other_grads, other: str):
    """Every gradient against the float64 reference's and another form's (bf16 bound)."""
    names = ("x", "w13", "w2", "routing weights", "w13 bias", "w2 bias")
    for name, g, w, o in zip(names, grads, ref_grads, other_grads, strict=True):
        if w is None:
            continue
        assert_close(g, w, BF16, what=f"d/d {name}")
        assert_close(g, o.double(), BF16, what=f"d/d {name} against {other}")


def test_grouped_form_of_an_empty_batch():
    leaves, ids = _case("cpu", True, "silu")
    leaves = [t[:0] if t is not None and t.shape[0] == T else t for t in leaves]
    out, grads = _grads(leaves, ids[:0], "silu", registry=_registry("cpu", True))
    assert out.shape == (0, H)
    assert grads[1] is not None and torch.equal(grads[1], torch.zeros_like(grads[1]))


@pytest.mark.parametrize("act,biased", [("silu", False), ("silu", True), ("swiglu_oai", True)])
def test_grouped_form_without_a_host_read_keeps_undefined_rows_out(act, biased):
    """The grouped form as it runs on a GPU (no host read: the rows of skipped slots stay
    past the last group), here on the CPU with a grouped GEMM that leaves those rows NaN in
    its output and input gradient: the values and every gradient are the float64
    reference's. Selecting the rows out at GEMM1's input and GEMM2's output is enough
    without biases; biases (gathered by each row's expert) need each GEMM's input and
    output."""
    leaves, ids = _case("cpu", biased, act)
    got = [None if t is None else t.clone().requires_grad_() for t in leaves]
    x, w13, w2, tw, b13, b2 = got
    spec = ExpertSpec(E, H, I, moerunner.Activation(act))
    topk = TopK(tw.float(), ids.int())
    weights = moerunner.ExpertWeights(w13, w2, b13, b2)
    out = torch_autograd._grouped_differentiable(
        x, weights, topk, spec, undefined_rows_mm, host_rows=False
    )
    proj = torch.linspace(-1, 1, H, dtype=torch.float64)
    (out.double() * proj).sum().backward()
    ref, ref_grads = _reference(leaves, ids, act)
    assert_close(out, ref.detach(), BF16, what="values")
    names = ("x", "w13", "w2", "routing weights", "w13 bias", "w2 bias")
    for name, t, want in zip(names, got, ref_grads, strict=True):
        if t is not None:
            assert_close(t.grad, want, BF16, what=f"d/d {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("act,biased", [("swiglu_oai", True), ("silu", False)])
def test_training_on_cuda_bf16_runs_grouped_without_a_host_sync(monkeypatch, act, biased):
    """CUDA bf16 (the default grouped_mm pair): the forward of a training call takes the
    grouped form and reads nothing on the host; values and gradients as the reference, with
    skipped slots whose rows the grouped GEMM leaves undefined (the allocator's free small
    blocks hold NaN first, so such rows read NaN if they reach a value: ``grouped_experts``
    selects them out at GEMM1's input and GEMM2's output, and with biases at each GEMM's)."""
    taken = []
    grouped = torch_autograd._grouped_differentiable
    monkeypatch.setattr(
        torch_autograd, "_grouped_differentiable", lambda *a: taken.append(1) or grouped(*a)
    )
    leaves, ids = _case("cuda", biased, act)
    got = [None if t is None else t.clone().requires_grad_() for t in leaves]
    x, w13, w2, tw, b13, b2 = got
    moerunner.fused_moe(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moerunner.fused_moe(
            x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2, check_ids=False
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert taken == [1, 1]
    poison = [torch.full((4096,), float("nan"), device="cuda") for _ in range(256)]
    del poison  # (the allocator's free small blocks now hold NaN)
    out, grads = _grads(leaves, ids, act)
    ref, ref_grads = _reference(leaves, ids, act)
    assert_close(out.cpu(), ref.detach(), BF16, what="values")
    for i, (g, w) in enumerate(zip(grads, ref_grads, strict=True)):
        if w is None:  # (no bias: a leaf that is None)
            assert g is None, i
            continue
        assert_close(g.cpu(), w, BF16, what=f"gradient of leaf {i}")


def _lora_training(device: str, sync_check: bool, rank: int = 4):
    """A LoRA training call on ``device`` (bf16 leaves of ``_case``, base frozen, factors
    trained): the output and the factors' gradients; with ``sync_check`` the forward runs
    under CUDA's sync debug mode "error"."""
    from moerunner.lora import MoeLoraWeights, lora_hooks

    leaves, ids = _case(device, True, "silu", seed=3)
    x, w13, w2, tw, b13, b2 = leaves
    g = torch.Generator().manual_seed(4)
    r = rank
    shapes = ((2, E, r, H), (2, E, 2 * I, r), (2, E, r, I), (2, E, H, r))
    factors = [
        (torch.randn(*s, generator=g) * 0.2).to(torch.bfloat16).to(device).requires_grad_()
        for s in shapes
    ]
    adapters = torch.tensor([0, 1, -1] * 4, device=device)[:T]
    hooks = lora_hooks(MoeLoraWeights(*factors), adapters)

    def call():
        return moerunner.fused_moe(
            x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2, hooks=hooks, check_ids=False
        )

    if sync_check:
        call()  # (first call: preparation)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = call()
    finally:
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
    out.float().square().sum().backward()
    return out.float().cpu(), [f.grad.float().cpu() for f in factors]


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [4, 8])
def test_lora_training_on_cuda_bf16_runs_grouped_without_a_host_sync(monkeypatch, rank):
    """LoRA factors training on CUDA bf16: the hooked sequence runs the grouped GEMMs (was
    one GEMM per expert after a host read of the offsets), so the forward reads nothing on
    the host; values and factor gradients as the same call on the CPU. The delta itself:
    rank 8 (16-byte factor rows) as two grouped GEMMs over the (adapter, expert) groups,
    rank 4 gathered per row."""
    import moerunner.lora as lora_module
    from moerunner.backends import torch_native

    taken, delta = [], []
    grouped = torch_native._grouped_gemms
    monkeypatch.setattr(torch_native, "_grouped_gemms", lambda *a: taken.append(1) or grouped(*a))
    device_delta = lora_module._grouped_device
    monkeypatch.setattr(
        lora_module, "_grouped_device", lambda *a, **k: delta.append(1) or device_delta(*a, **k)
    )
    out, grads = _lora_training("cuda", sync_check=True, rank=rank)
    assert taken and bool(delta) == (rank == 8)
    ref, ref_grads = _lora_training("cpu", sync_check=False, rank=rank)
    assert_close(out, ref.double(), BF16, what="values")
    for i, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(got, want.double(), 2 * BF16, what=f"gradient of factor {i}")


@pytest.mark.parametrize("act,biased", [("silu", True), ("swiglu_oai", False)])
def test_cpu_bf16_backward_in_float32_matches_pytorchs_and_the_reference(monkeypatch, act, biased):
    """CPU bf16 training computes the grouped GEMMs' backward in float32
    (``TorchOptions.fp32_backward``: PyTorch's CPU bf16 ``grad @ W`` ran 50-150x slower): the
    values and every gradient match the float64 reference, and PyTorch's own bf16 backward
    (the option emptied) within the bf16 bound; a spy sees the float32 backward run."""
    ran = []
    backward = torch_autograd._Float32GroupedMm.backward
    monkeypatch.setattr(
        torch_autograd._Float32GroupedMm,
        "backward",
        staticmethod(lambda ctx, g: ran.append(1) or backward(ctx, g)),
    )
    leaves, ids = _case("cpu", biased, act, seed=5)
    out, grads = _grads(leaves, ids, act)  # the defaults: grouped, float32 backward
    assert len(ran) == 2  # both GEMMs
    registry = moerunner.default_registry().copy()
    own_options = TorchOptions(fp32_backward=frozenset(), cpu_float32_gemms=frozenset())
    registry.register_backend(TorchBackend(own_options), replace=True)
    own, own_grads = _grads(leaves, ids, act, registry=registry)
    assert len(ran) == 2
    ref, ref_grads = _reference(leaves, ids, act)
    assert_close(out, ref.detach(), BF16, what="values")
    assert_close(out, own.double(), BF16, what="values against PyTorch's bf16 backward")
    _assert_grads(grads, ref_grads, own_grads, "PyTorch's bf16 backward")


@pytest.mark.parametrize("backward32", [True, False])
def test_cpu_bf16_training_forward_in_float32(backward32):
    """With bf16 in ``TorchOptions.cpu_float32_gemms`` (the default on CPUs without
    PyTorch's oneDNN bf16 matmul), training's grouped GEMMs run their forward from float32
    copies, rounded to bf16: values and every gradient match the float64 reference within
    the bf16 bound, with and without the float32 backward; a spy sees each grouped GEMM's
    operands in float32 (forward, and backward where asked) or bf16."""
    options = TorchOptions(
        cpu_float32_gemms=frozenset({torch.bfloat16}),
        fp32_backward=frozenset({("cpu", torch.bfloat16)}) if backward32 else frozenset(),
    )
    registry = moerunner.default_registry().copy()
    registry.register_backend(TorchBackend(options), replace=True)
    leaves, ids = _case("cpu", True, "silu", seed=7)
    with OpCalls({"_grouped_mm"}, lambda name, args, out: args[0].dtype) as spy:
        out, grads = _grads(leaves, ids, "silu", registry=registry)
    backward = torch.float32 if backward32 else torch.bfloat16
    # 2 forward GEMMs; 2 gradients (input, weight) for each in the backward
    assert spy.calls == [torch.float32] * 2 + [backward] * 4, spy.calls
    ref, ref_grads = _reference(leaves, ids, "silu")
    assert_close(out, ref.detach(), BF16, what="values")
    names = ("x", "w13", "w2", "routing weights", "w13 bias", "w2 bias")
    for name, g, w in zip(names, grads, ref_grads, strict=True):
        assert_close(g, w, BF16, what=f"d/d {name}")


def test_fp32_backward_option_is_validated():
    with pytest.raises(TypeError, match="fp32_backward"):
        TorchOptions(fp32_backward={("cpu", "bf16")})


def test_grouped_training_adds_no_zero_weight_gradients():
    """The grouped form reaches every argument through its GEMMs, so the call no longer
    connects each argument to the output once more: that connection's backward filled a
    zero gradient of each weight's size and added it to the real one (3.5 of 15 ms of a
    CPU fp32 training step). The backward makes no weight-sized zeros (``slice_backward``
    of the empty slice, or a fill); gradients as the float64 reference's; an empty batch
    still gets zero weight gradients."""
    leaves, ids = _case("cpu", True, "silu", seed=9)
    leaves = [t.float() if t is not None else None for t in leaves]
    got = [t.clone().requires_grad_() for t in leaves]
    x, w13, w2, tw, b13, b2 = got
    out = moerunner.fused_moe(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2)
    fill_ops = {"slice_backward", "fill_", "zero_", "zeros"}
    with OpCalls(fill_ops, lambda name, args, out: out.numel()) as fills:
        (out.double() * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
    assert w13.numel() not in fills.calls and w2.numel() not in fills.calls, fills.calls
    ref, ref_grads = _reference(leaves, ids, "silu")
    for name, g, w in zip(("x", "w13", "w2", "tw", "b13", "b2"), got, ref_grads, strict=True):
        assert_close(g.grad, w, 1e-5, what=f"d/d {name}")
    _, grads = _grads([t[:0] if t.shape[0] == T else t for t in leaves], ids[:0], "silu")
    assert grads[1] is not None and not grads[1].any()


@pytest.mark.parametrize("hooked", [False, True])
def test_per_expert_training_fills_no_weight_or_row_sized_zeros(hooked):
    """The per-expert form (here forced on the CPU: no grouped training), without and with
    hooks (LoRA factors trained beside the weights), takes each expert's weight from one
    ``unbind`` per tensor and call, whose backward stacks the experts' gradients: indexing
    ``w[e]`` made a zero tensor of the whole weight per expert hit in the backward (3x the
    step time of a CPU fp32 Qwen3-30B-A3B / 16 step). The rows likewise come from one split
    (a slice per expert filled a zero gradient of all the rows each), and GEMM1's gate and
    up halves from one split or unbind. The backward makes no zeros of a weight's shape and
    slices no rows; without hooks, a call that computes a row reaches every argument, so
    the connection that gives the others zero gradients (a flat fill per weight) is left
    out, and kept for a call without rows. Gradients as the float64 reference's, or with
    hooks as the grouped form's."""
    from moerunner.lora import MoeLoraWeights, lora_hooks

    leaves, ids = _case("cpu", True, "silu", seed=11)
    leaves = [t.float() if t is not None else None for t in leaves]
    g = torch.Generator().manual_seed(4)
    shapes = ((2, E, 4, H), (2, E, 2 * I, 4), (2, E, 4, I), (2, E, H, 4))
    factors = [torch.randn(*s, generator=g) * 0.2 for s in shapes]

    def train(registry):
        got = [t.clone().requires_grad_() for t in [*leaves, *factors]]
        x, w13, w2, tw, b13, b2, *lora = got
        hooks = None
        if hooked:
            hooks = lora_hooks(MoeLoraWeights(*lora), torch.tensor([0, 1, -1] * 4)[:T])
        out = moerunner.fused_moe(
            x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2, hooks=hooks, registry=registry
        )
        fill_ops = {"select_backward", "slice_backward", "fill_", "zero_", "zeros", "new_zeros"}
        with OpCalls(fill_ops, lambda name, args, out: (name, tuple(out.shape))) as fills:
            (out.double() * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
        return out, [t.grad for t in got[: 6 + 4 * hooked]], fills.calls

    per_expert = moerunner.default_registry().copy()
    options = TorchOptions(grouped_training=frozenset(), cpu_float32_gemms=frozenset())
    per_expert.register_backend(TorchBackend(options), replace=True)
    with OpCalls({"_grouped_mm"}, lambda name, args, out: tuple(args[1].shape)) as grouped:
        out, grads, fills = train(per_expert)
    # the per-expert form ran: no grouped GEMM over the experts' weights (the LoRA delta's,
    # over rank-4 factors and their gradients, are its own)
    assert not [s for s in grouped.calls if len(s) == 3 and min(s[-2:]) > 4], grouped.calls
    assert len(ids.unique()) >= 3  # several experts hit: the old form filled once per expert
    shapes = [s for _, s in fills]
    assert tuple(leaves[1].shape) not in shapes and tuple(leaves[2].shape) not in shapes, fills
    if not hooked:  # a row was computed: every weight is reached, no flat connection either
        flat = {(leaves[i].numel(),) for i in (1, 2, 4, 5)}  # w13, w2 and their biases
        assert not [s for name, s in fills if name == "slice_backward" and s in flat], fills
    rows = ids.numel() if hooked else int((ids >= 0).sum())  # the grouped rows
    sliced = [s for name, s in fills if name == "slice_backward" and len(s) == 2]
    assert not [s for s in sliced if s[0] == rows], fills
    skipped = torch.full_like(ids, -1)  # no row: zero gradients, through the connection
    _, zero_grads = _grads(leaves, skipped, "silu", registry=per_expert)
    assert all(g is not None and not g.any() for g in zero_grads)
    if hooked:
        _, expected, _ = train(None)  # the default: grouped GEMMs with the hooks between
    else:
        _, expected = _reference(leaves, ids, "silu")
    names = ("x", "w13", "w2", "tw", "b13", "b2", "A13", "B13", "A2", "B2")
    for name, got, want in zip(names[: len(grads)], grads, expected, strict=True):
        assert_close(got, want, 1e-5, what=f"d/d {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_fp32_fp16_training_runs_grouped_and_matches_the_reference(dtype):
    """CUDA training in fp32 / fp16 takes the grouped form by default
    (``TorchOptions.grouped_training``: PyTorch's grouped GEMM for these dtypes, 2.3-3.0x
    faster steps than one GEMM pair per expert on an H100); values and every gradient
    within the dtype's bound of the float64 reference, with skipped slots and biases."""
    leaves, ids = _case("cuda", True, "silu", seed=13)
    leaves = [t.to(dtype) for t in leaves]
    with OpCalls({"_grouped_mm"}, lambda name, args, out: args[0].dtype) as grouped:
        out, grads = _grads(leaves, ids, "silu")
    assert grouped.calls and set(grouped.calls) == {dtype}, grouped.calls
    ref, ref_grads = _reference(leaves, ids, "silu")
    bound = DTYPE_BOUND[dtype]
    assert_close(out.cpu(), ref.detach(), bound, what="values")
    names = ("x", "w13", "w2", "routing weights", "w13 bias", "w2 bias")
    for name, g, w in zip(names, grads, ref_grads, strict=True):
        assert_close(g.cpu(), w, bound, what=f"d/d {name}")


def test_autograd_functions_skip_the_signature_binding_outside_transforms(monkeypatch):
    """The backend's autograd Functions (``_Function``) call PyTorch's apply without its
    per-call ``inspect.signature`` binding (25-30 us of host time per GEMM on a CPU), and
    give the same gradients inside a torch.func transform, where PyTorch's own apply runs."""
    import inspect

    g = torch.Generator().manual_seed(5)
    a = torch.randn(6, 8, generator=g).bfloat16()
    b = torch.randn(2, 8, 4, generator=g).bfloat16()
    ends = torch.tensor([2, 6], dtype=torch.int32)

    def loss(a, b):
        return torch_autograd._Float32GroupedMm.apply(a, b, ends, True, True).float().sum()

    want = torch.func.grad(loss, argnums=(0, 1))(a, b)
    bound = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *x, **k: bound.append(1) or signature(*x, **k))
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    loss(a_, b_).backward()
    assert not bound
    assert torch.equal(a_.grad, want[0]) and torch.equal(b_.grad, want[1])
