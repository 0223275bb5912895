"""What a dispatcher is, what its factory receives, and the one weighted combine.

A dispatcher (stages 2 and 4) is any object with:

- ``dispatch_format``: the ``DispatchOutput`` format its ``dispatch`` returns
  (``moerunner.dispatch.formats``), which the runner's backends serve;
- ``accepts_quantized``: whether ``dispatch`` can move activations that were quantized before
  dispatch (fp8 all-to-all, DeepEP low-latency). No built-in dispatcher does yet; the seam is
  declared so a layer can check it instead of guessing;
- ``dispatch(hidden_states [T, H], topk) -> DispatchOutput`` and
  ``combine(expert_output, dispatch_output) -> [T, H]``;
- optionally ``takes_failure = True``: then ``dispatch`` also takes ``failure=`` (an
  exception, or None): the caller's step has already failed on this rank and its inputs are
  an empty stand-in. The dispatcher carries the failure in its first exchange, so that every
  rank raises the same ``RankFailedError`` there, before the stand-in's sizes (its top_k,
  its dtype) are compared with the other ranks' inputs and reported instead of the cause
  (a dispatcher that reads nothing on the host, the masked one in ``"flag"`` mode, flags
  the step on every rank instead and the caller raises after the step's exchanges).

Dispatchers are registered by name in ``moerunner.registry`` as factories of a
``DispatchSetup``; ``dispatch.builtin.default_dispatchers`` lists the built-in ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..routing import TopK
from .expert_map import ExpertPlacement

__all__ = [
    "DispatchSetup",
    "Dispatcher",
    "weighted_row_sum",
]


@runtime_checkable
class Dispatcher(Protocol):
    """The dispatcher protocol (see the module docstring)."""

    dispatch_format: str
    accepts_quantized: bool

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> Any: ...

    def combine(self, output: torch.Tensor, dispatch_output: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class DispatchSetup:
    """What a dispatcher factory is built from.

    Args:
        num_local_experts: experts this rank holds (routed and shared).
        hidden_size: H.
        placement: expert ownership over the group's ranks (``None``: every expert is local,
            as on one process or in tensor parallelism).
        group: the ``torch.distributed`` process group, or ``None`` on one process.
        rank: this rank in ``group`` (0 without one).
        capacity: rows per local expert (``masked`` only).
        on_overflow: ``"raise"`` or ``"flag"`` (``masked`` only).
        combine_dtype: dtype the combine's partial sums travel back in (``all_to_all``
            only; ``None``: the hidden dtype).
    """

    num_local_experts: int
    hidden_size: int
    placement: ExpertPlacement | None = None
    group: Any = None
    rank: int = 0
    capacity: int | None = None
    on_overflow: str = "raise"
    combine_dtype: torch.dtype | None = None


def weighted_row_sum(
    rows: torch.Tensor,
    destination: torch.Tensor,
    weight: torch.Tensor | None,
    num_out: int,
) -> torch.Tensor:
    """``out[d] = sum over rows r with destination[r] == d of weight[r] * rows[r]``, in fp32.

    The one weighted scatter-add every combine uses: ``rows [N, H]`` (any float dtype),
    ``destination [N]`` int64 in ``[0, num_out)``, ``weight [N]`` fp32 or ``None`` (unweighted);
    returns fp32 ``[num_out, H]`` for the caller to reduce further or round once.
    """
    out = torch.zeros((num_out, rows.shape[-1]), dtype=torch.float32, device=rows.device)
    contribution = rows.float()
    if weight is not None:
        contribution = contribution * weight[:, None]
    return out.index_add_(0, destination, contribution)
