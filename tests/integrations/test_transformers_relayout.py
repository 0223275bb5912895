"""GPT-OSS experts held once, over the contiguous canonical memory the kernels read fastest.

``use_moerunner`` (``relayout_experts``) makes each GPT-OSS experts parameter
(``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``) a transposed view of a contiguous
``[E, 2I, H]`` / ``[E, H, I]`` tensor. Checked here: the model computes what transformers'
experts compute (float64 eager reference), the experts' memory is counted once, the state
dict, ``save_pretrained`` / ``from_pretrained``, ``.to()``, ``deepcopy`` and transformers' own
experts implementations see the parameters as before, and layers where re-laying is unsafe
keep their stored layout (and still compute the same).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("transformers")

import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner.errors import MoeInputError  # noqa: E402
from moerunner.integrations import _relayout  # noqa: E402
from moerunner.integrations._hf_experts import expert_weights  # noqa: E402
from moerunner.memory import AllocationTracker, storage_bytes  # noqa: E402
from moerunner.testing import assert_close, compare  # noqa: E402

from ._tiny_models import build  # noqa: E402

# fp32 against the float64 model: a few fp32 ulps of the logits' magnitude after 2 layers and
# the LM head, in any summation order (measured <= 4e-7; test_transformers.py uses the same).
FP32_MAX_REL = 1e-5
# I = 40: 2I = 80 != H = 64 != I, so no transposed shape equals the stored one.
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))


def _model(seed: int = 0):
    return build("gpt_oss", seed=seed, intermediate_size=40)


def _logits(model, implementation: str | None = None) -> torch.Tensor:
    if implementation is not None:
        model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(IDS).logits


def _reference(model) -> torch.Tensor:
    """Logits of a float64 copy of ``model`` with transformers' eager experts."""
    return _logits(copy.deepcopy(model).double(), "eager").double()


def _experts(model) -> list[torch.nn.Module]:
    return [module for _, module in mt.experts_modules(model)]


def _canonical(param: torch.Tensor) -> bool:
    return param.transpose(1, 2).is_contiguous() and not param.is_contiguous()


def test_values_match_transformers_experts_and_kernels_read_contiguous_memory():
    model = _model()
    ref = _reference(model)
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    mt.use_moerunner(model, backend="torch")
    verdicts = mt.relayout_experts(model)  # done by use_moerunner: nothing left to re-lay
    assert verdicts == {"model.layers.0.mlp.experts": None, "model.layers.1.mlp.experts": None}
    for experts in _experts(model):
        assert experts.gate_up_proj.shape == (8, 64, 80)  # the parameters keep their shapes
        assert experts.down_proj.shape == (8, 40, 64)
        assert _canonical(experts.gate_up_proj) and _canonical(experts.down_proj)
    for key, value in model.state_dict().items():
        assert torch.equal(value, stored[key]), key  # values unchanged, bit for bit
    assert_close(_logits(model), ref, FP32_MAX_REL, what="relaid, moerunner")
    for experts in _experts(model):
        w, _ = expert_weights(experts)
        assert w.w13.is_contiguous() and w.w2.is_contiguous()
        # The canonical weights are the parameters' memory itself, not a copy of it.
        assert w.w13.data_ptr() == experts.gate_up_proj.data_ptr()
        assert w.w2.data_ptr() == experts.down_proj.data_ptr()


def test_layers_stored_canonical_are_not_touched():
    model = build("qwen3_moe")  # gate_up_proj [E, 2I, H], down_proj [E, H, I]: canonical
    before = {n: (p.data_ptr(), p.stride()) for n, p in model.named_parameters()}
    mt.use_moerunner(model)
    assert set(mt.relayout_experts(model).values()) == {None}
    assert {n: (p.data_ptr(), p.stride()) for n, p in model.named_parameters()} == before


def test_relayout_false_keeps_the_stored_layout_and_the_same_values():
    model = _model()
    ref = _reference(model)
    mt.use_moerunner(model, backend="torch", relayout=False)
    for experts in _experts(model):
        assert experts.gate_up_proj.is_contiguous() and experts.down_proj.is_contiguous()
        w, _ = expert_weights(experts)
        assert not w.w13.is_contiguous()  # strided views of the stored memory
    assert_close(_logits(model), ref, FP32_MAX_REL, what="stored layout, moerunner")


