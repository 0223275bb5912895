"""moerunner as transformers' experts implementation, on tiny random models of each family.

Each family's model is built once from a config (no hub). The same weights run under
transformers' "eager" experts loop and under "moerunner"; logits are compared with the one
tolerance helper (max |out - ref| / max |ref|, and the RMS ratio) and greedy generation must
give identical ids in fp32.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner.errors import BackendUnavailableError, MoeInputError  # noqa: E402
from moerunner.memory import storage_bytes  # noqa: E402
from moerunner.quant import dequantize  # noqa: E402
from moerunner.testing import assert_close, compare  # noqa: E402

from ._tiny_models import FAMILIES, build  # noqa: E402

# fp32: both sides run the same fp32 math in a different summation order; after 2 layers and
# the LM head the logits differ by a few ulps of their magnitude (measured <= 4e-7).
FP32_MAX_REL = 1e-5
# bf16: every GEMM output and activation is rounded to bf16 (2^-8 relative) in a different
# order on each side, and a rounding difference can flip a near-tied top-k choice in the next
# layer; so eager bf16 itself is 1e-2..2e-1 (max) away from the fp32 model on these random
# models. The bound: moerunner bf16 is no further from the fp32 logits than 1.5x eager bf16's
# own distance (max and RMS), plus 2 bf16 ulps (2^-7) of the logits' scale.
BF16_VS_EAGER = 1.5
BF16_SLACK = 2.0**-7
NEW_TOKENS = 16


def _ids(seed: int = 3, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, implementation: str, ids: torch.Tensor) -> torch.Tensor:
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(ids).logits.double()


def _greedy(model, implementation: str, ids: torch.Tensor) -> torch.Tensor:
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, build(request.param)


def test_logits_and_generate_match_eager(family_model):
    family, model = family_model
    ids = _ids()
    ref = _logits(model, "eager", ids)
    out = _logits(model, "moerunner", ids)
    assert_close(out, ref, FP32_MAX_REL, what=f"{family} fp32 logits")
    eager_tokens = _greedy(model, "eager", ids[:1])
    ours_tokens = _greedy(model, "moerunner", ids[:1])
    assert eager_tokens.shape[1] == ids.shape[1] + NEW_TOKENS
    assert torch.equal(ours_tokens, eager_tokens), f"{family}: greedy ids differ"

    half = copy.deepcopy(model).to(torch.bfloat16)
    eager16 = compare(_logits(half, "eager", ids), ref)
    ours16 = compare(_logits(half, "moerunner", ids), ref)
    assert ours16.nonfinite == 0, f"{family} bf16: {ours16}"
    assert ours16.max_rel <= BF16_VS_EAGER * eager16.max_rel + BF16_SLACK, (
        f"{family} bf16 vs fp32 logits: moerunner {ours16}; eager {eager16}"
    )
    assert ours16.rms_rel <= BF16_VS_EAGER * eager16.rms_rel + BF16_SLACK, (
        f"{family} bf16 vs fp32 logits: moerunner {ours16}; eager {eager16}"
    )


def test_layout_converted_once_and_refreshed_on_update():
    model = build("gpt_oss", num_hidden_layers=1, layer_types=["full_attention"])
    experts = model.model.layers[0].mlp.experts
    ids = _ids(length=6)
    first = _logits(model, "moerunner", ids)
    w13 = experts.__dict__["_moerunner_weights"][False][1].w13  # (grad mode off: the views)
    _logits(model, "moerunner", ids)
    assert experts.__dict__["_moerunner_weights"][False][1].w13 is w13  # no conversion per call
    with torch.no_grad():
        experts.gate_up_proj.mul_(0.5)  # in-place update: the cached layout must follow
    changed = _logits(model, "moerunner", ids)
    assert experts.__dict__["_moerunner_weights"][False][1].w13 is not w13
    assert_close(changed, _logits(model, "eager", ids), FP32_MAX_REL, what="after update")
    assert not torch.allclose(changed, first)


def test_gpt_oss_experts_live_once_in_the_model_parameters():
    # GPT-OSS stores gate_up_proj [E, H, 2I] and down_proj [E, I, H]; moerunner reads them
    # through canonical-shaped views, so the layer holds no transposed copy beside them.
    model = build("gpt_oss", num_hidden_layers=1, layer_types=["full_attention"])
    experts = model.model.layers[0].mlp.experts
    params = list(experts.parameters())
    ids = _ids(length=6)
    ours = _logits(model, "moerunner", ids)
    assert storage_bytes(experts.__dict__, params) == storage_bytes(params)
    assert_close(ours, _logits(model, "eager", ids), FP32_MAX_REL, what="views")
    freed = []
    weakref.finalize(experts.gate_up_proj.untyped_storage(), freed.append, True)
    del model, experts, params
    gc.collect()
    assert freed  # nothing derived from the parameters keeps their memory alive


def test_backend_choice_travels_from_config_and_registration():
    model = build("qwen3_moe", num_hidden_layers=1)
    ids = _ids(length=4)
    model.config.moerunner_backend = "no_such_backend"
    with pytest.raises(BackendUnavailableError, match="no_such_backend"):
        _logits(model, "moerunner", ids)
    del model.config.moerunner_backend
    name = mt.register("moerunner_torch", backend="torch")
    assert_close(
        _logits(model, name, ids),
        _logits(model, "eager", ids),
        FP32_MAX_REL,
        what="moerunner_torch",
    )


def _break_layer(model, index: int) -> None:
    # An activation moerunner does not have: the layer becomes unsupported.
    model.model.layers[index].mlp.experts.act_fn = torch.nn.Tanh()


def test_unsupported_layer_is_named_or_falls_back_by_rule():
    model = build("qwen3_moe")
    _break_layer(model, 1)
    with pytest.raises(mt.UnsupportedExpertsError, match=r"model\.layers\.1\.mlp\.experts"):
        mt.use_moerunner(model)
    verdicts = mt.check_model(model)
    assert verdicts["model.layers.0.mlp.experts"] is None
    assert "Tanh" in verdicts["model.layers.1.mlp.experts"]

    ids = _ids(length=5)
    with pytest.raises(mt.UnsupportedExpertsError, match="layers.1.mlp.experts"):
        _logits(model, "moerunner", ids)
    ref = _logits(model, "eager", ids)
    mt.use_moerunner(model, fallback="eager")
    assert model.config._experts_implementation == "moerunner"
    assert_close(_logits(model, "moerunner", ids), ref, FP32_MAX_REL, what="eager fallback")


def test_dtype_changes_are_seen_after_a_layer_was_described():
    """Whether the experts' dtype is one moerunner reads was cached with the layer's
    structure: a refusal of float64 experts stayed after .float(), and after .double() the
    float64 weights reached the kernels (a TypeError naming w13) past fallback='eager'."""
    model = build("qwen3_moe").double()
    with pytest.raises(mt.UnsupportedExpertsError, match="gate_up_proj has dtype torch.float64"):
        mt.use_moerunner(model)
    model.float()
    mt.use_moerunner(model)  # refused before: the cached float64 verdict
    ids = _ids(length=5)
    ref = _logits(copy.deepcopy(model), "eager", ids)
    assert_close(_logits(model, "moerunner", ids), ref, FP32_MAX_REL, what="after .float()")
    mt.use_moerunner(model, fallback="eager")
    model.double()
    with torch.no_grad():
        got = model(input_ids=ids).logits  # every layer falls back to transformers' loop
    twin = copy.deepcopy(model)
    twin.set_experts_implementation("eager")
    with torch.no_grad():
        assert torch.equal(got, twin(input_ids=ids).logits)


def test_a_refused_layer_reached_without_the_model_helpers_says_how_to_find_it():
    """Loaded with experts_implementation='moerunner' (no use_moerunner), a layer has no
    path of its own: the refusal named its class only."""
    model = build("qwen3_moe")
    _break_layer(model, 1)
    model.set_experts_implementation("moerunner")
    with pytest.raises(
        mt.UnsupportedExpertsError, match=r"Qwen3MoeExperts \(its path.*check_model"
    ):
        with torch.no_grad():
            model(input_ids=_ids(length=5))


@pytest.mark.parametrize(
    "scheme, max_rel",
    [
        # W4A16: weights stored in mxfp4, activations unquantized; the eager model holds the
        # dequantized weights, so both compute the same fp32 products (fp32 tolerance).
        ("mxfp4", FP32_MAX_REL),
        # W8A8: moerunner also quantizes the GEMM inputs to e4m3 per 128-group (2^-4 relative
        # rounding per element, averaged over K) which the eager model does not: a few percent.
        ("fp8_block", 5e-2),
    ],
)
def test_quantize_experts_at_load_time(scheme, max_rel):
    from moerunner.quant import dequantize

    model = build("qwen3_moe")
    ref_model = copy.deepcopy(model)
    done = mt.quantize_experts(model, scheme)
    assert set(done.values()) == {scheme} and len(done) == 2
    for path, experts in mt.experts_modules(model):
        assert experts.gate_up_proj.numel() == 0  # float weights released
        q = mt.quantized_scheme(experts)
        assert q == scheme
        target = ref_model.get_submodule(path)
        pinned = mt.quantized_weights(experts)
        with torch.no_grad():
            target.gate_up_proj.copy_(dequantize(pinned.w13))
            target.down_proj.copy_(dequantize(pinned.w2))
    ids = _ids(length=6)
    assert_close(
        _logits(model, "moerunner", ids),
        _logits(ref_model, "eager", ids),
        max_rel,
        what=f"{scheme} experts",
    )


def test_gpt_oss_mxfp4_checkpoint_stays_mxfp4(tmp_path):
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import moerunner

    model = build("gpt_oss")
    ref_model = copy.deepcopy(model)
    tensors = {}
    for path, experts in mt.experts_modules(model):
        # Write the layer as GPT-OSS checkpoints store it: [E, N(out), K/32, 16] nibbles + e8m0.
        for proj in ("gate_up_proj", "down_proj"):
            w_ENK = getattr(experts, proj).detach().transpose(1, 2).contiguous()
            q = moerunner.quantize(w_ENK, "mxfp4")
            e, n, k = q.shape
            blocks, scales = q.data.reshape(e, n, k // 32, 16), q.scale
            tensors[f"{path}.{proj}_blocks"] = blocks
            tensors[f"{path}.{proj}_scales"] = scales
            tensors[f"{path}.{proj}_bias"] = getattr(experts, proj + "_bias").detach().clone()
            # The reference decodes the same bytes with transformers' own MXFP4 decoder.
            decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            with torch.no_grad():
                getattr(ref_model.get_submodule(path), proj).copy_(decoded)
    save_file(tensors, str(tmp_path / "model.safetensors"))

    done = mt.load_gpt_oss_mxfp4(model, tmp_path)
    assert done == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for _, experts in mt.experts_modules(model):
        assert mt.quantized_scheme(experts) == "mxfp4"
        assert experts.gate_up_proj.numel() == 0
    ids = _ids(length=6)
    assert_close(
        _logits(model, "moerunner", ids),
        _logits(ref_model, "eager", ids),
        FP32_MAX_REL,
        what="gpt-oss mxfp4 checkpoint",
    )
    # The checkpoint's experts are in the state dict: a model quantized to mxfp4 loads them.
    fresh = build("gpt_oss", seed=4)
    mt.quantize_experts(fresh, "mxfp4")
    assert fresh.load_state_dict(model.state_dict()).missing_keys == []
    assert torch.equal(_logits(fresh, "moerunner", ids), _logits(model, "moerunner", ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_training_through_moerunner_gives_the_experts_their_gradients(family):
    """Grad mode on, parameters requiring grad (fine-tuning): the experts run on
    ``fused_moe``'s differentiable path, so every parameter, the experts' own included (GPT-OSS
    through views of its transposed storage), gets the gradient transformers' eager experts
    give it. fp32: the two sides differ in summation order only, as the logits do (measured
    <= 2.7e-6 of each gradient's magnitude over these steps), so the logits' bound applies."""
    models = {impl: build(family, implementation=impl) for impl in ("eager", "moerunner")}
    optimizers = {impl: torch.optim.SGD(m.parameters(), lr=0.05) for impl, m in models.items()}
    ids = _ids()
    for step in range(2):  # two optimizer steps, two forwards (two graphs) before each backward
        grads = {}
        for impl, model in models.items():
            model.train()
            optimizers[impl].zero_grad()
            loss = model(ids).logits.square().mean() + model(ids[:, :5]).logits.square().mean()
            loss.backward()
            grads[impl] = {n: p.grad for n, p in model.named_parameters()}
            optimizers[impl].step()
        experts = [n for n in grads["eager"] if ".experts." in n]
        assert experts and all(grads["moerunner"][n] is not None for n in experts)
        for name, want in grads["eager"].items():
            got = grads["moerunner"][name]
            if want is None:
                assert got is None, name
                continue
            assert_close(got, want.double(), FP32_MAX_REL, what=f"step {step}: d/d {name}")


def test_training_over_quantized_experts_reaches_every_other_parameter():
    """Grad mode on a model whose experts were quantized (``quantize_experts``): this raised
    "no backward". Quantized experts are now frozen and pass the gradient on (QLoRA's
    setting), so every other parameter gets the gradient of the eager model whose experts
    hold the dequantized weights (mxfp4 is weight-only: the same weights in both, fp32, the
    logits' bound)."""
    model = build("qwen3_moe", implementation="moerunner")
    reference = build("qwen3_moe")
    mt.quantize_experts(model, "mxfp4")
    with torch.no_grad():
        for (_, experts), (_, own) in zip(
            mt.experts_modules(model), mt.experts_modules(reference), strict=True
        ):
            quantized = mt.expert_weights(experts)[0]
            own.gate_up_proj.copy_(dequantize(quantized.w13))
            own.down_proj.copy_(dequantize(quantized.w2))
    ids = _ids()
    for m in (model, reference):
        m.train()
        m(ids).logits.square().mean().backward()
    want = dict(reference.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if ".experts." not in n]
    assert trained and all(p.grad is not None for _, p in trained)
    for name, p in trained:
        assert_close(p.grad, want[name].grad.double(), FP32_MAX_REL, what=f"d/d {name}")


def test_training_over_released_quantized_experts_gives_their_biases_gradients():
    """GPT-OSS's experts keep float biases beside quantized weights. With the float weights
    released (``quantize_experts``' default) an eager training step left the biases, which
    require grad, without gradients (the held weights took detached copies), while kept float
    weights and the compiled path gave them theirs; now all agree."""
    grads = {}
    for keep in (False, True):
        model = build("gpt_oss", implementation="moerunner", seed=3)
        mt.quantize_experts(model, "int8_w8a16", keep_float_weights=keep)
        model.train()
        model(_ids()).logits.square().mean().backward()
        grads[keep] = {n: p.grad for n, p in model.named_parameters() if n.endswith("_proj_bias")}
    assert len(grads[True]) == 4  # two layers, two biases each
    for name, want in grads[True].items():
        assert want is not None and grads[False][name] is not None, name
        torch.testing.assert_close(grads[False][name], want, rtol=0, atol=0)


def _clamp_gating(module, limit: float, attr: str | None) -> None:
    """Give one experts module the clamped SwiGLU of DeepSeek-V4 / HY-V4 / GLM-5-Next
    (``silu(gate.clamp(max=L)) * up.clamp(-L, L)``), with ``L`` kept under ``attr``."""

    def _apply_gate(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    module._apply_gate = _apply_gate
    if attr is not None:
        setattr(module, attr, limit)


def _clamped_experts_f64(experts, x, ids, weights, limit):
    """float64: each slot's expert with silu(min(gate, L)) * clamp(up, -L, L)."""
    w13, w2 = experts.gate_up_proj.detach().double(), experts.down_proj.detach().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t].double()).chunk(2)
            h = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


@pytest.mark.parametrize("limit, attr", [(10.0, "swiglu_limit"), (1e3, "limit"), (10.0, None)])
def test_a_clamped_swiglu_runs_or_is_refused_but_never_loses_its_clamp(limit, attr):
    # The probe covered [-10, 10], so a clamp at 10 or beyond matched plain silu and was
    # dropped: relative errors of 0.5-0.75 on the logits of such models once activations
    # passed it. Now the clamp shows on the probe: with its limit kept on the module
    # (DeepSeek-V4's swiglu_limit) the layer runs as swiglu_oai with alpha 1 and beta 0;
    # without it, it is refused.
    model = build("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    _clamp_gating(experts, limit, attr)
    verdict = mt.check_model(model)["model.layers.1.mlp.experts"]
    if attr is None:
        assert verdict is not None and "matches none" in verdict
        return
    assert verdict is None
    act = mt.describe(experts).activation
    assert (act.name, act.alpha, act.beta, act.limit) == ("swiglu_oai", 1.0, 0.0, limit)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, experts.gate_up_proj.shape[-1], generator=g) * 4 * limit**0.5
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    ours = mt.make_experts_forward("torch")(experts, x, ids, weights)
    want = _clamped_experts_f64(experts, x, ids, weights, limit)
    hidden = experts.gate_up_proj.detach() @ x.T  # the clamp is reached: a real test
    assert bool((hidden.abs() > limit).any()) or limit > 100
    assert_close(ours, want, FP32_MAX_REL, what="clamped swiglu")


def test_deepseek_v4_experts_run_with_their_clamp():
    pytest.importorskip("transformers.models.deepseek_v4")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    cfg = DeepseekV4Config(
        hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    experts = DeepseekV4Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 64**-0.5)
        experts.down_proj.normal_(0, 32**-0.5)
    x = torch.randn(16, 64) * 30  # pre-activations well past the limit of 10
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(16)])
    weights = torch.rand(16, 2)
    eager = type(experts).forward.__wrapped__(experts, x, ids, weights)
    ours = mt.make_experts_forward("torch")(experts, x, ids, weights)
    want = _clamped_experts_f64(experts, x, ids, weights, cfg.swiglu_limit)
    assert_close(eager, want, FP32_MAX_REL, what="eager against the definition")
    assert_close(ours, want, FP32_MAX_REL, what="moerunner")
    # The compiled op carries beta 1 only: traced, the layer breaks the graph and runs
    # eagerly (fullgraph=True raises), never with the clamp's beta dropped.
    torch._dynamo.reset()
    fn = mt.make_experts_forward("torch")
    compiled = torch.compile(lambda h: fn(experts, h, ids, weights), backend="eager")
    assert_close(compiled(x), want, FP32_MAX_REL, what="compiled")


