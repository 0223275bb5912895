"""Masked dispatcher: fixed-capacity expert-parallel layout with static shapes (decode).

Stage 2 and 4. Every rank receives ``[E_local, C, H]`` (``C`` = ``capacity``, the most rows one
local expert takes per step) plus ``counts [E_local]``: rows ``[e, :counts[e]]`` are valid.
Every tensor's shape depends only on (world, placement, capacity, H, T): no host
synchronisation in ``on_overflow="flag"`` mode, so a whole step can be captured in a CUDA graph.

dispatch:
  1. each (token, slot) pair gets (destination rank, local expert) from the placement and a
     position among this rank's pairs for that expert (stable sort + exclusive cumsum);
  2. one ``all_gather`` of a header and of every rank's counts per (destination, expert):
     every rank knows the whole count matrix, so overflow is computed identically everywhere;
  3. rows go into a send buffer ``[W, L, C, H]`` (L = most local slots of any rank) and one
     equal-split ``all_to_all_single`` moves it; the receiver packs each expert's rows from
     all sources, in source order, into ``[E_local, C, H]``.
combine: the inverse gather, the reverse ``all_to_all_single``, weights applied in fp32.

Overflow (an expert would receive more than ``C`` rows, from one source or in total):
``on_overflow="raise"`` reads the flag on the host after the small exchange and raises
``CapacityOverflowError`` on every rank before any row moves; ``on_overflow="flag"`` never
syncs: rows beyond capacity contribute zero and ``output.overflow`` (a 0-d bool tensor on the
device, equal on every rank) is set; the caller checks it after the step (e.g. after a graph
replay) and reruns that step with the all-to-all dispatcher or a larger capacity.

Invalid expert ids (below -1, or not below the placement's expert count) are never computed
with another expert: ``"raise"`` raises ``MoeInputError`` on every rank (as the all-to-all
dispatcher does); ``"flag"`` drops their pairs (they contribute zero) and sets
``output.overflow``, so a rerun with the all-to-all dispatcher reports them.

Input that fails this rank's own checks (not 2-D, another H, ids of another shape):
``"raise"`` raises ``RankFailedError`` on every rank in the header exchange. ``"flag"`` cannot
tell the others on the host, and a rank that raised at once would leave them waiting in the
exchanges, so this rank takes part in the step with an empty batch instead: ``dispatch``
returns, ``output.overflow`` is set on every rank, and this rank's ``combine`` raises
``RankFailedError`` (naming the cause) after its exchange. The other ranks finish the step.

Hidden dtype: ``"raise"`` checks on every call that all ranks pass one dtype (the same
``MoeInputError`` everywhere). ``"flag"`` exchanges rows in one wire dtype, the
constructor's ``dtype`` or, when that is None, the dtype of the first dispatch (checked on
every rank then: one host read, so warm up before capturing, or pass ``dtype``); a rank that
later passes another dtype is converted to the wire dtype and back, never a size mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import (
    all_gather_ints,
    check_consistent,
    collective_device,
    raise_failed,
    raise_on_every_rank,
    rank_and_size,
)
from ..errors import CapacityOverflowError, MoeInputError
from ..routing import TopK
from .all_to_all import DTYPE_CODES, _check_local, _dtype_name
from .base import weighted_row_sum
from .expert_map import ExpertPlacement
from .formats import MASKED, MaskedDispatchOutput

__all__ = ["MaskedDispatcher", "MaskedEPDispatchOutput", "OVERFLOW_POLICIES"]

OVERFLOW_POLICIES = ("raise", "flag")
_HEADER = 4  # num_tokens, hidden_size, dtype code, number of invalid expert ids


@dataclass(frozen=True)
class MaskedHandle:
    """What combine needs: where each pair's row went and how to bring the rows back."""

    send_index: torch.Tensor  # [T*k] int64: flat row of the send buffer, or W*L*C (dropped)
    recv_index: torch.Tensor  # [W*L*C] int64: flat row of [E_local*C] it was packed to, or
    #                           E_local*C (padding / dropped)
    token_weight: torch.Tensor  # [T*k] fp32: routing weight (0 for -1 ids)
    num_tokens: int
    top_k: int
    dtype: torch.dtype
    failure: BaseException | None = None  # "flag": this rank's input failed; combine raises


@dataclass(frozen=True)
class MaskedEPDispatchOutput(MaskedDispatchOutput):
    """``[E_local, C, H]`` rows, ``counts``, the global ``overflow`` flag and the handle."""

    overflow: torch.Tensor  # 0-d bool on device: some expert exceeded capacity (on any rank)
    handle: MaskedHandle


