"""Regressions of a probe of the ``MoE`` module as a PyTorch user drives it (float64
references).

- With shared experts, a replaced routed ``w13`` of the same shape (``functional_call`` in a
  loop, a parametrization over an edited original, a new ``Parameter`` per step) could be
  served the joined expert table of the old weight: its memo key named the freed storage by
  ``id``, which the new storage may get (outputs 0.8-3.6 off).
- A quantized layer read the quantized weights built at ``quantize_`` / load time, not its
  buffers: a buffer assigned anew or substituted by ``functional_call`` was ignored (and,
  compiled, until a later probe).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moerunner
from moerunner import ExpertWeights, MoeInputError, reference_moe
from moerunner.testing import DTYPE_BOUND, assert_close

E, H, I, K, T = 4, 8, 4, 2, 3


def _reference(layer, x, logits, w13) -> torch.Tensor:
    """float64: softmax top-k routing (no renormalisation), the routed experts with ``w13``
    and the layer's w2, plus its one shared expert (no gate)."""
    w, ids = logits.double().softmax(-1).topk(K, dim=-1)
    routed = reference_moe(x, ExpertWeights(w13.detach(), layer.w2.detach()), w, ids)
    s13, s2 = layer.shared_w13.detach()[0].double(), layer.shared_w2.detach()[0].double()
    h = x.double() @ s13.T
    return routed + (F.silu(h[:, :I]) * h[:, I:]) @ s2.T


def test_a_replaced_routed_weight_with_shared_experts_is_never_served_stale():
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K,
                              shared_experts=moerunner.SharedExpertsConfig(1))  # fmt: skip
    layer = moerunner.MoE(cfg, backend="torch")
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    base = layer.w13.detach().clone()
    for step in range(4):  # a fresh tensor each step, the last one freed
        w13 = base * (step + 1)
        with torch.no_grad():
            out = torch.func.functional_call(layer, {"w13": w13}, (x, logits))
        assert_close(out, _reference(layer, x, logits, w13), DTYPE_BOUND[torch.float32],
                     what=f"functional_call step {step}")  # fmt: skip
    for step in range(4):
        layer.w13 = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g))
        with torch.no_grad():
            out = layer(x, logits)
        assert_close(out, _reference(layer, x, logits, layer.w13), DTYPE_BOUND[torch.float32],
                     what=f"new Parameter step {step}")  # fmt: skip


def test_a_quantized_layer_runs_its_current_buffers():
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=32, intermediate_size=32, top_k=K)
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(5, 32, generator=g), torch.randn(5, E, generator=g)

    def layer():
        torch.manual_seed(0)
        return moerunner.MoE(cfg, backend="torch").quantize_("fp8_channel")

    with torch.no_grad():
        edited = layer()
        edited.w2_scale.mul_(2.0)  # in place: seen through the shared tensors all along
        want = edited(x, logits)
        plain = layer()
        assert not torch.equal(plain(x, logits), want)
        doubled = plain.w2_scale * 2.0
        got = torch.func.functional_call(plain, {"w2_scale": doubled}, (x, logits))
        assert torch.equal(got, want)  # (was the unsubstituted output)
        assigned = layer()
        assigned.w2_scale = doubled.clone()
        assert torch.equal(assigned(x, logits), want)  # (the assignment was ignored)
        assigned.w2_scale = torch.zeros_like(doubled)
        with pytest.raises(MoeInputError, match="buffer w2_scale was replaced"):
            assigned(x, logits)


def test_training_an_extended_swiglu_on_another_backend_names_the_activation():
    """It raised the triton backend's "no backward: wrap the call in torch.no_grad()",
    which did not say that the activation was the cause or that backend='torch' trains it."""
    act = moerunner.Activation("swiglu_oai", beta=0.5)
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K,
                              activation=act)  # fmt: skip
    layer = moerunner.MoE(cfg, backend="triton")
    x, logits = torch.randn(T, H), torch.randn(T, E)
    with pytest.raises(MoeInputError, match="runs on the torch backend only"):
        layer(x, logits)


# -- a second probe: fp16 overflow, loads, flags, dtypes, compile errors, int8 at the top --


def _overflowing_fp16_call():
    """gate = -1e5 and up = +1e5 for one unit: past fp16's range in an fp16 GEMM output."""
    w13, w2 = torch.zeros(1, 2 * 16, 16), torch.eye(16)[None].clone()
    w13[0, 0, 0], w13[0, 16, 0] = -1000.0, 1000.0
    x = torch.zeros(1, 16)
    x[0, 0] = 100.0
    return x.half(), w13.half(), w2.half(), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_an_fp16_gemm1_past_its_range_gives_the_kernels_zero_not_nan(activation):
    """act(gate) = 0 times an up half that overflowed to inf was NaN on the torch backend
    (the fused kernels keep float32 there: 0); the float64 reference gives 0."""
    x, w13, w2, tw, ti = _overflowing_fp16_call()
    out = moerunner.fused_moe(x, w13, w2, tw, ti, activation=activation, backend="torch")
    want = reference_moe(x, ExpertWeights(w13, w2), tw, ti, activation)
    assert torch.isfinite(out).all()
    assert_close(out, want, DTYPE_BOUND[torch.float16])


