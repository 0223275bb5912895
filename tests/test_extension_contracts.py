"""Extending moerunner: a user's backend or dispatcher (a probe that followed the docs to
register its own, 2026-12-06). Each test registers into a copy of the default registry, or
into the default registry with the registration undone after it.

The backend below is a per-expert loop over canonical weights; its results are held to an
independent float64 computation of the same experts (fp32 inputs: within 1e-5 of the
largest output, fp32 rounding of sums over H = 32 and I = 16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moerunner
from moerunner import ExtensionContractError, MoeInputError
from moerunner.backends.base import Backend, Capabilities
from moerunner.weights import PreparedWeights

E, H, I, T, K = 4, 32, 16, 8, 2


def _loop(d, p):
    """Per-expert loop over the prepared ``w13`` / ``w2`` (gate rows first)."""
    x, ids, w = d.hidden_states, d.topk.ids, d.topk.weights
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(p.spec.num_experts):
        t, s = torch.nonzero(ids == e, as_tuple=True)
        h = x[t].float() @ p.tensors["w13"][e].float().T
        y = (F.silu(h[:, :I]) * h[:, I:]) @ p.tensors["w2"][e].float().T
        out.index_add_(0, t, y * w[t, s, None])
    return out.to(x.dtype)


class Loop(Backend):
    def __init__(self, name="loop", op=_loop, swap=False):
        self.name, self.fused_ops, self.swap = name, {"standard": op}, swap
        self.capabilities = Capabilities(
            devices=frozenset({"cpu"}),
            dtypes=frozenset({torch.float32}),
            schemes=["fp32"],
            activations=frozenset({"silu"}),
        )

    def prepare_weights(self, weights, spec):
        p = PreparedWeights(backend=self.name, source=weights, spec=spec)
        w13 = weights.w13
        if self.swap:  # another layout: up rows first (its op reads them so)
            w13 = torch.cat([w13[:, I:], w13[:, :I]], 1)
        p.tensors.update(w13=w13, w2=weights.w2)
        return p


def _up_first_loop(d, p):
    w = p.tensors["w13"]
    swapped = PreparedWeights(p.backend, None, p.spec)
    swapped.tensors.update(w13=torch.cat([w[:, I:], w[:, :I]], 1), w2=p.tensors["w2"])
    return _loop(d, swapped)


def _case():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / 6
    w2 = torch.randn(E, H, I, generator=g) / 4
    topk = moerunner.select_experts(torch.randn(T, E, generator=g), K)
    return x, w13, w2, topk


def _reference(x, w13, w2, topk):
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for s in range(K):
            e = int(topk.ids[t, s])
            h = w13[e].double() @ x[t].double()
            y = w2[e].double() @ (F.silu(h[:I]) * h[I:])
            out[t] += float(topk.weights[t, s]) * y
    return out


def _close(got, want):
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), "not the experts"


@pytest.fixture
def default_registry():
    """The default registry, with whatever a test registers removed after it."""
    registry = moerunner.DEFAULT_REGISTRY
    backends, dispatchers = dict(registry.backends), dict(registry.dispatchers)
    yield registry
    registry.backends.clear()
    registry.backends.update(backends)
    registry.dispatchers.clear()
    registry.dispatchers.update(dispatchers)
    registry.forget_choices()


def test_a_replaced_backend_prepares_the_weights_again(default_registry):
    """The forms prepared for the old object were kept under the name and served to the new
    object's op, which reads another layout: 0.87 off, silently."""
    x, w13, w2, topk = _case()
    want = _reference(x, w13, w2, topk)
    default_registry.register_backend(Loop())
    _close(moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="loop"), want)
    default_registry.register_backend(Loop(op=_up_first_loop, swap=True), replace=True)
    _close(moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="loop"), want)