class MaskedDispatcher:
    """Fixed-capacity expert-parallel dispatch; static shapes end to end.

    Args:
        placement: expert ownership (``ExpertPlacement``), equal on every rank.
        capacity: C, the most rows one local expert receives per step (from all ranks
            together). Memory: send and receive buffers of ``W * L * C * H`` elements each.
        hidden_size: H (static; checked on every call).
        group: the ``torch.distributed`` process group (``None``: default group).
        on_overflow: ``"raise"`` (one host sync per step, ``CapacityOverflowError`` on every
            rank) or ``"flag"`` (no sync; see the module docstring).
        dtype: the hidden dtype rows travel in under ``"flag"`` (None: the first call's);
            equal on every rank.
    """

    dispatch_format = MASKED  # what dispatch returns (``dispatch.formats``)
    accepts_quantized = False  # moves activations in the hidden dtype
    takes_failure = True  # ``dispatch(..., failure=)`` (``dispatch.base``)

    def __init__(
        self,
        placement: ExpertPlacement,
        capacity: int,
        hidden_size: int,
        group=None,
        *,
        on_overflow: str = "raise",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.group = group
        self.rank, self.world_size = rank_and_size(group)
        error = None
        try:  # this rank's own checks: a failure is carried to every rank by the exchange
            if not isinstance(placement, ExpertPlacement):
                raise TypeError(
                    f"placement must be an ExpertPlacement, got {type(placement).__name__}"
                )
            for name, value in (("capacity", capacity), ("hidden_size", hidden_size)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise MoeInputError(f"{name} must be a positive int, got {value!r}")
            if on_overflow not in OVERFLOW_POLICIES:
                raise MoeInputError(
                    f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}"
                )
            if dtype is not None and dtype not in DTYPE_CODES:
                raise TypeError(f"dtype must be None or one of {list(DTYPE_CODES)}, got {dtype!r}")
        except Exception as err:  # noqa: BLE001
            error = err
        names = ("placement", "placement.world_size", "capacity", "hidden_size", "on_overflow")
        values = dict.fromkeys(names + ("dtype",), 0)  # (every rank sends as many values)
        if error is None:
            values.update(
                {
                    "placement": placement.fingerprint(),
                    "placement.world_size": placement.world_size,
                    "capacity": capacity,
                    "hidden_size": hidden_size,
                    "on_overflow": OVERFLOW_POLICIES.index(on_overflow),
                    "dtype": -1 if dtype is None else DTYPE_CODES[dtype],
                }
            )
        check_consistent(group, "MaskedDispatcher configuration", values, error=error)
        placement.check_world(self.world_size)
        self.placement = placement
        self.capacity = capacity
        self.hidden_size = hidden_size
        self.on_overflow = on_overflow
        self.dtype = dtype  # the wire dtype of "flag" mode, once known
        self.num_local_experts = placement.num_local(self.rank)
        self._slots = max(placement.max_local, 1)
        # Placement tables are built from host lists (a host-to-device copy): made here for
        # the group's device, so no dispatch ever copies, even the first one of a capture.
        device = collective_device(group)
        self._tables = {device: placement.routing_table(self.rank, device)}

    def _routing_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:  # another device than the group's: copied once
            self._tables[device] = self.placement.routing_table(self.rank, device)
        return self._tables[device]

    def dispatch(
        self, hidden_states: torch.Tensor, topk: TopK, *, failure: BaseException | None = None
    ) -> MaskedEPDispatchOutput:
        """Pack this rank's pairs, exchange, and return ``[E_local, C, H]`` with counts.

        ``failure``: this rank's step has already failed and its inputs are an empty
        stand-in. With ``on_overflow="raise"`` every rank then raises the same
        ``RankFailedError`` in the header exchange (see ``dispatch.base``); ``"flag"`` reads
        nothing on the host: the step goes on, ``output.overflow`` is set on every rank, and
        the caller raises after the step's exchanges. Input failing this rank's own checks is
        handled the same way (in ``"flag"`` mode, ``combine`` raises; module docstring).
        """
        import torch.distributed as dist

        local_failure = None
        if failure is None:
            try:
                self._check_local(hidden_states, topk)
            except Exception as err:
                failure = local_failure = err
        if failure is not None:
            if self.on_overflow == "raise":  # every rank raises in the header exchange
                self._exchange_failure(failure)
            hidden_states, topk = self._stand_in(hidden_states)
        num_tokens, hidden_size = hidden_states.shape
        if self.on_overflow == "flag" and self.dtype is None:
            self.dtype = self._agree_on_dtype(hidden_states.dtype, failure)
        local_dtype = hidden_states.dtype
        if self.on_overflow == "flag":
            hidden_states = hidden_states.to(self.dtype)  # no copy when it is the wire dtype
        device = hidden_states.device
        world, slots, cap = self.world_size, self._slots, self.capacity
        keys = world * slots
        dest_E, local_E = self._routing_table(device)
        ids = topk.ids.reshape(-1).long()
        in_range = ids < self.placement.num_total
        valid = (ids >= 0) & in_range
        invalid = ~in_range | (ids < -1)  # never computed with another expert
        safe = torch.where(valid, ids, 0)
        key = torch.where(valid, dest_E[safe] * slots + local_E[safe], keys)
        counts = torch.zeros(keys + 1, dtype=torch.int64, device=device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        # Position of each pair among this rank's pairs with the same key (stable order).
        order = torch.argsort(key, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(key)
        position[order] = torch.arange(key.numel(), device=device) - starts[key[order]]

        # Filled on the device (no host-to-device copy), so the step stays capturable.
        header = torch.cat(
            [
                counts.new_full((1,), value)
                for value in (num_tokens, hidden_size, DTYPE_CODES[hidden_states.dtype])
            ]
            + [invalid.sum().reshape(1)]
        )
        failed = counts.new_full((1,), int(failure is not None))
        row = torch.cat([header, counts[:keys], failed]).to(collective_device(self.group))
        table = all_gather_ints(row, self.group).to(device)
        counts_SDL = table[:, _HEADER:-1].view(world, world, slots)  # [source, dest, local]
        sent_SDL = counts_SDL.clamp(max=cap)
        overflow = (
            (counts_SDL > cap).any()
            | (sent_SDL.sum(0) > cap).any()
            | (table[:, 3] > 0).any()  # invalid ids
            | (table[:, -1] > 0).any()  # a rank whose step failed ("flag")
        )
        if self.on_overflow == "raise":
            self._check_world(table.cpu(), bool(overflow))

        # Send buffer: row (dest, local, position); rows beyond capacity go to a dropped row.
        fits = valid & (position < cap)
        send_index = torch.where(fits, key * cap + position, keys * cap)
        send = hidden_states.new_empty(  # unsent rows are never read on the receiving side
            (keys * cap + 1, hidden_size)
        )
        token_of_pair = torch.arange(key.numel(), device=device) // topk.ids.shape[1]
        send.index_copy_(0, send_index, hidden_states[token_of_pair])
        recv = torch.empty_like(send[: keys * cap])
        dist.all_to_all_single(recv, send[: keys * cap], group=self.group)

        # Pack expert l's rows from all sources, in source order, into [E_local, C].
        experts = self.num_local_experts
        got_SL = sent_SDL[:, self.rank, :]
        first_SL = torch.cumsum(got_SL, 0) - got_SL
        slot_C = torch.arange(cap, device=device)
        packed = first_SL[:, :, None] + slot_C
        local_L = torch.arange(slots, device=device)[None, :, None]
        ok = (slot_C < got_SL[:, :, None]) & (packed < cap) & (local_L < experts)
        recv_index = torch.where(ok, local_L * cap + packed, experts * cap).reshape(-1)
        masked = hidden_states.new_zeros((experts * cap + 1, hidden_size))
        masked.index_copy_(0, recv_index, recv)
        counts_E = got_SL.sum(0)[:experts].clamp(max=cap).to(torch.int32)

        weights = torch.where(valid, topk.weights.reshape(-1).float(), 0.0)
        handle = MaskedHandle(
            send_index,
            recv_index,
            weights,
            num_tokens,
            topk.ids.shape[1],
            local_dtype,
            local_failure,
        )
        return MaskedEPDispatchOutput(
            hidden_states=masked[: experts * cap].view(experts, cap, hidden_size),
            counts=counts_E,
            overflow=overflow,
            handle=handle,
        )

    def combine(
        self, output: torch.Tensor, dispatch_output: MaskedEPDispatchOutput
    ) -> torch.Tensor:
        """Bring unweighted ``[E_local, C, H]`` rows back; return ``sum_k w * y`` ``[T, H]``."""
        import torch.distributed as dist

        h = dispatch_output.handle
        shape = tuple(dispatch_output.hidden_states.shape)
        if tuple(output.shape) != shape:
            raise MoeInputError(
                f"output must have the dispatched shape {list(shape)}, got {list(output.shape)}"
            )
        hidden_size = shape[2]
        zero_row = output.new_zeros((1, hidden_size))
        source = torch.cat([output.reshape(-1, hidden_size), zero_row])
        back = source[h.recv_index]
        returned = torch.empty_like(back)
        dist.all_to_all_single(returned, back, group=self.group)
        rows = torch.cat([returned, zero_row])[h.send_index]
        if h.failure is not None:  # "flag": after the exchange, so the others finish
            from ..errors import RankFailedError

            text = f"{type(h.failure).__name__}: {h.failure}"
            raise RankFailedError(
                f"masked dispatch failed on rank {self.rank} (rank {self.rank}: {text})",
                (self.rank,),
                (text,),
            ) from h.failure
        token = torch.arange(h.num_tokens * h.top_k, device=output.device) // h.top_k
        return weighted_row_sum(rows, token, h.token_weight, h.num_tokens).to(h.dtype)

    def _agree_on_dtype(self, dtype: torch.dtype, failure: BaseException | None) -> torch.dtype:
        """First "flag" dispatch without a constructor dtype: every rank checks that all
        passed ``dtype`` (one small all_gather and host read) and takes it as wire dtype.
        A rank whose step failed says so there (code -1): having read the codes on the host
        anyway, every rank raises the same ``RankFailedError``."""
        code = -1 if failure is not None else DTYPE_CODES[dtype]
        row = torch.tensor([code], device=collective_device(self.group))
        codes = all_gather_ints(row, self.group)[:, 0].cpu().tolist()
        raise_failed([int(c < 0) for c in codes], self.group, "masked dispatch", failure)
        if len(set(codes)) > 1:
            raise_on_every_rank(
                [
                    "hidden dtype differs across ranks on the first dispatch: "
                    + ", ".join(f"rank {r} passed {_dtype_name(c)}" for r, c in enumerate(codes))
                    + "; pass one dtype (or build the dispatcher with dtype=)"
                ],
                "masked dispatch",
            )
        return dtype

    def _check_local(self, hidden_states: torch.Tensor, topk: TopK) -> None:
        """This rank's own checks, before any exchange."""
        _check_local(hidden_states, topk)
        if self.on_overflow == "flag" and hidden_states.shape[1] != self.hidden_size:
            raise MoeInputError(
                f"hidden_states has H={hidden_states.shape[1]}, the dispatcher was built "
                f"for H={self.hidden_size}"
            )

    def _stand_in(self, hidden_states) -> tuple[torch.Tensor, TopK]:
        """An empty batch for a rank whose step failed: H of the dispatcher, the wire dtype
        (else the input's, if accepted, else float32), on the collective device."""
        dtype = self.dtype
        if dtype is None:
            given = getattr(hidden_states, "dtype", None)
            dtype = given if given in DTYPE_CODES else torch.float32
        device = collective_device(self.group)
        x = torch.zeros((0, self.hidden_size), dtype=dtype, device=device)
        ids = torch.zeros((0, 1), dtype=torch.int32, device=device)
        return x, TopK(torch.zeros((0, 1), dtype=torch.float32, device=device), ids)

    def _exchange_failure(self, error: BaseException) -> None:
        """This rank's local checks failed: its row of the header exchange carries the flag,
        and every rank raises ``RankFailedError`` (``on_overflow="raise"``)."""
        row = torch.zeros(_HEADER + self.world_size * self._slots + 1, dtype=torch.int64)
        row[-1] = 1
        table = all_gather_ints(row.to(collective_device(self.group)), self.group).cpu()
        raise_failed(table[:, -1], self.group, "masked dispatch", error)

    def _check_world(self, table: torch.Tensor, overflow: bool) -> None:
        """Same table, same verdict on every rank (``on_overflow="raise"`` only)."""
        raise_failed(table[:, -1], self.group, "masked dispatch", None)
        problems = []
        sizes = table[:, 1].tolist()
        if any(h != self.hidden_size for h in sizes):
            problems.append(
                f"hidden size H must be the dispatcher's {self.hidden_size} on every rank; "
                + ", ".join(f"rank {r} passed {h}" for r, h in enumerate(sizes))
            )
        dtypes = table[:, 2].tolist()
        if len(set(dtypes)) > 1:
            problems.append(
                "hidden dtype differs across ranks: "
                + ", ".join(f"rank {r} passed {_dtype_name(c)}" for r, c in enumerate(dtypes))
            )
        invalid = table[:, 3].tolist()
        if any(invalid):
            problems.append(
                f"expert ids must be in [-1, {self.placement.num_total}) (routed + shared "
                "experts of the placement; -1: slot unused); ids outside per rank: "
                + ", ".join(f"rank {r}: {n}" for r, n in enumerate(invalid))
            )
        raise_on_every_rank(problems, "masked dispatch")
        if overflow:
            counts = table[:, _HEADER:-1].view(self.world_size, self.world_size, self._slots)
            worst = int(counts.sum(0).max())
            raise CapacityOverflowError(
                f"masked dispatch: an expert receives {worst} rows but capacity is "
                f"{self.capacity}; raise capacity, use the all_to_all dispatcher for this step, "
                "or build the dispatcher with on_overflow='flag' and handle output.overflow"
            )