@pytest.mark.parametrize(
    "setup", ["loaded", "loaded, memory shared", "relayout", "relayout=False", "stored"]
)
def test_strided_reads_warn_once_unless_the_layout_was_chosen(monkeypatch, setup):
    """A model loaded with experts_implementation="moerunner" alone is re-laid in place on its
    first inference call (below); where that cannot be done without a copy (another tensor
    holds the memory) it reads GPT-OSS's transposed experts through strided views, and its
    first call warns once per process, naming use_moerunner. Re-laid, or kept as stored on
    purpose, it does not warn."""
    import warnings

    from moerunner.integrations import _hf_experts

    monkeypatch.setattr(_hf_experts, "_STRIDED_WARNED", [False])
    model = build("gpt_oss", implementation="moerunner", intermediate_size=40)
    kept = [e.gate_up_proj.detach() for e in _experts(model)]  # noqa: F841  (held on purpose)
    if setup != "loaded, memory shared":
        del kept
    if setup == "relayout":
        mt.use_moerunner(model, backend="torch")
    elif setup == "relayout=False":
        mt.use_moerunner(model, backend="torch", relayout=False)
    elif setup == "stored":
        mt.relayout_experts(model, "stored")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _logits(model)
        _logits(model)
    strided = [w for w in seen if "strided views" in str(w.message)]
    if setup == "loaded, memory shared":
        assert len(strided) == 1 and issubclass(strided[0].category, RuntimeWarning)
        assert "GptOssExperts" in str(strided[0].message)  # the layer (its path once known)
        assert "use_moerunner(model)" in str(strided[0].message)
    else:
        assert not strided


def test_first_inference_call_relays_in_place(caplog):
    """A model loaded with experts_implementation="moerunner" (no use_moerunner): its first
    call with grad mode off re-lays each GPT-OSS experts layer in place, in the canonical
    layout, once; the logits match the float64 reference before and after."""
    model = build("gpt_oss", implementation="moerunner", intermediate_size=40)
    ref = _reference(model)
    experts = _experts(model)
    pointers = [e.gate_up_proj.untyped_storage().data_ptr() for e in experts]
    assert not any(_canonical(e.gate_up_proj) for e in experts)
    with caplog.at_level("INFO", logger="moerunner"):
        first = _logits(model)
    assert all(_canonical(e.gate_up_proj) and _canonical(e.down_proj) for e in experts)
    assert [e.gate_up_proj.untyped_storage().data_ptr() for e in experts] == pointers
    assert sum("re-laid the transposed experts" in r.message for r in caplog.records) == len(
        experts
    )
    assert_close(first, ref, FP32_MAX_REL, what="first call, re-laid")
    assert_close(_logits(model), ref, FP32_MAX_REL, what="second call")


def test_auto_leaves_the_layout_to_the_next_inference_call_again():
    """``relayout_experts(model, "auto")`` after a stored-on-purpose layout and an eager call
    (whose cached views hold the weights' memory): stored until the next inference call,
    which re-lays each layer in place, as for a freshly loaded model."""
    model = build("gpt_oss", implementation="moerunner", intermediate_size=40)
    ref = _reference(model)
    experts = _experts(model)
    mt.relayout_experts(model, "stored")
    assert_close(_logits(model), ref, FP32_MAX_REL, what="stored on purpose")
    assert not any(_canonical(e.gate_up_proj) for e in experts)
    pointers = [e.gate_up_proj.untyped_storage().data_ptr() for e in experts]
    assert mt.relayout_experts(model, "auto") == {p: None for p, _ in mt.experts_modules(model)}
    assert not any(_canonical(e.gate_up_proj) for e in experts)
    assert_close(_logits(model), ref, FP32_MAX_REL, what="first call after auto")
    assert all(_canonical(e.gate_up_proj) and _canonical(e.down_proj) for e in experts)
    assert [e.gate_up_proj.untyped_storage().data_ptr() for e in experts] == pointers
    with pytest.raises(MoeInputError, match="accepted: .*'auto'"):
        mt.relayout_experts(model, "transposed")


