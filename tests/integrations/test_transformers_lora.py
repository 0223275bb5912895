"""Several LoRA adapters, selected per sequence, through the transformers integration.

Adapters are written as PEFT saves them (``target_parameters`` wrappers on transformers 5's
fused expert parameters for every family; per-expert ``w1`` / ``w3`` / ``w2`` modules of
transformers 4 for Mixtral), read with ``load_peft_adapter_set`` and attached with
``use_moerunner(model, lora=...)``. The reference never uses moerunner: per adapter, a copy
of the model whose expert parameters have the float64 merged update (PEFT's formula) added
runs transformers' own eager experts on that adapter's sequences. fp32 tolerance as in
test_transformers.py (same math in another summation order; the merge adds one fp32
rounding of the weights, 6e-8 relative).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner import MoeInputError  # noqa: E402
from moerunner.lora_checkpoints import load_peft_adapter_set  # noqa: E402
from moerunner.testing import assert_close  # noqa: E402

from ._tiny_models import FAMILIES, Recorder, build, compiled_static_generate  # noqa: E402

FP32_MAX_REL = 1e-5
PREFIX = "base_model.model."
ADAPTERS = torch.tensor([1, -1, 0])  # per sequence of the batch
NEW_TOKENS = 8


def _factors(lora):
    return (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)


def _save(folder, tensors, **config):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    safetensors_torch.save_file(tensors, str(folder / "adapter_model.safetensors"))


def _fused_adapter(model, folder, g, r=4, alpha=8):
    """target_parameters adapter on every experts layer; returns {path: (d13, d2)} float64
    scaled deltas in the canonical [E, 2I, H] / [E, H, I] layout."""
    tensors, deltas = {}, {}
    for path, module in mt.experts_modules(model):
        w13, w2 = mt.float_weights(module).w13, mt.float_weights(module).w2
        (e, n13, h), i = w13.shape, w2.shape[2]
        out = []
        for wrap, k_in, n_out in (("base_layer.", h, n13), ("", i, h)):
            a = torch.randn(e * r, k_in, generator=g) * k_in**-0.5
            b = torch.randn(n_out, r * e, generator=g) * r**-0.5
            tensors[f"{PREFIX}{path}.{wrap}lora_A.weight"] = a
            tensors[f"{PREFIX}{path}.{wrap}lora_B.weight"] = b
            wa, wb = a.double().reshape(e, r, k_in), b.double().reshape(n_out, r, e)
            out.append(alpha / r * torch.einsum("o r e, e r i -> e o i", wb, wa))
        deltas[path] = tuple(out)
    _save(folder, tensors, r=r, lora_alpha=alpha, target_parameters=["gate_up_proj", "down_proj"])
    return deltas


def _mixtral_v4_adapter(model, folder, g, r=2, alpha=6):
    """Per-expert w1 / w3 / w2 Linear adapters as PEFT saved them for transformers 4."""
    tensors, deltas = {}, {}
    for path, module in mt.experts_modules(model):
        w2 = mt.float_weights(module).w2
        e, h, i = w2.shape
        v4 = path.replace(".mlp.experts", ".block_sparse_moe.experts")
        d13 = torch.zeros(e, 2 * i, h, dtype=torch.float64)
        d2 = torch.zeros(e, h, i, dtype=torch.float64)
        for x in range(e):
            for proj, k_in, n_out in (("w1", h, i), ("w3", h, i), ("w2", i, h)):
                a = torch.randn(r, k_in, generator=g) * k_in**-0.5
                b = torch.randn(n_out, r, generator=g) * r**-0.5
                tensors[f"{PREFIX}{v4}.{x}.{proj}.lora_A.weight"] = a
                tensors[f"{PREFIX}{v4}.{x}.{proj}.lora_B.weight"] = b
                d = alpha / r * (b.double() @ a.double())
                if proj == "w2":
                    d2[x] = d
                else:
                    d13[x, slice(0, i) if proj == "w1" else slice(i, 2 * i)] = d
        deltas[path] = (d13, d2)
    _save(folder, tensors, r=r, lora_alpha=alpha, target_modules=["w1", "w2", "w3"])
    return deltas


def _merged(model, deltas):
    merged = copy.deepcopy(model)
    modules = dict(mt.experts_modules(merged))
    with torch.no_grad():
        for path, (d13, d2) in deltas.items():
            module = modules[path]
            if module.is_transposed:  # parameters stored [E, in, out]
                d13, d2 = d13.transpose(1, 2), d2.transpose(1, 2)
            module.gate_up_proj.copy_((module.gate_up_proj.double() + d13).float())
            module.down_proj.copy_((module.down_proj.double() + d2).float())
    merged.set_experts_implementation("eager")
    return merged


def _setup(family, tmp_path):
    model = build(family)
    g = torch.Generator().manual_seed(7)
    first = _fused_adapter(model, tmp_path / "first", g)
    if family == "mixtral":
        second = _mixtral_v4_adapter(model, tmp_path / "second", g)
    else:
        second = _fused_adapter(model, tmp_path / "second", g, r=8, alpha=4)
    lora = load_peft_adapter_set([tmp_path / "first", tmp_path / "second"], model.config)
    references = [_merged(model, first), _merged(model, second)]
    return model, lora, references


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_per_sequence_match_merged_eager_models(family, tmp_path):
    model, lora, references = _setup(family, tmp_path)
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    mt.use_moerunner(model, backend="torch", lora=lora)
    mt.set_adapter_ids(model, ADAPTERS)
    with torch.no_grad():
        out = model(ids).logits.double()
        for row, adapter in enumerate(ADAPTERS.tolist()):
            if adapter < 0:
                reference = copy.deepcopy(model)
                reference.set_experts_implementation("eager")
            else:
                reference = references[adapter]
            ref = reference(ids[row : row + 1]).logits.double()
            assert_close(out[row : row + 1], ref, FP32_MAX_REL, what=f"{family} row {row}")
        for row, adapter in ((0, 1), (2, 0)):  # the other adapter moves the logits far more
            other = references[1 - adapter](ids[row : row + 1]).logits.double()
            assert (other - out[row : row + 1]).abs().max() > 1e-2 * out.abs().max()
        # per token ids [B, S] give the same answer; None runs the base experts
        mt.set_adapter_ids(model, ADAPTERS[:, None].expand(3, 10))
        assert_close(model(ids).logits, out, FP32_MAX_REL, what="per-token ids")
        mt.set_adapter_ids(model, None)
        model.set_experts_implementation("eager")
        plain = model(ids).logits.double()
        mt.use_moerunner(model, backend="torch")
        assert_close(model(ids).logits, plain, FP32_MAX_REL, what="no adapter ids")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_generate_with_adapters_per_sequence(family, tmp_path):
    """Per-sequence ids serve the prefill and every decode step of generate."""
    model, lora, references = _setup(family, tmp_path)
    ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    mt.use_moerunner(model, backend="torch", lora=lora)
    mt.set_adapter_ids(model, ADAPTERS)
    with torch.no_grad():
        out = model.generate(ids, pad_token_id=0, **kwargs)
        for row, adapter in enumerate(ADAPTERS.tolist()):
            if adapter < 0:
                continue
            ref = references[adapter].generate(ids[row : row + 1], pad_token_id=0, **kwargs)
            assert torch.equal(out[row : row + 1], ref), f"{family} row {row}"


def test_lora_misuse_raises_naming_the_problem(tmp_path):
    model, lora, _ = _setup("qwen3_moe", tmp_path)
    with pytest.raises(MoeInputError, match="no LoRA adapters attached"):
        mt.set_adapter_ids(model, ADAPTERS)
    mt.use_moerunner(model, backend="torch", lora=lora)
    with pytest.raises(MoeInputError, match=r"must lie in \[-1, 2\)"):
        mt.set_adapter_ids(model, [0, 2, 1])
    with pytest.raises(MoeInputError, match="int64, int32"):
        mt.set_adapter_ids(model, torch.zeros(3))
    mt.set_adapter_ids(model, [0, 1])
    with pytest.raises(MoeInputError, match=r"adapter ids \[2\] fit neither the 9 tokens"):
        with torch.no_grad():
            model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="MoeLoraSet"):
        mt.attach_lora(model, lora.layer(0))
    other = build("qwen3_moe", num_experts=4)
    with pytest.raises(MoeInputError, match="4 experts, its adapters' factors 8"):
        mt.use_moerunner(other, lora=lora)
    deep = build("deepseek_v3")  # layer 0 is dense
    with pytest.raises(MoeInputError, match=r"cover layers \[0\]"):
        mt.attach_lora(deep, lora)
    mt.attach_lora(model, None)
    with torch.no_grad():
        model(torch.zeros(1, 9, dtype=torch.long))  # detached: the stale ids are not read


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_adapters_on_the_gpu_with_triton(family, tmp_path):
    """triton on CUDA (hooked kernel sequence, gathered deltas), fp32. Bound 1e-4: triton's
    and cuBLAS's GEMMs reduce in other orders than the CPU's; the adapters move the logits
    by far more (checked)."""
    model, _, references = _setup(family, tmp_path)
    lora = load_peft_adapter_set(
        [tmp_path / "first", tmp_path / "second"], model.config, device="cuda"
    )
    model.to("cuda")
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1)).cuda()
    mt.use_moerunner(model, backend="triton", lora=lora, shared_experts=family == "qwen2_moe")
    mt.set_adapter_ids(model, ADAPTERS)
    with torch.no_grad():
        out = model(ids).logits.double()
        for row, adapter in enumerate(ADAPTERS.tolist()):
            if adapter < 0:
                continue
            reference = references[adapter].to("cuda")
            ref = reference(ids[row : row + 1]).logits.double()
            assert_close(out[row : row + 1], ref, 1e-4, what=f"{family} row {row}")
            base = references[1 - adapter].to("cuda")(ids[row : row + 1]).logits.double()
            assert (base - ref).abs().max() > 1e-2 * ref.abs().max()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("base", ["frozen", "trained"])
def test_adapters_on_every_layer_train_like_a_merged_float64_model(family, base, tmp_path):
    """Training PEFT adapters on every experts layer (PEFT's usual setting), with the base
    model frozen or trained beside them: a grad-mode forward with adapters raised beyond one
    adapted layer in a frozen model. It now trains: the logits and the gradients of every
    factor (and of every base parameter when trained) match autograd of a float64 copy of
    the model running transformers' eager experts on W + s B A, built from float64 twins of
    the factors (fp32 on one side, the bound of the logits above)."""
    model = build(family)
    _fused_adapter(model, tmp_path / "a", torch.Generator().manual_seed(7))
    lora = load_peft_adapter_set([tmp_path / "a"], model.config)
    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")
    mt.use_moerunner(model, backend="torch", lora=lora)
    mt.set_adapter_ids(model, torch.tensor([0, 0]))
    for m in (model, reference):
        m.requires_grad_(base == "trained")
    factors = {i: [t.requires_grad_() for t in _factors(w)] for i, w in lora.layers.items()}
    twins = {i: [t.detach().double().requires_grad_() for t in f] for i, f in factors.items()}
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 128, (2, 6), generator=g)
    out = model(ids).logits.double()
    proj = torch.randn(out.shape, dtype=torch.float64, generator=g)
    (out * proj).sum().backward()
    modules = dict(mt.experts_modules(reference))
    merged = {}
    for i, (a13, b13, a2, b2) in twins.items():
        path = f"model.layers.{i}.mlp.experts"
        module, scaling = modules[path], lora.layers[i].scaling
        s = float(scaling[0]) if isinstance(scaling, torch.Tensor) else float(scaling)
        d13, d2 = s * (b13[0] @ a13[0]), s * (b2[0] @ a2[0])
        if module.is_transposed:  # parameters stored [E, in, out]
            d13, d2 = d13.transpose(1, 2), d2.transpose(1, 2)
        merged[f"{path}.gate_up_proj"] = module.gate_up_proj + d13
        merged[f"{path}.down_proj"] = module.down_proj + d2
    assert len(merged) == 4  # both layers adapted
    ref = torch.func.functional_call(reference, merged, (ids,)).logits
    assert_close(out, ref.detach(), FP32_MAX_REL, what="logits")
    (ref * proj).sum().backward()
    for i, got in factors.items():
        for name, g_, w in zip(("w13_a", "w13_b", "w2_a", "w2_b"), got, twins[i], strict=True):
            assert_close(g_.grad, w.grad, FP32_MAX_REL, what=f"layer {i} {name}")
    if base == "trained":
        want = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert_close(p.grad, want[name].grad, FP32_MAX_REL, what=f"d/d {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_new_adapters_train_and_save_as_peft_adapters_that_load_back(family, tmp_path):
    """The fine-tuning loop end to end: ``new_lora_set`` starts every experts layer's
    adapter at the base model (B = 0, as PEFT initialises it), a few optimizer steps of the
    factors alone (base frozen) lower the loss, and ``save_peft_adapter`` writes them in
    PEFT's fused-parameter layout, which ``load_peft_adapter_set`` reads back to the same
    updates: logits of the reloaded adapter equal the trained one's (fp32 bound: the scaling
    folded into B rounds once)."""
    from moerunner.lora_checkpoints import new_lora_set, save_peft_adapter

    model = build(family)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(ids).logits
    lora = new_lora_set(model, r=4, lora_alpha=8)
    assert sorted(lora.layers) == sorted(
        int(p.split("layers.")[1].split(".")[0]) for p, _ in mt.experts_modules(model)
    )
    mt.use_moerunner(model, backend="torch", lora=lora)
    mt.set_adapter_ids(model, torch.tensor([0, 0]))
    model.requires_grad_(False)
    with torch.no_grad():
        assert_close(model(ids).logits, base.double(), FP32_MAX_REL, what="fresh adapter")
    factors = [t for w in lora.layers.values() for t in _factors(w)]
    assert all(t.requires_grad for t in factors)
    optimizer = torch.optim.Adam(factors, lr=1e-2)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    with torch.no_grad():
        trained = model(ids).logits.double()
    folder = save_peft_adapter(lora, tmp_path / "trained", model)
    reloaded = load_peft_adapter_set([folder], model.config)
    assert sorted(reloaded.layers) == sorted(lora.layers)
    mt.attach_lora(model, reloaded)
    mt.set_adapter_ids(model, torch.tensor([0, 0]))
    with torch.no_grad():
        assert_close(model(ids).logits, trained, FP32_MAX_REL, what="reloaded adapter")
        assert (trained - base.double()).abs().max() > 1e-3  # the adapter moved the logits


def _adapted(family, scheme=None, train=False):
    """A tiny model with two adapters on every experts layer (``new_lora_set``, B given
    random values so they change the logits), on the torch backend; quantized experts
    under ``scheme``; factors trainable with ``train`` (the base frozen)."""
    from moerunner.lora_checkpoints import new_lora_set

    model = build(family)
    lora = new_lora_set(model, r=4, lora_alpha=8, num_adapters=2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in lora.layers.values():
            for b in (w.w13_b, w.w2_b):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    mt.use_moerunner(model, backend="torch", lora=lora)
    if scheme is not None:
        mt.quantize_experts(model, scheme)
    model.requires_grad_(False)
    factors = [t.requires_grad_(train) for w in lora.layers.values() for t in _factors(w)]
    return model, factors


@pytest.mark.parametrize(
    ("family", "scheme"), [("qwen3_moe", None), ("gpt_oss", None), ("qwen3_moe", "fp8_channel")]
)
def test_adapters_compile_fullgraph_and_decode_under_a_compiled_static_cache_step(family, scheme):
    """A compiled experts call with adapters attached raised ("run eagerly only"). The
    adapters now enter the experts' custom op: a fullgraph forward has one op per layer and
    the eager logits (which the adapters move), and a static-cache generate whose decode
    step transformers compiles gives the eager greedy ids (GPT-OSS: its transposed experts;
    fp8_channel: quantized ones)."""
    torch._dynamo.reset()
    model, _ = _adapted(family, scheme)
    layers = len(list(mt.experts_modules(model)))
    ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(2))
    mt.set_adapter_ids(model, ADAPTERS)
    counter = Recorder()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model.forward, fullgraph=True, backend=counter)(ids).logits
        assert counter.moerunner_calls() == [layers]
        assert_close(compiled, eager.double(), FP32_MAX_REL, what="compiled logits")
        mt.set_adapter_ids(model, None)
        base = model(ids).logits
        assert (base - eager)[ADAPTERS >= 0].abs().max() > 1e-3 * eager.abs().max()
        assert_close(eager[1], base[1].double(), FP32_MAX_REL, what="the row without adapter")
        mt.set_adapter_ids(model, ADAPTERS)
        counter = Recorder()
        want, got = compiled_static_generate(model, ids, NEW_TOKENS, counter)
    calls = counter.moerunner_calls()
    assert calls and all(c == layers for c in calls), calls
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("family", "scheme"), [("qwen3_moe", None), ("gpt_oss", None), ("qwen3_moe", "int8")]
)
def test_adapters_train_in_a_compiled_fullgraph_step_as_eagerly(family, scheme):
    """Training adapters with a compiled forward (the base frozen, plain or quantized
    experts: QLoRA): every factor's gradient equals the eager step's (fp32, summation order
    only)."""
    torch._dynamo.reset()
    model, factors = _adapted(family, scheme, train=True)
    mt.set_adapter_ids(model, torch.tensor([0, 1]))
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(4))
    grads = []
    for forward in (torch.compile(model.forward, fullgraph=True, backend="aot_eager"), model):
        for t in factors:
            t.grad = None
        forward(ids).logits.square().mean().backward()
        grads.append([t.grad.clone() for t in factors])
    assert all(g.abs().max() > 0 for g in grads[1])
    for i, (got, want) in enumerate(zip(*grads, strict=True)):
        assert_close(got, want.double(), FP32_MAX_REL, what=f"factor {i}")
