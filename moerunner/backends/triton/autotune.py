# First-call tile tuning of the triton backend (``TritonOptions(autotune="first_call")``).
#
# A call whose token bucket (``token_bucket``: the nearest of the tuner's token counts) has
# no entry in the weights' tuned tiles times a few of ``moerunner tune``'s candidates for
# that bucket (``tune.tune_tokens`` over ``tune.limited_candidates``, the default tiles
# among them), once per prepared weights, and keeps the winner: in the prepared weights'
# ``TileSource`` (this call and later ones use it) and merged into the shape's tuned file in
# the first tile folder (``tune.merge_tuned``), where the next process finds it when it
# prepares the weights. Under CUDA-graph capture or ``torch.compile`` tracing nothing is
# timed (timing synchronises and launches kernels of its own): the default tiles answer.

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from ...device_files import gpu_name
from . import tune
from ._prepare import weight_layout
from .tile_config import (
    SHIPPED_DIR,
    MoeTiles,
    TileSource,
    config_file_name,
    heuristic_tiles,
    tile_folders,
)

_log = logging.getLogger(__name__)

#: Candidates timed per bucket besides the default tiles (spread over every BLOCK_M the
#: tuner searches for the bucket): seconds, not the minutes of a full search.
QUICK_CANDIDATES = 8


def token_bucket(num_tokens: int) -> int:
    """The token count a call of ``num_tokens`` tokens is tuned at: the nearest of
    ``tune.DEFAULT_TOKENS`` (ties to the smaller), as ``TileSource.lookup`` picks entries."""
    return min(tune.DEFAULT_TOKENS, key=lambda t: (abs(t - num_tokens), t))


def may_time(device: torch.device) -> bool:
    """Whether a call on ``device`` may time kernels now: not while ``torch.compile``
    traces, nor while a CUDA graph is being captured."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def tiles_for_call(
    prepared,
    num_tokens: int,
    top_k: int,
    device: torch.device,
    timer: Callable[[Callable[[], None], bool], float] | None = None,
) -> MoeTiles:
    """The tiles of one call on ``prepared`` (``TritonOptions.autotune`` decides how a
    missing bucket is filled). ``timer``: as ``tune.tune_tokens`` takes it (None: its
    default, CUDA-event timing)."""
    source = prepared.tensors["tiles"]
    if prepared.options.autotune == "off":
        return source.lookup(num_tokens, top_k)
    bucket = token_bucket(num_tokens)
    if source.table and bucket in source.table:
        return source.lookup(num_tokens, top_k)
    # Off the GPU the interpreter's times mean nothing: only a given timer tunes there.
    if not may_time(device) or (device.type != "cuda" and timer is None):
        return _default(source, num_tokens, top_k)
    return _tune_bucket(prepared, bucket, top_k, device, timer)


def _default(source: TileSource, num_tokens: int, top_k: int) -> MoeTiles:
    return heuristic_tiles(
        num_tokens, top_k, source.num_experts, source.n, source.k, source.scheme, source.dtype_bytes
    )


def _tune_bucket(prepared, bucket: int, top_k: int, device, timer) -> MoeTiles:
    source = prepared.tensors["tiles"]
    w13 = prepared.tensors["w13"]
    default = _default(source, bucket, top_k)
    layout = weight_layout(w13)
    cands = tune.candidate_tiles(bucket, top_k, source.num_experts, source.scheme, layout)
    cands = tune.limited_candidates(cands, QUICK_CANDIDATES, (default.gemm1, default.gemm2))
    kwargs = {} if timer is None else {"timer": timer}
    tiles, ms = tune.tune_tokens(prepared, bucket, top_k, cands, progress=_log.debug, **kwargs)
    table = {**(source.table or {}), bucket: tiles}
    path = source.path
    folder = tile_folders(prepared.options.tile_dirs)[0]
    device_name = gpu_name(device) or device.type
    if folder != SHIPPED_DIR:  # tile_dirs=(): in memory only, never into the package
        key = (source.num_experts, source.n, source.k, source.scheme, device_name, layout)
        path = folder / config_file_name(*key)
        folder.mkdir(parents=True, exist_ok=True)
        tune.merge_tuned(path, key, table, {bucket: ms})  # the whole table: it is read first
    prepared.tensors["tiles"] = dataclasses.replace(source, path=path, table=table)
    prepared.tensors.pop("plans", None)  # plans recorded with the tiles this bucket had
    _log.info(
        "triton: tuned tiles for T=%d on %s in the first call: %s (%s)",
        bucket,
        device_name,
        tiles,
        path if path is not None else "kept in memory",
    )
    return tiles