def test_a_nan_up_half_stays_nan():
    """The fix above does not hide a NaN that the input carries."""
    x, w13, w2, tw, ti = _overflowing_fp16_call()
    x[0, 1] = float("nan")
    w13[0, 17, 1] = 1.0  # the up row of unit 1 reads the NaN
    out = moerunner.fused_moe(x, w13, w2, tw, ti, backend="torch")
    assert out.isnan().any()


def test_a_refused_load_leaves_the_layer_as_it_was():
    """The correction bias was checked after the copy: a refused load left the infinite
    bias (and the rest of the state) in the layer, and every later load failed."""
    cfg = moerunner.MoeConfig(
        8, 16, 8, 2, routing=moerunner.RoutingConfig("sigmoid", True, correction_bias=True)
    )
    layer = moerunner.MoE(cfg, backend="torch")
    good = {k: v.clone() for k, v in layer.state_dict().items()}
    bad = {k: v.clone() for k, v in good.items()}
    bad["correction_bias"][3] = float("inf")
    bad["w13"].zero_()
    with pytest.raises(MoeInputError, match="correction_bias has NaN or infinite values"):
        layer.load_state_dict(bad)
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor, good[name]), name
    layer.load_state_dict({"w2": good["w2"] * 2}, strict=False)  # a later load works
    assert torch.equal(layer.w2, good["w2"] * 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(apply_router_weight_on_input="False"),
        dict(check_ids="no"),
        dict(gate_up_interleaved="False"),
    ],
    ids=["weight_on_input", "check_ids", "interleaved"],
)
def test_fused_moe_flags_must_be_bools(kwargs):
    """ "False" was read as True (apply_router_weight_on_input changed the output by 0.74)."""
    x, w13, w2 = torch.randn(3, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    topk = moerunner.select_experts(torch.randn(3, E), 1)
    (name,) = kwargs
    with pytest.raises(TypeError, match=f"{name} must be a bool, got str"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, **kwargs)


def test_moe_config_bias_must_be_a_bool():
    with pytest.raises(TypeError, match="bias must be a bool"):
        moerunner.MoeConfig(E, H, I, 1, bias="False")


@pytest.mark.parametrize("cast", ["to", "half"])
def test_the_correction_bias_stays_float32_when_the_layer_is_cast(cast):
    """``.to(bf16)`` rounded the float32 correction bias (0.5004 -> 0.5): a layer built in
    bf16 and one cast to it routed differently with the same state."""
    cfg = moerunner.MoeConfig(
        4, 16, 8, 1, routing=moerunner.RoutingConfig("sigmoid", True, correction_bias=True)
    )
    built = moerunner.MoE(cfg, dtype=torch.bfloat16, backend="torch")
    dtype = torch.bfloat16 if cast == "to" else torch.float16
    cast_layer = moerunner.MoE(cfg, backend="torch")
    cast_layer = cast_layer.to(dtype) if cast == "to" else cast_layer.half()
    assert cast_layer.correction_bias.dtype == torch.float32
    assert cast_layer.w13.dtype == dtype
    with torch.no_grad():
        built.correction_bias.copy_(torch.tensor([0.5, 0.5004, 0.0, 0.0]))
    cast_layer.load_state_dict(built.to(dtype).state_dict())
    assert cast_layer.correction_bias[1].item() == pytest.approx(0.5004, abs=1e-7)


def test_compiled_layer_refusal_reaches_the_caller():
    """The per-expert swiglu refusal was raised inside the traced graph: dynamo wrapped it
    (the message only in its debug context). Without fullgraph the MoeInputError reaches
    the caller; under fullgraph the error says that moerunner refused the call."""
    cfg = moerunner.MoeConfig(
        E, H, I, 2, activation=moerunner.Activation("swiglu_oai", alpha=torch.full((E,), 1.5))
    )
    layer = moerunner.MoE(cfg)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    with torch.no_grad():
        torch._dynamo.reset()
        with pytest.raises(MoeInputError, match="per-expert parameters"):
            torch.compile(layer)(x, logits)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="moerunner refused this call"):
            torch.compile(layer, fullgraph=True)(x, logits)