@pytest.mark.parametrize(
    "why", ["grad mode on", "relayout=False", "relaid to stored", "after a compiled call"]
)
def test_no_automatic_relayout_where_the_caller_decides(why):
    """Training calls (grad mode on) keep the layout, as do layers whose caller chose the
    stored layout, and layers a compiled graph has read (re-laying would change the strides
    its guards check, and recompile it)."""
    model = build("gpt_oss", implementation="moerunner", intermediate_size=40)
    experts = _experts(model)
    if why == "after a compiled call":
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            compiled(IDS)
    if why == "relayout=False":
        mt.use_moerunner(model, backend="torch", relayout=False)
    elif why == "relaid to stored":
        mt.relayout_experts(model)
        mt.relayout_experts(model, "stored")
    if why == "grad mode on":
        model(IDS).logits.sum().backward()
        assert all(e.gate_up_proj.grad is not None for e in experts)
    else:
        _logits(model)
    assert not any(_canonical(e.gate_up_proj) for e in experts)
    assert all(e.gate_up_proj.is_contiguous() for e in experts)


@pytest.mark.parametrize("zero_grad", ["set_to_none", "zeroed"])
def test_trained_layers_are_never_relaid_by_a_later_inference_call(zero_grad):
    """A training step (optimizer step, grads cleared or zeroed), then an evaluation with
    grad mode off: the evaluation re-laid the experts in place (the step's in-place update
    dropped the views that had kept them), under a fused AdamW whose state keeps the old
    strides, so every later step updated the wrong elements. The same training without the
    evaluations is the reference: evaluations must not change what training computes."""
    model = build("gpt_oss", implementation="moerunner", intermediate_size=40)
    twin = copy.deepcopy(model)
    experts = _experts(model)
    strides = [(e.gate_up_proj.stride(), e.down_proj.stride()) for e in experts]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, twin)]
    for _ in range(3):
        for m, opt in zip((model, twin), optimizers, strict=True):
            m(IDS).logits.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=zero_grad == "set_to_none")
        _logits(model)  # an evaluation between steps
        assert [(e.gate_up_proj.stride(), e.down_proj.stride()) for e in experts] == strides
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("switch", ["use_moerunner", "evaluation", "relayout_experts"])
def test_parameters_an_optimizer_stepped_are_never_relaid(switch):
    """Trained with transformers' own experts under a fused AdamW, then moerunner turned on
    (``use_moerunner``, or the implementation set and an evaluation with grad mode off, or
    an explicit ``relayout_experts``): the re-lay changed the strides the optimizer's state
    had, and every later step updated the wrong elements (parameters 1.7e-2 off a twin
    trained without the switch after one step, silently). Parameters an optimizer has
    stepped keep their layout; the twin's training is the reference."""
    model = build("gpt_oss", intermediate_size=40)
    twin = copy.deepcopy(model)
    experts = _experts(model)
    strides = [(e.gate_up_proj.stride(), e.down_proj.stride()) for e in experts]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, twin)]

    def steps(count):
        for _ in range(count):
            for m, opt in zip((model, twin), optimizers, strict=True):
                m(IDS).logits.square().mean().backward()
                opt.step()
                opt.zero_grad()

    steps(1)
    if switch == "use_moerunner":
        mt.use_moerunner(model, backend="torch")
    elif switch == "evaluation":
        _logits(model, "moerunner")
    else:
        verdicts = mt.relayout_experts(model)
        assert all("has optimizer state" in v for v in verdicts.values()), verdicts
    assert [(e.gate_up_proj.stride(), e.down_proj.stride()) for e in experts] == strides
    steps(2)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-4, name


def test_experts_memory_is_held_once_and_relaid_in_place():
    """With nothing else holding the experts' memory (the module's cached views are dropped
    first), each parameter is transposed in place: same memory, no second copy."""
    model = _model()
    experts = _experts(model)[0]
    _logits(model, "moerunner")  # canonical views of the stored memory are cached now
    before = storage_bytes(model)
    pointers = [p.untyped_storage().data_ptr() for p in (experts.gate_up_proj, experts.down_proj)]
    with AllocationTracker() as tracker:
        mt.relayout_experts(model)
    # the one buffer: one parameter of this tiny model (below the 64 MiB chunk)
    assert tracker.peak_bytes <= experts.gate_up_proj.numel() * 4
    for p, pointer in zip((experts.gate_up_proj, experts.down_proj), pointers, strict=True):
        assert _canonical(p) and p.untyped_storage().data_ptr() == pointer
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    _logits(model, "moerunner")
    params = list(experts.parameters())
    assert storage_bytes(experts.__dict__, params) == storage_bytes(params)
    assert storage_bytes(model) == before  # the model holds as many bytes as before