def test_a_malformed_backend_is_refused_where_it_registers():
    """It was accepted, then broke every later call's choice, of any backend, and
    ``moerunner info``, with an AttributeError that did not name it."""
    registry = moerunner.DEFAULT_REGISTRY.copy()

    class NoCapabilities(Backend):
        name = "broken"

        def __init__(self):
            self.fused_ops = {"standard": _loop}

    with pytest.raises(ExtensionContractError, match="'broken': capabilities must be"):
        registry.register_backend(NoCapabilities())
    nothing = Loop(name="nothing")
    nothing.fused_ops = {}
    with pytest.raises(ExtensionContractError, match="neither fused_ops nor a core"):
        registry.register_backend(nothing)
    assert "broken" not in registry.backends and "nothing" not in registry.backends


def test_a_backend_whose_verdict_is_malformed_serves_nothing_and_breaks_nothing(
    default_registry,
):
    """A ``supports`` returning a bare bool broke every call (``cannot unpack``), even one
    naming another backend; now that backend alone serves nothing, the reason says why."""
    x, w13, w2, topk = _case()

    class BareBool(Loop):
        def supports(self, problem):
            return True

    class Raises(Loop):
        def available(self):
            raise RuntimeError("driver missing")

    default_registry.register_backend(BareBool(name="bare"))
    default_registry.register_backend(Raises(name="raises"))
    want = _reference(x, w13, w2, topk)
    _close(moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch"), want)
    with pytest.raises(moerunner.BackendUnavailableError, match=r"supports\(\) returned True"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="bare")
    with pytest.raises(moerunner.BackendUnavailableError, match="raised RuntimeError: driver"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="raises")


@pytest.mark.parametrize(
    "op, match",
    [
        (lambda d, p: _loop(d, p).double(), r"returned \(8, 32\) torch.float64"),
        (lambda d, p: _loop(d, p)[:1], r"returned \(1, 32\) torch.float32"),
        (lambda d, p: [1.0], "returned list"),
    ],
    ids=["dtype", "shape", "type"],
)
def test_a_backend_output_outside_the_contract_is_named(default_registry, op, match):
    """Returned to the caller as it was (float64 for fp32 inputs, one row for eight)."""
    x, w13, w2, topk = _case()
    default_registry.register_backend(Loop(name="bad_output", op=op))
    with pytest.raises(ExtensionContractError, match="'bad_output': its fused op " + match):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="bad_output")


def test_prepare_weights_must_return_prepared_weights(default_registry):
    x, w13, w2, topk = _case()

    class DictPrepared(Loop):
        def prepare_weights(self, weights, spec):
            return {"w13": weights.w13, "w2": weights.w2}

    default_registry.register_backend(DictPrepared(name="dict_prep"))
    with pytest.raises(ExtensionContractError, match="prepare_weights returned a dict"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="dict_prep")


def test_declining_op_and_unregistering_are_said_as_such(default_registry):
    x, w13, w2, topk = _case()
    default_registry.register_backend(Loop(name="declines", op=lambda d, p: None))
    with pytest.raises(moerunner.BackendUnavailableError, match="its fused op declined"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="declines")
    default_registry.register_backend(Loop(name="gone"))
    moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="gone")
    default_registry.unregister_backend("gone")
    with pytest.raises(moerunner.BackendUnavailableError, match="'gone' is not registered"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="gone")
    with pytest.raises(moerunner.BackendUnavailableError, match="'gone' is not registered"):
        default_registry.unregister_backend("gone")


def test_dispatcher_registration_is_checked():
    from moerunner.dispatch.builtin import default_dispatchers

    registry = moerunner.DEFAULT_REGISTRY.copy()
    with pytest.raises(TypeError, match="factory must be callable"):
        registry.register_dispatcher("nc", 42)
    with pytest.raises(ValueError, match="'standard' is already registered; pass replace=True"):
        registry.register_dispatcher("standard", lambda setup: object())
    registry.register_dispatcher("standard", default_dispatchers()["standard"])  # the same one
    registry.register_dispatcher("odd", lambda setup: object())
    cfg = moerunner.MoeConfig(E, H, I, K)
    with pytest.raises(ExtensionContractError, match="'odd': its factory returned a object"):
        moerunner.MoE(cfg, dispatcher="odd", registry=registry)
    registry.unregister_dispatcher("odd")
    with pytest.raises(MoeInputError, match="dispatcher must be one of"):
        registry.unregister_dispatcher("odd")


