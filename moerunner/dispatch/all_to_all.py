"""All-to-all dispatcher: tokens travel to the ranks owning their experts, and back.

Stage 2 and 4 for expert parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

dispatch(hidden_TH, topk with global ids) -> ``AllToAllDispatchOutput`` (format "permuted"):
  1. every (token, slot) with an id >= 0 gets a destination rank and a local expert id from
     the ``ExpertPlacement``; a token travels *once* to each rank owning any of its experts,
     its row carrying the k local ids (-1 where another rank owns the slot) and weights;
  2. one ``all_gather`` exchanges a small header (T, H, dtype, extreme ids) and every rank's
     row counts per destination and pair counts per (destination, local expert): every rank
     checks the world the same way and reads the split sizes on the host (this path
     synchronises once per call, as all variable-size all-to-all exchanges must);
  3. ``all_to_all_single`` moves the rows; the receiver expands them into (row, slot) pairs
     grouped by local expert: rows ``offsets[e]:offsets[e+1]`` belong to local expert ``e``.
combine(y_MH unweighted, dispatch output) -> ``[T, H]``: on the expert side each received
row's pairs are weighted and summed in fp32 (so one row per token and rank travels back,
rounded once to the hidden dtype), the reverse ``all_to_all_single`` returns them, and each
token sums its rows from every rank in fp32.

Ranks with no tokens, experts with no tokens and arbitrarily skewed loads need no special
case. Shared experts (placement ``num_shared``) are owned by every rank: their slots stay home.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import collective_device, raise_failed, raise_on_every_rank, rank_and_size
from ..errors import MoeInputError
from ..routing import TopK
from .base import weighted_row_sum
from .expert_map import ExpertPlacement
from .formats import PERMUTED, PermutedDispatchOutput

__all__ = ["AllToAllDispatchOutput", "AllToAllDispatcher", "DTYPE_CODES"]

# dtype <-> small int, so headers of several ranks can be compared in one int tensor.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HEADER = ("num_tokens", "hidden_size", "dtype", "max_expert_id", "min_expert_id", "top_k")


@dataclass(frozen=True)
class AllToAllHandle:
    """What combine needs to reduce rows on the expert side, send them back and sum them."""

    token_of_row: torch.Tensor  # [N_send] int64: source token of each sent row, in send order
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    row_of_pair: torch.Tensor  # [M] int64: received row of each grouped (row, slot) pair
    weight_of_pair: torch.Tensor  # [M] fp32: routing weight of each grouped pair
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
        combine_dtype: dtype of the per-(token, rank) partial sums sent back; ``None``: the
            hidden dtype (DeepEP's choice: one extra rounding of each partial sum, about one
            bf16 ulp); ``torch.float32`` doubles the return traffic and rounds only once.
    """

    dispatch_format = PERMUTED  # what dispatch returns (``dispatch.formats``)
    accepts_quantized = False  # moves activations in the hidden dtype
    takes_failure = True  # ``dispatch(..., failure=)`` (``dispatch.base``)

    def __init__(
        self, placement: ExpertPlacement, group=None, *, combine_dtype: torch.dtype | None = None
    ) -> None:
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
        placement.check_world(self.world_size)
        if combine_dtype not in (None, *DTYPE_CODES):
            raise TypeError(f"combine_dtype must be None or one of {list(DTYPE_CODES)}")
        self.combine_dtype = combine_dtype
        self.placement = placement
        self.num_local_experts = placement.num_local(self.rank)
        self._slots = max(placement.max_local, 1)  # local-id stride per destination
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _routing_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            self._tables[device] = self.placement.routing_table(self.rank, device)
        return self._tables[device]

    def dispatch(
        self, hidden_states: torch.Tensor, topk: TopK, *, failure: BaseException | None = None
    ) -> AllToAllDispatchOutput:
        """Send each token once to every rank owning one of its experts; group rows here.

        ``failure``: this rank's step has already failed (its inputs are a stand-in): it takes
        part in the header exchange with its failure flag, and every rank raises the same
        ``RankFailedError`` naming it (see ``dispatch.base``).
        """
        import torch.distributed as dist

        world, slots = self.world_size, self._slots
        try:
            if failure is not None:
                raise failure
            row, routes = self._local_row(hidden_states, topk)
        except Exception as err:  # noqa: BLE001  (this rank takes part with a failure flag)
            row = torch.zeros(len(_HEADER) + world + world * slots + 1, dtype=torch.int64)
            row[-1] = 1
            table = _all_gather_rows(row.to(collective_device(self.group)), self.group).cpu()
            raise_failed(table[:, -1], self.group, "all_to_all dispatch", err)
            raise  # unreachable: raise_failed raises when any rank failed  # pragma: no cover
        num_tokens, hidden_size = hidden_states.shape
        top_k = topk.ids.shape[1]
        device = hidden_states.device
        valid_TK, dest_TK, local_TK, visits_TW = routes
        table = _all_gather_rows(row.to(collective_device(self.group)), self.group).cpu()
        raise_failed(table[:, -1], self.group, "all_to_all dispatch", None)
        self._check_world(table)
        head = len(_HEADER)
        rows_SD = table[:, head : head + world]  # rows each source sends each destination
        pairs_SDL = table[:, head + world : -1].view(world, world, slots)
        send_splits = rows_SD[self.rank].tolist()
        recv_splits = rows_SD[:, self.rank].tolist()

        # Send rows in (destination, token) order: the token's hidden state, then its k slots'
        # local ids (-1: not on that rank) and weights, bit-packed into the same row.
        dest_of_row, token_of_row = visits_TW.t().nonzero(as_tuple=True)
        meta_ids = torch.where(
            dest_TK[token_of_row] == dest_of_row[:, None], local_TK[token_of_row], -1
        ).to(torch.int32)
        meta_w = topk.weights.float()[token_of_row].contiguous().view(torch.int32)
        meta = torch.cat([meta_ids, meta_w], dim=1).view(hidden_states.dtype)
        send_buf = torch.cat([hidden_states[token_of_row], meta], dim=1)
        recv_buf = send_buf.new_empty((sum(recv_splits), send_buf.shape[1]))
        dist.all_to_all_single(recv_buf, send_buf, recv_splits, send_splits, group=self.group)
        recv_meta = recv_buf[:, hidden_size:].contiguous().view(torch.int32)
        recv_ids, recv_w = (
            recv_meta[:, :top_k],
            recv_meta[:, top_k:].contiguous().view(torch.float32),
        )

        # Expand received rows into (row, slot) pairs grouped by local expert.
        experts = self.num_local_experts
        per_expert = pairs_SDL[:, self.rank, :experts].sum(0)
        num_pairs = int(per_expert.sum())
        key = torch.where(recv_ids >= 0, recv_ids.long(), experts).reshape(-1)
        pair_order = torch.argsort(key, stable=True)[:num_pairs]
        row_of_pair = pair_order // top_k
        offsets = torch.zeros(experts + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(per_expert, 0)
        handle = AllToAllHandle(
            token_of_row,
            send_splits,
            recv_splits,
            row_of_pair,
            recv_w.reshape(-1)[pair_order],
            num_tokens,
            hidden_states.dtype,
        )
        return AllToAllDispatchOutput(
            hidden_states=recv_buf[row_of_pair, :hidden_size],
            expert_offsets=offsets.to(device),
            handle=handle,
        )

    def _local_row(self, hidden_states: torch.Tensor, topk: TopK) -> tuple[torch.Tensor, tuple]:
        """This rank's checks and its row of the header exchange (header, rows per
        destination, pairs per destination and local expert, failure flag 0), with the
        routes ``dispatch`` goes on with."""
        _check_local(hidden_states, topk)
        num_tokens, hidden_size = hidden_states.shape
        device = hidden_states.device
        world, slots = self.world_size, self._slots
        dest_E, local_E = self._routing_table(device)
        ids_TK = topk.ids.long()
        valid_TK = ids_TK >= 0
        safe = torch.where(valid_TK, ids_TK, 0).clamp(max=self.placement.num_total - 1)
        dest_TK = torch.where(valid_TK, dest_E[safe], world)
        local_TK = local_E[safe]
        # Which ranks each token visits (once each), and pair counts per (rank, local expert).
        visits_TW = torch.zeros((num_tokens, world + 1), dtype=torch.bool, device=device)
        visits_TW.scatter_(1, dest_TK, True)
        visits_TW = visits_TW[:, :world]
        pair_key = torch.where(valid_TK, dest_TK * slots + local_TK, world * slots).reshape(-1)
        pair_counts = torch.zeros(world * slots + 1, dtype=torch.int64, device=device)
        pair_counts.scatter_add_(0, pair_key, torch.ones_like(pair_key))
        header = torch.tensor(
            [num_tokens, hidden_size, DTYPE_CODES[hidden_states.dtype], -1, -1, ids_TK.shape[1]],
            dtype=torch.int64,
            device=device,
        )
        if ids_TK.numel():
            header[3] = ids_TK.max()
            header[4] = ids_TK.min()
        failed = header.new_zeros(1)
        row = torch.cat([header, visits_TW.sum(0), pair_counts[: world * slots], failed])
        return row, (valid_TK, dest_TK, local_TK, visits_TW)

    def combine(
        self, output: torch.Tensor, dispatch_output: AllToAllDispatchOutput
    ) -> torch.Tensor:
        """Weight and sum expert rows ``[M, H]`` per received row, send them back, and sum
        each token's rows from every rank (fp32 sums); returns ``[T, H]``."""
        import torch.distributed as dist

        h = dispatch_output.handle
        hidden_size = dispatch_output.hidden_states.shape[1]
        if tuple(output.shape) != tuple(dispatch_output.hidden_states.shape):
            raise MoeInputError(
                f"output must have the dispatched shape {list(dispatch_output.hidden_states.shape)}"
                f", got {list(output.shape)}"
            )
        partial = weighted_row_sum(output, h.row_of_pair, h.weight_of_pair, sum(h.recv_splits))
        wire = self.combine_dtype or output.dtype
        back = partial.new_empty((len(h.token_of_row), hidden_size), dtype=wire)
        dist.all_to_all_single(
            back, partial.to(wire), h.send_splits, h.recv_splits, group=self.group
        )
        return weighted_row_sum(back, h.token_of_row, None, h.num_tokens).to(h.dtype)

    def _check_world(self, table: torch.Tensor) -> None:
        """Every rank evaluates the same gathered header table and raises the same error."""
        problems = []
        # top_k sizes the rows that travel (k ids and weights ride with each row).
        for col, name in ((1, "hidden size H"), (2, "dtype"), (5, "top_k")):
            values = table[:, col].tolist()
            if len(set(values)) > 1:
                shown = [_dtype_name(v) for v in values] if col == 2 else values
                problems.append(f"{name} differs across ranks: {shown}")
        max_ids = table[:, 3].tolist()
        if max(max_ids) >= self.placement.num_total:
            problems.append(
                f"expert ids must be < {self.placement.num_total} (routed + shared experts of "
                f"the placement); ranks saw maxima {max_ids}"
            )
        shared, routed = self.placement.num_shared, self.placement.num_experts
        tokens = table[:, 0].tolist()
        pairs = enumerate(zip(tokens, max_ids, strict=True))
        missing = [r for r, (t, m) in pairs if t > 0 and m < routed]
        if shared and missing:  # (a shared slot's id is >= E on every token that has one)
            problems.append(
                f"the routing of rank(s) {missing} has no shared-expert slots (ids {routed}.."
                f"{self.placement.num_total - 1}) though the placement has {shared} shared "
                "expert(s), which would never run: pass append_shared_slots(topk, placement)"
            )
        min_ids = table[:, 4].tolist()
        if min(min_ids) < -1:
            problems.append(
                f"expert ids must be >= -1 (-1: slot unused), as fused_moe accepts; ranks saw "
                f"minima {min_ids}"
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
