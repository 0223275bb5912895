"""Runner hooks (``moerunner.hooks``) on every backend that declares them, on both paths of
the standard format.

The hooks under test add known tensors: ``gate_up`` adds ``P13[expert]`` to GEMM1's output
(exactly a w13 bias) and ``down`` adds ``c[token, slot] * P2[expert]`` to GEMM2's output (a
w2 bias scaled per (token, slot), so a wrong token or slot shows). The float64 reference is
``reference_moe`` with bias ``P13`` plus ``sum_s w[t, s] c[t, s] P2[ids[t, s]]``. fp32 bounds:
``DTYPE_BOUND`` (two fp32 GEMMs, the activation in fp32); quantized: plus
``ACTIVATION_QUANT_BOUND`` (``error_bound``).
"""

from __future__ import annotations

import pytest
import torch
from cases import cpu_backends, interpreted_triton

import moerunner
from moerunner import MoeInputError, MoeRunner
from moerunner.api import run_experts
from moerunner.backends.base import Capabilities
from moerunner.config import Activation
from moerunner.errors import BackendUnavailableError
from moerunner.hooks import HookRows, MoeHooks
from moerunner.testing import DTYPE_BOUND, assert_close, error_bound
from moerunner.weights import ExpertWeights

T, E, H, I, K = 7, 5, 32, 16, 2
BACKENDS = cpu_backends()  # CPU tensors (see cases.cpu_backends)


