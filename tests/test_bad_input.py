"""Bad input raises ValueError/TypeError naming the argument; never an AssertionError."""

from __future__ import annotations

import pytest
import torch

import moerunner
from moerunner import BackendUnavailableError, MoeInputError

T, H, I, E, K = 4, 16, 8, 4, 2


def args(**override):
    base = dict(
        hidden_states=torch.randn(T, H),
        w13=torch.randn(E, 2 * I, H),
        w2=torch.randn(E, H, I),
        topk_weights=torch.rand(T, K),
        topk_ids=torch.randint(0, E, (T, K), dtype=torch.int32),
    )
    base.update(override)
    return base


def call(kwargs, **options):
    a = dict(kwargs)
    return moerunner.fused_moe(
        a.pop("hidden_states"),
        a.pop("w13"),
        a.pop("w2"),
        a.pop("topk_weights"),
        a.pop("topk_ids"),
        **a,
        **options,
    )


BAD = [
    ("hidden_rank", dict(hidden_states=torch.randn(T, H, 1)), MoeInputError, "hidden_states"),
    ("w13_rank", dict(w13=torch.randn(2 * I, H)), MoeInputError, "w13"),
    ("E_mismatch", dict(w2=torch.randn(E + 1, H, I)), MoeInputError, "E="),
    ("H_mismatch", dict(w2=torch.randn(E, H + 1, I)), MoeInputError, "H="),
    (
        "I_mismatch",
        dict(w2=torch.randn(E, H, I + 1)),
        MoeInputError,
        r"w13 \(16 rows\) and w2 \(I=9\) disagree",
    ),
    ("hidden_H", dict(hidden_states=torch.randn(T, H + 2)), MoeInputError, "hidden_states"),
    ("float_ids", dict(topk_ids=torch.zeros(T, K)), TypeError, "topk_ids"),
    (
        "ids_too_big",
        dict(topk_ids=torch.full((T, K), E, dtype=torch.int32)),
        MoeInputError,
        "topk_ids",
    ),
    (
        "ids_below_minus_one",
        dict(topk_ids=torch.full((T, K), -2, dtype=torch.int32)),
        MoeInputError,
        "topk_ids",
    ),
    (
        # top_k > E itself is accepted (an expert-parallel shard); its ids are still checked.
        "topk_gt_E_ids_out_of_range",
        dict(
            topk_weights=torch.rand(T, E + 1), topk_ids=torch.full((T, E + 1), E, dtype=torch.int32)
        ),
        MoeInputError,
        "topk_ids",
    ),
    ("shape_mismatch", dict(topk_weights=torch.rand(T, K + 1)), MoeInputError, "topk_weights"),
    (
        "T_mismatch",
        dict(topk_weights=torch.rand(T + 1, K), topk_ids=torch.zeros(T + 1, K, dtype=torch.int32)),
        MoeInputError,
        "T=",
    ),
    (
        "int_weights",
        dict(topk_weights=torch.ones(T, K, dtype=torch.int32)),
        TypeError,
        "topk_weights",
    ),
    ("dtype_mismatch", dict(w13=torch.randn(E, 2 * I, H, dtype=torch.float64)), TypeError, "w13"),
    (
        "weights_vs_hidden_dtype",
        dict(hidden_states=torch.randn(T, H, dtype=torch.bfloat16)),
        TypeError,
        "w13 dtype",
    ),
    (
        "int_hidden",
        dict(hidden_states=torch.ones(T, H, dtype=torch.int32)),
        TypeError,
        "hidden_states",
    ),
    ("not_tensor", dict(topk_ids=[[0, 1]] * T), TypeError, "topk_ids"),
    ("bias_shape", dict(w13_bias=torch.randn(E, I)), MoeInputError, "w13_bias"),
    ("w2_bias_shape", dict(w2_bias=torch.randn(E, H + 1)), MoeInputError, "w2_bias"),
]


@pytest.mark.parametrize("name, override, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_clearly(name, override, error, match):
    with pytest.raises(error, match=match) as info:
        call(args(**override))
    assert not isinstance(info.value, AssertionError)


def test_bad_activation_options():
    with pytest.raises(MoeInputError, match="activation"):
        call(args(), activation="tanh")
    with pytest.raises(MoeInputError, match="swiglu"):
        call(args(), activation="silu", swiglu_limit=3.0)
    with pytest.raises(MoeInputError, match=r"w13 \(16 rows\) and w2 \(I=8\) disagree"):
        call(args(), activation="relu2")  # relu2 needs w13 [E, I, H]
    with pytest.raises(MoeInputError, match="interleaved"):
        call(args(w13=torch.randn(E, I, H)), activation="relu2", gate_up_interleaved=True)


def test_unknown_backend_lists_registered_ones():
    with pytest.raises(BackendUnavailableError, match="torch"):
        call(args(), backend="cutlass9000")


def test_unsupported_request_names_every_backend():
    registry = moerunner.default_registry()
    # A registry of its own, with a backend that claims only CUDA, keeps the message fixed.
    from moerunner.backends.base import Backend, Capabilities

    class CudaOnly(Backend):
        name = "cuda_only"
        capabilities = Capabilities(
            frozenset({"cuda"}),
            frozenset({torch.float32}),
            frozenset({"fp32"}),
            frozenset({"silu"}),
        )

    local = moerunner.Registry(permutes=dict(registry.permutes))
    local.register_backend(registry.backends["torch"])
    local.register_backend(CudaOnly().variant(core=lambda *a: None))
    from moerunner.backends.base import MoeProblem

    w = moerunner.ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    spec = w.spec(moerunner.Activation("silu"))
    problem = MoeProblem.of(torch.randn(T, H), w, spec, "standard")
    with pytest.raises(BackendUnavailableError) as info:
        local.select(problem, "cuda_only")
    message = str(info.value)
    assert "cuda_only: rejected: device 'cpu'" in message and "torch: can serve" in message
    assert local.select(problem).backend.name == "torch"


@pytest.mark.parametrize("which", ["hidden_states", "topk_weights", "w13_bias"])
def test_a_list_for_a_tensor_is_named_with_grad_mode_on(which):
    # The grad-mode check read .requires_grad of every argument before the type checks: a
    # list gave AttributeError (grad mode is on by default, so every such call did).
    assert torch.is_grad_enabled()
    kw = args()
    if which == "w13_bias":
        kw["w13_bias"] = torch.zeros(E, 2 * I).tolist()
    else:
        kw[which] = kw[which].tolist()
    with pytest.raises((TypeError, MoeInputError), match=which):
        call(kw)
