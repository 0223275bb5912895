"""Standard dispatcher: every rank sees every token; nothing is exchanged before the experts.

Stage 2 and 4. Single device, tensor parallel (each rank holds a slice of I) or expert
parallel by ownership (each rank holds some experts; ids of experts it does not own become
-1). With a process group the ranks' partial outputs are summed by an all-reduce in
``combine``, in one of two precisions (``reduce_dtype``):

- ``torch.float32`` (default with a group): ``dispatch`` groups the (token, slot) pairs by
  local expert (format ``permuted``), the runner returns unweighted expert rows, and
  ``combine`` weights and sums them in fp32, all-reduces the fp32 ``[T, H]`` partials and
  rounds once: the same arithmetic as one process, up to the order of fp32 additions;
- ``None``: format ``standard``; the runner weights, sums and rounds each rank's partial to
  the hidden dtype and the all-reduce adds those rounded partials in the hidden dtype (half
  the bytes on the wire, about one hidden-dtype ulp more error per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import MoeInputError
from ..routing import TopK
from .base import weighted_row_sum
from .expert_map import local_ids
from .formats import PERMUTED, STANDARD, PermutedDispatchOutput, StandardDispatchOutput
from .permute import PermuteContext, pre_permute_standard

__all__ = ["StandardDispatcher", "StandardEPDispatchOutput"]


@dataclass(frozen=True)
class StandardEPDispatchOutput(PermutedDispatchOutput):
    """Pairs grouped by local expert (rows past ``expert_offsets[E]`` are -1 ids / padding),
    plus what ``combine`` needs to weight and sum them per token."""

    context: PermuteContext  # token and routing weight (0 for padding) of every grouped row
    token_count: int  # T
    dtype: torch.dtype  # hidden dtype of the layer's output


class StandardDispatcher:
    """Map global expert ids to local ones (or -1), and all-reduce partial outputs.

    Args:
        expert_map: optional int32 ``[E_global]`` tensor, local id of each global expert on
            this rank or -1 (an expert held but computed on another rank, as shared experts
            on every rank but 0, is -1 too: ``ExpertPlacement.standard_map(rank)``).
            ``None``: all experts are local and ids pass through.
        group: optional ``torch.distributed`` process group whose ranks' outputs are summed.
        num_local_experts: experts this rank holds (default: those ``expert_map`` maps);
            needed with ``reduce_dtype=float32`` and a group when ``expert_map`` is ``None``
            (tensor parallel: E).
        reduce_dtype: ``torch.float32`` (default): weight, sum and all-reduce in fp32 and
            round once (for bf16 / fp16 layers the all-reduce moves 4 instead of 2 bytes per
            element of ``[T, H]``; the runner takes its grouped-layout path). ``None``: sum
            in the hidden dtype (module docstring). Without a group nothing is reduced and
            the format is ``standard`` either way.
    """

    def __init__(
        self,
        expert_map: torch.Tensor | None = None,
        group=None,
        *,
        num_local_experts: int | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        if reduce_dtype not in (None, torch.float32):
            raise TypeError(f"reduce_dtype must be torch.float32 or None, got {reduce_dtype}")
        if expert_map is not None:
            mapped = int((expert_map >= 0).sum())
            highest = int(expert_map.max()) if expert_map.numel() else -1
            if num_local_experts is None:
                num_local_experts = mapped
            elif highest >= num_local_experts:
                raise MoeInputError(
                    f"num_local_experts={num_local_experts} but expert_map maps an expert to "
                    f"local id {highest}"
                )
        self.expert_map = expert_map
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.num_local_experts = num_local_experts
        self.accepts_quantized = False  # runs on activations in the hidden dtype
        self.dispatch_format = (
            PERMUTED if group is not None and reduce_dtype is not None else STANDARD
        )
        if self.dispatch_format == PERMUTED and num_local_experts is None:
            raise MoeInputError(
                "StandardDispatcher with a group and reduce_dtype=torch.float32 needs "
                "num_local_experts= (or an expert_map)"
            )
        self._maps: dict[torch.device, torch.Tensor] = {}  # expert_map per device, copied once

    def _map_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._maps:
            self._maps[device] = self.expert_map.to(device)
        return self._maps[device]

    def dispatch(
        self, hidden_states: torch.Tensor, topk: TopK
    ) -> StandardDispatchOutput | StandardEPDispatchOutput:
        """Make ids local; with an fp32 reduction also group the pairs by local expert."""
        if self.expert_map is not None:
            from ..device_checks import check_ids_async

            ids = topk.ids
            if ids.numel():  # CPU: at once; GPU: on the device, raised later (no sync)
                check_ids_async(ids, self.expert_map.shape[0], where="standard dispatch")
            ids = local_ids(ids, self._map_on(ids.device))
            topk = TopK(weights=topk.weights, ids=ids)
        standard = StandardDispatchOutput(hidden_states=hidden_states, topk=topk)
        if self.dispatch_format == STANDARD:
            return standard
        grouped, context = pre_permute_standard(standard, self.num_local_experts)
        return StandardEPDispatchOutput(
            hidden_states=grouped.hidden_states,
            expert_offsets=grouped.expert_offsets,
            context=context,
            token_count=hidden_states.shape[0],
            dtype=hidden_states.dtype,
        )

    def combine(
        self,
        output: torch.Tensor,
        dispatch_output: StandardDispatchOutput | StandardEPDispatchOutput,
    ) -> torch.Tensor:
        """Sum the ranks' partial ``[T, H]`` outputs (identity on one process)."""
        if self.group is None:
            return output
        import torch.distributed as dist

        if self.dispatch_format == STANDARD:
            dist.all_reduce(output, group=self.group)
            return output
        d = dispatch_output
        if tuple(output.shape) != tuple(d.hidden_states.shape):
            raise MoeInputError(
                f"output must have the dispatched shape {list(d.hidden_states.shape)}, "
                f"got {list(output.shape)}"
            )
        # Padding rows carry weight 0 and were zeroed by the runner's post-permute.
        total = weighted_row_sum(output, d.context.source_row, d.context.row_weight, d.token_count)
        dist.all_reduce(total, group=self.group)
        return total.to(d.dtype)