def test_the_standard_dispatcher_under_another_name_is_the_plain_layer():
    """The layer decided "one process, plain layer" by the name 'standard': the same factory
    under another name made it an expert-parallel layer (inference only; across ranks, a
    gloo abort instead of the token-count error)."""
    from moerunner.dispatch.builtin import default_dispatchers

    registry = moerunner.DEFAULT_REGISTRY.copy()
    registry.register_dispatcher("my_standard", default_dispatchers()["standard"])
    cfg = moerunner.MoeConfig(E, H, I, K)
    torch.manual_seed(0)
    plain = moerunner.MoE(cfg, backend="torch")
    named = moerunner.MoE(cfg, backend="torch", dispatcher="my_standard", registry=registry)
    named.load_state_dict(plain.state_dict())
    x, logits = torch.randn(T, H), torch.randn(T, E)
    assert torch.equal(named(x, logits), plain(x, logits))  # grad mode on: was refused


def test_a_layer_registry_with_its_own_backends_is_named_on_the_op_path():
    """Grad-mode and compiled calls go through the custom op, which looked the backend up in
    the default registry: 'not registered' for a backend registered in the layer's own, or
    another object of the same name, silently."""
    registry = moerunner.DEFAULT_REGISTRY.copy()
    registry.register_backend(Loop(name="mine_only"))
    cfg = moerunner.MoeConfig(E, H, I, K)
    layer = moerunner.MoE(cfg, backend="mine_only", registry=registry, dtype=torch.float32)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    with torch.no_grad():
        layer(x, logits)  # eager inference runs the layer's registry
    with pytest.raises(MoeInputError, match=r"serves backend\(s\) \['mine_only'\]"):
        layer(x, logits)
    # A copy with nothing of its own replaced compiles and trains as before.
    same = moerunner.MoE(cfg, backend="torch", registry=moerunner.DEFAULT_REGISTRY.copy())
    same(x, logits).sum().backward()


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("dtypes", {"bfloat16"}, TypeError, "dtypes must hold dtype values"),
        ("activations", {"slu"}, ValueError, r"\['slu'\] not among moerunner's activations"),
        ("devices", "cpu", TypeError, "devices must be a set"),
    ],
)
def test_capabilities_refuse_typos(field, value, error, match):
    """Accepted before; the mistake showed only as "not supported" on every call."""
    given = dict(devices={"cpu"}, dtypes={torch.float32}, schemes=["fp32"], activations={"silu"})
    given[field] = value
    with pytest.raises(error, match=match):
        Capabilities(**given)