def test_a_gpt_oss_alpha_under_another_attribute_name_is_read():
    # MiniMax-M3-VL keeps GPT-OSS's SwiGLU parameters as swiglu_alpha / swiglu_limit.
    model = build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    experts.swiglu_alpha, experts.swiglu_limit = 1.5, experts.limit
    del experts.alpha
    gated = type(experts)._apply_gate

    def _apply_gate(gate_up):
        experts.alpha = experts.swiglu_alpha
        try:
            return gated(experts, gate_up)
        finally:
            del experts.alpha

    experts._apply_gate = _apply_gate
    assert mt.check_model(model)["model.layers.0.mlp.experts"] is None
    assert mt.describe(experts).activation.alpha == 1.5


def test_a_model_whose_moe_blocks_bypass_the_experts_interface_is_named():
    class SparseMoeBlock(torch.nn.Module):  # computes its experts itself, as Llama-4's does
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(4, 2)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([SparseMoeBlock(), torch.nn.Linear(4, 4)])

    with pytest.raises(MoeInputError, match=r"Model has no .*\(SparseMoeBlock\)"):
        mt.use_moerunner(Model())
    with pytest.raises(MoeInputError, match=r"has no transformers experts module: none of"):
        mt.use_moerunner(torch.nn.Linear(4, 4))


