"""Quantized expert weights held as module buffers, so ``state_dict`` saves them.

Stage: the edge between ``nn.Module`` state and ``QuantizedWeight``. A module that holds
quantized experts (``moerunner.MoE`` after ``quantize_``, the transformers integration's
experts after ``quantize_experts``) derives from ``HoldsQuantized``. Its ``quantized``
attribute is an ``ExpertWeights`` of two ``QuantizedWeight``; ``_hold_quantized()`` registers
their tensors as buffers:

- ``w13_qdata``, ``w13_scale``, ``w13_global_scale``, ``w13_zero_point``, ``w13_input_scale``
  where the scheme has them (``qdata``: ``w13`` names the float weight), the same for ``w2``;
- ``w13_scheme`` / ``w2_scheme``: the scheme's fields as JSON bytes (``scheme_to_tensor``),
  so safetensors stores them as well.

``load_state_dict`` restores them into a module holding the same scheme (values are copied in
place; new ``QuantizedWeight`` objects over the buffers are validated and rebuilt), and
raises ``MoeInputError`` when the state holds another scheme, float weights where this module
holds quantized ones, or the reverse, a tensor whose dtype or shape is not its buffer's
(nothing is converted), or invalid scales or zero points; a refused load changes nothing.
``.to(device)`` moves the buffers; a dtype conversion (``.half()``, ``.to(torch.bfloat16)``)
leaves them in their own dtypes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

import torch
from torch import nn

from .errors import MoeInputError
from .ops import adopt_quantized
from .weights import ExpertWeights

__all__ = [
    "BUFFER_NAMES",
    "HeldTensors",
    "HoldsQuantized",
    "scheme_from_tensor",
    "scheme_to_tensor",
]

# QuantizedWeight field -> buffer name suffix (``data`` is ``qdata``: ``w13`` is the float one).
BUFFER_NAMES = {
    "data": "qdata",
    "scale": "scale",
    "global_scale": "global_scale",
    "zero_point": "zero_point",
    "input_scale": "input_scale",
}
HELD_NAMES = frozenset(
    f"{w}_{n}" for w in ("w13", "w2") for n in (*BUFFER_NAMES.values(), "scheme")
)


class HeldTensors(NamedTuple):
    """A held weight as a traced call reads it: its scheme and logical shape with the
    module's current buffers in the ``QuantizedWeight`` fields' places (what
    ``moerunner.ops.call_fused_experts`` takes from a ``QuantizedWeight``)."""

    scheme: object
    shape: tuple
    data: torch.Tensor
    scale: torch.Tensor | None
    global_scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    input_scale: torch.Tensor | None


def scheme_to_tensor(scheme) -> torch.Tensor:
    """A ``QuantScheme`` as a uint8 tensor (JSON of its fields), storable by safetensors."""
    text = json.dumps(dataclasses.asdict(scheme), sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def scheme_from_tensor(tensor: torch.Tensor):
    """The ``QuantScheme`` that `scheme_to_tensor` stored (MoeInputError if it is not one)."""
    from .quant import QuantScheme

    try:
        fields = json.loads(bytes(tensor.cpu().tolist()).decode())
        if fields.get("block_shape") is not None:
            fields["block_shape"] = tuple(fields["block_shape"])
        return QuantScheme(**fields)
    except (ValueError, TypeError, AttributeError) as exc:
        raise MoeInputError(
            f"load_state_dict: a *_scheme entry is not a stored scheme ({exc})"
        ) from exc


class HoldsQuantized(nn.Module):
    """Base of modules whose ``quantized`` experts may be held as buffers (see the module
    docstring). A subclass says where its biases and row order come from and how its users
    quantize it (for the error messages)."""

    quantized: ExpertWeights | None

    #: What the module is called in messages, and the call that quantizes it to ``{scheme}``.
    _held_owner = "module"
    _held_quantize_call = "quantize_({scheme})"
    #: Attributes holding float weights kept beside the quantized copy (``keep_float_weights``).
    _held_float_names: tuple[str, ...] = ()

    def _frozen(self, *tensors: torch.Tensor | None) -> None:
        """Quantized experts are frozen: ``tensors`` (biases, shared experts, the leaves of
        ``_kept_floats``) take no gradient."""
        for t in tensors:
            if t is not None:
                t.requires_grad_(False)

    def _kept_floats(self) -> dict[str, torch.Tensor]:
        """The leaves of the float weights kept beside the quantized copy (``float_leaves``)."""
        return float_leaves(self, self._held_float_names)

    def _held_biases(self) -> tuple:
        """The biases the rebuilt ``quantized`` weights carry."""
        return (None, None)

    def _held_interleaved(self) -> bool:
        return False

    def _float_in_state(self, state_dict, prefix: str, w: str) -> bool:
        """Whether ``state_dict`` holds this module's float ``w`` (``w13`` / ``w2``)."""
        return False

    # -- holding ---------------------------------------------------------------------------

    def _hold_quantized(self) -> None:
        """Register the quantized weights' tensors (and schemes) as buffers."""
        for w in ("w13", "w2"):
            qw = getattr(self.quantized, w)
            for field, tensor in qw.tensors().items():
                self.register_buffer(f"{w}_{BUFFER_NAMES[field]}", tensor)
            self.register_buffer(f"{w}_scheme", scheme_to_tensor(qw.scheme))

    def _quantized_buffers(self) -> list[str]:
        return [n for n in self._buffers if n in HELD_NAMES]

    def _held_current(self) -> None:
        """Rebuild ``quantized`` where a held buffer is no longer the tensor it was built over
        (a buffer assigned anew, or substituted by ``torch.func.functional_call``): the call
        then reads the module's buffers, as it reads its parameters. Identity checks only
        (in-place edits are seen through the shared tensors); nothing to do while tracing."""
        if self.quantized is None or torch.compiler.is_compiling():
            return
        check_kept_floats(self._held_owner, self._kept_floats())  # (grad mode only)
        for w in ("w13", "w2"):
            for field, tensor in getattr(self.quantized, w).tensors().items():
                name = f"{w}_{BUFFER_NAMES[field]}"
                if self._buffers.get(name, tensor) is not tensor:  # (not held: no buffer)
                    try:
                        self._rebuild_quantized()
                    except (ValueError, TypeError) as exc:
                        raise MoeInputError(
                            f"the {self._held_owner}'s quantized buffer {name} was replaced by "
                            f"a tensor it cannot run: {exc}"
                        ) from exc
                    return

    def _held_call_weights(self) -> tuple:
        """``w13`` and ``w2`` as a call runs them: the ``quantized`` objects in eager calls
        (which the caller's checks brought up to date, ``_held_current``); while tracing, the
        module's buffers themselves (``HeldTensors``), so a compiled call reads the buffers
        it is given (assigned anew, or substituted by ``functional_call``) as it reads its
        parameters, instead of the tensors the objects were built over."""
        if not torch.compiler.is_compiling():
            return self.quantized.w13, self.quantized.w2
        held = []
        for w in ("w13", "w2"):
            qw = getattr(self.quantized, w)
            fields = {
                f: self._buffers.get(f"{w}_{n}", getattr(qw, f)) for f, n in BUFFER_NAMES.items()
            }
            held.append(HeldTensors(qw.scheme, tuple(qw.shape), **fields))
        return tuple(held)

    def _rebuild_quantized(self, check_values: bool = True) -> None:
        """New ``QuantizedWeight`` objects over the current buffers (validated, the scales'
        values unless ``check_values`` is False; fresh memo)."""
        from .quant import QuantizedWeight

        built = []
        for w in ("w13", "w2"):
            old = getattr(self.quantized, w)
            tensors = {
                f: self._buffers[f"{w}_{n}"]
                for f, n in BUFFER_NAMES.items()
                if self._buffers.get(f"{w}_{n}") is not None
            }
            built.append(
                QuantizedWeight.from_tensors(
                    old.scheme, old.shape, tensors, check_values=check_values
                )
            )
        self.quantized = ExpertWeights(
            built[0], built[1], *self._held_biases(), self._held_interleaved()
        )
        adopt_quantized(self.quantized.w13)
        adopt_quantized(self.quantized.w2)

    # -- nn.Module hooks -------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, *rest):
        held = bool(self._quantized_buffers())
        owner, call = self._held_owner, self._held_quantize_call
        for w in ("w13", "w2"):
            incoming = state_dict.get(f"{prefix}{w}_scheme")
            if incoming is not None and not held:
                name = scheme_from_tensor(incoming).name
                raise MoeInputError(
                    f"load_state_dict: the state holds quantized {w} (scheme {name!r}) but this "
                    f"{owner}'s {w} is not held quantized: call "
                    f"{call.format(scheme=repr(name))} before loading"
                )
            if incoming is None and held:
                if self._float_in_state(state_dict, prefix, w):
                    raise MoeInputError(
                        f"load_state_dict: the state holds float {w} but this {owner} holds it "
                        f"quantized ({getattr(self.quantized, w).scheme.name!r}): load it into "
                        f"a float {owner}, then call {call.format(scheme='scheme')}"
                    )
            elif incoming is not None:
                mine = getattr(self.quantized, w).scheme
                theirs = scheme_from_tensor(incoming)
                if not theirs.same_format(mine):
                    raise MoeInputError(
                        f"load_state_dict: the state's {w} is in scheme {theirs.name!r} but this "
                        f"{owner}'s in {mine.name!r}: call "
                        f"{call.format(scheme=repr(theirs.name))} first"
                    )
                # The scheme buffer is a name-length byte string: keep this module's own.
                state_dict = {**state_dict, f"{prefix}{w}_scheme": self._buffers[f"{w}_scheme"]}
            if held:  # (also without a *_scheme entry: its tensors are copied all the same)
                _check_incoming(
                    self._buffers, getattr(self.quantized, w).scheme, state_dict, prefix, w
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, *rest)
        if held:
            self._rebuild_quantized()

    #: Buffers besides the quantized ones that keep their dtype under ``.to(dtype)`` /
    #: ``.half()`` (a subclass's float32 routing data: a correction bias rounded to bf16
    #: would route otherwise).
    _float32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        # Quantized buffers move with the module but keep their dtypes (``.half()`` must not
        # turn fp32 scales into fp16 or fp8 data into fp16); the schemes stay on the CPU.
        quantized = self._quantized_buffers()
        kept = [n for n in self._float32_buffers if self._buffers.get(n) is not None]
        held = {n: self._buffers.pop(n) for n in (*quantized, *kept)}
        moved_any = False
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in held.items():
                if not name.endswith("_scheme"):
                    moved = fn(tensor)
                    if moved.dtype != tensor.dtype:
                        moved = tensor.to(moved.device)
                    moved_any |= moved is not tensor
                    tensor = moved
                self._buffers[name] = tensor
        if quantized and moved_any:  # (a move to where they are keeps the prepared weights)
            # Moved or cast copies of checked values, or (``to_empty``) memory a load will
            # write: no value read (it would also synchronise with the device).
            self._rebuild_quantized(check_values=False)
        return self