def test_fused_moe_takes_a_registry():
    """fused_moe chose from the default registry only: a backend registered in a copy could
    not be called, and a replaced 'torch' backend was bypassed, silently, by calls that
    need gradients (they run moerunner's own differentiable ops)."""
    x, w13, w2, topk = _case()
    want = _reference(x, w13, w2, topk)
    registry = moerunner.DEFAULT_REGISTRY.copy()
    registry.register_backend(Loop(name="mine_only"))
    call = (x, w13, w2, topk.weights, topk.ids)
    _close(moerunner.fused_moe(*call, backend="mine_only", registry=registry), want)
    logits = torch.randn(T, E)
    routed = moerunner.fused_moe_from_logits(
        x, logits, w13, w2, K, backend="mine_only", registry=registry
    )
    again = moerunner.select_experts(logits, K)
    _close(routed, _reference(x, w13, w2, again))
    with pytest.raises(moerunner.BackendUnavailableError, match="mine_only"):
        moerunner.fused_moe(*call, backend="mine_only")  # the default registry has none

    # Traced: the custom op looks backends up in the default registry, so it is refused.
    @torch.compile(backend="eager")
    def traced(x):
        return moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, registry=registry)

    with pytest.raises(MoeInputError, match="the registry given to fused_moe serves"):
        traced(x)
    same = moerunner.DEFAULT_REGISTRY.copy()  # nothing replaced: traced as before
    traced_same = torch.compile(backend="eager")(
        lambda x: moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, registry=same)
    )
    _close(traced_same(x), want)
    whole = torch.compile(backend="eager", fullgraph=True)(  # no graph break for the check
        lambda x: moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, registry=same)
    )
    _close(whole(x), want)

    # Gradients: a registry whose 'torch' is another object is refused, not bypassed.
    from moerunner.backends.torch_native import TorchBackend

    class MyTorch(TorchBackend):
        pass

    mine = moerunner.DEFAULT_REGISTRY.copy()
    mine.register_backend(MyTorch(), replace=True)
    xg = x.clone().requires_grad_()
    with pytest.raises(MoeInputError, match="serves backend 'torch' with MyTorch"):
        moerunner.fused_moe(xg, w13, w2, topk.weights, topk.ids, registry=mine)
    cfg = moerunner.MoeConfig(E, H, I, K)
    layer = moerunner.MoE(cfg, backend="torch", registry=mine, dtype=torch.float32)
    with pytest.raises(MoeInputError, match="serves backend 'torch' with MyTorch"):
        layer(x, logits)  # parameters require grad, grad mode on
    with torch.no_grad():
        layer(x, logits)  # inference runs the registry's own
    grads = moerunner.fused_moe(xg, w13, w2, topk.weights, topk.ids, registry=same)
    grads.sum().backward()
    assert xg.grad is not None and bool(xg.grad.abs().sum() > 0)


# A second probe that followed the docs to extend the library (2026-12-07).


def test_a_backend_handing_on_another_backends_weights_is_named(default_registry):
    """A backend wrapping the torch backend returned what torch prepared: calls then ran
    torch's op, never the wrapper's (its x2 here was silently skipped). The preparing
    backend's own name on the prepared weights is the contract; set, the wrapper runs."""
    import dataclasses

    x, w13, w2, topk = _case()
    want = _reference(x, w13, w2, topk)
    inner = default_registry.backends["torch"]

    class Wrap(Loop):
        def __init__(self, name, rename):
            super().__init__(name, op=lambda d, p: inner.fused_ops["standard"](d, p) * 2)
            self.rename = rename

        def prepare_weights(self, weights, spec):
            prepared = inner.prepare_weights(weights, spec)
            return dataclasses.replace(prepared, backend=self.name) if self.rename else prepared

    default_registry.register_backend(Wrap("hands_on", rename=False))
    with pytest.raises(ExtensionContractError, match="'hands_on'.* prepared for 'torch'"):
        moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="hands_on")
    default_registry.register_backend(Wrap("wraps", rename=True))
    got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="wraps")
    _close(got, 2 * want)


def test_info_lists_a_backend_whose_verdict_raises(default_registry, capsys, tmp_path):
    """``moerunner info`` called ``available()`` itself: a raising extension crashed it
    (RuntimeError), a bare bool made it fail to unpack. It lists them as the choice reads
    them: unavailable, with why; the other backends are listed as before."""
    import json

    from moerunner.cli import main

    class Raises(Loop):
        def available(self):
            raise RuntimeError("driver missing")

    class BareBool(Loop):
        def available(self):
            return True

    default_registry.register_backend(Raises(name="raises"))
    default_registry.register_backend(BareBool(name="bare"))
    assert main(["info", "--json", str(tmp_path / "info.json")]) == 0
    out = capsys.readouterr().out
    assert "[raises] NOT available: available() raised RuntimeError: driver missing" in out
    assert "[bare] NOT available: available() returned True, not (bool, str)" in out
    record = json.loads((tmp_path / "info.json").read_text())["backends"]
    assert record["torch"]["available"] and not record["raises"]["available"]


