# What the triton backend's GEMMs feed their MMA for a quantization scheme (private): the
# weights as stored against a quantized input ("qdot": fp8 or int8 operands), or the weights
# decoded to the hidden dtype. Weight preparation (``_prepare``) and the tile heuristic
# (``tile_config``) both key on it. The ids of the GEMM kernel's operand constexprs
# (``_gemm_kernel``: W_FORMAT, SCALE_FMT, A_SCALE) are defined here, where schemes map to them.

from __future__ import annotations

from ...quant.schemes import QuantScheme

# Weight storage formats (constexpr W_FORMAT).
WF_PLAIN, WF_FP8, WF_INT8, WF_UINT4, WF_E2M1 = 0, 1, 2, 3, 4
# Scale encodings (constexpr SCALE_FMT).
SF_NONE, SF_FP32, SF_E8M0, SF_E4M3 = 0, 1, 2, 3
# A-side scales (constexpr A_SCALE): none, one per row, one per row and K group (the
# weight's K block, GROUP_K).
AS_NONE, AS_ROW, AS_GROUP = 0, 1, 2

#: Activation formats fed to the MMA quantized, with the scales each reads ("row": one per
#: token, "group": one per K group). Other formats are emulated: the fake-quantized input is
#: fed in the hidden dtype (exact for mxfp8 in bf16 / fp32).
QDOT_ACTIVATIONS = {
    "fp8_token": "row",
    "fp8_group128": "group",
    "fp8_group": "group",
    "int8_token": "row",
}


def mma_operand(scheme: QuantScheme) -> str:
    """Operand type the kernels feed ``scheme``'s MMA: "fp8" or "int8" (weights as stored,
    against a quantized input), else "compute" (weights decoded to the hidden dtype)."""
    if scheme.activation_format not in QDOT_ACTIVATIONS:
        return "compute"
    return {"e4m3": "fp8", "int8": "int8"}.get(scheme.weight_format, "compute")
