"""All-to-all dispatcher: tokens travel to the ranks owning their experts, and back.

Stage 2 and 4 for expert parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

dispatch(hidden_TH, topk with global ids) -> ``AllToAllDispatchOutput`` (format "permuted"):
  1. every (token, slot) pair with an id >= 0 gets a destination rank and a local expert id
     from the ``ExpertPlacement``; pairs are sorted by (destination, local expert);
  2. one ``all_gather`` exchanges a small header (T, H, dtype) and every rank's send counts
     per (destination, local expert): every rank checks the world the same way, and reads the
     split sizes on the host (this path synchronises once per call, as all variable-size
     all-to-all exchanges must);
  3. ``all_to_all_single`` moves the rows; the receiver regroups them from (source, expert)
     to (expert, source) order: rows ``offsets[e]:offsets[e+1]`` belong to local expert ``e``.
combine(y_MH unweighted, dispatch output) -> ``[T, H]``: the inverse regroup, the reverse
``all_to_all_single``, then the routing weights applied and summed per token in fp32.

A token routed to two experts of one rank travels twice (no de-duplication); ranks with no
tokens, experts with no tokens and arbitrarily skewed loads need no special case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import collective_device, raise_on_every_rank, rank_and_size
from ..errors import MoeInputError
from ..routing import TopK
from .expert_map import ExpertPlacement
from .formats import PermutedDispatchOutput

__all__ = ["AllToAllDispatchOutput", "AllToAllDispatcher", "DTYPE_CODES"]

# dtype <-> small int, so headers of several ranks can be compared in one int tensor.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HEADER = ("num_tokens", "hidden_size", "dtype", "max_expert_id")


@dataclass(frozen=True)
class AllToAllHandle:
    """What combine needs to send rows back and sum them per token."""

    token_of_row: torch.Tensor  # [N_send] int64: source token of each sent row, in send order
    weight_of_row: torch.Tensor  # [N_send] fp32: routing weight of each sent row
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    grouped_order: torch.Tensor  # [M] int64: received row feeding each grouped row
    num_tokens: int
    dtype: torch.dtype


@dataclass(frozen=True)
class AllToAllDispatchOutput(PermutedDispatchOutput):
    """Received rows grouped by local expert, plus the handle only ``combine`` reads."""

    handle: AllToAllHandle


class AllToAllDispatcher:
    """Expert parallelism by all-to-all exchange (variable sizes; one host sync per dispatch).

    Args:
        placement: which rank owns each expert (``ExpertPlacement``); its ``world_size`` must
            equal the group's size and be the same on every rank (checked here, collectively).
        group: the ``torch.distributed`` process group (``None``: the default group).
    """

    def __init__(self, placement: ExpertPlacement, group=None) -> None:
        if not isinstance(placement, ExpertPlacement):
            raise TypeError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
        from ..distributed import check_consistent

        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        check_consistent(
            group,
            "AllToAllDispatcher placement",
            {"placement": placement.fingerprint(), "placement.world_size": placement.world_size},
        )
        if placement.world_size != self.world_size:
            raise MoeInputError(
                f"placement is for world_size={placement.world_size} but the process group has "
                f"{self.world_size} ranks"
            )
        self.placement = placement
        self.num_local_experts = placement.num_local(self.rank)
        self._slots = max(placement.max_local, 1)  # local-id stride per destination
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _routing_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            self._tables[device] = self.placement.routing_table(self.rank, device)
        return self._tables[device]

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> AllToAllDispatchOutput:
        """Send every (token, slot) pair to its expert's rank; return the grouped rows here."""
        import torch.distributed as dist

        _check_local(hidden_states, topk)
        num_tokens, hidden_size = hidden_states.shape
        device = hidden_states.device
        world, slots = self.world_size, self._slots
        dest_E, local_E = self._routing_table(device)
        ids = topk.ids.reshape(-1).long()
        valid = ids >= 0
        safe = torch.where(valid, ids, 0).clamp(max=self.placement.num_total - 1)
        key = torch.where(valid, dest_E[safe] * slots + local_E[safe], world * slots)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(world * slots + 1, dtype=torch.int64, device=device)
        counts.scatter_add_(0, key, torch.ones_like(key))

        header = torch.tensor(
            [num_tokens, hidden_size, DTYPE_CODES[hidden_states.dtype], -1],
            dtype=torch.int64,
            device=device,
        )
        if ids.numel():
            header[3] = ids.max()
        row = torch.cat([header, counts[: world * slots]]).to(collective_device(self.group))
        table = _all_gather_rows(row, self.group).cpu()
        self._check_world(table)
        counts_SDL = table[:, len(_HEADER) :].view(world, world, slots)
        send_splits = counts_SDL[self.rank].sum(1).tolist()
        recv_LS = counts_SDL[:, self.rank, :]  # [source, local expert]
        recv_splits = recv_LS.sum(1).tolist()

        num_send = sum(send_splits)
        sent_pairs = order[:num_send]
        top_k = topk.ids.shape[1]
        token_of_row = sent_pairs // top_k
        weight_of_row = topk.weights.reshape(-1).float()[sent_pairs]
        send_buf = hidden_states[token_of_row]
        recv_buf = hidden_states.new_empty((sum(recv_splits), hidden_size))
        dist.all_to_all_single(recv_buf, send_buf, recv_splits, send_splits, group=self.group)

        # Received rows are ordered (source, local expert); regroup them (local expert, source).
        experts = self.num_local_experts
        label = torch.arange(slots, device=device).repeat(world)
        label = torch.repeat_interleave(
            label, recv_LS.reshape(-1).to(device), output_size=sum(recv_splits)
        )
        grouped_order = torch.argsort(label, stable=True)
        offsets = torch.zeros(experts + 1, dtype=torch.int64, device=device)
        offsets[1:] = torch.cumsum(recv_LS.sum(0)[:experts], 0).to(device)
        handle = AllToAllHandle(
            token_of_row,
            weight_of_row,
            send_splits,
            recv_splits,
            grouped_order,
            num_tokens,
            hidden_states.dtype,
        )
        return AllToAllDispatchOutput(
            hidden_states=recv_buf[grouped_order], expert_offsets=offsets, handle=handle
        )

    def combine(
        self, output: torch.Tensor, dispatch_output: AllToAllDispatchOutput
    ) -> torch.Tensor:
        """Send unweighted expert rows ``[M, H]`` back; return ``sum_k w * y`` as ``[T, H]``."""
        import torch.distributed as dist

        h = dispatch_output.handle
        hidden_size = dispatch_output.hidden_states.shape[1]
        if tuple(output.shape) != tuple(dispatch_output.hidden_states.shape):
            raise MoeInputError(
                f"output must have the dispatched shape {list(dispatch_output.hidden_states.shape)}"
                f", got {list(output.shape)}"
            )
        received_order = torch.empty_like(output)
        received_order[h.grouped_order] = output
        back = output.new_empty((len(h.token_of_row), hidden_size))
        dist.all_to_all_single(back, received_order, h.send_splits, h.recv_splits, group=self.group)
        out = torch.zeros((h.num_tokens, hidden_size), dtype=torch.float32, device=output.device)
        out.index_add_(0, h.token_of_row, back.float() * h.weight_of_row[:, None])
        return out.to(h.dtype)

    def _check_world(self, table: torch.Tensor) -> None:
        """Every rank evaluates the same gathered header table and raises the same error."""
        problems = []
        for col, name in ((1, "hidden size H"), (2, "dtype")):
            values = table[:, col].tolist()
            if len(set(values)) > 1:
                shown = values if col == 1 else [_dtype_name(v) for v in values]
                problems.append(f"{name} differs across ranks: {shown}")
        max_ids = table[:, 3].tolist()
        if max(max_ids) >= self.placement.num_total:
            problems.append(
                f"expert ids must be < {self.placement.num_total} (routed + shared experts of "
                f"the placement); ranks saw maxima {max_ids}"
            )
        raise_on_every_rank(problems, "all_to_all dispatch")


def _dtype_name(code: int) -> str:
    return next(
        (str(d).replace("torch.", "") for d, c in DTYPE_CODES.items() if c == code), f"code {code}"
    )


def _all_gather_rows(row: torch.Tensor, group) -> torch.Tensor:
    from ..distributed import all_gather_ints

    return all_gather_ints(row, group)


def _check_local(hidden_states: torch.Tensor, topk: TopK) -> None:
    """Shape and dtype checks that need no other rank (raise before any collective)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise MoeInputError("hidden_states must be a 2-D tensor [T, H]")
    if hidden_states.dtype not in DTYPE_CODES:
        raise TypeError(f"hidden_states dtype {hidden_states.dtype} not accepted: bf16/fp16/fp32")
    if topk.ids.dim() != 2 or topk.ids.shape[0] != hidden_states.shape[0]:
        raise MoeInputError(
            f"topk.ids must be [T={hidden_states.shape[0]}, k], got {list(topk.ids.shape)}"
        )
    if tuple(topk.weights.shape) != tuple(topk.ids.shape):
        raise MoeInputError("topk.weights and topk.ids must have the same shape")
