"""Hooks into the expert computation: callables applied between the kernels of the runner.

A ``MoeHooks`` value holds up to two callables, each called once per call of the experts
with every row the call computes (one row per (token, slot) pair routed to a local expert):

- ``gate_up(h_RN, x_RK, rows) -> h_RN``: GEMM1's output (float32 ``[R, 2I]``, or ``[R, I]``
  non-gated, bias added) before the activation; ``x_RK`` is GEMM1's input rows (the hidden
  states, in their dtype, before any activation quantization);
- ``down(y_RH, a_RI, rows) -> y_RH``: GEMM2's output (float32 ``[R, H]``, bias added)
  before the routing weight and the combine; ``a_RI`` is GEMM2's input rows (the
  activation's output in the hidden dtype, before any quantization).

Each returns the tensor to continue with (it may modify its argument in place and return
it). ``rows`` (``HookRows``) names per row its expert (the index into the prepared
weights; -1 for a row that computes nothing, whose values are undefined and discarded), its
token (row of the call's hidden states) and its top-k slot. Shared experts
(``moerunner.shared``) run unhooked, in a call of their own. Sizes are the prepared
weights' (``prepared.spec``). Rows come in whatever order the backend runs them; a hook must
be row-wise: its output row r may depend only on row r of its inputs and of ``rows``.

Semantics are the same on every backend that declares ``Capabilities.hooks`` and on both
paths of the standard dispatch format (fused op, and pre-permute -> core -> post-permute);
other formats do not know a row's token, and hooks raise there. The hooked run is a slower
sequence (GEMM1 without the fused activation, the hook, the activation, GEMM2 without the
routing weight, the hook, weight and sum); a call without hooks is not affected.
A hook's work must stay on the device (no host reads) for the call to remain CUDA-graph
capturable on backends that are.

LoRA over the experts (``moerunner.lora``) is built on these hooks. Its hooks are
callables and at once declarative records (``moerunner.lora.LoraDelta``) that a backend
with kernels for them applies instead of calling them (the triton backend does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import MoeInputError

__all__ = ["HookRows", "MoeHooks", "RowHooks"]

Hook = Callable[[torch.Tensor, torch.Tensor, "HookRows"], torch.Tensor]


@dataclass(frozen=True)
class HookRows:
    """What each computed row is: ``expert`` (int ``[R]``, -1: nothing computed), ``token``
    (int64 ``[R]``, -1 with expert -1) and ``slot`` (int64 ``[R]``, -1 with expert -1).
    ``shared``: a scratch of the call's rows where its hooks keep what they derive from the
    rows once for both GEMMs (LoRA: each row's adapter, scale and grouping); it lives as
    long as the rows, one call."""

    expert: torch.Tensor
    token: torch.Tensor
    slot: torch.Tensor
    shared: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class MoeHooks:
    """The hooks of one call (see the module doc); either may be None. ``num_tokens``: the
    number of tokens of the call they were made for (per-token data such as LoRA adapter
    ids), checked by the runner; ``num_experts``: the routed experts they were made for
    (per-expert data such as LoRA factors), checked against the weights; None: any. A hook
    object with a ``num_tokens`` of its own (``LoraDelta``: its adapter ids) sets it where it
    is None and must agree with it otherwise."""

    gate_up: Hook | None = None
    down: Hook | None = None
    num_tokens: int | None = None
    num_experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("gate_up", "down"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"hooks: {name} must be callable or None, got {type(value)}")
        for name in ("num_tokens", "num_experts"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise TypeError(f"hooks: {name} must be None or an int >= 0, got {n!r}")
        for name in ("gate_up", "down"):
            n = getattr(getattr(self, name), "num_tokens", None)
            if not isinstance(n, int) or n == self.num_tokens:
                continue
            if self.num_tokens is not None:
                raise MoeInputError(
                    f"hooks: {name} holds data of {n} tokens (e.g. a LoraDelta's adapter ids), "
                    f"another hook or num_tokens says {self.num_tokens}"
                )
            object.__setattr__(self, "num_tokens", n)

    def needs_grad(self) -> bool:
        """Grad mode is on and a tensor the hooks read requires grad: what a hook object
        lists in its ``tensors()`` (``LoraDelta``: the LoRA factors; a plain function lists
        none). Such a call runs where the hooks' PyTorch ops carry the gradient (the torch
        backend); a backend applying them in its own kernels would drop it."""
        return torch.is_grad_enabled() and bool(self._trained())

    def _trained(self) -> list[torch.Tensor]:
        found = []
        for fn in (self.gate_up, self.down):
            tensors = getattr(fn, "tensors", None)
            if callable(tensors):
                found += [t for t in tensors() if isinstance(t, torch.Tensor) and t.requires_grad]
        return found

    def in_graph(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` of a call with these hooks, part of the graph of the tensors they train
        even where no hook ran (no rows, no slots, no adapter): a loss over it then gives
        them zero gradients instead of failing for want of a graph (``in_graph_of``)."""
        return in_graph_of(out, self._trained(), each=True) if torch.is_grad_enabled() else out

    def apply(self, which: str, out: torch.Tensor, inp: torch.Tensor, rows: HookRows):
        """Run hook ``which`` ("gate_up" or "down") if set; check what it returns."""
        fn = getattr(self, which)
        if fn is None:
            return out
        got = fn(out, inp, rows)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(out.shape):
            shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise MoeInputError(
                f"hooks: {which} must return a tensor of shape {list(out.shape)}, got {shape}"
            )
        if not got.is_floating_point():  # (an int or bool result was taken as values)
            raise TypeError(f"hooks: {which} must return a floating tensor, got {got.dtype}")
        if got.device != out.device:
            raise MoeInputError(
                f"hooks: {which} must return a tensor on {out.device}, got one on {got.device}"
            )
        # (the kernels after a hook read rows by one stride: a transposed result was misread)
        return got.float().contiguous()


