"""MoE LoRA with many adapters in one batch (``moerunner.lora``), through the hooks.

The float64 reference never uses the hooks: for each adapter it merges ``W + s B A`` per
expert in float64 and runs ``reference_moe`` on that adapter's tokens (tokens without an
adapter on the plain weights). fp32 bound: ``DTYPE_BOUND`` (the deltas are fp32 GEMMs of
rank r added to fp32 GEMM outputs, the same order of rounding as the base GEMMs).
"""

from __future__ import annotations

import pytest
import torch
from cases import OpCalls, cpu_backends, interpreted_triton, undefined_rows_mm

import moerunner
import moerunner.lora as lora_module
from moerunner import MoeInputError, MoeRunner
from moerunner.api import run_experts
from moerunner.backends import triton as triton_backend
from moerunner.backends.triton import TritonBackend, TritonOptions
from moerunner.config import Activation
from moerunner.hooks import HookRows, MoeHooks
from moerunner.lora import LoraDelta, MoeLoraWeights, _gathered, lora_delta, lora_hooks
from moerunner.quant import fake_quantize_activation
from moerunner.routing import TopK
from moerunner.testing import DTYPE_BOUND, assert_close
from moerunner.weights import ExpertWeights

T, E, H, I, K, L = 9, 4, 32, 16, 2, 3
BACKENDS = cpu_backends()  # CPU tensors (see cases.cpu_backends)
ADAPTERS = [0, 1, 2, -1, 0, 2, 1, -1, 0]