@pytest.mark.parametrize("experts_per_chunk", [1, 3, 100])
def test_in_place_relayout_goes_through_one_buffer_of_the_chunk_size(experts_per_chunk):
    """The in-place re-lay both ways, in chunks of 1, 3 (8 experts: 3 + 3 + 2) or all experts:
    the values never change, the memory stays, and the only new memory is one chunk."""
    model = _model()
    experts = _experts(model)[0]
    param = experts.gate_up_proj
    values, pointer = param.detach().clone(), param.untyped_storage().data_ptr()
    per_expert = param[0].numel() * param.element_size()
    for layout in ("canonical", "stored", "canonical"):
        with AllocationTracker() as tracker:
            assert _relayout.relayout(experts, layout, chunk_bytes=experts_per_chunk * per_expert)
        assert tracker.peak_bytes == min(experts_per_chunk, param.shape[0]) * per_expert
        assert _relayout.in_layout(param, layout) and not _relayout.in_layout(
            param, "stored" if layout == "canonical" else "canonical"
        )
        assert param.untyped_storage().data_ptr() == pointer
        assert torch.equal(param, values)


def test_memory_another_tensor_holds_is_not_relaid_in_place():
    """A view kept elsewhere (here one the caller took) must keep its values: the parameter
    gets new memory instead, the view keeps the old one, unchanged."""
    model = _model()
    experts = _experts(model)[0]
    kept = experts.gate_up_proj.detach()
    values = kept.clone()
    mt.relayout_experts(model)
    assert _canonical(experts.gate_up_proj)
    assert experts.gate_up_proj.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
    assert torch.equal(kept, values) and kept.is_contiguous()
    assert torch.equal(experts.gate_up_proj, values)
    # down_proj had no other holder: re-laid in place
    assert _canonical(experts.down_proj)