def test_a_dense_configuration_of_an_moe_family_is_named_dense():
    # Every layer dense (mlp_only_layers): the message named the model's attention, decoder
    # layer, head and dense MLP "MoE blocks" (their class names hold "Moe").
    from transformers import AutoModelForCausalLM

    from moerunner.integrations.tiny_models import tiny_config

    config = tiny_config("qwen3_moe", mlp_only_layers=[0, 1], num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(MoeInputError, match=r"none of its layers has experts") as error:
        mt.use_moerunner(model)
    assert "Attention" not in str(error.value) and "MoE blocks" not in str(error.value)


@pytest.mark.parametrize(
    ("act_name", "ours"), [("silu", "silu_no_mul"), ("gelu", "gelu_no_mul"), ("relu2", "relu2")]
)
def test_non_gated_experts_are_matched_to_their_activation(act_name, ours):
    # Experts without a gate (has_gate=False: act(x W_up) W_down) were matched against relu2
    # alone; a non-gated silu or gelu layer was refused. Each now runs as its own activation.
    from torch import nn
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, is_transposed=True)
    class PlainExperts(nn.Module):
        def __init__(self, config):  # the decorator's wrapper reads the config
            super().__init__()
            self.config = config
            g = torch.Generator().manual_seed(11)
            self.num_experts = 4
            self.up_proj = nn.Parameter(torch.randn(4, 32, 24, generator=g) / 32**0.5)
            self.down_proj = nn.Parameter(torch.randn(4, 24, 32, generator=g) / 24**0.5)
            self.act_fn = ACT2FN[act_name]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states  # not used: moerunner's forward replaces it

    from transformers import PretrainedConfig

    experts = PlainExperts(PretrainedConfig())
    assert mt.describe(experts).activation.name == ours
    g = torch.Generator().manual_seed(12)
    x = torch.randn(7, 32, generator=g) * 3
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)
    got = mt.make_experts_forward("torch")(experts, x, ids, weights)
    up, down = experts.up_proj.detach().double(), experts.down_proj.detach().double()
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
           "relu2": lambda h: torch.relu(h) ** 2}[act_name]  # fmt: skip
    want = torch.zeros(7, 32, dtype=torch.float64)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            want[t] += float(weights[t, j]) * (act(x[t].double() @ up[e]) @ down[e])
    assert_close(got, want, FP32_MAX_REL, what=f"non-gated {act_name}")


