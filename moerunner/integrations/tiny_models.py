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