def _case(rank=8, act="silu", seed=0, scaling=None, tokens=T, hidden=H, inter=I, dtype=None):
    """Random experts, adapters (the pattern of ADAPTERS repeated over ``tokens``) and
    routing; ``dtype`` rounds every tensor to it (the reference then sees the same values)."""
    act = Activation.of(act)
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if act.gated else inter
    w13 = torch.randn(E, rows, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(E, hidden, inter, generator=g) * inter**-0.5
    lora = MoeLoraWeights(
        torch.randn(L, E, rank, hidden, generator=g) * hidden**-0.5,
        torch.randn(L, E, rows, rank, generator=g) * rank**-0.5,
        torch.randn(L, E, rank, inter, generator=g) * inter**-0.5,
        torch.randn(L, E, hidden, rank, generator=g) * rank**-0.5,
        torch.tensor([0.5, 1.0, 2.0]) if scaling is None else scaling,
    )
    x = torch.randn(tokens, hidden, generator=g)
    topk = moerunner.select_experts(torch.randn(tokens, E, generator=g), K, renormalize=True)
    adapters = torch.tensor(ADAPTERS * (tokens // len(ADAPTERS) + 1))[:tokens]
    if dtype is not None:
        x, w13, w2 = (t.to(dtype) for t in (x, w13, w2))
        lora = MoeLoraWeights(
            *(t.to(dtype) for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)), lora.scaling
        )
    return x, ExpertWeights(w13, w2), lora, topk, adapters, act


def _reference(x, weights, lora, topk, adapters, act):
    """float64: per adapter, the merged weights on its tokens."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = (w.double() for w in (weights.w13, weights.w2))
    b13, b2 = (b.double() if b is not None else None for b in (weights.w13_bias, weights.w2_bias))
    for a in [-1, *range(lora.num_adapters)]:
        tok = (adapters == a).nonzero().flatten()
        s, d13, d2 = 0.0, 0.0, 0.0
        if a >= 0:
            s = lora.scaling[a].item() if isinstance(lora.scaling, torch.Tensor) else lora.scaling
            d13 = lora.w13_b[a].double() @ lora.w13_a[a].double()
            d2 = lora.w2_b[a].double() @ lora.w2_a[a].double()
        merged = ExpertWeights(w13 + s * d13, w2 + s * d2, b13, b2, w13_order=weights.w13_order)
        out[tok] = moerunner.reference_moe(
            x[tok].double(), merged, topk.weights[tok], topk.ids[tok], act
        )
    return out


def _run(backend, x, weights, lora, topk, adapters, act, force_permute=False):
    runner = MoeRunner(backend, force_permute=force_permute)
    hooks = lora_hooks(lora, adapters)
    return run_experts(runner, weights, x, topk.weights, topk.ids, act, hooks=hooks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("force_permute", [False, True])
@pytest.mark.parametrize("rank", [8, 16])
def test_many_adapters_in_one_batch(backend, force_permute, rank):
    x, weights, lora, topk, adapters, act = _case(rank)
    out = _run(backend, x, weights, lora, topk, adapters, act, force_permute)
    ref = _reference(x, weights, lora, topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=f"{backend} r={rank}")
    plain = _reference(x, weights, lora, topk, torch.full((T,), -1), act)
    assert (ref - plain).abs().max() > 0.1 * ref.abs().max()  # the adapters matter


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_64_non_gated_and_a_float_scaling(backend):
    x, weights, lora, topk, adapters, act = _case(64, "relu2", seed=1, scaling=0.25)
    out = _run(backend, x, weights, lora, topk, adapters, act)
    assert_close(out, _reference(x, weights, lora, topk, adapters, act), DTYPE_BOUND[torch.float32])


def _row_deltas(x_XK, a, b, adapter_R, expert_R, scale_R, row_div=1):
    """float64 ``[R, N]``: row r's ``scale * (B A) x[r // row_div]`` for its (adapter,
    expert); 0 where either is -1 or the expert is past E."""
    rows, num_experts = adapter_R.shape[0], a.shape[1]
    want = torch.zeros(rows, b.shape[2], dtype=torch.float64)
    for r in range(rows):
        ad, ex = int(adapter_R[r]), int(expert_R[r])
        if ad >= 0 and 0 <= ex < num_experts:
            ab = b[ad, ex].double() @ a[ad, ex].double()
            want[r] = float(scale_R[r]) * (ab @ x_XK[r // row_div].double())
    return want


def test_gathered_and_grouped_deltas_agree():
    """The CPU grouped form and the off-CPU gathered form (run here on CPU tensors, in
    chunks of 7 rows) against a float64 loop over rows."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, H, generator=g)
    a, b = torch.randn(L, E, 8, H, generator=g), torch.randn(L, E, 2 * I, 8, generator=g)
    adapter = torch.randint(-1, L, (40,), generator=g)
    expert = torch.randint(-1, E + 2, (40,), generator=g)  # past E: shared experts, no delta
    scale = torch.rand(40, generator=g)
    want = _row_deltas(x, a, b, adapter, expert, scale)
    assert want.abs().sum() > 0
    grouped = lora_delta(x, a, b, adapter, expert, scale)
    assert_close(grouped, want, 1e-5)
    valid = (adapter >= 0) & (expert >= 0) & (expert < E)
    key = torch.where(valid, adapter * E + expert, -1)
    gathered = _gathered(x, a, b, key, scale, torch.zeros(40, 2 * I), chunk=7)
    assert_close(gathered, want, 1e-5)


def _delta_leaves(seed: int, rank: int, dtype: torch.dtype):
    """A delta's differentiable leaves (40 rows, factors of ``rank``, scales) and each row's
    adapter and expert, some -1 and some experts past E."""
    g = torch.Generator().manual_seed(seed)
    leaves = [
        torch.randn(40, H, generator=g).to(dtype),
        torch.randn(L, E, rank, H, generator=g).to(dtype),
        torch.randn(L, E, 2 * I, rank, generator=g).to(dtype),
        torch.rand(40, generator=g),
    ]
    adapter = torch.randint(-1, L, (40,), generator=g)
    expert = torch.randint(-1, E + 2, (40,), generator=g)
    return leaves, adapter, expert


def _check_delta(out, got, leaves, adapter, expert, bound: float, grad_bound: float) -> None:
    """``out`` (a delta of ``got``, twins of ``leaves`` that require grad) and the gradients
    of the rows, both factors and the scales against float64 autograd of a loop over rows."""
    want64 = [t.double().requires_grad_() for t in leaves]
    x64, a64, b64, s64 = want64
    zero = torch.zeros(2 * I, dtype=torch.float64)
    want = torch.stack([
        s64[r] * (b64[ad, ex] @ (a64[ad, ex] @ x64[r])) if ad >= 0 and 0 <= ex < E else zero
        for r, (ad, ex) in enumerate(zip(adapter.tolist(), expert.tolist(), strict=True))
    ])  # fmt: skip
    assert_close(out, want.detach(), bound)
    proj = torch.linspace(-1, 1, 2 * I)
    (out * proj).sum().backward()
    (want * proj.double()).sum().backward()
    for name, t, w in zip(("x", "a", "b", "scale"), got, want64, strict=True):
        assert_close(t.grad, w.grad, grad_bound, what=name)


@pytest.mark.parametrize("rank", [8, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_grouped_delta_forms_and_gradients(rank, dtype):
    """The CPU delta runs two grouped GEMMs over every (adapter, expert) group where
    PyTorch's take the factors (rank 8: 32-byte rows), else two GEMMs per group (rank 3):
    values and the gradients of the rows, both factors and the scales against float64
    autograd of a loop over rows (float32 products: 1e-5; bf16 factors and rows are exact
    in float32, the delta is float32)."""
    leaves, adapter, expert = _delta_leaves(6, rank, dtype)
    got = [t.clone().requires_grad_() for t in leaves]
    with OpCalls({"_grouped_mm"}) as spy:
        out = lora_delta(got[0], got[1], got[2], adapter, expert, got[3])
    assert len(spy.calls) == (2 if rank == 8 else 0)
    grad_bound = 1e-5 if dtype == torch.float32 else DTYPE_BOUND[dtype]
    _check_delta(out, got, leaves, adapter, expert, 1e-5, grad_bound)


def test_device_grouped_delta_keeps_rows_without_a_pair_out():
    """The device form of the delta (CUDA bf16: two grouped GEMMs over the (adapter, expert)
    groups, no host read; run here on the CPU with a grouped GEMM that leaves the rows past
    the last group NaN in its output and input gradient, as the CUDA kernel may): values and
    gradients as float64's. Bound: bf16's (the rank-r intermediate rounds to bf16, relative
    2^-9 of the delta)."""
    leaves, adapter, expert = _delta_leaves(7, 8, torch.bfloat16)
    valid = (adapter >= 0) & (expert >= 0) & (expert < E)
    assert not valid.all()
    key = torch.where(valid, adapter * E + expert, -1)
    got = [t.clone().requires_grad_() for t in leaves]
    out = lora_module._grouped_device(
        got[0], got[1], got[2], key, got[3], torch.zeros(40, 2 * I), mm=undefined_rows_mm
    )
    bound = DTYPE_BOUND[torch.bfloat16]
    _check_delta(out, got, leaves, adapter, expert, bound, bound)


def test_the_two_lora_gemms_of_a_call_share_the_rows_grouping():
    """The gate/up and down hooks of one call (one ``HookRows``) derive each row's adapter,
    scale, key and grouping once (``HookRows.shared``; the CPU and the device grouped forms
    take the same grouping): one sort for both GEMMs, the same deltas as hooks called on
    rows of their own."""
    g = torch.Generator().manual_seed(8)
    factors = [
        torch.randn(L, E, 8, H, generator=g), torch.randn(L, E, 2 * I, 8, generator=g),
        torch.randn(L, E, 8, I, generator=g), torch.randn(L, E, H, 8, generator=g),
    ]  # fmt: skip
    lora = MoeLoraWeights(*[f.bfloat16() for f in factors], scaling=0.5)
    hooks = lora_hooks(lora, torch.tensor([0, 1, -1, 2, 1, 0, 2, 1, 0])[:T])
    rows_R = 2 * T
    expert = torch.randint(-1, E, (rows_R,), generator=g)
    token = torch.where(expert >= 0, torch.arange(rows_R) // 2, -1)
    x_RH = torch.randn(rows_R, H, generator=g).bfloat16()
    a_RI = torch.randn(rows_R, I, generator=g).bfloat16()

    def both(rows):
        h = hooks.gate_up(torch.zeros(rows_R, 2 * I), x_RH, rows)
        return h, hooks.down(torch.zeros(rows_R, H), a_RI, rows)

    def rows_of():
        return HookRows(expert=expert, token=token, slot=torch.where(expert >= 0, 0, -1))

    with OpCalls({"sort"}) as sorts:
        h, y = both(rows_of())
    assert len(sorts.calls) == 1
    alone_h, _ = both(rows_of())
    _, alone_y = both(rows_of())
    assert torch.equal(h, alone_h) and torch.equal(y, alone_y)
    assert h.abs().sum() > 0 and y.abs().sum() > 0


# The triton backend's LoRA kernels (``moerunner.backends.triton.lora``), in both row
# layouts: each row its own block (few rows per adapter/expert pair) and rows grouped by
# pair (forced with ``lora_group_min_rows_per_pair``). fp32 bound: DTYPE_BOUND (float32
# products and sums of rank r, as the GEMMs'). fp16 bound: DTYPE_BOUND too; the grouped
# expand rounds the rank-r intermediate to fp16 (relative 2^-11 of the delta alone) before
# its tensor-core product, below the bound.
LAYOUTS = {"rows": 10**6, "grouped": 0}
# Backend variants of the end-to-end tests: (rows grouped from this many per pair, LoRA in
# the fused sequence). "rows" runs inside the fused sequence (``lora.sequence_lora``),
# "rows-hooked" the same row-block kernel in the hooked sequence, "grouped" the hooked
# sequence's grouped kernels (never in the fused sequence).
VARIANTS = {"rows": (10**6, True), "rows-hooked": (10**6, False), "grouped": (0, True)}
# On CPU tensors the kernels run under Triton's interpreter only (GPU: the gpu test below).
needs_triton = pytest.mark.skipif(
    not triton_backend.interpreted(), reason="needs Triton's interpreter for CPU tensors"
)


@needs_triton
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_triton_lora_kernels_match_a_float64_loop_over_rows(layout, dtype, rank):
    """Rows of 2 slots per token (``a_row_div`` 2), unaligned K = 40 and N = 24, adapters
    and experts including -1, experts past E (no delta) and rows without a token; rows
    without a pair keep their values. Rank 8 with a scaling tensor, 16 and 64 with a number."""
    from moerunner.backends.triton.lora import apply_lora, lora_layout

    g = torch.Generator().manual_seed(rank)
    tokens, row_div, k, n = 23, 2, 40, 24
    rows = tokens * row_div
    x = torch.randn(tokens, k, generator=g).to(dtype)
    a = (torch.randn(L, E, rank, k, generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(L, E, n, rank, generator=g) * rank**-0.5).to(dtype)
    scaling = torch.tensor([0.5, 1.0, 2.0]) if rank == 8 else 0.75
    adapter_T = torch.randint(-1, L, (tokens,), generator=g)
    expert = torch.randint(-1, E + 2, (rows,), generator=g).to(torch.int32)
    token = torch.arange(rows) // row_div
    token = torch.where(torch.rand(rows, generator=g) < 0.1, -1, token)
    expert = torch.where(token < 0, -1, expert)
    hook_rows = HookRows(expert=expert, token=token, slot=torch.where(token < 0, -1, 0))
    w2_a, w2_b = torch.zeros(L, E, rank, n, dtype=dtype), torch.zeros(L, E, k, rank, dtype=dtype)
    lora = MoeLoraWeights(a, b, w2_a, w2_b, scaling)  # w13's factors are the ones applied
    delta = LoraDelta(lora, adapter_T, "w13")
    options = TritonOptions(lora_group_min_rows_per_pair=LAYOUTS[layout])
    plan = lora_layout(hook_rows, delta, options)
    assert plan.row_blocks == (layout == "rows")
    before = torch.randn(rows, n, generator=g)
    out = apply_lora(before.clone(), x, row_div, delta, plan, options)
    adapter_R = torch.where(token >= 0, adapter_T[token.clamp(min=0)], -1)
    scale_R = scaling[adapter_R.clamp(min=0)] if rank == 8 else torch.full((rows,), scaling)
    want = _row_deltas(x, a, b, adapter_R, expert, scale_R, row_div)
    assert (want != 0).any(dim=1).sum() >= 8 and (want == 0).all(dim=1).sum() >= 8
    assert_close(out - before, want, DTYPE_BOUND[dtype], what=f"{layout} {dtype} r={rank}")
    untouched = (want == 0).all(dim=1)
    assert torch.equal(out[untouched], before[untouched])
    empty = HookRows(*(torch.empty(0, dtype=torch.int64) for _ in range(3)))
    none = apply_lora(
        torch.empty(0, n), x[:0], 1, delta, lora_layout(empty, delta, options), options
    )
    assert none.shape == (0, n)


@needs_triton
@pytest.mark.parametrize("programs", [1, 24, 10**6], ids=["one-group", "two-groups", "per-block"])
@pytest.mark.parametrize("rank", [16, 64])
def test_triton_lora_row_kernel_over_several_k_steps_and_n_groups(programs, rank):
    """The row-block kernel (shrink and expand in one launch) with K = N = 300: rank 64 takes
    two K steps (the second masked) and five N blocks, rank 16 one K step and two N blocks,
    split into groups per row as the grid target ``programs`` asks (one group of all
    blocks, two groups whose last block lies past N, one block per program). fp16 bound:
    DTYPE_BOUND (float32 products of fp16 values)."""
    from moerunner.backends.triton import lora as lora_launcher

    g = torch.Generator().manual_seed(programs + rank)
    tokens, row_div, k, n = 6, 2, 300, 300
    rows = tokens * row_div
    x = torch.randn(tokens, k, generator=g).half()
    a = (torch.randn(L, E, rank, k, generator=g) * k**-0.5).half()
    b = (torch.randn(L, E, n, rank, generator=g) * rank**-0.5).half()
    adapter_T = torch.tensor([0, 2, -1, 1, 0, 2])
    expert = torch.tensor([0, 3, 1, 2, 0, 1, 3, 3, -1, 2, 1, 0], dtype=torch.int32)
    token = torch.arange(rows) // row_div
    hook_rows = HookRows(expert=expert, token=token, slot=token % row_div)
    zeros = torch.zeros(L, E, rank, n, dtype=x.dtype), torch.zeros(L, E, k, rank, dtype=x.dtype)
    delta = LoraDelta(MoeLoraWeights(a, b, *zeros, 1.5), adapter_T, "w13")
    options = TritonOptions(lora_group_min_rows_per_pair=10**6)
    plan = lora_launcher.lora_layout(hook_rows, delta, options)
    assert plan.row_blocks
    groups, per_group = lora_launcher.rows_grid(rows, n, max(16, 4096 // max(16, rank)), programs)
    assert groups == {1: 1, 24: 2, 10**6: (5 if rank == 64 else 2)}[programs]
    assert groups * per_group >= _cdiv(n, max(16, 4096 // max(16, rank)))
    before = torch.randn(rows, n, generator=g)
    out = lora_launcher.apply_lora(before.clone(), x, row_div, delta, plan, options, programs)
    adapter_R = adapter_T[token]
    want = _row_deltas(x, a, b, adapter_R, expert, torch.full((rows,), 1.5), row_div)
    assert (want == 0).all(dim=1).sum() == 3  # token 2's rows and the row of expert -1
    assert_close(out - before, want, DTYPE_BOUND[torch.float16], what=f"r={rank} {programs}")
    untouched = (want == 0).all(dim=1)
    assert torch.equal(out[untouched], before[untouched])


def _cdiv(a, b):
    return -(-a // b)


@pytest.fixture
def lora_variants():
    """The triton backend registered once per LoRA variant (``VARIANTS``)."""
    names = {}
    for layout, (group_min, in_sequence) in VARIANTS.items():
        options = TritonOptions(
            lora_group_min_rows_per_pair=group_min, lora_in_sequence=in_sequence
        )
        names[layout] = f"triton-lora-{layout}"
        triton_backend.register(TritonBackend(options, name=names[layout]), replace=True)
    yield names
    for name in names.values():
        moerunner.DEFAULT_REGISTRY.backends.pop(name, None)
    moerunner.DEFAULT_REGISTRY._selections.clear()


@needs_triton
@pytest.mark.parametrize("layout", sorted(VARIANTS))
@pytest.mark.parametrize(
    "dtype,force_permute", [(torch.float32, False), (torch.float32, True), (torch.float16, False)]
)
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_triton_backend_applies_lora_with_its_kernels(
    lora_variants, monkeypatch, layout, dtype, force_permute, rank
):
    """End to end against the merged-weights reference, H = 40 and I = 24 (unaligned), both
    paths of the standard format; the PyTorch form is switched off, so the kernels ran, and
    the fused op took the sequence the variant names (the hooked one for "rows-hooked" and
    "grouped", the fused one for "rows"). Tokens of different adapters (and without one)
    share experts. Empty calls (T = 0) return [0, H]."""
    x, weights, lora, topk, adapters, act = _case(
        rank, seed=rank, tokens=18, hidden=40, inter=24, dtype=dtype
    )
    shared = [e for e in range(E) if len(set(adapters[(topk.ids == e).any(dim=1)].tolist())) >= 3]
    assert shared, "the case must route tokens of several adapters to one expert"

    def no_pytorch_form(*args):
        raise AssertionError("the triton backend called the LoRA hook's PyTorch form")

    hooked_calls = []

    def hooked_standard(*args):
        hooked_calls.append(args)
        return hooked_sequence_standard(*args)

    hooked_sequence_standard = triton_backend.hooked_standard
    monkeypatch.setattr(LoraDelta, "__call__", no_pytorch_form)
    monkeypatch.setattr(triton_backend, "hooked_standard", hooked_standard)
    out = _run(lora_variants[layout], x, weights, lora, topk, adapters, act, force_permute)
    if not force_permute:
        assert bool(hooked_calls) == (layout != "rows")
    ref = _reference(x.float(), weights, lora, topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[dtype], what=f"{layout} {dtype} r={rank}")
    empty = _run(
        lora_variants[layout], x[:0], weights, lora, topk_slice(topk, 0), adapters[:0], act
    )
    assert empty.shape == (0, 40)


@needs_triton
@pytest.mark.parametrize("layout", ["rows", "rows-hooked"])
def test_triton_lora_with_biases_and_interleaved_gate_up(lora_variants, layout):
    """swiglu_oai over interleaved gate/up rows with both biases (GPT-OSS's layout): the
    fused sequence's GEMM1 adds each delta column to its own weight row (gate and up
    alternating), after the bias, as the hooked sequence does. fp32 bound: DTYPE_BOUND."""
    x, weights, lora, topk, adapters, act = _case(16, "swiglu_oai", seed=3, tokens=12)
    g = torch.Generator().manual_seed(4)
    weights = ExpertWeights(
        weights.w13,
        weights.w2,
        torch.randn(E, 2 * I, generator=g) * 0.1,
        torch.randn(E, H, generator=g) * 0.1,
        gate_up_interleaved=True,
    )
    out = _run(lora_variants[layout], x, weights, lora, topk, adapters, act)
    ref = _reference(x, weights, lora, topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=layout)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_sequence_lora_stores_each_rows_delta_and_zero_without_a_pair(dtype, rank):
    """The fused sequence's deltas (``SequenceLora``): rows are (token, slot) pairs of k = 3
    slots, each row's token ``p // 3``; experts include -1 and ids past the adapters' E,
    adapters include -1. Every row of the float32 workspace is set, whatever it held (NaN
    before the call): the delta, or exactly 0 for a row without a pair. GEMM1's delta reads
    the token's input, GEMM2's the row's own. fp16 bound: DTYPE_BOUND (float32 products of
    fp16 values), fp32 likewise."""
    from moerunner.backends.triton.lora import SequenceLora

    g = torch.Generator().manual_seed(rank + 1)
    tokens, top_k, hidden, inter = 7, 3, 40, 24
    rows = tokens * top_k
    lora = MoeLoraWeights(
        (torch.randn(L, E, rank, hidden, generator=g) * hidden**-0.5).to(dtype),
        (torch.randn(L, E, 2 * inter, rank, generator=g) * rank**-0.5).to(dtype),
        (torch.randn(L, E, rank, inter, generator=g) * inter**-0.5).to(dtype),
        (torch.randn(L, E, hidden, rank, generator=g) * rank**-0.5).to(dtype),
        torch.tensor([0.5, 1.0, 2.0]),
    )
    adapter_T = torch.tensor([0, -1, 2, 1, 0, 2, -1])
    expert = torch.randint(-1, E + 2, (rows,), generator=g).to(torch.int32)
    hooks = lora_hooks(lora, adapter_T)
    seq = SequenceLora(hooks.gate_up, hooks.down, top_k, TritonOptions())
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    inter_RI = torch.randn(rows, inter, generator=g).to(dtype)
    adapter_R = adapter_T[torch.arange(rows) // top_k]
    scale_R = lora.scaling[adapter_R.clamp(min=0)]
    for which, inp, row_div, a, b in (
        ("gate_up", x, top_k, lora.w13_a, lora.w13_b),
        ("down", inter_RI, 1, lora.w2_a, lora.w2_b),
    ):
        width = b.shape[2]  # the GEMM's output width (w13 rows, or H)
        first = getattr(seq, which)(inp, expert, width)
        first.fill_(float("nan"))  # the cached workspace: the next call must set every row
        out = getattr(seq, which)(inp, expert, width)
        assert out.data_ptr() == first.data_ptr() and out.dtype == torch.float32
        want = _row_deltas(inp, a, b, adapter_R, expert, scale_R, row_div)
        without = (want == 0).all(dim=1)
        assert without.sum() >= 4 and (~without).sum() >= 4
        assert torch.equal(out[without], torch.zeros_like(out[without]))
        assert_close(out, want, DTYPE_BOUND[dtype], what=f"{which} {dtype} r={rank}")


@needs_triton
def test_lora_and_plain_calls_of_one_shape_do_not_share_results(lora_variants):
    """On one set of weights and one shape: a plain call, a LoRA call in the fused sequence,
    the plain call again, then LoRA with other adapter ids: each matches its own reference
    (nothing of a call's deltas is kept for the next, whatever ids it has)."""
    x, weights, lora, topk, adapters, act = _case(16, seed=6, tokens=9)
    runner = MoeRunner(lora_variants["rows"])

    def call(ids):
        hooks = None if ids is None else lora_hooks(lora, ids)
        return run_experts(runner, weights, x, topk.weights, topk.ids, act, hooks=hooks)

    other = torch.tensor([2, 2, -1, 0, 1, 1, 0, 2, -1])
    plain_ref = _reference(x, weights, lora, topk, torch.full((9,), -1), act)
    bound = DTYPE_BOUND[torch.float32]
    assert_close(call(None), plain_ref, bound, what="plain")
    assert_close(call(adapters), _reference(x, weights, lora, topk, adapters, act), bound)
    assert_close(call(None), plain_ref, bound, what="plain after lora")
    assert_close(call(other), _reference(x, weights, lora, topk, other, act), bound)


def topk_slice(topk, tokens):
    """The first ``tokens`` rows of a routing result."""
    return type(topk)(topk.weights[:tokens], topk.ids[:tokens])


def test_bad_lora_input_is_named():
    x, weights, lora, topk, adapters, act = _case()
    with pytest.raises(TypeError, match="lora must be a MoeLoraWeights"):
        lora_hooks((lora.w13_a,), adapters)
    with pytest.raises(MoeInputError, match="must share"):
        lora_hooks(MoeLoraWeights(lora.w13_a, lora.w13_b[:, :2], lora.w2_a, lora.w2_b), adapters)
    with pytest.raises(MoeInputError, match="ranks differ"):
        lora_hooks(MoeLoraWeights(lora.w13_a, lora.w13_b[..., :4], lora.w2_a, lora.w2_b), adapters)
    with pytest.raises(MoeInputError, match=r"scaling must be a number or a float \[L=3\]"):
        lora_hooks(
            MoeLoraWeights(lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b, torch.ones(2)), adapters
        )
    with pytest.raises(MoeInputError, match=r"adapter_ids must be a 1-D \[T\] tensor of int64"):
        lora_hooks(lora, adapters.float())
    with pytest.raises(MoeInputError, match=r"lora: adapter_ids must be in \[-1, L=3\)"):
        lora_hooks(lora, torch.tensor([0, 3]))  # L = 3: id 3 out of range
    wide = MoeLoraWeights(
        torch.randn(L, E, 8, H + 1), lora.w13_b[..., :8], lora.w2_a[:, :, :8], lora.w2_b[..., :8]
    )
    with pytest.raises(MoeInputError, match="w13_a has 33 where the experts need 32"):
        _run("torch", x, weights, wide, topk, adapters, act)
    for backend in ["torch"] + (["triton"] if interpreted_triton() else []):  # per token
        with pytest.raises(MoeInputError, match="hooks were made for 8 tokens.*call has 9"):
            _run(backend, x, weights, lora, topk, adapters[:8], act)
    with pytest.raises(TypeError, match="num_tokens must be None or an int"):
        MoeHooks(num_tokens=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [9, 64], ids=["fused-row-blocks", "hooked-grouped"])
def test_lora_call_is_captured_in_a_cuda_graph_and_replays(monkeypatch, tokens):
    """triton, bf16, the default options: 9 tokens give 18 rows, under 2 per (adapter,
    expert) pair (row blocks, inside the fused sequence); 64 give 128 rows (grouped by pair,
    the hooked sequence). The LoRA kernels ran (the
    PyTorch form is switched off), the eager call reads nothing back to the host, the call
    captures, each replay with new inputs matches an eager call, and the result matches
    the float64 merged-weights reference (the torch backend reads expert bounds on the host
    and does not capture)."""
    bf, dev = torch.bfloat16, "cuda"
    x, weights, lora, topk, adapters, act = _case(16, tokens=tokens, hidden=96, inter=48, dtype=bf)
    w = ExpertWeights(weights.w13.to(dev), weights.w2.to(dev))
    lo = MoeLoraWeights(*(t.to(dev) for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)),
                        lora.scaling.to(dev))  # fmt: skip
    xs, tw, ti, ad = x.to(dev), topk.weights.to(dev), topk.ids.to(dev), adapters.to(dev)

    def no_pytorch_form(*args):
        raise AssertionError("the triton backend called the LoRA hook's PyTorch form")

    monkeypatch.setattr(LoraDelta, "__call__", no_pytorch_form)

    def call():
        hooks = lora_hooks(lo, ad, check_ids=False)
        return moerunner.fused_moe(
            xs, w.w13, w.w2, tw, ti, backend="triton", check_ids=False, hooks=hooks
        )

    call()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = _reference(x.float(), weights, lora, topk, adapters, act)
    assert_close(eager, ref, DTYPE_BOUND[bf], what=f"T={tokens}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        xs.copy_(torch.randn(tokens, xs.shape[1], generator=g).to(dev, bf))
        graph.replay()
        torch.testing.assert_close(out, call())
    ref = _reference(xs.float().cpu(), weights, lora, topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[bf], what=f"T={tokens} replayed")


@pytest.mark.gpu
def test_lora_calls_take_no_launch_plan_of_plain_calls():
    """triton, bf16, CUDA (where eager calls record and replay launch plans): plain calls
    of one shape until their plan replays, then LoRA calls of the same shape inside the
    fused sequence with two sets of adapter ids, then plain again. Each matches its own
    float64 reference: a LoRA call neither replays the plain calls' plan nor leaves one
    that a plain call (or a LoRA call with other ids) would replay."""
    bf, dev = torch.bfloat16, "cuda"
    x, weights, lora, topk, adapters, act = _case(16, tokens=9, hidden=96, inter=48, dtype=bf)
    w13, w2 = weights.w13.to(dev), weights.w2.to(dev)
    lo = MoeLoraWeights(*(t.to(dev) for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)),
                        lora.scaling.to(dev))  # fmt: skip
    xs, tw, ti = x.to(dev), topk.weights.to(dev), topk.ids.to(dev)
    other = torch.tensor([2, 2, -1, 0, 1, 1, 0, 2, -1])

    def call(ids):
        hooks = None if ids is None else lora_hooks(lo, ids.to(dev), check_ids=False)
        return moerunner.fused_moe(xs, w13, w2, tw, ti, backend="triton", hooks=hooks)

    def ref(ids):
        return _reference(x.float(), weights, lora, topk, ids, act)

    bound = DTYPE_BOUND[bf]
    plain = ref(torch.full((9,), -1))
    for _ in range(4):  # records, then replays the plain calls' plan
        assert_close(call(None), plain, bound, what="plain")
    for ids in (adapters, other, adapters):
        for _ in range(4):
            assert_close(call(ids), ref(ids), bound, what=f"lora {ids.tolist()}")
    assert_close(call(None), plain, bound, what="plain after lora")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["silu", "silu_no_mul"])
def test_w13_b_of_another_width_is_refused_on_every_path(backend, act):
    # The triton backend's LoRA inside the fused sequence (decode sizes) sized its workspace
    # from w13_b itself and checked w13_b against that: 8 rows too many ran with the first
    # rows, too few read past the workspace, and a gated adapter on a non-gated layer
    # dropped the adapter (its up rows sit past the first I).
    x, weights, lora, topk, adapters, act = _case(act=act)
    rows = weights.w13.shape[1]
    for bad_rows in (rows + 8, rows - 8):
        bad_b = torch.randn(L, E, bad_rows, lora.w13_b.shape[3])
        bad = MoeLoraWeights(lora.w13_a, bad_b, lora.w2_a, lora.w2_b)
        with pytest.raises(MoeInputError, match=f"w13_b has {bad_rows} where the experts need"):
            _run(backend, x, weights, bad, topk, adapters, act)
    if not act.gated:  # a gated adapter on a non-gated layer says so
        gated_b = torch.randn(L, E, 2 * rows, lora.w13_b.shape[3])
        with pytest.raises(MoeInputError, match="gated=False"):
            _run(backend, x, weights, MoeLoraWeights(lora.w13_a, gated_b, lora.w2_a, lora.w2_b),
                 topk, adapters, act)  # fmt: skip


def test_training_lora_factors_runs_where_their_gradients_flow():
    """Factors that require grad: the triton kernels applied them without autograd, so the
    gradients were silently lost. ``auto`` now runs such a call on the torch backend (its
    gradients match autograd of the float64 reference) and ``triton`` refuses it by name."""
    x, weights, lora, topk, adapters, act = _case(seed=3)
    trained = MoeLoraWeights(
        *(t.clone().requires_grad_() for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)),
        lora.scaling,
    )
    hooks = lora_hooks(trained, adapters)

    def call(backend):
        return moerunner.fused_moe(
            x, weights.w13, weights.w2, topk.weights, topk.ids, backend=backend, hooks=hooks
        )

    with pytest.raises(MoeInputError, match="backend 'triton' applies hooks without autograd"):
        call("triton")
    out = call("auto")
    assert out.requires_grad
    (out.double() * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
    factors64 = [
        t.detach().double().requires_grad_()
        for t in (trained.w13_a, trained.w13_b, trained.w2_a, trained.w2_b)
    ]
    ref = _reference(
        x.double(), ExpertWeights(weights.w13.double(), weights.w2.double()),
        MoeLoraWeights(*factors64, lora.scaling.double()), topk, adapters, act,
    )  # fmt: skip
    (ref * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
    for got, want in zip(
        (trained.w13_a, trained.w13_b, trained.w2_a, trained.w2_b), factors64, strict=True
    ):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # no grad mode: the chosen backend as usual
        call("triton" if interpreted_triton() else "torch")


def _factors(lora):
    return (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)


def _swap_halves(t, dim):
    """Gate rows then up rows <-> up rows then gate rows along ``dim``."""
    half = t.shape[dim] // 2
    return torch.cat([t.narrow(dim, half, half), t.narrow(dim, 0, half)], dim)


def _interleave_rows(t, dim):
    """Gate rows then up rows -> alternating (row 2j gate j, row 2j+1 up j) along ``dim``."""
    half = t.shape[dim] // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return t.index_select(dim, order)


SCALINGS = {  # a scaling tensor the hooks take as it is, and ones they must convert
    "float32": lambda v: torch.tensor(v),
    "float64": lambda v: torch.tensor(v, dtype=torch.float64),
    "float16": lambda v: torch.tensor(v, dtype=torch.float16),
    "strided": lambda v: torch.tensor([x for x in v for _ in range(2)])[::2],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", [*SCALINGS, "inference"])
def test_in_place_scaling_edits_take_effect_whatever_the_tensors_dtype(backend, kind):
    """A float64 / fp16 / strided scaling tensor was converted once and the copy kept, so
    ``scaling[a] = 0`` after a first call was silently ignored (a float32 one, used as it is,
    followed the edit). Each call now matches the float64 merged-weights reference with the
    tensor's values of that moment, over two edits; an inference tensor (no version
    counter) alike."""
    x, weights, lora, topk, adapters, act = _case(seed=6)
    mode = torch.inference_mode() if kind == "inference" else torch.no_grad()
    with mode:
        scaling = SCALINGS["float64" if kind == "inference" else kind]([0.5, 1.0, 2.0])
        lora = MoeLoraWeights(*_factors(lora), scaling)
        for edit in (None, (1, 0.0), (2, -1.5)):
            if edit is not None:
                scaling[edit[0]] = edit[1]
            out = _run(backend, x, weights, lora, topk, adapters, act)
            ref = _reference(x, weights, lora, topk, adapters, act)
            assert_close(out, ref, DTYPE_BOUND[torch.float32], what=f"{kind} after {edit}")


def test_non_finite_scaling_tensor_is_refused_on_cpu():
    """A NaN number was refused, a NaN or inf scaling tensor accepted (non-finite rows)."""
    x, weights, lora, topk, adapters, act = _case()
    for bad in (float("nan"), float("inf"), -float("inf")):
        scaling = torch.tensor([0.5, bad, 2.0])
        with pytest.raises(MoeInputError, match=r"lora scaling must be finite.*got \[0\.5, "):
            lora_hooks(MoeLoraWeights(*_factors(lora), scaling), adapters)


def test_gathered_rows_without_a_pair_stay_finite_beside_a_non_finite_adapter(monkeypatch):
    """The form run off the CPU computed rows without an (adapter, expert) pair with pair 0's
    factors times 0: one non-finite adapter 0 gave NaN on every row without an adapter.
    Called directly on CPU tensors, and through fused_moe with the CPU form swapped for it."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, H, generator=g)
    a, b = torch.randn(L, E, 8, H, generator=g), torch.randn(L, E, 2 * I, 8, generator=g)
    a[0, 0] = float("nan")  # pair 0: adapter 0, expert 0
    b[0, 0, 3] = float("inf")
    adapter = torch.tensor([-1, 1, 2, -1, 1, 2, -1, -1, 2, 1, -1, 2])
    expert = torch.tensor([0, 1, 3, 2, 0, -1, 1, 3, 0, 2, 0, E + 1])
    scale = torch.rand(12, generator=g)
    want = _row_deltas(x, a, b, adapter, expert, scale)
    valid = (adapter >= 0) & (expert >= 0) & (expert < E)
    key = torch.where(valid, adapter * E + expert, -1)
    got = _gathered(x, a, b, key, scale, torch.zeros(12, 2 * I), chunk=5)
    assert_close(got, want, 1e-5)

    def gathered_on_cpu(x_RK, a, b, key, scale_R, out, shared=None):
        return _gathered(x_RK, a, b, key, scale_R, out, chunk=5)

    monkeypatch.setattr(lora_module, "_grouped_cpu", gathered_on_cpu)
    x, weights, lora, topk, _, act = _case(seed=7)
    broken = lora.w13_a.clone()
    broken[0] = float("nan")  # adapter 0, which no token uses
    lora = MoeLoraWeights(broken, lora.w13_b, lora.w2_a, lora.w2_b, lora.scaling)
    adapters = torch.tensor([1, -1, 2, -1, 1, 2, -1, 1, 2])
    out = _run("torch", x, weights, lora, topk, adapters, act)
    assert_close(out, _reference(x, weights, lora, topk, adapters, act), DTYPE_BOUND[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["up_gate", "interleaved"])
def test_w13_b_rows_are_in_the_canonical_order_whatever_w13_order(backend, order):
    """w13_b's rows are gate then up for an up_gate w13 too (the weights are swapped where
    they are prepared, the factors never), and alternate with an interleaved w13; the module
    doc said they follow w13's own row order. Both against the float64 reference of the
    gate-then-up layer merged with the gate-then-up factors."""
    x, weights, lora, topk, adapters, act = _case(seed=8)
    ref = _reference(x, weights, lora, topk, adapters, act)
    if order == "up_gate":
        held = ExpertWeights(_swap_halves(weights.w13, 1), weights.w2, w13_order="up_gate")
        b13, wrong_b13 = lora.w13_b, _swap_halves(lora.w13_b, 2)
    else:
        held = ExpertWeights(_interleave_rows(weights.w13, 1), weights.w2, w13_order=order)
        b13, wrong_b13 = _interleave_rows(lora.w13_b, 2), lora.w13_b
    factors = (lora.w13_a, b13, lora.w2_a, lora.w2_b)
    out = _run(backend, x, held, MoeLoraWeights(*factors, lora.scaling), topk, adapters, act)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=order)
    wrong = MoeLoraWeights(lora.w13_a, wrong_b13, lora.w2_a, lora.w2_b, lora.scaling)
    off = _run(backend, x, held, wrong, topk, adapters, act)
    assert (off - ref).abs().max() > 0.1 * ref.abs().max()  # the other order is not read


def test_trainable_factors_get_zero_gradients_where_no_row_uses_them():
    """With factors that require grad, a call in which no row has an adapter returned a
    tensor without grad_fn, so loss.backward() raised. It now requires grad and gives each
    factor (and a trained scaling tensor) zero gradients; its values are the base
    experts' (float64 reference), also with a non-finite factor no row reads."""
    x, weights, lora, topk, _, act = _case(seed=9)
    factors = [t.clone().requires_grad_() for t in _factors(lora)]
    with torch.no_grad():
        factors[0][1, 2] = float("nan")
    scaling = lora.scaling.clone().requires_grad_()
    trained = MoeLoraWeights(*factors, scaling)
    none = torch.full((T,), -1)
    out = moerunner.fused_moe(
        x, weights.w13, weights.w2, topk.weights, topk.ids, backend="auto",
        hooks=lora_hooks(trained, none),
    )  # fmt: skip
    assert_close(
        out.detach(), _reference(x, weights, lora, topk, none, act), DTYPE_BOUND[torch.float32]
    )
    assert out.requires_grad
    out.sum().backward()
    names = ("w13_a", "w13_b", "w2_a", "w2_b", "scaling")
    for name, t in zip(names, (*factors, scaling), strict=True):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t)), name
    # the hook's PyTorch form alike on no rows, and with rank-0 factors
    rows = HookRows(*(torch.empty(0, dtype=torch.int64) for _ in range(3)))
    empty = LoraDelta(trained, none, "w13")(torch.zeros(0, 2 * I), x[:0], rows)
    assert empty.requires_grad and empty.shape == (0, 2 * I)
    rank0 = [torch.zeros(*t.shape[:2], 0, t.shape[3]).requires_grad_() for t in (lora.w13_a,)]
    delta = lora_delta(x, rank0[0], torch.zeros(L, E, 2 * I, 0), torch.zeros(T, dtype=torch.long),
                       torch.zeros(T, dtype=torch.long), torch.ones(T))  # fmt: skip
    assert delta.requires_grad and torch.equal(delta.detach(), torch.zeros(T, 2 * I))
    with torch.no_grad():  # no grad mode: no graph
        assert not LoraDelta(trained, none, "w13")(torch.zeros(0, 2 * I), x[:0], rows).requires_grad


@pytest.mark.parametrize("empty", ["T=0", "top_k=0"])
def test_trainable_factors_get_zero_gradients_from_an_empty_call(empty):
    x, weights, lora, topk, _, act = _case(seed=9)
    factors = [t.clone().requires_grad_() for t in _factors(lora)]
    tokens, slots = (0, K) if empty == "T=0" else (T, 0)
    out = moerunner.fused_moe(
        x[:tokens], weights.w13, weights.w2, topk.weights[:tokens, :slots],
        topk.ids[:tokens, :slots], backend="torch",
        hooks=lora_hooks(MoeLoraWeights(*factors, lora.scaling), torch.zeros(tokens).long()),
    )  # fmt: skip
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in factors)


def test_lora_delta_built_directly_checks_its_gemm_and_adapter_ids():
    """A public ``LoraDelta`` with gemm="gate_up" (a hook's name, not a GEMM's) silently
    applied the w2 factors where their shapes fit (non-gated experts with H == I), and
    adapter ids past L failed in torch's indexing (IndexError)."""
    g = torch.Generator().manual_seed(10)
    x, w13, w2 = (torch.randn(T, H, generator=g), torch.randn(E, H, H, generator=g) / 6,
                  torch.randn(E, H, H, generator=g) / 6)  # fmt: skip
    factors = (torch.randn(L, E, 4, H, generator=g) / 4, torch.randn(L, E, H, 4, generator=g) / 4)
    lora = MoeLoraWeights(*factors, *(torch.randn(*t.shape, generator=g) / 4 for t in factors))
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K)
    ids = torch.tensor(ADAPTERS)
    with pytest.raises(MoeInputError, match=r"gemm must be 'w13' .* or 'w2' .*got 'gate_up'"):
        LoraDelta(lora, ids, "gate_up")
    with pytest.raises(MoeInputError, match=r"LoraDelta: adapter_T must be in \[-1, L=3\)"):
        LoraDelta(lora, torch.tensor([0, 3, -1]), "w13")
    with pytest.raises(MoeInputError, match=r"LoraDelta: adapter_T must be in \[-1, L=3\)"):
        LoraDelta(lora, torch.tensor([-2, 0]), "w2")
    with pytest.raises(MoeInputError, match=r"adapter_T must be a 1-D \[T\] tensor of int64"):
        LoraDelta(lora, ids.float(), "w13")
    with pytest.raises(TypeError, match="LoraDelta: lora must be a MoeLoraWeights"):
        LoraDelta(_factors(lora), ids, "w13")
    # built by hand right, it runs as lora_hooks's (float64 merged-weights reference)
    hooks = MoeHooks(gate_up=LoraDelta(lora, ids, "w13"), down=LoraDelta(lora, ids, "w2"),
                     num_tokens=T)  # fmt: skip
    out = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, activation="relu2",
                              backend="torch", hooks=hooks)  # fmt: skip
    ref = _reference(x, ExpertWeights(w13, w2), lora, topk, ids, Activation.of("relu2"))
    assert_close(out, ref, DTYPE_BOUND[torch.float32])


def _leaves(*tensors, device="cpu"):
    """Trainable fp32 copies (on ``device``) and their float64 twins (on the CPU)."""
    got = [None if t is None else t.detach().to(device).clone().requires_grad_() for t in tensors]
    want = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    return got, want


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per hidden column (a plain sum hides column mix-ups)."""
    columns = torch.linspace(-1, 1, out.shape[1], dtype=torch.float64, device=out.device)
    return (out.double() * columns).sum()


def _assert_grads(got, want, what, bound=DTYPE_BOUND[torch.float32]):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is not None:
            assert g.grad is not None, f"{what}: leaf {i} got no gradient"
            assert_close(g.grad.cpu(), w.grad, bound, what=f"{what}: gradient of leaf {i}")


GRAD_CASES = {  # activation, w13 order, biased
    "silu": ("silu", "gate_up", False),
    "swiglu_oai interleaved biased": ("swiglu_oai", "interleaved", True),
    "relu2": ("relu2", "gate_up", False),
}


@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_reach_every_input_of_a_call_with_lora_hooks(case):
    """A call with LoRA hooks whose hidden states, routing weights, experts or biases
    required grad raised: the hooks' path had no backward through the hidden states. It now
    runs the torch backend's differentiable path with the hooks, and the gradients of the
    hidden states, routing weights, experts, biases and factors match autograd of the
    float64 merged-weights reference (fp32 math in another order: rtol 1e-4)."""
    act_name, order, biased = GRAD_CASES[case]
    x, weights, lora, topk, adapters, act = _case(seed=5, act=act_name)
    g = torch.Generator().manual_seed(6)
    rows = weights.w13.shape[1]
    b13 = torch.randn(E, rows, generator=g) * 0.1 if biased else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if biased else None
    got, want = _leaves(x, topk.weights, weights.w13, weights.w2, b13, b2, *_factors(lora))
    out = moerunner.fused_moe(
        got[0], got[2], got[3], got[1], topk.ids, activation=act, w13_bias=got[4],
        w2_bias=got[5], w13_order=order, backend="auto",
        hooks=lora_hooks(MoeLoraWeights(*got[6:], lora.scaling), adapters),
    )  # fmt: skip
    assert out.dtype == x.dtype and out.requires_grad
    _loss(out).backward()
    ref = _reference(
        want[0], ExpertWeights(want[2], want[3], want[4], want[5], w13_order=order),
        MoeLoraWeights(*want[6:], lora.scaling.double()),
        TopK(weights=want[1], ids=topk.ids), adapters, act,
    )  # fmt: skip
    assert_close(out, ref.detach(), DTYPE_BOUND[torch.float32])
    _loss(ref).backward()
    _assert_grads(got, want, case)
    with pytest.raises(MoeInputError, match="backend 'triton' applies hooks without autograd"):
        moerunner.fused_moe(
            got[0], got[2], got[3], got[1], topk.ids, activation=act, w13_bias=got[4],
            w2_bias=got[5], w13_order=order, backend="triton",
            hooks=lora_hooks(MoeLoraWeights(*got[6:], lora.scaling), adapters),
        )  # fmt: skip


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_stacked_adapted_layers_train_together(device):
    """Two adapted MoE layers, the second on the first's output (a later layer's hidden
    states depend on the earlier layer's factors): this raised; the factors of both layers,
    and the input, now get the gradients of the float64 reference (on the CPU) of the same
    stack. On CUDA the hooks gather each row's factors (``_gathered``) instead of grouping
    rows on the host."""
    x, w_a, lora_a, topk_a, adapters, act = _case(seed=7)
    _, w_b, lora_b, _, _, _ = _case(seed=8)
    topk_b = moerunner.select_experts(
        torch.randn(T, E, generator=torch.Generator().manual_seed(9)), K, renormalize=True
    )
    got, want = _leaves(x, *_factors(lora_a), *_factors(lora_b), device=device)
    layers = ((w_a, lora_a.scaling, topk_a), (w_b, lora_b.scaling, topk_b))

    def stack(leaves, run):
        h = leaves[0]
        for i, (w, scaling, topk) in enumerate(layers):
            h = h + run(h, w, MoeLoraWeights(*leaves[1 + 4 * i : 5 + 4 * i], scaling), topk)
        return h

    def on_device(h, w, lora, topk):
        lora = MoeLoraWeights(lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b, lora.scaling.to(device))
        return moerunner.fused_moe(
            h, w.w13.to(device), w.w2.to(device), topk.weights.to(device), topk.ids.to(device),
            hooks=lora_hooks(lora, adapters.to(device)),
        )  # fmt: skip

    def reference(h, w, lora, topk):
        lora = MoeLoraWeights(*_factors(lora), lora.scaling.double())
        return _reference(
            h, ExpertWeights(w.w13.double(), w.w2.double()), lora, topk, adapters, act
        )

    out, ref = stack(got, on_device), stack(want, reference)
    assert_close(out.cpu(), ref.detach(), DTYPE_BOUND[torch.float32])
    _loss(out).backward()
    _loss(ref).backward()
    _assert_grads(got, want, f"two stacked layers on {device}")
    assert all(t.grad.abs().sum() > 0 for t in got)


def _quantized_reference(x, weights64, lora, topk, adapters, scheme):
    """float64 silu experts on dequantized weights, slot by slot, with LoRA on each GEMM's
    unquantized input (as the hooks see it). A scheme that quantizes each GEMM's input (the
    scheme's quantizer, fp32) does so in the forward and passes the gradient straight
    through; the activation's output is rounded to fp32 as the kernels store it."""
    quantizes = moerunner.quant.get_scheme(scheme).activation_format != "none"

    def gemm_input(v):
        if not quantizes:
            return v
        return v + (fake_quantize_activation(v.detach().float(), scheme).double() - v).detach()

    w13, w2 = weights64
    a13, b13, a2, b2 = _factors(lora)
    inter = w2.shape[2]
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        ad = int(adapters[t])
        for j in range(K):
            e = int(topk.ids[t, j])
            h = w13[e] @ gemm_input(x[t : t + 1])[0]
            if ad >= 0:
                h = h + lora.scaling[ad].item() * (b13[ad, e] @ (a13[ad, e] @ x[t]))
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            act = act + (act.float().double() - act).detach()
            y = w2[e] @ gemm_input(act[None])[0]
            if ad >= 0:
                y = y + lora.scaling[ad].item() * (b2[ad, e] @ (a2[ad, e] @ act))
            row = row + topk.weights[t, j] * y
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("x_trains", [True, False], ids=["input-trained", "factors-only"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["mxfp4", "int4_g32_zp", "fp8_block"])
def test_frozen_quantized_experts_pass_gradients_without_keeping_float_weights(
    scheme, device, x_trains
):
    """QLoRA: quantized experts (frozen) with trainable LoRA factors, in grad mode with the
    hidden states requiring grad (any layer after the first). This raised ("quantized
    weights have no backward"). The gradients now pass through the quantized experts and
    match autograd of a float64 reference on the dequantized weights (fp32 bound; fp8_block
    also quantizes each GEMM's input, whose gradient passes straight through, as in the
    reference). The backward dequantizes again instead of keeping any expert's float weight
    alive from the forward. With the input frozen (the first layer of a frozen model) the
    factors' gradients are the same: that call ran the inference path, where autograd
    differentiated the input quantization itself (w13 factors off by 0.1-1.3). A quantized
    weight's scale that requires grad is refused either way (it got a gradient silently)."""
    x, weights, lora, topk, adapters, act = _case(seed=11, hidden=128, inter=128)
    w13, w2 = (moerunner.quantize(w.to(device), scheme) for w in (weights.w13, weights.w2))
    got, want = _leaves(x, topk.weights, *_factors(lora), device=device)
    if not x_trains:
        got[0].requires_grad_(False)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trained = MoeLoraWeights(*got[2:], lora.scaling.to(device))
        out = moerunner.fused_moe(
            got[0], w13, w2, got[1], topk.ids.to(device),
            hooks=lora_hooks(trained, adapters.to(device)),
        )  # fmt: skip
    float_weights = {tuple(w.shape[1:]) for w in (weights.w13, weights.w2)}
    assert not float_weights & set(saved), "an expert's float weight was kept for the backward"
    _loss(out).backward()
    ref = _quantized_reference(
        want[0], [moerunner.quant.dequantize(w).cpu().double() for w in (w13, w2)],
        MoeLoraWeights(*want[2:], lora.scaling.double()), TopK(weights=want[1], ids=topk.ids),
        adapters, scheme,
    )  # fmt: skip
    assert_close(out.cpu(), ref.detach(), DTYPE_BOUND[torch.float32], what=scheme)
    _loss(ref).backward()
    _assert_grads(got if x_trains else [None, *got[1:]], want, scheme)
    if w13.scale.is_floating_point():  # (e8m0 scales are bytes: they cannot require grad)
        w13.scale.requires_grad_()
        with pytest.raises(MoeInputError, match=r"are frozen, but w13.scale requires grad"):
            moerunner.fused_moe(got[0], w13, w2, got[1].detach(), topk.ids.to(device))


def test_a_call_that_computes_no_row_gives_zero_gradients():
    """Grad mode, every id -1 (or top_k = 0): the output had no graph, so a loss over it
    raised "does not require grad" (without hooks), and with LoRA hooks the w13 factors got
    None where the w2 factors got zeros. Every trained tensor now gets zero gradients."""
    x, weights, lora, topk, adapters, act = _case(seed=13)
    none = torch.full_like(topk.ids, -1)
    for ids in (none, none[:, :0]):
        got, _ = _leaves(x, weights.w13, weights.w2, topk.weights[:, : ids.shape[1]])
        out = moerunner.fused_moe(got[0], got[1], got[2], got[3], ids)
        assert out.requires_grad and torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in got)
    factors, _ = _leaves(*_factors(lora))
    hooks = lora_hooks(MoeLoraWeights(*factors, lora.scaling), adapters)
    moerunner.fused_moe(
        x, weights.w13, weights.w2, topk.weights, none, hooks=hooks
    ).sum().backward()
    assert all(t.grad is not None and torch.equal(t.grad, torch.zeros_like(t)) for t in factors)
    # T = 0 with trained factors and inputs: the factors kept the output in a graph, and the
    # inputs then got None
    got, _ = _leaves(x[:0], weights.w13, weights.w2, topk.weights[:0], *_factors(lora))
    hooks = lora_hooks(MoeLoraWeights(*got[4:], lora.scaling), adapters[:0])
    moerunner.fused_moe(*got[:3], got[3], topk.ids[:0], hooks=hooks).sum().backward()
    assert all(t.grad is not None and torch.equal(t.grad, torch.zeros_like(t)) for t in got)
