"""transformers models with moerunner experts under torch.compile(fullgraph=True), on CPU.

The decode step of ``generate(..., cache_implementation="static")`` is compiled by
transformers itself (``compile_config``); greedy tokens must equal the eager generate with
the same experts, for plain and quantized experts. ``aot_eager`` keeps CPU compile time low:
it traces the whole graph (a graph break raises under ``fullgraph=True``) and runs the ops'
fake implementations, as inductor does, without generating code.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner.testing import assert_close  # noqa: E402

from ._tiny_models import Recorder, build, compiled_static_generate  # noqa: E402

NEW_TOKENS = 6


def _ids(length: int = 6) -> torch.Tensor:
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_model_forward_compiles_fullgraph(family):
    torch._dynamo.reset()
    model = build(family, implementation="moerunner")  # never run eagerly before tracing
    recorder = Recorder()
    compiled = torch.compile(model.forward, fullgraph=True, backend=recorder)
    ids = _ids()
    with torch.no_grad():
        out = compiled(ids).logits
        ref = model(ids).logits
    assert recorder.moerunner_calls() == [model.config.num_hidden_layers]  # one op per layer
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_model_never_run_eagerly_compiles_with_dynamic_shapes(family):
    """With ``dynamic=True`` Dynamo restarts its analysis of a frame; the first pass filled
    the layer's description, so the second took the other branch of ``traced_layout``
    (SpeculationLogDivergence). Traced, a layer is described without caching it."""
    torch._dynamo.reset()
    model = build(family, implementation="moerunner")
    recorder = Recorder()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=True, backend=recorder)
    inputs = [_ids(length) for length in (6, 9, 12, 5)]
    with torch.no_grad():
        outs = [compiled(ids).logits for ids in inputs]
        # The first run describes the layers (cached on them, which the first graph's guards
        # see): one more graph, then the same one for every length.
        assert len(recorder.graphs) == 2
        for ids, out in zip(inputs, outs, strict=True):
            torch.testing.assert_close(out, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_traced_layer_is_described_through_its_id():
    """While tracing, a layer not yet described is found by its ``id`` among the live experts
    modules (torch 2.11 cannot hand the module itself to a constant-result function: the
    test above failed there with "UnspecializedNNModuleVariable is not a constant"), and
    described as an eager call describes it."""
    from moerunner.integrations import _hf_experts

    model = build("gpt_oss", implementation="moerunner")
    modules = [m for _, m in mt.experts_modules(model)]
    for module in modules:
        module.__dict__.pop(_hf_experts._DESCRIPTION, None)
        _hf_experts._BY_ID.pop(id(module), None)
    found = _hf_experts._layout_of_id(id(modules[-1]))
    assert all(_hf_experts._BY_ID.get(id(m)) is m for m in modules)  # one scan found all
    assert _hf_experts._DESCRIPTION not in modules[-1].__dict__  # not cached while traced
    assert found == _hf_experts._layout_constants(modules[-1])
    assert found[0] == "swiglu_oai" and found[3:] == (True, True, True)  # transposed etc.
    assert len(_hf_experts._layout_of_id(id(object()))) == 1  # a reason


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_compiled_steps_prepare_each_layer_once(family, prepares):
    """The compiled forward hands the experts op the module's own tensors (no alias per
    call): steps after the first, and eager calls in between, find the prepared weights
    memoised on them. GPT-OSS has biases and weights stored transposed (the op's canonical
    views are memoised too)."""
    torch._dynamo.reset()
    model = build(family, implementation="moerunner")
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for length in (6, 6, 4, 6):
            compiled(_ids(length))
            model(_ids(length))  # eager calls share the same prepared weights
    assert len(prepares) == model.config.num_hidden_layers


@pytest.mark.parametrize(
    ("family", "scheme"),
    [("qwen3_moe", None), ("qwen3_moe", "fp8_channel"), ("gpt_oss", None), ("mixtral", "mxfp4")],
)
def test_static_cache_generate_with_compiled_decode_matches_eager(family, scheme):
    torch._dynamo.reset()
    model = build(family, implementation="moerunner")
    if scheme is not None:
        mt.quantize_experts(model, scheme)
    recorder = Recorder()
    ids = _ids()
    with torch.no_grad():
        eager, compiled = compiled_static_generate(model, ids, NEW_TOKENS, recorder)
    calls = recorder.moerunner_calls()  # the decode step was compiled, one op per layer
    assert calls and all(c == model.config.num_hidden_layers for c in calls), calls
    assert eager.shape[1] == ids.shape[1] + NEW_TOKENS
    assert torch.equal(compiled, eager), f"{family} {scheme}: greedy ids differ"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_compiled_training_step_gives_the_experts_their_gradients(family):
    """A compiled forward with grad mode on: the experts op's backward (the torch backend's
    differentiable path, recomputed) gives every parameter the gradient transformers' eager
    experts give it, the experts' own included (GPT-OSS: its transposed storage, biases)."""
    torch._dynamo.reset()
    grads = {}
    for implementation in ("eager", "moerunner"):
        model = build(family, implementation=implementation)
        model.train()
        forward = model.forward
        if implementation == "moerunner":
            forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        forward(_ids()).logits.square().mean().backward()
        grads[implementation] = {n: p.grad for n, p in model.named_parameters()}
    experts = [n for n in grads["eager"] if ".experts." in n]
    assert experts and all(grads["moerunner"][n] is not None for n in experts)
    for name, want in grads["eager"].items():
        got = grads["moerunner"][name]
        assert (got is None) == (want is None), name
        if want is not None:
            # fp32, summation order only (as in the eager training test of test_transformers)
            assert_close(got, want.double(), 1e-5, what=f"d/d {name}")


