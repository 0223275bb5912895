"""Baselines timed in the same process as the backends: transformers' own experts modules.

``eager`` is the per-expert loop transformers runs by default (``experts_implementation=
"eager"``); ``grouped_mm`` is its grouped-GEMM implementation. Both are built from a config
of the matching family (Qwen3-MoE module for gated SiLU/GELU experts, GPT-OSS for the clamped
SwiGLU with biases and interleaved gate/up, Nemotron-H for non-gated relu2) and load the same
weights the backends get (views where the layouts agree, one transposed copy for GPT-OSS).
Where transformers is absent, ``grouped_mm`` falls back to an equivalent plain grouped-GEMM
path built on ``torch._grouped_mm`` and ``eager`` to a per-expert loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..activations import apply_activation
from ..config import Activation, ExpertSpec
from .presets import BenchShape

BASELINES = ("eager", "grouped_mm")
# moerunner activation -> transformers' ACT2FN name of its function (gated: of the gate)
_HF_ACT = {
    "silu": "silu",
    "gelu": "gelu",
    "gelu_tanh": "gelu_pytorch_tanh",
    "relu2": "relu2",
    "silu_no_mul": "silu",
    "gelu_no_mul": "gelu",
    "gelu_tanh_no_mul": "gelu_pytorch_tanh",
}

# (hidden [T, H], ids [T, k] int64, weights [T, k] in hidden dtype) -> [T, H]
BaselineFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _param(t: torch.Tensor, trainable: bool = False) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach(), requires_grad=trainable)


def _transformers_module(
    shape: BenchShape, impl: str, w13, w2, b13, b2, trainable: bool = False
) -> torch.nn.Module:
    if shape.activation == "swiglu_oai":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        if b13 is None:
            raise ValueError("the GPT-OSS baseline needs biases")
        if not shape.gate_up_interleaved:  # GPT-OSS reads gate/up interleaved: reorder rows
            i = shape.intermediate_size
            order = torch.stack([torch.arange(i), torch.arange(i) + i], 1).reshape(-1)
            w13, b13 = w13[:, order.to(w13.device)], b13[:, order.to(b13.device)]
        config = GptOssConfig(
            num_local_experts=shape.num_experts,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            experts_implementation=impl,
        )
        module = GptOssExperts(config)
        module.gate_up_proj = _param(w13.transpose(1, 2).contiguous(), trainable)
        module.gate_up_proj_bias = _param(b13, trainable)
        module.down_proj = _param(w2.transpose(1, 2).contiguous(), trainable)
        module.down_proj_bias = _param(b2, trainable)
        return module
    if b13 is not None or b2 is not None:
        raise ValueError(f"no transformers experts module with biases for {shape.activation!r}")
    if not Activation(shape.activation).gated:  # Nemotron-H's experts: act(x W_up) W_down
        from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        config = NemotronHConfig(
            hidden_size=shape.hidden_size,
            n_routed_experts=shape.num_experts,
            moe_intermediate_size=shape.intermediate_size,
            mlp_hidden_act=_HF_ACT[shape.activation],
            experts_implementation=impl,
        )
        module = NemotronHExperts(config)
        module.up_proj, module.down_proj = _param(w13, trainable), _param(w2, trainable)
        return module
    if shape.gate_up_interleaved:
        raise ValueError(
            f"no transformers experts module with interleaved gate/up for {shape.activation!r}"
        )
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        num_experts=shape.num_experts,
        hidden_size=shape.hidden_size,
        moe_intermediate_size=shape.intermediate_size,
        hidden_act=_HF_ACT[shape.activation],
        experts_implementation=impl,
    )
    module = Qwen3MoeExperts(config)
    module.gate_up_proj, module.down_proj = _param(w13, trainable), _param(w2, trainable)
    return module


def _torch_baseline(shape: BenchShape, impl: str, w13, w2, b13, b2) -> BaselineFn:
    """Plain PyTorch equivalents of the two transformers implementations (no transformers)."""
    spec = ExpertSpec(
        shape.num_experts,
        shape.hidden_size,
        shape.intermediate_size,
        Activation(shape.activation),
        shape.gate_up_interleaved,
    )

    def expert_rows(x, e_of_row, gemm):
        h = gemm(x, w13)
        if b13 is not None:
            h = h + b13[e_of_row]
        y = gemm(apply_activation(h, spec).to(x.dtype), w2)
        return y + b2[e_of_row] if b2 is not None else y

    def grouped(hidden, ids, weights):
        flat = ids.reshape(-1)
        expert_sorted, order = torch.sort(flat)
        counts = torch.bincount(expert_sorted, minlength=shape.num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = hidden[order // ids.shape[1]]
        y = expert_rows(
            x, expert_sorted, lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        )
        y = y * weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden, dtype=torch.float32)
        return out.index_add_(0, order // ids.shape[1], y.float()).to(hidden.dtype)

    def eager(hidden, ids, weights):
        out = torch.zeros_like(hidden)
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            e_rows = torch.full_like(token, e)
            y = expert_rows(hidden[token], e_rows, lambda a, w, e=e: a @ w[e].T)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    return grouped if impl == "grouped_mm" else eager


def build_baseline(
    shape: BenchShape,
    impl: str,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    trainable: bool = False,
) -> tuple[BaselineFn, str]:
    """A callable running baseline ``impl`` on these canonical weights, and what it is.
    ``trainable``: the module's weights and biases require grad (a training step's
    backward computes their gradients, as a model's does); else they are frozen. The
    PyTorch equivalent (without transformers) uses the given tensors, trained or not as
    they are."""
    if impl not in BASELINES:
        raise ValueError(f"baseline: unknown {impl!r}; accepted: {', '.join(BASELINES)}")
    try:
        import transformers
    except ImportError:
        return _torch_baseline(shape, impl, w13, w2, w13_bias, w2_bias), "torch equivalent"
    module = _transformers_module(shape, impl, w13, w2, w13_bias, w2_bias, trainable)

    def run(hidden, ids, weights):
        return module(hidden, ids, weights)

    return run, f"transformers {transformers.__version__} {type(module).__name__} ({impl})"