@dataclass(frozen=True)
class RowHooks:
    """Hooks bound to the rows of a grouped layout (what a backend's core gets): the token
    and slot of each grouped row (int64 ``[M]``; -1 past the valid rows)."""

    hooks: MoeHooks
    token: torch.Tensor
    slot: torch.Tensor

    def rows(self, expert: torch.Tensor) -> HookRows:
        """``HookRows`` with the core's expert per row."""
        return HookRows(expert=expert, token=self.token, slot=self.slot)


def check_hooks(hooks: object) -> MoeHooks | None:
    """``hooks`` as given to an entry point: None or a ``MoeHooks``."""
    if hooks is None or isinstance(hooks, MoeHooks):
        return hooks
    raise TypeError(f"hooks must be a MoeHooks or None, got {type(hooks).__name__}")


def expert_of_rows(expert_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Expert of each grouped row from the offsets ``[E + 1]`` (-1 past ``offsets[E]``),
    int64 on the device, no host read."""
    num_experts = expert_offsets.shape[0] - 1
    row_ids = torch.arange(num_rows, device=expert_offsets.device)
    expert = torch.searchsorted(expert_offsets[1:].contiguous(), row_ids, right=True)
    return torch.where(expert < num_experts, expert, -1)


def in_graph_of(out: torch.Tensor, tensors, each: bool = False) -> torch.Tensor:
    """``out``, part of the autograd graph of those ``tensors`` that require grad, where it
    is not already (grad mode on; ``each``: of each of them, also where ``out`` is in a graph
    that may miss some): an empty slice's sum adds exactly 0 whatever the values (a
    non-finite one included). Host metadata only."""
    if (out.requires_grad and not each) or not torch.is_grad_enabled():
        return out
    trained = [t for t in tensors if t.requires_grad]
    if not trained:
        return out
    return out + sum(t.reshape(-1)[:0].sum() for t in trained)