@pytest.mark.parametrize("scheme", ["int8", "int8_w8a16", "int8_g64"])
def test_finite_weights_at_float32s_top_dequantize_finite(scheme):
    """A scale of amax / 127 rounded up made 127 * scale inf for amax near float32's
    largest value; docs/quantization.md: never inf."""
    from moerunner.quant import dequantize, quantize

    w = torch.zeros(1, 1, 64)
    w[0, 0, 0] = torch.finfo(torch.float32).max
    back = dequantize(quantize(w, scheme))
    assert torch.isfinite(back).all()
    assert back[0, 0, 0].item() == pytest.approx(w[0, 0, 0].item(), rel=1 / 127)


@pytest.mark.parametrize("change", ["half", "assigning load"])
def test_a_cast_or_an_assigning_load_frees_the_old_experts_at_once(change):
    """The layer's views and the prepared memo kept the old expert memory alive until the
    next forward (a model cast to bf16 held both copies of every layer's experts)."""
    import gc
    import weakref

    layer = moerunner.MoE(moerunner.MoeConfig(E, H, I, K))
    with torch.no_grad():
        layer(torch.randn(T, H), torch.randn(T, E))
    old = weakref.ref(layer.w13.untyped_storage())
    if change == "half":
        layer.half()
    else:
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        layer.load_state_dict(state, assign=True)
    gc.collect()
    assert old() is None
    with torch.no_grad():  # and the layer still runs on its new weights
        out = layer(torch.randn(T, H, dtype=layer.w13.dtype), torch.randn(T, E))
    assert out.dtype == layer.w13.dtype and torch.isfinite(out).all()


# -- a third probe: the lifecycle of quantized layers (compile, .data writes, moves) --


def _quantized_pair(scheme: str, backend: str = "torch", dtype=torch.float32):
    """Two layers of one config quantized from different weights."""
    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=32, intermediate_size=32, top_k=K)
    layers = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        layers.append(moerunner.MoE(cfg, backend=backend, dtype=dtype).quantize_(scheme))
    return layers


def test_a_compiled_quantized_layer_runs_its_current_buffers():
    """The traced call read the tensors ``quantize_`` had built its weights over: a buffer
    assigned anew, or substituted by ``functional_call``, was ignored once compiled (outputs
    off by 0.8-1.5 relative) while the eager call saw it."""
    layer, other = _quantized_pair("int8_w8a16")
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(5, 32, generator=g), torch.randn(5, E, generator=g)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        first = compiled(x, logits)
        assert torch.equal(first, layer(x, logits))
        layer.w13_scale = layer.w13_scale * 2
        assert torch.equal(compiled(x, logits), layer(x, logits))
        assert not torch.equal(compiled(x, logits), first)
        theirs = dict(other.named_buffers())
        call = torch.compile(
            lambda b: torch.func.functional_call(layer, b, (x, logits)),
            fullgraph=True,
            backend="eager",
        )
        assert torch.equal(call(theirs), other(x, logits))


@pytest.mark.parametrize("scheme", ["mxfp4", "int4_g32", "int8_w8a16"])
def test_weights_changed_refreshes_what_was_prepared_from_held_buffers(scheme):
    """``MoE.weights_changed()`` after ``.data`` writes to held quantized buffers forgot
    nothing there: the triton backend's re-laid 4-bit weights stayed those of the old values."""
    from cases import interpreted_triton

    backend = "triton" if interpreted_triton() else "torch"
    layer, other = _quantized_pair(scheme, backend, torch.float16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g, dtype=torch.float16)
    logits = torch.randn(5, E, generator=g)
    with torch.no_grad():
        before = layer(x, logits)  # prepared
        for name, tensor in other.named_buffers():
            if name in dict(layer.named_buffers()) and not name.endswith("_scheme"):
                getattr(layer, name).data.copy_(tensor)
        layer.weights_changed()
        out = layer(x, logits)
        topk = moerunner.select_experts(logits, K)
        want = reference_moe(x.double(), other.quantized, topk.weights, topk.ids)
    assert not torch.equal(out, before)
    assert_close(out, want, DTYPE_BOUND[torch.float16])


def test_a_move_to_where_the_layer_is_keeps_its_prepared_weights():
    """A no-op ``.to()`` / ``.float()`` dropped every prepared form, and the third one warned
    that the caller passed new tensor objects each call."""
    import warnings

    cfg = moerunner.MoeConfig(num_experts=E, hidden_size=32, intermediate_size=32, top_k=K)
    plain = moerunner.MoE(cfg, backend="torch")
    (held,) = _quantized_pair("int8_w8a16")[:1]
    x, logits = torch.randn(5, 32), torch.randn(5, E)
    for layer in (plain, held):
        with torch.no_grad():
            want = layer(x, logits)
            weights = layer.expert_weights()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for _ in range(4):
                    layer.to("cpu").float()
                    assert torch.equal(layer(x, logits), want)
            assert layer.expert_weights() is weights
