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

import gc
import logging
import threading

import torch

from ..device_checks import capturing
from ._hf_experts import (
    EXPERT_WEIGHT_NAMES,
    STORED_ON_PURPOSE,
    UnsupportedExpertsError,
    describe,
    forget_weights,
    layer_name,
    quantized_weights,
)

LAYOUTS = ("canonical", "stored")
_log = logging.getLogger("moerunner")


def _weights(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    found = []
    for name in EXPERT_WEIGHT_NAMES:
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


def _optimizer_state_blocker(weights: list[tuple[str, torch.nn.Parameter]]) -> str | None:
    """Why the weights must keep their layout because an optimizer holds state for them, or
    None. An optimizer's state tensors have the parameter's strides, and PyTorch's fused
    optimizers update parameter and state as flat memory assumed to match: after a re-lay
    every step updated the wrong elements, silently. Found by what refers to the parameters
    (an optimizer's ``state`` is a dict keyed by them), whenever and however that state was
    made (steps, ``load_state_dict``), once per re-lay decision."""
    params = {id(param): name for name, param in weights}
    for referrer in gc.get_referrers(*(param for _, param in weights)):
        if not isinstance(referrer, dict):
            continue
        for key, value in list(referrer.items()):
            if id(key) in params and isinstance(value, dict) and value:
                return (
                    f"{params[id(key)]} has optimizer state, whose tensors keep its strides "
                    "(fused optimizers would update the wrong elements after a re-lay)"
                )
    return None


def _param_blocker(name: str, param: torch.nn.Parameter) -> str | None:
    """Why parameter ``name``'s data cannot be re-laid, or None."""
    if param.dim() != 3 or param.numel() == 0:
        return f"{name} is not a non-empty 3-D tensor (shape {list(param.shape)})"
    if param.device.type == "meta":
        return f"{name} is on the meta device (offloaded or not loaded)"
    if type(param.data) is not torch.Tensor:
        return f"{name} is a {type(param.data).__name__}, not a plain tensor"
    if param.is_inference():
        return f"{name} is an inference tensor (its data cannot be replaced)"
    return None


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
        reason = _param_blocker(name, param)
        if reason is not None:
            return reason
        key = (str(param.device), param.untyped_storage().data_ptr())
        if len(owners.get(key, ())) > 1:
            return f"{name} shares its memory with another tensor of the model"
    return _optimizer_state_blocker(_weights(module))


#: Transient memory of an in-place re-lay: experts are transposed in chunks of about this size
#: (at least one expert) through one buffer.
CHUNK_BYTES = 64 << 20


def relayout(module: torch.nn.Module, layout: str, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Re-lay the module's transposed experts parameters in ``layout``; return whether
    anything moved. The caller checked ``blocker`` first.

    A parameter whose memory no other tensor references is transposed in place, expert by
    expert through one buffer of about ``chunk_bytes`` (at least one expert): GPT-OSS-120B's
    4.2 GB ``gate_up_proj`` takes 64 MiB of transient memory, not a second 4.2 GB. Where
    another tensor shares the memory (a view someone kept, autograd's saved tensors) its
    values must not move, so the parameter gets new memory instead (one parameter of
    transient memory; the old memory lives on with those views)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: got {layout!r}; accepted: {LAYOUTS}")
    if not describe(module).transposed:  # stored canonical: its memory is already right
        return False
    moved = False
    for _, param in _weights(module):
        if in_layout(param, layout):
            continue
        # The module's canonical views reference the old memory: drop them first, so it is
        # re-laid in place, or freed as soon as the data is replaced.
        if not moved:
            _drop_views(module)
        alone = _alone(param)
        with torch.inference_mode(False), torch.no_grad():
            if alone:
                _transpose_in_place(param, layout, chunk_bytes)
            elif layout == "canonical":
                param.data = param.detach().transpose(1, 2).contiguous().transpose(1, 2)
            else:
                param.data = param.detach().contiguous()
        moved = True
    return moved


def _drop_views(module: torch.nn.Module) -> None:
    """Drop the module's cached views of its weights (``forget_weights``): they reference the
    weights' memory. Where a parameter is still not alone after that, the dropped views may
    wait in reference cycles, so those are collected."""
    forget_weights(module)
    if not all(_alone(param) for _, param in _weights(module)):
        gc.collect()


def _alone(param: torch.nn.Parameter) -> bool:
    """No tensor but ``param`` references its memory (PyTorch's storage use count: the
    parameter and the storage object asked for here), and the memory is its own."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # a PyTorch without it: assume shared, re-lay by copy
        return False
    storage = param.untyped_storage()
    own = param.storage_offset() == 0 and storage.nbytes() == param.numel() * param.element_size()
    return own and count(storage._cdata) == 2


def _transpose_in_place(param: torch.nn.Parameter, layout: str, chunk_bytes: int) -> None:
    """``param``'s memory, contiguous in the other layout, rewritten in ``layout``: each
    expert's ``[x, y]`` block becomes its transpose ``[y, x]`` in the same bytes (experts do
    not overlap), through one buffer of ``chunk_bytes`` (at least one expert)."""
    source = param.detach() if layout == "canonical" else param.detach().transpose(1, 2)
    experts, x, y = source.shape  # contiguous [E, x, y]
    step = max(1, chunk_bytes // (x * y * source.element_size()))
    buffer = torch.empty((min(step, experts), x, y), dtype=source.dtype, device=source.device)
    flat = source.view(experts, x * y)
    for start in range(0, experts, step):
        n = min(step, experts - start)
        buffer[:n].copy_(source[start : start + n])
        flat[start : start + n].view(n, y, x).copy_(buffer[:n].transpose(1, 2))
    relaid = flat.view(experts, y, x)  # contiguous [E, y, x]
    param.data = relaid.transpose(1, 2) if layout == "canonical" else relaid


def auto_relayout(module: torch.nn.Module) -> bool:
    """On an experts layer's first eager inference call, re-lay its transposed (GPT-OSS)
    parameters in place into the canonical layout the kernels read fastest (the layout
    ``use_moerunner`` makes; measured on an H200 at 32-row decode, the experts' time went
    from 0.87x to 0.62x transformers' grouped_mm with it), where that costs no copy: nothing
    but the parameter references its memory. Returns whether it did.

    Not done (the layer keeps reading strided views, and warns once per process): where the
    caller chose the stored layout (``use_moerunner(model, relayout=False)``,
    ``relayout_experts(model, "stored")``), with grad mode on (training keeps its layout),
    while compiling or capturing a CUDA graph, after an earlier call (compiled or with grad
    mode on) derived views of the weights, for weights another tensor shares, that are
    offloaded, meta, inference tensors or tensor subclasses, that an optimizer holds state
    for, and after a first decision. A
    call with grad mode on whose parameters require grad decides for good: trained
    parameters keep their layout (an optimizer's state has their strides)."""
    if module.__dict__.get(STORED_ON_PURPOSE) or module.__dict__.get(_AUTO_DECIDED):
        return False
    if capturing():
        return False
    if torch.is_grad_enabled():
        if any(param.requires_grad for _, param in _weights(module)):
            # Trained: its layout stays for good. An optimizer's state follows the
            # parameters' strides (fused AdamW's kernels assume they match): re-laid in a
            # later inference call, the next steps updated the wrong elements.
            module.__dict__[_AUTO_DECIDED] = True
        return False
    # Decided once, under a lock, and marked decided only after the memory was re-laid:
    # another thread's first call waits here instead of reading memory being rewritten.
    with _RELAYOUT_LOCK:
        if module.__dict__.get(_AUTO_DECIDED):
            return False
        try:
            return _relayout_if_alone(module)
        finally:
            module.__dict__[_AUTO_DECIDED] = True


def _relayout_if_alone(module: torch.nn.Module) -> bool:
    if _offloading_hook(module) or quantized_weights(module) is not None:
        return False
    weights = _weights(module)
    for name, param in weights:
        # Alone also means no earlier call derived anything from it: a compiled graph's
        # memoised views, or a grad-mode call's, hold its memory (re-laying under a compiled
        # graph would change the strides it guards on and recompile it).
        if _param_blocker(name, param) is not None or not in_layout(param, "stored"):
            return False
        if not _alone(param):
            return False
    if _optimizer_state_blocker(weights) is not None:
        return False
    relayout(module, "canonical")  # in place: every parameter is alone
    _log.info(
        "moerunner: re-laid the transposed experts of %s in place (canonical layout; "
        "use_moerunner(model, relayout=False) keeps the stored one)",
        layer_name(module),
    )
    return True


_RELAYOUT_LOCK = threading.Lock()
# Set on a module once auto_relayout has decided (it does not look again).
_AUTO_DECIDED = "_moerunner_auto_relayout_decided"


def undecided(module: torch.nn.Module) -> None:
    """Leave the layout to ``auto_relayout`` again: forget its decision and the module's
    derived views of the weights (which would keep the parameters from being alone)."""
    module.__dict__.pop(_AUTO_DECIDED, None)
    _drop_views(module)
