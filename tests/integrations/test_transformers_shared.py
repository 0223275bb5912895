"""Shared experts of Qwen2-MoE / DeepSeek-V3 blocks in the routed moerunner call
(``fuse_shared_experts``, ``use_moerunner(shared_experts=True)``), on tiny random models.

The reference is transformers' own block (router, eager experts loop, separate shared MLP);
fp32 tolerance as in test_transformers.py (the same fp32 math in another summation order).
With adapters, the reference is a copy with merged expert weights (test_transformers_lora):
the shared expert's rows get no LoRA delta.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import moerunner.integrations.transformers as mt  # noqa: E402
from moerunner import MoeInputError  # noqa: E402
from moerunner.testing import assert_close  # noqa: E402

from ._tiny_models import build  # noqa: E402
from .test_transformers_lora import ADAPTERS, _setup  # noqa: E402

FP32_MAX_REL = 1e-5
SHARED_FAMILIES = ["qwen2_moe", "deepseek_v3"]


def _ids(batch=2, length=9, seed=5):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _shared_mlps(model):
    for _, block in model.named_modules():
        name = mt.SHARED_BLOCKS.get(type(block).__name__)
        if name is not None:
            yield getattr(block, name)


def _forbid_shared_mlps(model):
    """Make the blocks' own shared MLPs raise: the fused path must not call them."""

    def refuse(*args, **kwargs):
        raise AssertionError("the block ran its separate shared MLP")

    for mlp in _shared_mlps(model):
        mlp.forward = refuse


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_fused_shared_experts_match_transformers(family):
    model = build(family)
    eager = copy.deepcopy(model)
    ids = _ids()
    blocks = mt.fuse_shared_experts(model)
    assert len(blocks) == (2 if family == "qwen2_moe" else 1)
    mt.use_moerunner(model, backend="torch")
    _forbid_shared_mlps(model)
    with torch.no_grad():
        ref = eager(ids).logits.double()
        out = model(ids).logits.double()
        assert_close(out, ref, FP32_MAX_REL, what=f"{family} fused shared")
        kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kwargs), eager.generate(ids, **kwargs))


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_fused_shared_experts_with_adapters(family, tmp_path):
    model, lora, references = _setup(family, tmp_path)
    ids = _ids(3, 8)
    mt.use_moerunner(model, backend="torch", lora=lora, shared_experts=True)
    mt.set_adapter_ids(model, ADAPTERS)
    _forbid_shared_mlps(model)
    with torch.no_grad():
        out = model(ids).logits.double()
        for row, adapter in enumerate(ADAPTERS.tolist()):
            if adapter < 0:
                continue
            ref = references[adapter](ids[row : row + 1]).logits.double()
            assert_close(out[row : row + 1], ref, FP32_MAX_REL, what=f"{family} row {row}")


def test_blocks_run_their_own_forward_off_moerunner_and_when_restored():
    model = build("qwen2_moe")
    ids = _ids()
    mt.use_moerunner(model, backend="torch", shared_experts=True)
    calls = []
    for mlp in _shared_mlps(model):
        mlp.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        fused = model(ids).logits
        assert calls == []
        model.set_experts_implementation("eager")  # not moerunner: the block's own forward
        eager = model(ids).logits
        assert len(calls) == 2
        assert_close(fused, eager.double(), FP32_MAX_REL)
        model.set_experts_implementation("moerunner")
        mt.fuse_shared_experts(model, enable=False)
        model(ids)
        assert len(calls) == 4
    # the shared weights are re-read after an in-place update
    mt.fuse_shared_experts(model)
    with torch.no_grad():
        before = model(ids).logits
        for mlp in _shared_mlps(model):
            mlp.down_proj.weight.mul_(2.0)
        after = model(ids).logits
        model.set_experts_implementation("eager")
        assert_close(after, model(ids).logits.double(), FP32_MAX_REL)
    assert (after - before).abs().max() > 1e-3


