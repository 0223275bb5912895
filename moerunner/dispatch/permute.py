"""Pre- and post-permutes between each dispatch format and the grouped (per-expert) layout.

A backend core computes on rows grouped by local expert (``PermutedDispatchOutput``); these
functions bring each dispatch format into that layout and back. They never synchronise with
the host: the grouped layout always has as many rows as there are (token, slot) pairs, and
rows of -1 ids (or masked padding) sit past ``expert_offsets[E]``, where cores may leave
garbage that ``post`` never reads (standard) or masks out (masked, permuted).

The standard post-permute weights and sums each token's k rows in float32, a block of tokens
at a time, so no float32 copy of all ``[M, H]`` rows is made and the block stays in cache.

The grouped rows that the standard and masked pre-permutes gather are private to the call
(``is_scratch``): a core may write its output over them, so the permute path holds one
``[T*k, H]`` buffer instead of two. Rows of a dispatcher's own output are never marked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import MaskedDispatchOutput, PermutedDispatchOutput, StandardDispatchOutput


@dataclass(frozen=True)
class PermuteContext:
    """What post-permute needs: the source row of each grouped row and its weight."""

    source_row: torch.Tensor  # [M] int64: token (standard) or flat e*C+c slot (masked)
    row_weight: torch.Tensor | None  # [M] float32 (0 for padding rows) or None: unweighted
    num_valid: torch.Tensor  # 0-d int64 on device: expert_offsets[E]
    # [T, k] int64, standard only: grouped row of each (token, slot) pair; a -1 id's pair
    # points at row 0 (its weight in ``pair_weight`` is 0), never at a padding row.
    pair_row: torch.Tensor | None = None
    pair_weight: torch.Tensor | None = None  # [T, k] float32 routing weights, 0 for -1 ids


_SCRATCH_ATTR = "_moerunner_scratch"


def _scratch(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` (a fresh gather nobody else holds) as writable by the core."""
    setattr(t, _SCRATCH_ATTR, True)
    return t


def is_scratch(t: torch.Tensor) -> bool:
    """True for grouped rows a pre-permute gathered for this call only (see module doc)."""
    return getattr(t, _SCRATCH_ATTR, False)


def group_rows(key: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of rows by ``key`` (group ids; ``num_groups`` or more: padding, last)
    and the offsets ``[G + 1]`` (int64; group g's rows are ``offsets[g]:offsets[g+1]``), no
    host read."""
    sorted_key, order = torch.sort(key, stable=True)
    # offsets[g] = how many keys sort below g: a search of the sorted keys (two launches; a
    # count of each key scattered into a buffer, then a cumulative sum, took six).
    bounds = torch.arange(num_groups + 1, dtype=sorted_key.dtype, device=key.device)
    return order, torch.searchsorted(sorted_key, bounds)


def valid_rows(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """bool ``[num_rows]``: the grouped rows inside a group (before ``offsets[-1]``; the
    padding rows sort after them), no host read."""
    return torch.arange(num_rows, device=offsets.device) < offsets[-1]


def group_pairs(
    topk, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T*k (token, slot) pairs of ``topk`` grouped by expert, in their order within an
    expert: (order of the pairs, token of each grouped row, expert offsets [E+1], routing
    weights [T, k] in float32 with 0 for skipped ids). Pairs whose id is not in
    ``[0, num_experts)`` (-1, or unchecked ids out of range) are skipped: they sort past
    offsets[E]."""
    ids = topk.ids if topk.ids.dtype in (torch.int32, torch.int64) else topk.ids.int()
    valid_TK = _valid_ids(ids, num_experts)
    # (the keys in int32 / int64 ids' own dtype: no copy; narrower ids could not hold E)
    key = torch.where(valid_TK, ids, num_experts).reshape(-1)
    order, offsets = group_rows(key, num_experts)
    weight_TK = torch.where(valid_TK, topk.weights.float(), 0.0)
    return order, order // topk.ids.shape[1], offsets, weight_TK


def _valid_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (ids >= 0) & (ids < num_experts)


def pre_permute_standard(
    dispatch_output: StandardDispatchOutput, num_experts: int
) -> tuple[PermutedDispatchOutput, PermuteContext]:
    """Group the T*k (token, slot) pairs by expert; -1 ids become padding rows."""
    order, token, offsets, weight_TK = group_pairs(dispatch_output.topk, num_experts)
    valid_TK = _valid_ids(dispatch_output.topk.ids, num_experts)
    row_of_pair = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.shape[0], device=order.device)
    )
    pair_row = torch.where(valid_TK, row_of_pair.view(valid_TK.shape), 0)
    grouped = PermutedDispatchOutput(
        hidden_states=_scratch(dispatch_output.hidden_states[token]), expert_offsets=offsets
    )
    ctx = PermuteContext(
        source_row=token,
        row_weight=weight_TK.reshape(-1)[order],
        num_valid=offsets[-1],
        pair_row=pair_row,
        pair_weight=weight_TK,
    )
    return grouped, ctx


