"""Quantized experts in a transformers model: ``quantize_experts`` and ``load_gpt_oss_mxfp4``.

Both pin quantized weights on each experts module (``_hf_experts.set_quantized``) and, unless
the float weights are kept, release those (emptied parameters) and hold the quantized tensors
as buffers, so ``state_dict`` saves them. A released layer runs only on moerunner's experts
implementation; a forward pre-hook says so where the model asks for another one.
``moerunner.integrations.transformers`` exports these functions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..errors import MoeInputError
from ..memo import forget_memo
from ..runner import forget_prepared
from ..weights import ExpertWeights
from ._hf_experts import (
    UnsupportedExpertsError,
    describe,
    experts_implementation,
    experts_modules,
    layer_name,
    no_experts_error,
    pin_following,
    quantized_float_weights,
    quantized_weights,
    set_quantized,
)

__all__ = ["load_gpt_oss_mxfp4", "quantize_experts", "quantized_scheme"]


def quantize_experts(model, scheme, *, keep_float_weights: bool = False) -> dict[str, str]:
    """Quantize every experts layer of ``model`` into ``scheme`` (a ``moerunner.quant`` name).

    Done once (e.g. right after loading a bf16 checkpoint, on the target device); the
    moerunner experts implementation then runs those layers in ``scheme`` on whatever
    backend serves it. Biases stay in floating point (the module's own parameters). Unless
    ``keep_float_weights``, the float expert parameters are released (emptied) and the
    quantized tensors are held as buffers of each experts module's child
    ``moerunner_quantized``: ``model.state_dict()`` saves them (``torch.save`` or safetensors'
    ``save_file``), and a model of the same config on which ``quantize_experts(model, scheme)``
    was called restores them with ``load_state_dict``. The layers then run only on moerunner.
    With ``keep_float_weights`` the state dict holds the float weights only, and an eager
    call quantizes a layer again after its float weights were edited in place, replaced,
    loaded into or stepped by an optimizer (a traced call does not check: call
    ``quantize_experts`` again after edits there; writes through ``.data`` need
    ``moerunner.weights_changed(parameter)`` first).
    Returns ``{layer path: scheme name}``.
    """
    from ..quant import get_scheme

    _check_keep(keep_float_weights, "quantize_experts")
    resolved = get_scheme(scheme)
    if resolved.activation_scales == "static":
        raise MoeInputError(
            f"quantize_experts: scheme {resolved.name!r} quantizes the experts' inputs with "
            "static scales, which quantize_experts has no calibration for; use its dynamic "
            "form, or build ExpertWeights with moerunner.quantize(..., input_scale=) and run "
            "them through moerunner.MoE.from_weights"
        )
    modules = list(experts_modules(model))
    for path, module in modules:  # before any layer changes
        if _RELEASED_HOOK in module.__dict__:
            raise MoeInputError(
                f"quantize_experts: experts layer {path} already holds quantized experts and "
                "its float weights were released, so there is nothing to quantize again: "
                "load the float model anew (or quantize with keep_float_weights=True to "
                "quantize again later)"
            )
    done: dict[str, str] = {}
    for path, module in modules:
        if keep_float_weights:  # quantized again from the floats after their edits
            pin_following(module, resolved)
        else:
            set_quantized(module, quantized_float_weights(module, resolved), hold=True)
            _release_float_weights(module)
        done[path] = resolved.name
    if not done:
        raise no_experts_error(model)
    if not keep_float_weights:
        _guard_save_pretrained(model)
    return done


def _check_keep(keep_float_weights: object, where: str) -> None:
    if not isinstance(keep_float_weights, bool):
        raise TypeError(
            f"{where}: keep_float_weights must be a bool, got {type(keep_float_weights).__name__}"
        )


class _SavePretrainedRefused:
    """``model.save_pretrained`` of a model whose float experts were released: transformers'
    writer converts the float expert parameters (now empty) into the checkpoint's layout and
    fails inside that conversion, and a folder it wrote could not be loaded back."""

    def __call__(self, *args, **kwargs):
        raise MoeInputError(
            "save_pretrained: this model's experts are held quantized only (quantize_experts "
            "or load_gpt_oss_mxfp4 released the float weights), which transformers' "
            "checkpoint format does not hold: save model.state_dict() (safetensors' "
            "save_file) and load it with load_state_dict into a model on which "
            "quantize_experts(model, scheme) was called (docs/transformers.md), or quantize "
            "with keep_float_weights=True to keep float weights that save_pretrained writes"
        )


def _guard_save_pretrained(model) -> None:
    """``model.save_pretrained`` (and ``push_to_hub``, which calls it) raise a clear error."""
    if hasattr(type(model), "save_pretrained"):
        model.__dict__["save_pretrained"] = _SavePretrainedRefused()


def _release_float_weights(module: torch.nn.Module) -> None:
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        param = getattr(module, name, None)
        if isinstance(param, torch.nn.Parameter):
            # What calls kept on the parameter (prepared forms, views) holds the old memory.
            forget_prepared(param)
            forget_memo(param)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    if _RELEASED_HOOK not in module.__dict__:
        module.__dict__[_RELEASED_HOOK] = module.register_forward_pre_hook(_needs_moerunner)


_RELEASED_HOOK = "_moerunner_released_hook"


def _needs_moerunner(module: torch.nn.Module, args) -> None:
    """Forward pre-hook of an experts layer whose float weights ``quantize_experts``
    released: any other experts implementation would read the emptied parameters."""
    if torch.compiler.is_compiling():
        return
    name, ours = experts_implementation(module)
    if ours is None:
        raise MoeInputError(
            f"experts layer {layer_name(module)} holds its experts quantized only "
            f"(quantize_experts or load_gpt_oss_mxfp4 released the float weights), so it runs "
            f"on moerunner's experts implementation alone, but the model asks for {name!r}: "
            "call moerunner.integrations.transformers.use_moerunner(model) first (or pass "
            "keep_float_weights=True to keep both)"
        )


def load_gpt_oss_mxfp4(
    model,
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    scheme: str = "mxfp4",
    keep_float_weights: bool = False,
) -> list[str]:
    """Keep a GPT-OSS checkpoint's experts in MXFP4: read them from ``paths`` and pin them.

    ``paths``: the checkpoint's safetensors file(s) (``<layer>.gate_up_proj_blocks`` /
    ``_scales`` / ``_bias``, ``<layer>.down_proj_*``), e.g. the files of the directory the model
    was loaded from. The packed bytes and e8m0 scales are used as stored (no dequantization);
    ``scheme`` is ``"mxfp4"`` (bf16 activations) or ``"mxfp4_mxfp8"``. Unless
    ``keep_float_weights``, the experts are held in the model's ``state_dict`` as after
    ``quantize_experts`` (the checkpoint's biases are copied into the bias parameters).
    Returns the layers done.
    """
    from ..quant.checkpoints import gpt_oss_experts_from_safetensors

    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        paths = sorted(
            os.path.join(paths, f) for f in os.listdir(paths) if f.endswith(".safetensors")
        )
    _check_keep(keep_float_weights, "load_gpt_oss_mxfp4")
    done = []
    for path, module in experts_modules(model):
        layout = describe(module)
        if layout.activation.name != "swiglu_oai":
            raise UnsupportedExpertsError(
                f"load_gpt_oss_mxfp4: layer {layer_name(module)} is not a GPT-OSS experts layer"
            )
        found = gpt_oss_experts_from_safetensors(paths, path + ".", scheme=scheme)
        _check_checkpoint_shapes(module, layout, found, path)
        device = module.down_proj.device
        bias_dtype = module.down_proj_bias.dtype if layout.has_bias else torch.float32
        b13, b2 = (
            None if b is None else b.to(device=device, dtype=bias_dtype)
            for b in (found["w13_bias"], found["w2_bias"])
        )
        hold = not keep_float_weights
        if hold and layout.has_bias:  # held weights run with the module's bias parameters
            b13, b2 = _set_biases(module, b13, b2)
        weights = ExpertWeights(
            _to(found["w13"], device),
            _to(found["w2"], device),
            b13,
            b2,
            found["gate_up_interleaved"],
        )
        set_quantized(module, weights, hold=hold)
        if not keep_float_weights:
            _release_float_weights(module)
        done.append(path)
    if not done:
        raise no_experts_error(model)
    if not keep_float_weights:
        _guard_save_pretrained(model)
    return done


def _set_biases(module: torch.nn.Module, b13, b2) -> tuple:
    """Copy the checkpoint's biases into the module's bias parameters (zeros where the
    checkpoint has none) and return those parameters, detached."""
    out = []
    for name, bias in (("gate_up_proj_bias", b13), ("down_proj_bias", b2)):
        param = getattr(module, name)
        with torch.no_grad():
            if bias is None:
                param.zero_()
            elif tuple(bias.shape) != tuple(param.shape):
                raise MoeInputError(
                    f"load_gpt_oss_mxfp4: the checkpoint's {name} of layer {layer_name(module)} "
                    f"has shape {list(bias.shape)}, the model's {list(param.shape)}; load the "
                    "checkpoint of this model"
                )
            else:
                param.copy_(bias)
        out.append(param.detach())
    return tuple(out)


def _check_checkpoint_shapes(module, layout, found: dict, path: str) -> None:
    """The checkpoint's experts must have the model's E, H and I (an E mismatch would drop
    or invent experts silently: the forward skips ids outside the weights)."""
    expected = {}
    num_experts = getattr(module, "num_experts", None)
    if isinstance(num_experts, int):
        expected["E"] = num_experts
    down = getattr(module, "down_proj", None)
    if isinstance(down, torch.Tensor) and down.dim() == 3:  # float weights not yet released
        e, a, b = down.shape
        h, i = (b, a) if layout.transposed else (a, b)
        expected.update(E=e, H=h, I=i)
    e, h, i = found["w2"].shape
    got = {"E": e, "H": h, "I": i}
    wrong = [f"{k}={got[k]} (model: {v})" for k, v in expected.items() if got[k] != v]
    if wrong:
        raise MoeInputError(
            f"load_gpt_oss_mxfp4: the checkpoint's layer {path} has "
            + ", ".join(wrong)
            + "; load the checkpoint of this model"
        )


def _to(qweight, device: torch.device):
    if qweight.device == device:
        return qweight
    from ..quant import QuantizedWeight

    moved = {f: t.to(device) for f, t in qweight.tensors().items()}
    data = moved.pop("data")
    return QuantizedWeight(qweight.scheme, qweight.shape, data, **moved)


def quantized_scheme(module: torch.nn.Module) -> str | None:
    """Scheme name of a layer's pinned quantized weights, None when it runs its float weights."""
    weights = quantized_weights(module)
    return None if weights is None else weights.scheme