def test_blocks_without_a_fusable_shared_expert_raise():
    with pytest.raises(mt.UnsupportedExpertsError, match="MixtralSparseMoeBlock.*not one"):
        mt.use_moerunner(build("mixtral"), shared_experts=True)
    model = build("qwen2_moe")
    model.model.layers[1].mlp.shared_expert.act_fn = torch.nn.GELU()
    with pytest.raises(mt.UnsupportedExpertsError, match="layers.1.mlp .*gating"):
        mt.fuse_shared_experts(model)
    assert "forward" not in model.model.layers[0].mlp.__dict__  # nothing changed


def test_use_moerunner_changes_nothing_when_the_blocks_are_refused(tmp_path):
    model, lora, _ = _setup("mixtral", tmp_path)
    with pytest.raises(mt.UnsupportedExpertsError, match="not one moerunner fuses"):
        mt.use_moerunner(model, lora=lora, shared_experts=True)
    with pytest.raises(MoeInputError, match="no LoRA adapters attached"):
        mt.set_adapter_ids(model, [0])
    assert model.config._experts_implementation == "eager"


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_a_copy_or_a_saved_fused_model_runs_its_own_blocks(family, tmp_path):
    """The fused forward bound its block by a weak reference, which deepcopy copied as it
    was: a copy ran the original's blocks (edits to the copy changed nothing, and it failed
    once the original was gone), and torch.save of the model could not pickle it."""
    import gc
    import io

    model = build(family)
    mt.use_moerunner(model, backend="torch", shared_experts=True)
    ids = _ids()
    copied = copy.deepcopy(model)
    reference = build(family)  # the same weights, transformers' own blocks
    with torch.no_grad():
        for m in (copied, reference):
            for name, p in m.named_parameters():
                if ".mlp." in name:
                    p.mul_(0.5)  # the copy's MoE blocks only
        want = reference(ids).logits.double()
        before = model(ids).logits
        buffer = io.BytesIO()
        torch.save(model, buffer)
        del model
        gc.collect()
        assert_close(copied(ids).logits.double(), want, FP32_MAX_REL, what=f"{family} copy")
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(loaded(ids).logits, before)


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_fused_shared_experts_get_their_gradients(family):
    """In grad mode the fused call took the shared MLP as detached weights: the loss and
    every other gradient matched, but the shared MLP's (and Qwen2's shared gate's) stayed
    None, so an optimizer never updated them. Training runs the block's own forward."""
    torch.manual_seed(0)
    ref = build(family).train()
    model = copy.deepcopy(ref)
    mt.use_moerunner(model, backend="torch", shared_experts=True)
    ids = _ids()
    for m in (ref, model):
        m(input_ids=ids, labels=ids).loss.backward()
    want = dict(ref.named_parameters())
    shared = [n for n, p in model.named_parameters() if "shared_expert" in n]
    assert shared
    for name, p in model.named_parameters():
        if want[name].grad is None:
            continue
        assert p.grad is not None, name
        assert_close(p.grad, want[name].grad, FP32_MAX_REL, what=name)
    with torch.no_grad():  # inference still runs the fused call
        _forbid_shared_mlps(model)
        model(input_ids=ids)


@pytest.mark.parametrize("family", SHARED_FAMILIES)
@pytest.mark.parametrize("scheme", ["int8_w8a16", "fp8_channel"])
def test_fused_shared_mlp_beside_quantized_experts_stays_float(family, scheme):
    """``quantize_experts`` then fused shared experts: the fused call quantized the shared
    MLP into the routed scheme, which the block's own forward (unfused, or under
    ``torch.compile``) keeps in floating point, so the two runs were 2-5 % apart. The fused
    shared MLP now stays float: the fused model's logits equal the unfused one's to fp32
    rounding."""
    model = build(family)
    mt.use_moerunner(model, backend="torch")
    mt.quantize_experts(model, scheme)
    unfused = copy.deepcopy(model)
    mt.fuse_shared_experts(model)
    _forbid_shared_mlps(model)
    ids = _ids()
    with torch.no_grad():
        ref = unfused(ids).logits.double()
        out = model(ids).logits.double()
    assert_close(out, ref, FP32_MAX_REL, what=f"{family} {scheme} fused shared")
