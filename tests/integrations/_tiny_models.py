"""Tiny random transformers 5 MoE models per family, built from configs (no hub).

Shapes are small (2 layers, hidden 32-64, 4-8 experts) so a forward pass and a 16-token
generate take milliseconds on CPU. ``build(family, dtype, implementation)`` returns a model
in eval mode with the same weights for every implementation (fixed seed).
"""

from __future__ import annotations

import torch

from moerunner.integrations.tiny_models import FAMILIES, tiny_config

__all__ = ["FAMILIES", "build", "tiny_config"]


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


MOERUNNER_OPS = [
    ["moerunner", name]
    for name in ("fused_experts", "fused_experts_quantized", "fused_experts_transposed")
]


class Recorder:
    """A compile backend that keeps the graphs it is given, then runs them with aot_eager."""

    def __init__(self):
        self.graphs = []

    def __deepcopy__(self, memo):  # transformers deep-copies its compile config
        return self

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def moerunner_calls(self) -> list[int]:
        """Per graph compiled: how many moerunner experts ops it calls."""
        return [
            sum(
                node.op == "call_function" and str(node.target).split(".")[:2] in MOERUNNER_OPS
                for node in gm.graph.nodes
            )
            for gm in self.graphs
        ]


def compiled_static_generate(model, ids: torch.Tensor, new_tokens: int, recorder: Recorder):
    """Greedy ``generate`` over a static cache, eagerly and with transformers' compiled
    decode step (fullgraph, compiled by ``recorder``, also on a CPU): (eager ids, compiled
    ids)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, mode="default", backend=recorder)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    eager = model.generate(ids, disable_compile=True, **kwargs)
    return eager, model.generate(ids, compile_config=config, **kwargs)