def test_use_moerunner_reaches_experts_built_from_a_copy_of_their_config():
    # Dots3-Note's vision tower builds each experts layer from a per-layer copy of its config,
    # which model.set_experts_implementation does not update: use_moerunner reported those
    # layers as running on moerunner while they stayed on grouped_mm.
    model = build("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    experts.config = copy.copy(experts.config)  # the layer's own copy, as per-layer configs are
    experts.config._experts_implementation = "grouped_mm"
    mt.use_moerunner(model)
    for _, module in mt.experts_modules(model):
        name, function = mt.experts_implementation(module)
        assert name == "moerunner" and function is not None


def test_tiny_config_names_the_families_it_builds():
    from moerunner.integrations.tiny_models import tiny_config

    with pytest.raises(ValueError, match="family 'llama'; accepted: mixtral"):
        tiny_config("llama")


def test_tiny_gpt_oss_builds_without_transformers_rope_warning(capfd):
    # Its YaRN lengths used to be GPT-OSS's own (4096) under a 256-token context, and
    # transformers warned on every tiny GPT-OSS model that the factor did not match them.
    from transformers import AutoModelForCausalLM

    from moerunner.integrations.tiny_models import tiny_config

    cfg = tiny_config("gpt_oss")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model(_ids(length=4))
    assert "rope" not in capfd.readouterr().err.lower()
    rope = cfg.rope_parameters
    assert rope["original_max_position_embeddings"] * rope["factor"] == 256


def test_quantized_copy_follows_kept_float_weights():
    # keep_float_weights: the quantized copy is quantized again after the float weights are
    # edited in place or after a .data write named by weights_changed, as MoE.quantize_ does
    # (it used to keep the first copy, silently).
    from moerunner import weights_changed

    model = build("qwen3_moe")
    mt.quantize_experts(model, "int8_w8a16", keep_float_weights=True)
    ids = _ids(length=6)
    first = _logits(model, "moerunner", ids)
    layers = [experts for _, experts in mt.experts_modules(model)]
    with torch.no_grad():
        for experts in layers:
            experts.gate_up_proj.mul_(-1)
    edited = _logits(model, "moerunner", ids)
    fresh = copy.deepcopy(model)
    mt.quantize_experts(fresh, "int8_w8a16", keep_float_weights=True)
    assert torch.equal(edited, _logits(fresh, "moerunner", ids))
    assert not torch.equal(edited, first)
    for experts in layers:
        experts.gate_up_proj.data.mul_(-1)  # unseen by PyTorch's counter until named
    assert torch.equal(_logits(model, "moerunner", ids), edited)
    weights_changed(*(experts.gate_up_proj for experts in layers))
    assert torch.equal(_logits(model, "moerunner", ids), first)


@pytest.mark.parametrize("limit", [2.0, 7.0])
def test_a_clamp_after_the_activation_runs_as_swiglu_step(limit):
    # Step-3.7 and Bailing-hybrid clamp silu's output: min(silu(gate), L) * clamp(up, -L, L).
    # Such layers were refused (limits up to 11) or, past that, run as a clamp before silu.
    model = build("qwen3_moe")
    experts = model.model.layers[1].mlp.experts

    def _apply_gate(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)

    experts._apply_gate, experts.limit = _apply_gate, limit
    act = mt.describe(experts).activation
    assert (act.name, act.limit) == ("swiglu_step", limit)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, experts.gate_up_proj.shape[-1], generator=g) * 4 * limit**0.5
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    ours = mt.make_experts_forward("torch")(experts, x, ids, weights)
    w13, w2 = experts.gate_up_proj.detach().double(), experts.down_proj.detach().double()
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t].double()).chunk(2)
            h = torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
            want[t] += float(weights[t, j]) * (w2[e] @ h)
    assert_close(ours, want, FP32_MAX_REL, what="swiglu_step")
