# Stage "experts" of the triton backend: the activation between the two GEMMs (private).
#
# ``activate`` is the math, applied in GEMM1's epilogue (``_gemm_kernel``) on the float32
# accumulator; ``activation_kernel`` applies the same math as a launch of its own on GEMM1's
# stored float32 output, for the hooked sequence (``hooked.py``), where a hook edits that
# output before the activation. Gated activations take act(gate) * up, the clamped SwiGLU
# of GPT-OSS (``swiglu_oai``) its alpha and limit, the clamp after silu (``swiglu_step``) its
# limit, Kimi-K3's soft caps (``situ``) its beta in the alpha slot and its linear beta in the
# limit slot (0: none).

from __future__ import annotations

import triton
import triton.language as tl

from . import _pdl

# Activation ids (constexpr ACT); ACT_NONE is used by GEMM2.
ACT_NONE, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_SWIGLU_OAI, ACT_RELU2 = 0, 1, 2, 3, 4, 5
ACT_SWIGLU_STEP, ACT_SITU = 6, 7


@triton.jit
def _soft_cap(x, cap):
    """cap * tanh(x / cap) in float32, as cap * (2 sigmoid(2x / cap) - 1): Triton has no
    tanh in every version; finite for any |x| (sigmoid saturates to 0 or 1)."""
    return cap * (2.0 * tl.sigmoid((2.0 / cap) * x) - 1.0)


@triton.jit
def activate(g, u, alpha, limit, ACT: tl.constexpr):
    """Gated (act(g) * u) or non-gated (act(g) * 1: callers pass u = 1; relu2 ignores u)
    activation in float32; ``ACT`` one of the ids above (literals here: a jit function
    reads constexpr arguments)."""
    if ACT == 1:
        out = g * tl.sigmoid(g) * u
    elif ACT == 2:
        out = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == 3:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        out = g * tl.sigmoid(2.0 * inner) * u  # 0.5 * (1 + tanh(x)) == sigmoid(2x)
    elif ACT == 4:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = g * tl.sigmoid(alpha * g) * (u + 1.0)
    elif ACT == 5:
        r = tl.maximum(g, 0.0)
        out = r * r
    elif ACT == 6:  # the clamp after the activation
        s = tl.minimum(g * tl.sigmoid(g), limit)
        out = s * tl.minimum(tl.maximum(u, -limit), limit)
    elif ACT == 7:  # situ: alpha is its beta, limit its linear beta (0: up as is)
        s = _soft_cap(g, alpha) * tl.sigmoid(g)
        capped = _soft_cap(u, tl.where(limit > 0.0, limit, 1.0))
        out = s * tl.where(limit > 0.0, capped, u)
    else:
        out = g
    return out


@triton.jit
def activation_kernel(
    h_ptr,
    out_ptr,
    inter,
    alpha,
    limit,
    stride_hm,
    stride_om,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    PDL: tl.constexpr,
):
    """GEMM1's activation on its stored float32 output (the hooked sequence): row
    ``program_id(0)``, columns ``program_id(1)`` * BLOCK on of ``inter``. Gated: gate then up
    halves, or alternating gate/up columns (INTERLEAVED)."""
    _pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    h_row = h_ptr + row * stride_hm
    if GATED and INTERLEAVED:
        g = tl.load(h_row + 2 * offs, mask=mask, other=0.0)
        u = tl.load(h_row + 2 * offs + 1, mask=mask, other=0.0)
    elif GATED:
        g = tl.load(h_row + offs, mask=mask, other=0.0)
        u = tl.load(h_row + inter + offs, mask=mask, other=0.0)
    else:
        g = tl.load(h_row + offs, mask=mask, other=0.0)
        u = tl.full(g.shape, 1.0, tl.float32)  # act(g) * 1
    out = activate(g.to(tl.float32), u.to(tl.float32), alpha, limit, ACT)
    tl.store(out_ptr + row * stride_om + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
