"""Tiny random configs of every MoE family the transformers integration covers.

For tests, examples and smoke runs without a model hub: ``tiny_config(family)`` gives a
2-layer config (hidden 64, 8 experts of width 32, top-2) of a transformers model type, with
each family's own routing features switched on (shared experts, grouped top-k, biases...).
"""

from __future__ import annotations

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_config(family: str, **overrides):
    """A tiny config of ``family`` (transformers model type, one of ``FAMILIES``)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"tiny_config: family {family!r}; accepted: {', '.join(FAMILIES)}")
    extra = {
        "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
        "qwen3_moe": dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=16,
        ),
        "deepseek_v3": dict(
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
        "gpt_oss": dict(
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    }[family]
    kwargs = {**_COMMON, **extra, **overrides}
    if family == "gpt_oss" and "rope_parameters" not in overrides:
        # GPT-OSS's YaRN scaling, stretched from the tiny context's share of its factor
        # (otherwise transformers warns that the factor and the lengths disagree)
        rope = getattr(AutoConfig.for_model(family), "rope_parameters", None) or {}
        if "factor" in rope:
            original = max(1, kwargs["max_position_embeddings"] // int(rope["factor"]))
            kwargs["rope_parameters"] = {**rope, "original_max_position_embeddings": original}
    return AutoConfig.for_model(family, **kwargs)


def tiny_peft_adapter(model, folder, *, r: int = 4, lora_alpha: float = 8.0, seed: int = 0):
    """Write a random PEFT LoRA adapter over ``model``'s experts into ``folder`` and return it.

    The layout is what PEFT saves for transformers 5 experts with
    ``target_parameters=["gate_up_proj", "down_proj"]`` (``adapter_config.json`` and
    ``adapter_model.safetensors``); B is random too, so the adapter changes the output.
    """
    import json
    import os

    import torch
    from safetensors.torch import save_file

    from .transformers import experts_modules, float_weights

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in experts_modules(model):
        weights = float_weights(module)
        (experts, rows, hidden), inter = weights.w13.shape, weights.w2.shape[2]
        # gate_up_proj's wrapper is the inner one (base_layer.), down_proj's the outer one
        for wrap, k_in, n_out in (("base_layer.", hidden, rows), ("", inter, hidden)):
            key = f"base_model.model.{path}.{wrap}"
            tensors[key + "lora_A.weight"] = (
                torch.randn(experts * r, k_in, generator=gen) / k_in**0.5
            )
            tensors[key + "lora_B.weight"] = torch.randn(n_out, r * experts, generator=gen) / r
    os.makedirs(folder, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": lora_alpha,
        "target_modules": [],
        "target_parameters": ["gate_up_proj", "down_proj"],
    }
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return folder