def test_state_dict_round_trip_is_bit_identical(tmp_path):
    model = _model()
    mt.use_moerunner(model)
    expected = _logits(model)
    state = model.state_dict()
    fresh = _model(seed=9)
    mt.use_moerunner(fresh)
    assert not torch.equal(_logits(fresh), expected)  # other weights: the load must matter
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    result = fresh.load_state_dict(torch.load(buffer))
    assert not result.missing_keys and not result.unexpected_keys
    for experts in _experts(fresh):  # loaded in place: still held canonically
        assert _canonical(experts.gate_up_proj) and _canonical(experts.down_proj)
    assert torch.equal(_logits(fresh), expected)
    # safetensors' save_file takes contiguous tensors only (save_pretrained makes them so).
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="non contiguous"):
        save_file(state, tmp_path / "raw.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "m.safetensors")
    other = _model(seed=10)
    other.load_state_dict(load_file(tmp_path / "m.safetensors"))
    mt.use_moerunner(other)
    assert torch.equal(_logits(other), expected)


def test_save_pretrained_then_from_pretrained(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _model()
    mt.use_moerunner(model)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:  # the checkpoint's own layout
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 64, 80]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    mt.use_moerunner(loaded)
    assert torch.equal(_logits(loaded), expected)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_transformers_own_experts_run_on_the_relaid_parameters(implementation):
    model = _model()
    ref = _reference(model)
    mt.use_moerunner(model)
    assert_close(_logits(model, implementation), ref, FP32_MAX_REL, what=implementation)
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(mt.relayout_experts(model, "stored").values()) == {None}
    for experts in _experts(model):
        assert experts.gate_up_proj.is_contiguous() and experts.down_proj.is_contiguous()
    for key, value in model.state_dict().items():
        assert torch.equal(value, stored[key]), key
    assert_close(_logits(model, "moerunner"), ref, FP32_MAX_REL, what="stored again")


def test_to_and_deepcopy_keep_the_canonical_memory():
    """``.to(dtype)`` and ``deepcopy`` preserve strides, so the canonical memory survives. fp16
    bound: moerunner's fp16 logits are no further from the float64 model (of the same fp16
    weights) than 1.5x transformers' eager fp16 logits are, plus 2 fp16 ulps (2^-10)."""
    model = _model()
    mt.use_moerunner(model)
    moved = copy.deepcopy(model).to(torch.float16)
    for experts in _experts(moved):
        assert experts.gate_up_proj.dtype == torch.float16
        assert _canonical(experts.gate_up_proj) and _canonical(experts.down_proj)
    ref = _reference(moved)
    eager = compare(_logits(moved, "eager"), ref)
    ours = compare(_logits(moved, "moerunner"), ref)
    assert ours.nonfinite == 0 and ours.max_rel <= 1.5 * eager.max_rel + 2.0**-10, (ours, eager)


def test_training_sees_the_same_parameters():
    """The parameters stay leaves that require grad: transformers' eager experts give them
    the gradients they give the stored layout, and an optimizer step updates them in place
    (in the canonical memory); moerunner's call under autograd behaves as with the stored
    layout (same outputs, same gradients)."""
    relaid, stored = _model(), _model()
    mt.use_moerunner(relaid)
    mt.use_moerunner(stored, relayout=False)
    grads = []
    for model in (relaid, stored):
        model.set_experts_implementation("eager")
        model.zero_grad()
        model(IDS).logits.square().mean().backward()
        experts = _experts(model)[0]
        grads.append((experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for a, b in zip(*grads, strict=True):
        assert_close(a, b.double(), FP32_MAX_REL, what="eager experts grad")
    results = []
    for model in (relaid, stored):
        model.set_experts_implementation("moerunner")
        model.zero_grad()
        out = model(IDS).logits
        out.square().mean().backward()
        experts = _experts(model)[0]
        results.append((out.detach(), model.model.embed_tokens.weight.grad, experts))
    (out_a, grad_a, experts_a), (out_b, grad_b, experts_b) = results
    assert_close(out_a, out_b.double(), FP32_MAX_REL, what="moerunner under autograd")
    assert_close(grad_a, grad_b.double(), FP32_MAX_REL, what="moerunner input grads")
    assert (experts_a.gate_up_proj.grad is None) == (experts_b.gate_up_proj.grad is None)
    before = experts_a.gate_up_proj.detach().clone()
    relaid.set_experts_implementation("eager")
    relaid.zero_grad()
    relaid(IDS).logits.square().mean().backward()
    torch.optim.SGD(relaid.parameters(), lr=0.1).step()
    assert _canonical(experts_a.gate_up_proj)
    assert not torch.equal(experts_a.gate_up_proj, before)  # updated through the view
    w, _ = expert_weights(experts_a)
    assert torch.equal(w.w13, experts_a.gate_up_proj.detach().transpose(1, 2))


def test_layers_that_cannot_be_relaid_keep_their_stored_layout():
    with pytest.raises(MoeInputError, match="layout"):
        mt.relayout_experts(_model(), "transposed")

    # A parameter tied under two names is one tensor: re-laid once, still tied.
    model = _model()
    first, second = _experts(model)
    second.down_proj = first.down_proj
    ref = _reference(model)
    assert set(mt.relayout_experts(model).values()) == {None}
    assert second.down_proj is first.down_proj and _canonical(first.down_proj)
    assert_close(_logits(model, "moerunner"), ref, FP32_MAX_REL, what="tied")

    # Two parameters over one memory: re-laying one would untie them.
    model = _model()
    first, second = _experts(model)
    second.gate_up_proj = torch.nn.Parameter(first.gate_up_proj.detach())
    ref = _reference(model)
    verdicts = mt.relayout_experts(model)
    assert all("shares its memory" in reason for reason in verdicts.values())
    assert second.gate_up_proj.data_ptr() == first.gate_up_proj.data_ptr()
    assert first.gate_up_proj.is_contiguous()
    assert_close(_logits(model, "moerunner"), ref, FP32_MAX_REL, what="shared memory")

    # Quantized experts: the float weights are released, nothing to re-lay.
    model = _model()
    mt.quantize_experts(model, "fp8_channel")
    assert all("quantized" in reason for reason in mt.relayout_experts(model).values())

    # Weights on the meta device (not loaded) stay there.
    from transformers import AutoModelForCausalLM

    from moerunner.integrations.tiny_models import tiny_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("gpt_oss", intermediate_size=40))
    assert all("meta" in reason for reason in mt.relayout_experts(meta).values())


def test_offloaded_layers_keep_their_stored_layout():
    accelerate = pytest.importorskip("accelerate")
    model = _model()
    ref = _reference(model)
    accelerate.cpu_offload(model.model.layers[1], execution_device=torch.device("cpu"))
    mt.use_moerunner(model)
    verdicts = mt.relayout_experts(model)
    assert verdicts["model.layers.0.mlp.experts"] is None
    assert "offloaded" in verdicts["model.layers.1.mlp.experts"]
    assert_close(_logits(model), ref, FP32_MAX_REL, what="offloaded layer")


@pytest.mark.gpu
def test_the_triton_backend_reads_the_parameters_memory_contiguously(monkeypatch):
    """On CUDA with the triton backend: the weights the backend prepares are the contiguous
    canonical parameters' memory (no copy), and the logits match the float64 eager model
    (bound 1e-4: triton's GEMMs reduce in other orders than cuBLAS)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from moerunner.backends.triton import TritonBackend

    seen = []
    prepare = TritonBackend.prepare_weights

    def spy(self, weights, spec):
        seen.append((weights.w13, weights.w2))
        return prepare(self, weights, spec)

    monkeypatch.setattr(TritonBackend, "prepare_weights", spy)
    model = _model()
    ref = _reference(model)  # on the CPU, in float64
    model = model.cuda()
    mt.use_moerunner(model, backend="triton")
    with torch.no_grad():
        out = model(IDS.cuda()).logits
    assert_close(out.cpu(), ref, 1e-4, what="triton, relaid")
    params = {p.data_ptr() for e in _experts(model) for p in (e.gate_up_proj, e.down_proj)}
    assert len(seen) >= 2  # each layer's weights, prepared once per form
    for w13, w2 in seen:
        assert w13.is_contiguous() and w2.is_contiguous()
        assert {w13.data_ptr(), w2.data_ptr()} <= params


@pytest.mark.parametrize("order", ["stepped", "resumed state"])
def test_optimizer_state_blocks_a_relayout_however_it_was_made(order):
    """The re-lay looks at the optimizers' state itself, so neither the order of imports nor
    how the state was made (steps, or ``load_state_dict`` of a saved one before any step)
    matters; a frozen parameter an optimizer lists but holds no state for is re-laid."""
    model = build("gpt_oss", intermediate_size=40)
    twin = copy.deepcopy(model)
    experts = _experts(model)
    strides = [(e.gate_up_proj.stride(), e.down_proj.stride()) for e in experts]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, twin)]
    if order == "resumed state":
        warm = copy.deepcopy(model)
        warm_opt = torch.optim.AdamW(warm.parameters(), lr=1e-2, fused=True)
        warm(IDS).logits.square().mean().backward()
        warm_opt.step()
        for opt in optimizers:
            opt.load_state_dict(warm_opt.state_dict())
    else:
        for m, opt in zip((model, twin), optimizers, strict=True):
            m(IDS).logits.square().mean().backward()
            opt.step()
            opt.zero_grad()
    mt.use_moerunner(model, backend="torch")
    mt.use_moerunner(twin, backend="torch", relayout=False)  # the same kernels on both
    assert [(e.gate_up_proj.stride(), e.down_proj.stride()) for e in experts] == strides
    # One step: a re-lay puts it ~1e-2 off; a second step would also amplify the 1e-6 the
    # two models' float sums differ by where Adam's second moment is near zero.
    for _ in range(1):
        for m, opt in zip((model, twin), optimizers, strict=True):
            m(IDS).logits.square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-4, name


def test_a_frozen_parameter_an_optimizer_lists_is_still_relaid():
    """Frozen experts (LoRA-style training) sit in ``AdamW(model.parameters())`` with no
    state: nothing keeps their strides, so ``use_moerunner`` re-lays them."""
    model = build("gpt_oss", intermediate_size=40)
    for e in _experts(model):
        e.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(IDS).logits.square().mean().backward()
    opt.step()
    mt.use_moerunner(model, backend="torch")
    assert all(_canonical(e.gate_up_proj) for e in _experts(model))