def _case(act="silu", interleaved=False, seed=0):
    act = Activation.of(act)
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if act.gated else I
    w13 = torch.randn(E, rows, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    x = torch.randn(T, H, generator=g)
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    p13 = torch.randn(E, rows, generator=g)
    p2 = torch.randn(E, H, generator=g)
    c = torch.randn(T, K, generator=g)
    return x, ExpertWeights(w13, w2, gate_up_interleaved=interleaved), topk, act, p13, p2, c


def _hooks(p13, p2, c, seen=None):
    def gate_up(h, x_rows, rows: HookRows):
        if seen is not None:
            seen.append((h.shape, x_rows.shape, rows))
        ok = rows.expert >= 0
        e = rows.expert.clamp(min=0).long()
        return torch.where(ok[:, None], h + p13[e], h)

    def down(y, a_rows, rows: HookRows):
        ok = rows.expert >= 0
        e = rows.expert.clamp(min=0).long()
        scale = c[rows.token.clamp(min=0), rows.slot.clamp(min=0)]
        return torch.where(ok[:, None], y + scale[:, None] * p2[e], y)

    return MoeHooks(gate_up=gate_up, down=down)


def _reference(x, weights, topk, act, p13, p2, c):
    biased = ExpertWeights(weights.w13, weights.w2, p13, None, weights.gate_up_interleaved)
    ref = moerunner.reference_moe(x, biased, topk.weights, topk.ids, act)
    ids = topk.ids.long()
    valid = (ids >= 0) & (ids < E)
    extra = topk.weights.double() * c.double() * valid
    return ref + torch.einsum("tk,tkh->th", extra, p2.double()[ids.clamp(min=0)])


def _run(backend, x, weights, topk, act, hooks, force_permute=False, **kw):
    runner = MoeRunner(backend, force_permute=force_permute)
    return run_experts(runner, weights, x, topk.weights, topk.ids, act, hooks=hooks, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("force_permute", [False, True])
@pytest.mark.parametrize(
    "act,interleaved",
    [
        ("silu", False),
        ("swiglu_oai", True),
        ("relu2", False),
        ("gelu", True),
        ("gelu_tanh", False),
        ("silu_no_mul", False),
        ("gelu_no_mul", False),
    ],  # fmt: skip
)
def test_hooks_add_known_tensors(backend, force_permute, act, interleaved):
    x, weights, topk, act, p13, p2, c = _case(act, interleaved)
    seen = []
    out = _run(backend, x, weights, topk, act, _hooks(p13, p2, c, seen), force_permute)
    assert_close(out, _reference(x, weights, topk, act, p13, p2, c), DTYPE_BOUND[torch.float32])
    ((h_shape, x_shape, rows),) = seen
    assert h_shape[1] == weights.w13.shape[1] and x_shape[1] == H
    valid = rows.expert >= 0
    assert int(valid.sum()) == T * K  # every (token, slot) pair seen once, with its token
    pairs = sorted(zip(rows.token[valid].tolist(), rows.slot[valid].tolist(), strict=True))
    assert pairs == [(t, s) for t in range(T) for s in range(K)]
    assert all(int(topk.ids[t, s]) == int(e) for t, s, e in zip(
        rows.token[valid].tolist(), rows.slot[valid].tolist(), rows.expert[valid].tolist(),
        strict=True))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_hooks_with_skipped_ids_biases_and_fp16(backend):
    x, weights, topk, act, p13, p2, c = _case(seed=1)
    ids = topk.ids.clone()
    ids[0, 1] = -1
    ids[3, 0] = -1
    topk = moerunner.TopK(topk.weights, ids)
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    biased = ExpertWeights(weights.w13, weights.w2, b13, b2)
    out = _run(backend, x, biased, topk, act, _hooks(p13, p2, c))
    ref = _reference(x, ExpertWeights(weights.w13, weights.w2), topk, act, p13 + b13, p2, c)
    ref += moerunner.reference_moe(
        x, ExpertWeights(torch.zeros_like(weights.w13), weights.w2, None, b2), topk.weights,
        topk.ids, act,
    )  # fmt: skip
    assert_close(out, ref, DTYPE_BOUND[torch.float32])
    half = ExpertWeights(weights.w13.half(), weights.w2.half())
    out = _run(backend, x.half(), half, topk, act, _hooks(p13, p2, c))
    assert_close(out, _reference(x.half(), half, topk, act, p13, p2, c), DTYPE_BOUND[torch.float16])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", ["fp8_channel", "int8_w8a16"])
def test_hooks_on_quantized_weights(backend, scheme):
    x, weights, topk, act, p13, p2, c = _case(seed=2)
    q = ExpertWeights(
        moerunner.quantize(weights.w13, scheme), moerunner.quantize(weights.w2, scheme)
    )
    out = _run(backend, x, q, topk, act, _hooks(p13, p2, c))
    quantizes = q.w13.scheme.activation_format != "none"
    assert_close(
        out, _reference(x, q, topk, act, p13, p2, c), error_bound(torch.float32, quantizes)
    )


def test_auto_picks_a_backend_that_runs_hooks_and_others_refuse():
    registry = moerunner.default_registry().copy()
    torch_backend = registry.backends["torch"]
    caps = torch_backend.capabilities
    no_hooks = Capabilities(caps.devices, caps.dtypes, caps.schemes, caps.activations, hooks=False)
    registry.register_backend(torch_backend.variant(name="plain", capabilities=no_hooks))
    x, weights, topk, act, p13, p2, c = _case()
    hooks = _hooks(p13, p2, c)
    runner = MoeRunner("auto", registry=registry, preference={"cpu": ("plain", "torch")})
    out = run_experts(runner, weights, x, topk.weights, topk.ids, act, hooks=hooks)
    assert runner.backend == "torch"
    assert_close(out, _reference(x, weights, topk, act, p13, p2, c), DTYPE_BOUND[torch.float32])
    run_experts(runner, weights, x, topk.weights, topk.ids, act)  # no hooks: the first one
    assert runner.backend == "plain"
    with pytest.raises(BackendUnavailableError, match="hooks"):
        run_experts(
            MoeRunner("plain", registry=registry), weights, x, topk.weights, topk.ids, act,
            hooks=hooks,
        )  # fmt: skip


def test_bad_hooks_and_formats_are_refused():
    x, weights, topk, act, p13, p2, c = _case()
    with pytest.raises(TypeError, match="hooks must be a MoeHooks"):
        _run("torch", x, weights, topk, act, lambda *a: a[0])
    with pytest.raises(TypeError, match="gate_up must be callable"):
        MoeHooks(gate_up=3)
    short = MoeHooks(down=lambda y, a, rows: y[:1])
    with pytest.raises(MoeInputError, match="down must return a tensor of shape"):
        _run("torch", x, weights, topk, act, short)
    from moerunner.dispatch.formats import PermutedDispatchOutput
    from moerunner.runner import prepare_for_backend

    runner = MoeRunner("torch")
    prepared = prepare_for_backend(runner.registry.backends["torch"], weights, weights.spec(act))
    grouped = PermutedDispatchOutput(
        hidden_states=x, expert_offsets=torch.tensor([0, 7, 7, 7, 7, 7])
    )
    with pytest.raises(MoeInputError, match="hooks need the 'standard' dispatch format"):
        runner.run(grouped, prepared, MoeHooks())


@pytest.mark.parametrize(
    "act,interleaved", [("silu", False), ("swiglu_oai", True), ("relu2", False)]
)
def test_gradients_pass_through_the_hooks(act, interleaved):
    """Grad mode with the hidden states requiring grad and hooks set: this raised ("hooks
    have no backward"). The call now runs the differentiable path with the hooks, and the
    gradients of the hidden states, experts, routing weights and of the tensors the hooks
    read match autograd of the float64 reference (fp32 bound)."""
    x, weights, topk, act, p13, p2, c = _case(act, interleaved, seed=3)
    leaves = (x, weights.w13, weights.w2, topk.weights, p13, p2, c)
    got = [t.clone().requires_grad_() for t in leaves]
    want = [t.double().requires_grad_() for t in leaves]
    proj = torch.linspace(-1, 1, H, dtype=torch.float64)
    for side in (got, want):
        gx, g13, g2, gw, g_p13, g_p2, g_c = side
        w = ExpertWeights(g13, g2, gate_up_interleaved=interleaved)
        tk = moerunner.TopK(gw, topk.ids)
        if side is got:
            out = _run("auto", gx, w, tk, act, _hooks(g_p13, g_p2, g_c))
            assert out.dtype == x.dtype and out.requires_grad
        else:
            out = _reference(gx, w, tk, act, g_p13, g_p2, g_c)
        (out.double() * proj).sum().backward()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g.grad, w.grad, DTYPE_BOUND[torch.float32], what=f"gradient of leaf {i}")


def test_triton_refuses_a_hook_whose_result_requires_grad():
    """A plain hook closing over a tensor that requires grad (no ``tensors()`` method, so
    ``MoeHooks.needs_grad`` cannot see it): triton applied it and dropped the graph, so the
    tensor got no gradient. Triton now refuses such a result by name; the torch backend
    carries its gradient."""
    if not interpreted_triton():
        pytest.skip("CPU tensors: triton runs them under its interpreter only")
    x, weights, topk, act, p13, p2, c = _case()
    trained = p2.clone().requires_grad_()
    hooks = _hooks(p13, trained, c)
    with pytest.raises(MoeInputError, match="down returned a tensor that requires grad"):
        _run("triton", x, weights, topk, act, hooks)
    _run("torch", x, weights, topk, act, hooks).sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens_call_no_hook(backend):
    x, weights, topk, act, p13, p2, c = _case()
    called = []
    hooks = MoeHooks(gate_up=lambda h, x, rows: called.append(1) or h)
    empty = moerunner.TopK(topk.weights[:0], topk.ids[:0])
    out = _run(backend, x[:0], weights, empty, act, hooks)
    assert out.shape == (0, H) and not called