# Elements per block of the standard combine: the float32 weighted block stays ~4 MiB.
_COMBINE_BLOCK_ELEMENTS = 1 << 20


def post_permute_standard(
    y_MH: torch.Tensor, ctx: PermuteContext, dispatch_output: StandardDispatchOutput
) -> torch.Tensor:
    """Each token's k expert rows times their routing weights, summed in fp32, rounded once.

    Gathers by ``ctx.pair_row``, so padding rows (garbage allowed) are never read; when no
    pair is valid, row 0 is padding too and the result is zeros.
    """
    hidden = dispatch_output.hidden_states
    tokens, top_k = ctx.pair_row.shape
    out_TH = torch.empty((tokens, y_MH.shape[1]), dtype=torch.float32, device=y_MH.device)
    block = max(1, _COMBINE_BLOCK_ELEMENTS // (top_k * y_MH.shape[1]))
    for start in range(0, tokens, block):
        rows_BKH = y_MH[ctx.pair_row[start : start + block]]
        weighted_BKH = rows_BKH * ctx.pair_weight[start : start + block, :, None]
        torch.sum(weighted_BKH, dim=1, out=out_TH[start : start + block])
    return torch.where(ctx.num_valid > 0, out_TH, 0.0).to(hidden.dtype)


def pre_permute_permuted(
    dispatch_output: PermutedDispatchOutput, num_experts: int
) -> tuple[PermutedDispatchOutput, None]:
    """Already grouped: nothing to do."""
    return dispatch_output, None


def post_permute_permuted(
    y_MH: torch.Tensor, ctx: None, dispatch_output: PermutedDispatchOutput
) -> torch.Tensor:
    """Already in the dispatcher's layout: padding rows are zeroed so nothing leaks."""
    valid = torch.arange(y_MH.shape[0], device=y_MH.device) < dispatch_output.expert_offsets[-1]
    return torch.where(valid[:, None], y_MH, torch.zeros((), dtype=y_MH.dtype, device=y_MH.device))


def pre_permute_masked(
    dispatch_output: MaskedDispatchOutput, num_experts: int
) -> tuple[PermutedDispatchOutput, PermuteContext]:
    """Compact each expert's first ``counts[e]`` rows into the grouped layout."""
    hidden_ECH = dispatch_output.hidden_states
    experts, capacity, hidden_size = hidden_ECH.shape
    slot = torch.arange(capacity, device=hidden_ECH.device)
    valid_EC = slot[None, :] < dispatch_output.counts.to(slot.device).long()[:, None]
    expert_EC = torch.arange(experts, device=hidden_ECH.device)[:, None].expand(-1, capacity)
    key = torch.where(valid_EC, expert_EC, num_experts).reshape(-1)
    order, offsets = group_rows(key, num_experts)
    grouped = PermutedDispatchOutput(
        hidden_states=_scratch(hidden_ECH.reshape(-1, hidden_size)[order]),
        expert_offsets=offsets,
    )
    return grouped, PermuteContext(source_row=order, row_weight=None, num_valid=offsets[-1])


def post_permute_masked(
    y_MH: torch.Tensor, ctx: PermuteContext, dispatch_output: MaskedDispatchOutput
) -> torch.Tensor:
    """Scatter grouped rows back to ``[E, C, H]``; padding slots are zero."""
    shape = dispatch_output.hidden_states.shape
    valid = torch.arange(y_MH.shape[0], device=y_MH.device) < ctx.num_valid
    out = torch.zeros((shape[0] * shape[1], y_MH.shape[1]), dtype=y_MH.dtype, device=y_MH.device)
    rows = torch.where(valid[:, None], y_MH, torch.zeros((), dtype=y_MH.dtype, device=y_MH.device))
    out.index_copy_(0, ctx.source_row, rows)
    return out.view(shape[0], shape[1], -1)
