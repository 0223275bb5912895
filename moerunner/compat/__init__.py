"""Entry points with the argument names and semantics of peer MoE code bases.

``moerunner.compat.vllm`` (``fused_experts``, ``fused_moe``, ``fused_topk``,
``grouped_topk``) and ``moerunner.compat.sglang`` (``fused_experts``, ``fused_moe``,
``select_experts``, ``TopK``, ``TopKConfig``, ``StandardTopKOutput``, ``MoeRunnerConfig``) translate
their arguments once into moerunner's values (``moerunner.fused_moe``,
``moerunner.select_experts``, ``QuantizedWeight``) and call the native API; nothing is
computed here. Arguments without a moerunner mapping raise ``MoeInputError`` naming the
argument. The table of what maps is in docs/compat.md.
"""

from . import sglang, vllm

__all__ = ["sglang", "vllm"]