def float_leaves(module: nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The leaves of ``module``'s float weights ``names``, by name: each weight parameter
    itself, or the parameters of its parametrization (nothing is computed); absent or None
    ones left out."""
    leaves = {}
    parametrized = module._modules.get("parametrizations")
    for name in names:
        if parametrized is not None and name in parametrized._modules:
            for part, p in parametrized[name].named_parameters():
                leaves[f"{name} ({part})"] = p
        elif module._parameters.get(name) is not None:
            leaves[name] = module._parameters[name]
    return leaves


def check_kept_floats(owner: str, weights: dict) -> None:
    """MoeInputError where, with grad mode on, a float weight kept beside its quantized copy
    (``keep_float_weights=True``, which freezes them) requires grad again: the calls compute
    with the copy, so that weight would silently get no gradient. Eager calls only."""
    if not torch.is_grad_enabled():
        return
    for name, t in weights.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise MoeInputError(
                f"the {owner}'s float {name} requires grad, but its calls compute with the "
                f"quantized copy keep_float_weights=True made of it, which gives {name} no "
                f"gradient: freeze it ({name}.requires_grad_(False); the copy follows its "
                "edits), train before quantizing, or train LoRA adapters on the quantized "
                "experts"
            )


def _check_incoming(buffers, scheme, state_dict, prefix: str, w: str) -> None:
    """What a load would copy into the held buffers of ``w`` (or, with ``assign=True``, put
    in their place), checked before any of it happens: a refused load must leave the module
    as it was (the buffers are shared with the held ``QuantizedWeight`` objects, so a check
    after the copy would leave them corrupted). Every tensor needs its buffer's dtype and
    shape, since ``copy_`` would convert silently (fp8 codes given as their uint8 bytes, e8m0
    codes given as the float scales they mean); scales and zero points need valid values."""
    from .quant.weight import check_scale_values, check_zero_point_values

    keys = {f: f"{prefix}{w}_{n}" for f, n in BUFFER_NAMES.items()}
    fields = {}
    for field, key in keys.items():
        theirs, mine = state_dict.get(key), buffers.get(f"{w}_{BUFFER_NAMES[field]}")
        if not isinstance(theirs, torch.Tensor) or mine is None:
            continue  # (torch names a non-tensor or unexpected entry)
        if theirs.dtype != mine.dtype or theirs.shape != mine.shape:
            raise MoeInputError(
                f"load_state_dict: {key} is {theirs.dtype} {list(theirs.shape)}, but scheme "
                f"{scheme.name!r} holds it as {mine.dtype} {list(mine.shape)} here (a load "
                "copies the values, it does not convert them: save the state of a module with "
                "this scheme and shape); this module's tensors were left as they were"
            )
        fields[field] = theirs
    try:
        check_scale_values(fields, keys)
        check_zero_point_values(scheme, fields.get("zero_point"), keys["zero_point"])
    except ValueError as exc:
        raise MoeInputError(
            f"load_state_dict: {exc}; this module's tensors were left as they were"
        ) from exc