def test_compiled_training_over_quantized_experts_matches_eager():
    """A compiled training step of a model with quantized experts raised "no backward".
    Frozen quantized experts now pass the gradient on under torch.compile as eagerly (where
    test_transformers checks them against eager experts on the dequantized weights): every
    parameter gets the eager step's gradient (fp8_channel, the same math: 1e-5)."""
    torch._dynamo.reset()
    model = build("qwen3_moe", implementation="moerunner")
    mt.quantize_experts(model, "fp8_channel")
    model.train()
    compiled = torch.compile(model.forward, backend="aot_eager")
    grads = []
    for forward in (compiled, model.forward):
        model.zero_grad()
        forward(_ids()).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[1]) > 4
    for name, want in grads[1].items():
        assert_close(grads[0][name], want.double(), 1e-5, what=f"d/d {name}")


@pytest.mark.gpu
def test_compiled_training_step_on_the_gpu():
    """On CUDA the op's forward runs the fastest backend's kernels and its backward
    recomputes on the torch path through ``torch.func.vjp`` on the autograd engine's device
    thread, on the caller's stream (the earlier thread of its own waited for that device
    thread while the device thread waited for it: this test ran past 200 s on an H200).
    Against transformers' eager experts: fp32, but the forward's GEMMs may run in TF32 (about
    2^-11 per product), which moves the upstream gradients by about 1e-3 of their magnitude;
    a stream error would give unrelated values. Bound: 1e-2."""
    torch._dynamo.reset()
    grads = {}
    for implementation in ("eager", "moerunner"):
        model = build("qwen3_moe", implementation=implementation).cuda()
        model.train()
        forward = model.forward
        if implementation == "moerunner":
            forward = torch.compile(model.forward, fullgraph=True)
        side = torch.cuda.Stream()  # not the default stream: the backward must follow it
        with torch.cuda.stream(side):
            forward(_ids().cuda()).logits.square().mean().backward()
        torch.cuda.synchronize()
        grads[implementation] = {n: p.grad for n, p in model.named_parameters()}
    for name, want in grads["eager"].items():
        got = grads["moerunner"][name]
        assert (got is None) == (want is None), name
        if want is not None:
            assert_close(got, want.double(), 1e-2, what=f"d/d {name}")


def test_compiled_quantized_experts_read_their_current_buffers():
    """A compiled forward read the tensors ``quantize_experts`` had built its weights over,
    so a held buffer assigned anew was ignored once compiled (the eager call saw it)."""
    torch._dynamo.reset()
    model = build("qwen3_moe", implementation="moerunner")
    mt.quantize_experts(model, "int8_w8a16")
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    ids = _ids()
    with torch.no_grad():
        first = compiled(ids).logits
        for _, experts in mt.experts_modules(model):
            holder = experts.moerunner_quantized
            holder.w2_scale = holder.w2_scale * 2
        out, ref = compiled(ids).logits, model(ids).logits
    assert not torch.equal(ref, first)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
