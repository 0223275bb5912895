"""Standard dispatcher: every rank sees every token; nothing is exchanged before the experts.

Single device, tensor parallel (each rank holds a slice of I) or expert parallel by ownership
(each rank holds some experts; ids of experts it does not own become -1). Either way the
partial outputs of the ranks are summed by an all-reduce in ``combine`` when a process group
is given.
"""

from __future__ import annotations

import torch

from ..routing import TopK
from .formats import StandardDispatchOutput


class StandardDispatcher:
    """Map global expert ids to local ones (or -1), and all-reduce partial outputs.

    Args:
        expert_map: optional int32 ``[E_global]`` tensor, local id of each global expert on
            this rank or -1. ``None``: all experts are local and ids pass through.
        group: optional ``torch.distributed`` process group whose ranks' outputs are summed.
    """

    def __init__(self, expert_map: torch.Tensor | None = None, group=None) -> None:
        self.expert_map = expert_map
        self.group = group

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> StandardDispatchOutput:
        """Wrap the tokens and their routing, with ids made local."""
        if self.expert_map is not None:
            ids = topk.ids
            local = self.expert_map.to(ids.device)[ids.clamp(min=0).long()]
            ids = torch.where(ids >= 0, local, torch.full_like(local, -1)).to(torch.int32)
            topk = TopK(weights=topk.weights, ids=ids)
        return StandardDispatchOutput(hidden_states=hidden_states, topk=topk)

    def combine(
        self, output: torch.Tensor, dispatch_output: StandardDispatchOutput
    ) -> torch.Tensor:
        """Sum the ranks' partial ``[T, H]`` outputs (identity on one process)."""
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(output, group=self.group)
        return output
