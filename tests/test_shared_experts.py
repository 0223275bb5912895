"""Shared experts beside the routed experts (``moerunner.shared``: a call of their own).

Every result is held to the float64 reference of the separate computation: the routed
experts (``reference_moe``) plus each shared expert as one dense MLP over all tokens, times
its gate (``reference_moe`` with every token routed to shared expert s with the gate value
as weight). fp32 bounds are ``DTYPE_BOUND`` (two GEMMs in fp32). Triton runs in the
interpreter (fp32: it computes bf16 wrongly).
"""

from __future__ import annotations

import pytest
import torch
from cases import cpu_backends

import moerunner
from moerunner import MoE, MoeConfig, MoeInputError, MoeRunner, RoutingConfig
from moerunner.api import run_experts
from moerunner.config import Activation, SharedExpertsConfig
from moerunner.shared import SharedExperts, shared_dense
from moerunner.testing import DTYPE_BOUND, assert_close, error_bound
from moerunner.weights import ExpertWeights

T, E, H, I, K = 6, 5, 32, 16, 2


# The tensors here live on the CPU (the triton rows run under Triton's interpreter).
BACKENDS = cpu_backends()


def _weights(act: Activation, e: int, inter: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if act.gated else inter
    w13 = torch.randn(e, rows, H, generator=g) * H**-0.5
    w2 = torch.randn(e, H, inter, generator=g) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def _reference(x, routed: ExpertWeights, shared: SharedExperts, topk, act, interleaved=False):
    """float64: routed experts + every shared expert as a dense MLP times its gate."""
    ref = moerunner.reference_moe(x, routed, topk.weights, topk.ids, act)
    s = shared.w13.shape[0]
    if shared.gate is None:
        gate = torch.ones(x.shape[0], s, dtype=torch.float64)
    else:
        gate = torch.sigmoid(x.double() @ shared.gate.double().T)
    dense = ExpertWeights(shared.w13, shared.w2, gate_up_interleaved=interleaved)
    ids = torch.arange(s).expand(x.shape[0], s)
    return ref + moerunner.reference_moe(x, dense, gate, ids, act)


def _case(act="silu", s=1, inter_s=I, gate=False, interleaved=False, seed=0):
    act = Activation.of(act)
    torch.manual_seed(seed)
    x = torch.randn(T, H)
    w13, w2 = _weights(act, E, I, seed=seed)
    routed = ExpertWeights(w13, w2, gate_up_interleaved=interleaved)
    sw13, sw2 = _weights(act, s, inter_s, seed=seed + 1)
    shared = SharedExperts(sw13, sw2, torch.randn(s, H) if gate else None)
    topk = moerunner.select_experts(torch.randn(T, E), K, renormalize=True)
    return x, routed, shared, topk, act


def _fused(x, routed, shared, topk, act, backend, **kw):
    return moerunner.fused_moe(
        x,
        routed.w13,
        routed.w2,
        topk.weights,
        topk.ids,
        activation=act,
        gate_up_interleaved=routed.gate_up_interleaved,
        backend=backend,
        shared_experts=shared,
        **kw,
    )


# (S, I_s): DeepSeek-V3 (one shared expert, I_s = I), DeepSeek-V2 / Qwen2-MoE (I_s a multiple
# of I: split into chunks), I_s not a multiple of I (last chunk zero-padded), I_s < I.
SHAPES = [(1, I), (2, 2 * I), (1, I + 8), (2, I // 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("s,inter_s", SHAPES)
@pytest.mark.parametrize("gate", [False, True])
def test_one_call_equals_routed_plus_dense_shared(backend, s, inter_s, gate):
    x, routed, shared, topk, act = _case(s=s, inter_s=inter_s, gate=gate)
    out = _fused(x, routed, shared, topk, act, backend)
    ref = _reference(x, routed, shared, topk, act)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=f"{backend} S={s} I_s={inter_s}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "act,interleaved", [("relu2", False), ("swiglu_oai", True), ("gelu", False)]
)
def test_every_activation_and_row_order(backend, act, interleaved):
    x, routed, shared, topk, act = _case(act, s=2, inter_s=I + 4, gate=True, interleaved=True)
    routed = ExpertWeights(routed.w13, routed.w2, gate_up_interleaved=interleaved)
    out = _fused(x, routed, shared, topk, act, backend)
    ref = _reference(x, routed, shared, topk, act, interleaved)
    assert_close(out, ref, DTYPE_BOUND[torch.float32], what=f"{backend} {act.name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_path_equals_the_reference(backend):
    x, routed, shared, topk, act = _case(s=2, inter_s=2 * I, gate=True)
    runner = MoeRunner(backend, force_permute=True)
    out = run_experts(runner, routed, x, topk.weights, topk.ids, act, shared=shared)
    assert_close(out, _reference(x, routed, shared, topk, act), DTYPE_BOUND[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_biased_routed_experts_add_no_bias_to_shared_ones(backend):
    x, routed, shared, topk, act = _case(s=1, inter_s=2 * I)
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    biased = ExpertWeights(routed.w13, routed.w2, b13, b2)
    out = _fused(x, routed, shared, topk, act, backend, w13_bias=b13, w2_bias=b2)
    assert_close(out, _reference(x, biased, shared, topk, act), DTYPE_BOUND[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantized_shared", [False, True])
def test_quantized_routed_experts(backend, quantized_shared):
    """fp8 per channel: quantized shared weights are used as given; float ones stay in
    floating point, as the model's own shared MLP; the reference runs each on what was
    given."""
    scheme = "fp8_channel"
    x, routed, shared, topk, act = _case(s=2, inter_s=I, gate=True)
    q = ExpertWeights(moerunner.quantize(routed.w13, scheme), moerunner.quantize(routed.w2, scheme))
    qs = SharedExperts(
        moerunner.quantize(shared.w13, scheme), moerunner.quantize(shared.w2, scheme), shared.gate
    )
    out = _fused(x, q, qs if quantized_shared else shared, topk, act, backend)
    # quantized shared GEMM inputs are fp8-quantized per token like the routed ones
    ref_shared = moerunner.reference_moe(
        x,
        ExpertWeights(qs.w13, qs.w2) if quantized_shared else ExpertWeights(shared.w13, shared.w2),
        torch.sigmoid(x.double() @ shared.gate.double().T),
        torch.arange(2).expand(T, 2),
        act,
    )
    ref = moerunner.reference_moe(x, q, topk.weights, topk.ids, act) + ref_shared
    assert_close(out, ref, error_bound(torch.float32, True), what=f"{backend} {scheme}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_shared_experts_beside_quantized_routed_ones_stay_float(backend):
    """I_s = 2I beside fp8_block routed experts: the shared experts stay in floating point
    (they were split and quantized into the routed scheme, off by its rounding: about 3 %
    here), so the call minus the routed experts alone is the float64 shared MLP within the
    fp32 bound; the routed part keeps its own bound."""
    scheme = "fp8_block_64x64"
    act = Activation("silu")
    torch.manual_seed(3)
    h, inter = 128, 64
    x = torch.randn(T, h)
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(E, 2 * inter, h, generator=g) * h**-0.5
    w2 = torch.randn(E, h, inter, generator=g) * inter**-0.5
    sw13 = torch.randn(1, 4 * inter, h, generator=g) * h**-0.5
    sw2 = torch.randn(1, h, 2 * inter, generator=g) * inter**-0.5
    routed = ExpertWeights(moerunner.quantize(w13, scheme), moerunner.quantize(w2, scheme))
    shared = SharedExperts(sw13, sw2, torch.randn(1, h, generator=g))
    topk = moerunner.select_experts(torch.randn(T, E), K)
    out = _fused(x, routed, shared, topk, act, backend)
    alone = _fused(x, routed, None, topk, act, backend)
    gate = torch.sigmoid(x.double() @ shared.gate.double().T)
    ref_shared = moerunner.reference_moe(
        x, ExpertWeights(sw13, sw2), gate, torch.zeros(T, 1, dtype=torch.int32), act
    )
    assert_close(out.double() - alone.double(), ref_shared, DTYPE_BOUND[torch.float32])
    ref = moerunner.reference_moe(x, routed, topk.weights, topk.ids, act) + ref_shared
    assert_close(out, ref, error_bound(torch.float32, True), what=f"{backend} fp8_block")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens_no_routed_slots_and_unchecked_ids(backend):
    x, routed, shared, topk, act = _case(s=1, inter_s=I, gate=True)
    empty = _fused(
        x[:0], routed, shared, moerunner.TopK(topk.weights[:0], topk.ids[:0]), act, backend
    )
    assert empty.shape == (0, H)
    # top_k = 0: only the shared experts
    none = moerunner.TopK(torch.empty(T, 0), torch.empty(T, 0, dtype=torch.int32))
    out = _fused(x, routed, shared, none, act, backend)
    assert_close(out, _reference(x, routed, shared, none, act), DTYPE_BOUND[torch.float32])
    # unchecked ids at or past E are skipped: they must not reach the shared slots (E..)
    ids = topk.ids.clone().long()
    ids[:, 0] = E
    bad = moerunner.TopK(topk.weights, ids)
    out = _fused(x, routed, shared, bad, act, backend, check_ids=False)
    skipped = moerunner.TopK(topk.weights, torch.where(ids >= E, -1, ids))
    assert_close(out, _reference(x, routed, shared, skipped, act), DTYPE_BOUND[torch.float32])


def test_gradients_reach_the_shared_weights_and_gate():
    x, routed, shared, topk, act = _case(s=2, inter_s=I + 8, gate=True)
    leaves = [t.clone().requires_grad_() for t in (shared.w13, shared.w2, shared.gate)]
    out = _fused(x, routed, SharedExperts(*leaves), topk, act, "torch")
    out.square().sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (shared.w13, shared.w2, shared.gate)]
    x64 = x.double()
    ref = moerunner.reference_moe(x, routed, topk.weights, topk.ids, act)
    gate = torch.sigmoid(x64 @ leaves64[2].T)
    for s in range(2):
        h = x64 @ leaves64[0][s].T
        half = h.shape[1] // 2
        a = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
        ref = ref + (a @ leaves64[1][s].T) * gate[:, s : s + 1]
    ref.square().sum().backward()
    for got, want in zip(leaves, leaves64, strict=True):
        assert_close(got.grad, want.grad, 1e-4)


def test_dense_fallback_equals_the_reference():
    x, routed, shared, topk, act = _case(s=2, inter_s=I + 8, gate=True)
    dense = shared_dense(x, shared, act)
    ref = _reference(x, routed, shared, topk, act) - moerunner.reference_moe(
        x, routed, topk.weights, topk.ids, act
    )
    assert_close(dense, ref, DTYPE_BOUND[torch.float32])


def test_bad_shared_experts_are_named():
    x, routed, shared, topk, act = _case(s=2, inter_s=I)

    def call(sh):
        return _fused(x, routed, sh, topk, act, "torch")

    with pytest.raises(TypeError, match="shared_experts must be a SharedExperts"):
        call((shared.w13, shared.w2))
    with pytest.raises(MoeInputError, match="shared w13 has S=2 experts but shared w2 has S=1"):
        call(SharedExperts(shared.w13, shared.w2[:1]))
    with pytest.raises(MoeInputError, match="hidden size H=32"):
        call(SharedExperts(shared.w13[:, :, :16], shared.w2))
    with pytest.raises(MoeInputError, match="needs 32"):
        call(SharedExperts(shared.w13[:, :8], shared.w2))
    with pytest.raises(MoeInputError, match=r"shared gate must be \[S=2, H=32\]"):
        call(SharedExperts(shared.w13, shared.w2, torch.randn(1, H)))
    with pytest.raises(TypeError, match="shared w13/w2 dtype torch.float16 must equal hidden"):
        call(SharedExperts(shared.w13.half(), shared.w2.half()))
    q = ExpertWeights(*(moerunner.quantize(w, "fp8_channel") for w in (routed.w13, routed.w2)))
    qother = SharedExperts(*(moerunner.quantize(w, "int8") for w in (shared.w13, shared.w2)))
    # float shared experts beside quantized routed ones run on the hidden states as they are
    with pytest.raises(TypeError, match="shared w13/w2 dtype torch.float32 must equal hidden"):
        _fused(x.bfloat16(), q, shared, topk, act, "torch")
    with pytest.raises(TypeError, match="shared w13 and w2 must both be plain tensors"):
        _fused(x, q, SharedExperts(shared.w13, qother.w2), topk, act, "torch")
    with pytest.raises(TypeError, match="shared w13/w2 dtypes torch.float32/torch.float16"):
        _fused(x, q, SharedExperts(shared.w13, shared.w2.half()), topk, act, "torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_shared_experts_of_any_width_and_scheme(backend):
    """Shared experts run as a call of their own, so quantized ones need neither the routed
    I (I_s = 2I here) nor the routed scheme (int8 beside fp8_channel), nor quantized routed
    experts; each part against float64 on what it was given (int8's activation bound)."""
    x, routed, shared, topk, act = _case(s=1, inter_s=2 * I, gate=True)
    qs = SharedExperts(
        *(moerunner.quantize(w, "int8") for w in (shared.w13, shared.w2)), shared.gate
    )
    gate = torch.sigmoid(x.double() @ shared.gate.double().T)
    ids = torch.zeros(T, 1, dtype=torch.int32)
    ref_shared = moerunner.reference_moe(x, ExpertWeights(qs.w13, qs.w2), gate, ids, act)
    q = ExpertWeights(*(moerunner.quantize(w, "fp8_channel") for w in (routed.w13, routed.w2)))
    for weights in (q, routed):
        out = _fused(x, weights, qs, topk, act, backend)
        ref = moerunner.reference_moe(x, weights, topk.weights, topk.ids, act) + ref_shared
        assert_close(out, ref, error_bound(torch.float32, True), what=f"{backend}")


# -- the layer ------------------------------------------------------------------------------


CFG = MoeConfig(
    num_experts=E,
    hidden_size=H,
    intermediate_size=I,
    top_k=K,
    routing=RoutingConfig(renormalize=True),
    shared_experts=SharedExpertsConfig(num_experts=2, intermediate_size=3 * I, gate=True),
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_runs_its_shared_experts_and_follows_edits(backend):
    torch.manual_seed(0)
    layer = MoE(CFG, backend=backend)
    assert layer.shared_w13.shape == (2, 6 * I, H) and layer.shared_gate.shape == (2, H)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    topk = moerunner.select_experts(logits, K, renormalize=True)
    routed = ExpertWeights(layer.w13.detach(), layer.w2.detach())

    def ref():
        return _reference(x, routed, layer.shared_experts(), topk, CFG.activation)

    with torch.no_grad():
        assert_close(layer(x, logits), ref(), DTYPE_BOUND[torch.float32])
        layer.shared_w2.mul_(2.0)  # in place: prepared again
        assert_close(layer(x, logits), ref(), DTYPE_BOUND[torch.float32])
    assert {"shared_w13", "shared_w2", "shared_gate"} <= set(layer.state_dict())


def test_layer_quantized_and_from_weights():
    torch.manual_seed(1)
    layer = MoE(CFG, backend="torch").quantize_("fp8_channel", keep_float_weights=True)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    topk = moerunner.select_experts(logits, K, renormalize=True)
    with torch.no_grad():
        out = layer(x, logits)
    sh = layer.shared_experts()
    # the shared experts stay float (I_s = 3I); the fp8 bound is the routed experts'
    ref = moerunner.reference_moe(x, layer.quantized, topk.weights, topk.ids)
    gate = torch.sigmoid(x.double() @ sh.gate.double().T)
    ref += moerunner.reference_moe(
        x, ExpertWeights(sh.w13, sh.w2), gate, torch.arange(2).expand(T, 2)
    )
    assert_close(out, ref, error_bound(torch.float32, True))
    built = MoE.from_weights(
        ExpertWeights(layer.w13.detach(), layer.w2.detach()),
        backend="torch",
        shared_experts=SharedExperts(sh.w13, sh.w2, sh.gate),
    )
    with torch.no_grad():
        got = built(x, topk=topk)
    routed = ExpertWeights(layer.w13.detach(), layer.w2.detach())
    assert_close(got, _reference(x, routed, sh, topk, CFG.activation), DTYPE_BOUND[torch.float32])


def test_shared_experts_config_is_checked():
    with pytest.raises(MoeInputError, match="num_experts must be a positive int"):
        SharedExpertsConfig(num_experts=0)
    with pytest.raises(TypeError, match="gate must be a bool"):
        SharedExpertsConfig(gate=1)
    with pytest.raises(TypeError, match="shared_experts must be a SharedExpertsConfig"):
        MoeConfig(4, 8, 8, 2, shared_experts=2)


def test_float_shared_experts_beside_quantized_routed_ones_train():
    """Float shared experts beside quantized routed experts stay in floating point, so they
    train (they were quantized into the routed scheme, and were refused in grad mode): the
    gradients of the shared weights and gate equal float64 autograd of the shared MLP, since
    the frozen routed part does not depend on them; grad mode off computes the same."""
    x, routed, shared, topk, act = _case(s=1, gate=True)
    q = ExpertWeights(*(moerunner.quantize(w, "int8_w8a16") for w in (routed.w13, routed.w2)))
    leaves = [t.clone().requires_grad_() for t in (shared.w13, shared.w2, shared.gate)]
    out = _fused(x, q, SharedExperts(*leaves), topk, act, "torch")
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_leaves = [t.double().requires_grad_() for t in (shared.w13, shared.w2, shared.gate)]
    ref_out = moerunner.reference_moe(
        x.double(),
        ExpertWeights(ref_leaves[0], ref_leaves[1]),
        torch.sigmoid(x.double() @ ref_leaves[2].T),
        torch.zeros(T, 1, dtype=torch.int32),
        act,
    )
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, grad_out.double())
    for name, got, want in zip(("w13", "w2", "gate"), grads, ref_grads, strict=True):
        assert_close(got, want, DTYPE_BOUND[torch.float32], what=f"shared {name} grad")
    with torch.no_grad():
        assert_close(
            _fused(x, q, shared, topk, act, "torch"), out.detach().double(), 1e-6, what="no grad"
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", ["int8_w8a16", "fp8_channel", "nvfp4"])
def test_quantized_layer_compiled_equals_eager_with_float_shared_experts(backend, scheme):
    """A quantized layer's float shared experts: eager calls quantized them into the routed
    scheme and compiled calls ran them in floating point, 2-16 % apart. Both now run them as
    a float call of their own on the layer's backend, so the two agree to fp32 rounding."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    layer = MoE(CFG, backend=backend).quantize_(scheme)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        eager, traced = layer(x, logits), compiled(x, logits)
    assert_close(traced, eager.double(), DTYPE_BOUND[torch.float32], what=f"{backend} {scheme}")


def test_shared_experts_hold_no_copy_of_the_routed_weights():
    """The expert table (routed experts followed by the shared ones) was a second copy of
    every routed weight, made at the first call; the shared experts' own call allocates
    nothing of that size: every storage a call makes is smaller than the routed w13."""
    from moerunner.memory import AllocationTracker, storage_bytes

    experts, hidden, inter, tokens = 64, 64, 32, 4
    g = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    shared = SharedExperts(
        torch.randn(1, 4 * inter, hidden, generator=g) * hidden**-0.5,
        torch.randn(1, hidden, 2 * inter, generator=g) * inter**-0.5,
    )
    topk = moerunner.select_experts(torch.randn(tokens, experts, generator=g), K)
    with AllocationTracker() as tracker:
        out = moerunner.fused_moe(
            x, w13, w2, topk.weights, topk.ids, backend="torch", shared_experts=shared
        )
    assert tracker.largest_bytes < storage_bytes(w13), tracker.largest_bytes
    ref = _reference(x, ExpertWeights(w13, w2), shared, topk, Activation("silu"))
    assert_close(out, ref, DTYPE_BOUND[torch.float32])
