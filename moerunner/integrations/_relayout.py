"""Transposed (GPT-OSS) experts parameters held over canonical storage (private helper).

Stage: the edge, once, before the forward calls. A transposed experts module stores
``gate_up_proj [E, H, N]`` and ``down_proj [E, I, H]``; the kernels read the canonical
``w13 [E, N, H]`` / ``w2 [E, H, I]`` fastest when those are contiguous. ``relayout(module,
"canonical")`` replaces each parameter's data with a transposed view of a contiguous
canonical tensor: the parameter keeps its object, name, shape and values (transformers' code,
``state_dict``, ``load_state_dict`` and optimizers see what they saw), its memory is the
canonical tensor, and moerunner's canonical view of it (``canonical_from_transposed``) is that
tensor itself: one copy of the experts, read contiguously. ``relayout(module, "stored")`` is
the inverse (contiguous in the stored shape again). ``blocker`` says why a module must keep
its stored layout (moerunner then reads it through strided views, as before).
"""

from __future__ import annotations

import torch

from ._hf_experts import UnsupportedExpertsError, describe, forget_weights, quantized_weights

LAYOUTS = ("canonical", "stored")
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def _weights(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    found = []
    for name in _WEIGHTS:
        param = module._parameters.get(name)
        if param is not None:
            found.append((name, param))
    return found


def in_layout(t: torch.Tensor, layout: str) -> bool:
    """Whether a stored-shape ``[E, a, b]`` tensor's memory is contiguous in ``layout``:
    ``"canonical"`` (its transpose ``[E, b, a]`` is) or ``"stored"`` (it is)."""
    return (t.transpose(1, 2) if layout == "canonical" else t).is_contiguous()


def storage_owners(model: torch.nn.Module) -> dict[tuple[str, int], set[int]]:
    """``{(device, storage pointer): ids of the distinct tensors on it}`` over the model's
    parameters and buffers (a parameter tied under several names counts once)."""
    owners: dict[tuple[str, int], set[int]] = {}
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        owners.setdefault(key, set()).add(id(t))
    return owners


def _offloading_hook(module: torch.nn.Module) -> bool:
    """An accelerate hook that swaps the module's weights in per forward (offload)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    return any(
        getattr(h, "offload", False) or getattr(h, "weights_map", None) is not None for h in hooks
    )


def blocker(model: torch.nn.Module, path: str, module: torch.nn.Module, owners: dict) -> str | None:
    """Why ``module`` (at ``path`` in ``model``) must keep its stored layout, or None."""
    try:
        layout = describe(module)
    except UnsupportedExpertsError as exc:
        return str(exc)
    if not layout.transposed:
        return None  # stored canonical already: nothing to re-lay
    if quantized_weights(module) is not None:
        return "it runs quantized weights (its float weights are not read)"
    parts = path.split(".") if path else []
    for depth in range(len(parts) + 1):
        if _offloading_hook(model.get_submodule(".".join(parts[:depth]))):
            return "its weights are offloaded (an accelerate hook loads them per forward)"
    for name, param in _weights(module):
        if param.dim() != 3 or param.numel() == 0:
            return f"{name} is not a non-empty 3-D tensor (shape {list(param.shape)})"
        if param.device.type == "meta":
            return f"{name} is on the meta device (offloaded or not loaded)"
        if type(param.data) is not torch.Tensor:
            return f"{name} is a {type(param.data).__name__}, not a plain tensor"
        if param.is_inference():
            return f"{name} is an inference tensor (its data cannot be replaced)"
        key = (str(param.device), param.untyped_storage().data_ptr())
        if len(owners.get(key, ())) > 1:
            return f"{name} shares its memory with another tensor of the model"
    return None


def relayout(module: torch.nn.Module, layout: str) -> bool:
    """Re-lay the module's transposed experts parameters in ``layout`` (one parameter at a
    time: the transient extra memory is one parameter); return whether anything moved.
    The caller checked ``blocker`` first."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}; accepted: {LAYOUTS}")
    if not describe(module).transposed:  # stored canonical: its memory is already right
        return False
    moved = False
    for _, param in _weights(module):
        if in_layout(param, layout):
            continue
        # The module's canonical views reference the old memory: drop them first, so it is
        # freed as soon as the data is replaced.
        forget_weights(module)
        with torch.inference_mode(False), torch.no_grad():
            if layout == "canonical":
                param.data = param.detach().transpose(1, 2).contiguous().transpose(1, 2)
            else:
                param.data = param.detach().contiguous()
        moved = True
    return moved
