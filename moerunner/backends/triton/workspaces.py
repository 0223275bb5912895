# Workspaces of the triton backend: the buffers a call needs beside its inputs and output
# (alignment, intermediate activations, per-slot outputs, split-K partial sums), reused across
# calls of the same shapes instead of allocated per call, and made outside any CUDA graph's
# memory pool (``memory.kept``); those too large to keep are made per call (``Workspaces``).

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ...memory import kept
from ..base import caller
from . import _launch
from ._align import max_padded_rows, scratch_size
from ._launch import cdiv as _cdiv

#: Default bound of the workspace cache: buffers of recent shapes kept for reuse.
WORKSPACE_LIMIT_BYTES = 256 << 20
#: Default size above which one key's buffers are made per call instead of kept: a quarter
#: of the bound, so the three keys one call uses (its per-slot output, intermediate and
#: alignment buffers) always fit beside each other and never evict one another.
PER_CALL_BYTES = 64 << 20
#: Keys remembered as made per call (least recently seen forgotten first).
_PER_CALL_KEYS = 256


class Workspaces:
    """LRU cache of per-call buffers, bounded in entries and in bytes, keyed per caller.

    ``get(key, make)`` returns the buffers of ``key`` for the calling thread and its current
    CUDA stream (``backends.base.caller``), making them with ``make()`` on a miss. ``make``
    must not hold a call's tensors (a launch plan keeps it for its replays: see below).
    Least recently used entries are evicted until at most ``capacity`` entries and
    ``max_bytes`` bytes remain. A buffer in use is never freed under its user: eviction
    only drops the cache's reference.

    Buffers of one key larger than ``per_call_bytes`` (default: 64 MiB, at most
    ``max_bytes``), such as a prefill's intermediate activations, are not kept: holding them
    would pin that memory between calls, and two of them would evict each other on every
    call. From their second call on they are made in the calling thread, where the caching
    allocator hands back the same blocks in microseconds (``_launch.per_call``: a launch
    plan makes them again at each replay). Kept buffers are made by ``memory.kept``, away
    from any CUDA graph's pool.
    """

    def __init__(
        self,
        capacity: int = 16,
        max_bytes: int = WORKSPACE_LIMIT_BYTES,
        per_call_bytes: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.per_call_bytes = (
            min(max_bytes, PER_CALL_BYTES) if per_call_bytes is None else per_call_bytes
        )
        self.entries: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
        self.sizes: dict[tuple, int] = {}
        self.nbytes = 0
        self.per_call: OrderedDict[tuple, None] = OrderedDict()  # keys made per call
        self._lock = threading.Lock()

    def get(self, key: tuple, make) -> dict[str, torch.Tensor]:
        device = key[0] if key and isinstance(key[0], torch.device) else torch.device("cpu")
        full = (caller(device), *key)
        with self._lock:
            entry = self.entries.get(full)
            if entry is not None:
                self.entries.move_to_end(full)
                return entry
            per_call = full in self.per_call
            if per_call:
                self.per_call.move_to_end(full)
        if per_call:
            return _launch.per_call(make)
        entry = kept(make, device)
        size = sum(t.numel() * t.element_size() for t in entry.values())
        if size > self.per_call_bytes:
            with self._lock:
                self.per_call[full] = None
                while len(self.per_call) > _PER_CALL_KEYS:
                    self.per_call.popitem(last=False)
            return _launch.per_call(make, entry)
        with self._lock:
            if full in self.entries:  # made meanwhile by this caller: keep the first
                return self.entries[full]
            self.entries[full], self.sizes[full] = entry, size
            self.nbytes += size
            while len(self.entries) > self.capacity or self.nbytes > self.max_bytes:
                old, _ = self.entries.popitem(last=False)
                self.nbytes -= self.sizes.pop(old)
        return entry

    def clear(self) -> None:
        """Drop every cached buffer (and what was learnt about sizes)."""
        with self._lock:
            self.entries.clear()
            self.sizes.clear()
            self.nbytes = 0
            self.per_call.clear()


WORKSPACES = Workspaces()
_DUMMIES: dict[torch.device, torch.Tensor] = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """One float32 zero on ``device``, kept: the argument a kernel gets for a tensor it does
    not read (its pointer must be valid)."""
    d = _DUMMIES.get(device)
    if d is None:
        make = lambda: torch.zeros(1, dtype=torch.float32, device=device)  # noqa: E731
        d = _DUMMIES[device] = kept(make, device)
    return d


# The buffers of one key, by kind (callers pass these as ``make``).


def alignment_workspace(
    num_rows: int, num_experts: int, block_m: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The buffers ``experts.layout_rows`` aligns into: sorted_rows, block_expert,
    num_padded and the multi-program scratch, sized for the worst case of ``num_rows``
    rows."""
    max_padded = max_padded_rows(num_rows, num_experts, block_m)
    return {
        "sorted_rows": torch.empty(max_padded, dtype=torch.int32, device=device),
        "block_expert": torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
        "num_padded": torch.empty(1, dtype=torch.int32, device=device),
        "align_scratch": torch.empty(
            scratch_size(num_rows, num_experts), dtype=torch.int32, device=device
        ),
    }


def intermediate_buffers(
    num_rows: int, inter: int, dtype: torch.dtype, fused_quant: bool, device: torch.device
) -> dict[str, torch.Tensor]:
    """GEMM1's output: ``inter`` [rows, I] in ``dtype``, or with ``fused_quant`` (see
    ``experts.fuses_gemm2_input_quant``) e4m3 codes and ``inter_scale`` [rows, ceil(I / 128)]."""
    if not fused_quant:
        return {"inter": torch.empty(num_rows, inter, dtype=dtype, device=device)}
    return {
        "inter": torch.empty(num_rows, inter, dtype=torch.float8_e4m3fn, device=device),
        "inter_scale": torch.empty(num_rows, _cdiv(inter, 128), device=device),
    }


def alignment_buffers(num_rows, num_experts, bm, dev) -> dict:
    """A sequence call's alignment buffers, and GEMM1 -> GEMM2 streaming's count per
    aligned block (row blocks never stream), zero between calls
    (``_gemm_kernel.moe_gemm_kernel``, STREAM)."""
    ws = alignment_workspace(num_rows, num_experts, bm, dev)
    ws["block_done"] = torch.zeros_like(ws["block_expert"])
    return ws


def split_k_workspace(
    device: torch.device, slot: int, num_tiles: int, split: int, block_m: int, width: int
) -> dict[str, torch.Tensor]:
    """A split-K launch's buffers (``_gemm_kernel.moe_gemm_kernel``, SPLIT_K): ``part``
    float32 partial sums, ``split`` slots of ``block_m`` x ``width`` per tile, and ``count``
    int32 [tiles], zero between launches (each tile's last program resets its count). Kept
    per caller and ``slot`` (``WORKSPACES``), so launches on different streams, or that
    overlap on one stream, never share them."""

    def make() -> dict[str, torch.Tensor]:
        return {
            "part": torch.empty(num_tiles * split * block_m * width, device=device),
            "count": torch.zeros(num_tiles, dtype=torch.int32, device=device),
        }

    return WORKSPACES.get((device, "split_k", slot, num_tiles, split, block_m, width), make)