def test_a_choice_reads_one_copy_of_the_backends(default_registry):
    """Another thread registering a backend while a call's choice went over the backends
    failed that call with "dictionary changed size during iteration" (7 of 390 calls in a
    threaded probe). A ``supports`` that registers one makes the interleaving certain."""
    x, w13, w2, topk = _case()
    want = _reference(x, w13, w2, topk)
    made = []

    class RegistersMeanwhile(Loop):
        def supports(self, problem):
            made.append(Loop(name=f"late{len(made)}"))
            default_registry.register_backend(made[-1])
            return True, ""

    default_registry.register_backend(RegistersMeanwhile(name="a_first"))
    _close(moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="torch"), want)
    _close(moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="a_first"), want)
    assert made and all(m.name in default_registry.backends for m in made)


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("align_h", 0, ValueError),
        ("align_h", "8", ValueError),
        ("align_i", -4, ValueError),
        ("align_i", True, ValueError),
        ("biases", "no", TypeError),
        ("hooks", 1, TypeError),
    ],
)
def test_capabilities_refuse_malformed_alignment_and_flags(field, value, error):
    """align_h 0 divided by zero inside the padding of every call, "8" failed there with a
    TypeError; -4 and a str flag were taken silently."""
    given = dict(devices={"cpu"}, dtypes={torch.float32}, schemes=["fp32"], activations={"silu"})
    with pytest.raises(error, match=f"Capabilities.{field} must be"):
        Capabilities(**given, **{field: value})


def test_auto_is_not_a_backend_name():
    """A backend registered as "auto" could never be called: the name asks for the choice."""
    registry = moerunner.DEFAULT_REGISTRY.copy()
    with pytest.raises(ValueError, match="'auto' names the automatic choice"):
        registry.register_backend(Loop(name="auto"))
    assert "auto" not in registry.backends


def test_reference_names_its_bad_arguments():
    """The public float64 reference failed on raw tensors with AttributeError, on a hidden
    size mismatch with a matmul error, and skipped out-of-range ids silently where the
    runner's checked calls refuse them."""
    from moerunner.weights import ExpertWeights

    x, w13, w2, topk = _case()
    weights = ExpertWeights(w13, w2)
    assert torch.allclose(
        moerunner.reference_moe(x, weights, topk.weights, topk.ids), _reference(x, w13, w2, topk)
    )
    with pytest.raises(TypeError, match="weights must be an ExpertWeights"):
        moerunner.reference_moe(x, w13, topk.weights, topk.ids)
    with pytest.raises(TypeError, match="topk_weights must be a tensor, got TopK"):
        moerunner.reference_moe(x, weights, topk, topk.ids)
    with pytest.raises(MoeInputError, match=r"H = 32 \(the weights' hidden size\), got \(8, 16\)"):
        moerunner.reference_moe(x[:, :16], weights, topk.weights, topk.ids)
    ids = topk.ids.clone()
    ids[2, 1] = E + 10
    with pytest.raises(
        MoeInputError, match=r"topk_ids must be in \[-1, E=4\), got values in \[0, 14\]"
    ):
        moerunner.reference_moe(x, weights, topk.weights, ids)
    with pytest.raises(TypeError, match="topk_ids must be"):
        moerunner.reference_moe(x, weights, topk.weights, topk.ids.float())
    ids[2, 1] = -1  # an empty slot is skipped
    empty = moerunner.reference_moe(x, weights, topk.weights, ids)
    assert torch.isfinite(empty).all()


def test_replacing_a_backend_does_not_warn_about_new_tensor_objects(default_registry, monkeypatch):
    """A notebook cell re-run (replace the backend, call on the same weights) three times
    warned "prepared ... 3 times, each for new tensor objects": the objects were the same,
    only the backend object was new, and preparing anew for it is by design."""
    import warnings

    import moerunner.runner as runner_module

    monkeypatch.setattr(runner_module, "_REPEATS_WARNED", [False])
    x, w13, w2, topk = _case()
    want = _reference(x, w13, w2, topk)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            default_registry.register_backend(Loop(name="rerun"), replace=True)
            got = moerunner.fused_moe(x, w13, w2, topk.weights, topk.ids, backend="rerun")
            _close(got, want)
