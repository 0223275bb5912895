"""Tiny random transformers 5 MoE models per family, built from configs (no hub).

Shapes are small (2 layers, hidden 32-64, 4-8 experts) so a forward pass and a 16-token
generate take milliseconds on CPU. ``build(family, dtype, implementation)`` returns a model
in eval mode with the same weights for every implementation (fixed seed).
"""

from __future__ import annotations

import torch

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
    """A tiny config of ``family`` (transformers model type)."""
    from transformers import AutoConfig

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
    return AutoConfig.for_model(family, **kwargs)


def build(
    family: str,
    dtype: torch.dtype = torch.float32,
    implementation: str = "eager",
    seed: int = 0,
    **overrides,
):
    """A tiny random causal LM of ``family`` with non-trivial router/bias weights."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, experts_implementation=implementation
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Routers are zero-initialised in some families (ties would make ids arbitrary)
            # and biases are zero: give every tensor random values at a sane scale.
            if p.dim() == 1 and "norm" in name:
                continue
            fan_in = p.shape[-1] if p.dim() > 1 else 16
            p.copy_(torch.randn(p.shape, generator=gen) * fan_in**-0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model.to(dtype).eval()
