# Stage "route" as one Triton kernel (private): router logits -> top-k weights and ids.
#
# Covers every variant of ``moerunner.routing.select_experts`` in one launch: softmax or
# sigmoid scores, choosing on the raw logits (``topk_sigmoid``), correction bias (added for
# choosing only), grouped top-k (a group's score is the sum of its two best biased scores, or
# its best with ``group_score="max"``; ``topk_group`` groups stay eligible), top-k,
# renormalisation and the routed scaling factor. Output: float32 weights and int32 ids
# ``[T, k]``, the formats the expert kernels take (``route`` also stores bf16 / fp16 weights
# and int64 ids, converted by the stores, for callers that hand them on). The numerics are
# those that the module docstring of ``moerunner.routing`` defines, so both paths give the
# same bits:
#   - scores in float64 from the float32 logits, rounded once to float32;
#   - choosing by unique int64 keys: the float32 value mapped to an order-preserving integer
#     (-0.0 as +0.0, every NaN as the largest value, as ``torch.sort`` orders them) in the
#     high half, ``E_POW2 - 1 - index`` in the low half. Keys are unique, so the maximum is
#     one slot and equal values go to the lowest index first: a stable descending sort;
#   - renormalising sum and division in float64, rounded once; scaling in float32.
# One program handles BLOCK_T rows; nothing is read back to the host (CUDA-graph capturable).
# ``route_aligned`` (a layer step at decode sizes) runs every block in one program and then
# the experts' one-program alignment of the ids it wrote: one launch instead of two.

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from ...errors import BackendUnavailableError, MoeInputError
from ...topk import TopK
from . import _launch, _pdl, _plan
from ._align import align_in_program, one_program_constants
from ._launch import cdiv as _cdiv
from ._launch import next_power_of_2 as _pow2
from .options import DEFAULT_OPTIONS

# Below every key: the smallest real key (-inf) is about -2^63 + 2^55.
_MIN_KEY = tl.constexpr(-9223372036854775807)
# Elements of one program's [BLOCK_T, E_POW2] tile: with 4 warps, 8 per thread (compiled for
# sm_90: about 150 registers at E = 256 with groups, no spills; 2048 reached 255).
_TILE = 1024
# Plans of routing launches (``_plan``), least recently used dropped past ``_plan.MAX_PLANS``.
_PLANS: OrderedDict = OrderedDict()


@triton.jit
def _ordered(v):
    """int64 that orders like the float32 ``v`` (-0.0 equal to +0.0, NaN above +inf)."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(v != v, 0x7FC00000, ordered)
    return ordered.to(tl.int64)


@triton.jit
def _index_of(key, POW2: tl.constexpr):
    """The index that a key of ``_ordered(v) << 32 | (POW2 - 1 - index)`` carries (its low
    half: the arithmetic shift floors, so the difference is in [0, 2^32))."""
    return (POW2 - 1 - (key - ((key >> 32) << 32))).to(tl.int32)


@triton.jit
def _route_rows(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    first,
    num_tokens,
    stride_lt,
    scale,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    G_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    ON_LOGITS: tl.constexpr,
):
    """Rows [first, first + BLOCK_T): scores, (grouped) choice, top-k, weights."""
    rows = first + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    rows64 = rows.to(tl.int64)
    experts = tl.arange(0, E_POW2)
    real = experts[None, :] < NUM_EXPERTS
    x = tl.load(
        logits_ptr + rows64[:, None] * stride_lt + experts[None, :],
        mask=row_ok[:, None] & real,
        other=0.0,
    )
    x = x.to(tl.float32).to(tl.float64)

    # Scores: float64, rounded once.
    if SIGMOID:
        s64 = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(real, x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        e = tl.where(real, e, 0.0)
        s64 = e / tl.sum(e, axis=1)[:, None]
    scores = tl.where(real, s64.to(tl.float32), 0.0)

    choice = scores
    if ON_LOGITS:  # topk_sigmoid: choose on the float32 logits, weights from the scores
        choice = tl.where(real, x.to(tl.float32), 0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + experts, mask=experts < NUM_EXPERTS, other=0.0)
        choice = choice + bias.to(tl.float32)[None, :]  # (topk_sigmoid: the logits')
    low = (E_POW2 - 1 - experts).to(tl.int64)[None, :]
    keys = tl.where(real, (_ordered(choice) << 32) | low, _MIN_KEY)

    if NUM_GROUPS > 0:
        # Group score: the sum of the group's two best choice values (GROUP_MAX: its best).
        groups = tl.arange(0, G_POW2)
        if NUM_EXPERTS == E_POW2 and NUM_GROUPS == G_POW2:
            # Groups tile the row exactly (powers of two, DeepSeek-V3's 8 x 32): every
            # group's best and second best in one reduction each, over [rows, G, size].
            k3 = tl.reshape(keys, (BLOCK_T, NUM_GROUPS, GROUP_SIZE))
            c3 = tl.reshape(choice, (BLOCK_T, NUM_GROUPS, GROUP_SIZE))
            hit3 = k3 == tl.max(k3, axis=2)[:, :, None]
            gscore = tl.sum(tl.where(hit3, c3, 0.0), axis=2)
            if GROUP_SIZE > 1 and not GROUP_MAX:
                k3 = tl.where(hit3, _MIN_KEY, k3)
                second = k3 == tl.max(k3, axis=2)[:, :, None]
                gscore += tl.sum(tl.where(second, c3, 0.0), axis=2)
            gkeys = (_ordered(gscore) << 32) | (G_POW2 - 1 - groups)[None, :]
        else:
            gkeys = tl.full((BLOCK_T, G_POW2), _MIN_KEY, tl.int64)
            for g in tl.static_range(NUM_GROUPS):
                in_g = (experts[None, :] >= g * GROUP_SIZE) & (
                    experts[None, :] < (g + 1) * GROUP_SIZE
                )
                k_in = tl.where(in_g, keys, _MIN_KEY)
                first = _index_of(tl.max(k_in, axis=1), E_POW2)
                hit = experts[None, :] == first[:, None]
                gscore = tl.sum(tl.where(hit, choice, 0.0), axis=1)
                if GROUP_SIZE > 1 and not GROUP_MAX:
                    second = _index_of(tl.max(tl.where(hit, _MIN_KEY, k_in), axis=1), E_POW2)
                    gscore += tl.sum(
                        tl.where(experts[None, :] == second[:, None], choice, 0.0), axis=1
                    )
                gkey = (_ordered(gscore) << 32) | (G_POW2 - 1 - g)
                gkeys = tl.where(groups[None, :] == g, gkey[:, None], gkeys)
        # A group stays eligible when fewer than TOPK_GROUP groups rank above it.
        above = tl.sum((gkeys[:, None, :] > gkeys[:, :, None]).to(tl.int32), axis=2)
        kept = ((above < TOPK_GROUP) & (groups[None, :] < NUM_GROUPS)).to(tl.int32)
        if NUM_EXPERTS == E_POW2 and NUM_GROUPS == G_POW2:
            allowed = tl.reshape(
                tl.broadcast_to(kept[:, :, None], (BLOCK_T, NUM_GROUPS, GROUP_SIZE)),
                (BLOCK_T, E_POW2),
            )
        else:
            allowed = tl.zeros((BLOCK_T, E_POW2), tl.int32)
            for g in tl.static_range(NUM_GROUPS):
                kept_g = tl.sum(tl.where(groups[None, :] == g, kept, 0), axis=1)
                in_g = (experts[None, :] >= g * GROUP_SIZE) & (
                    experts[None, :] < (g + 1) * GROUP_SIZE
                )
                allowed = tl.where(in_g, kept_g[:, None], allowed)
        masked = tl.where(allowed > 0, choice, float("-inf"))
        keys = tl.where(real, (_ordered(masked) << 32) | low, _MIN_KEY)

    # Top-k: the largest key k times; weights from the unbiased scores.
    slots = tl.arange(0, K_POW2)
    ids = tl.zeros((BLOCK_T, K_POW2), tl.int32)
    weights = tl.zeros((BLOCK_T, K_POW2), tl.float32)
    for j in range(TOP_K):
        best = _index_of(tl.max(keys, axis=1), E_POW2)
        hit = experts[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        keys = tl.where(hit, _MIN_KEY, keys)
        ids = tl.where(slots[None, :] == j, best[:, None], ids)
        weights = tl.where(slots[None, :] == j, w[:, None], weights)

    if RENORMALIZE:
        wide = weights.to(tl.float64)
        denominator = tl.sum(wide, axis=1)
        if SIGMOID:
            denominator += tl.full((BLOCK_T,), 1e-20, tl.float64)
        weights = (wide / denominator[:, None]).to(tl.float32)
    if SCALED:
        weights = weights * scale

    out = rows64[:, None] * TOP_K + slots[None, :]
    out_mask = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + out, ids, mask=out_mask)
    tl.store(weights_ptr + out, weights, mask=out_mask)


@triton.jit
def _routing_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_lt,
    scale,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    G_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALED: tl.constexpr,
    PDL: tl.constexpr,
    GROUP_MAX: tl.constexpr = False,
    ON_LOGITS: tl.constexpr = False,
):
    """Program p routes rows [p * BLOCK_T, +BLOCK_T)."""
    _pdl.enter(PDL)
    _route_rows(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        tl.program_id(0) * BLOCK_T,
        num_tokens,
        stride_lt,
        scale,
        NUM_EXPERTS,
        TOP_K,
        E_POW2,
        K_POW2,
        BLOCK_T,
        SIGMOID,
        HAS_BIAS,
        NUM_GROUPS,
        GROUP_SIZE,
        TOPK_GROUP,
        G_POW2,
        RENORMALIZE,
        SCALED,
        GROUP_MAX,
        ON_LOGITS,
    )


@triton.jit
def _route_align_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_tokens,
    stride_lt,
    scale,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    G_POW2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP_MAX: tl.constexpr,
    ON_LOGITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ALIGN_E_POW2: tl.constexpr,
    ROWS_POW2: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: routes the rows (one block of BLOCK_T rows, as the first program of
    ``_routing_kernel`` would), then aligns the ids it wrote (``_align.align_in_program``)."""
    _pdl.enter(PDL)
    _route_rows(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        0,
        num_tokens,
        stride_lt,
        scale,
        NUM_EXPERTS,
        TOP_K,
        E_POW2,
        K_POW2,
        BLOCK_T,
        SIGMOID,
        HAS_BIAS,
        NUM_GROUPS,
        GROUP_SIZE,
        TOPK_GROUP,
        G_POW2,
        RENORMALIZE,
        SCALED,
        GROUP_MAX,
        ON_LOGITS,
    )
    tl.debug_barrier()  # every thread's ids are stored before any thread counts them
    align_in_program(
        ids_ptr,
        sorted_rows_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_tokens * TOP_K,
        NUM_EXPERTS,
        BLOCK_M,
        ALIGN_E_POW2,
        ROWS_POW2,
        FILL,
    )


def _runnable(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    from . import interpreted

    return device.type == "cpu" and interpreted()


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    group_score: str = "top2_sum",
    weights_dtype: torch.dtype = torch.float32,
    ids_dtype: torch.dtype = torch.int32,
) -> TopK:
    """``select_experts`` in one kernel launch; arguments as there, already validated
    (``select_experts(..., backend="triton")`` checks them, then calls this).

    Runs on CUDA tensors (CPU ones under Triton's interpreter). T = 0 launches nothing.
    The kernel stores the weights and ids in the dtypes of their tensors (a store converts:
    float32 rounded to nearest even, int32 widened).
    """
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    if not _runnable(device):
        raise BackendUnavailableError(
            f"the triton routing kernel needs CUDA router_logits (or Triton's interpreter), "
            f"got router_logits on {device}; use backend='torch'"
        )
    if correction_bias is not None and correction_bias.device != device:
        raise MoeInputError(
            f"correction_bias is on {correction_bias.device} but router_logits on {device}"
        )
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=ids_dtype, device=device)
    if num_tokens == 0:
        return TopK(weights=weights, ids=ids)
    stride_t, stride_e = router_logits.stride()
    if stride_e != 1:
        router_logits = router_logits.contiguous()
        stride_t = router_logits.stride(0)
    bias = router_logits if correction_bias is None else correction_bias.contiguous()
    roles = (
        (router_logits, weights, ids)
        if correction_bias is None
        else (router_logits, weights, ids, bias)
    )
    settings = (top_k, scoring_func, renormalize, num_expert_group, topk_group, group_score)
    planned = _plan.enabled(DEFAULT_OPTIONS, device)
    if planned:  # one launch, replayed per (shape, settings, caller): ``_plan``
        plan_key = _routing_key(roles, stride_t, routed_scaling_factor, settings)
        if _plan.replay(_PLANS, plan_key, roles):
            return TopK(weights=weights, ids=ids)
    with _plan.recorded(_PLANS, plan_key, roles) if planned else contextlib.nullcontext():
        _launch_routing(
            router_logits,
            bias,
            weights,
            ids,
            stride_t,
            routed_scaling_factor,
            correction_bias,
            *settings,
        )
    return TopK(weights=weights, ids=ids)


def _routing_key(roles: tuple, stride_t: int, routed_scaling_factor, settings: tuple) -> tuple:
    """The plan key of a ``route`` call (``_plan.key`` with its other facts)."""
    return _plan.key(roles, stride_t, float(routed_scaling_factor), *settings)


def routing_plan(
    roles: tuple[torch.Tensor, ...],
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    group_score: str = "top2_sum",
) -> _plan.LaunchPlan | None:
    """The plan that ``route`` recorded for calls like one with ``roles`` = ``(router_logits
    [T, E] with unit stride along E, weights [T, k] float32, ids [T, k] int32[, correction
    bias [E]])`` and these settings (same shapes, dtypes and alignments), if it made one and
    it is alive; None otherwise. The key is ``route``'s own."""
    settings = (top_k, scoring_func, renormalize, num_expert_group, topk_group, group_score)
    plan = _PLANS.get(_routing_key(roles, roles[0].stride(0), routed_scaling_factor, settings))
    return plan if isinstance(plan, _plan.LaunchPlan) and plan.alive() else None


def _launch_routing(
    router_logits,
    bias,
    weights,
    ids,
    stride_t,
    routed_scaling_factor,
    correction_bias,
    top_k,
    scoring_func,
    renormalize,
    num_expert_group,
    topk_group,
    group_score,
) -> None:
    num_tokens = router_logits.shape[0]
    consts = _constants(
        router_logits.shape,
        correction_bias is not None,
        routed_scaling_factor,
        top_k,
        scoring_func,
        renormalize,
        num_expert_group,
        topk_group,
        group_score,
    )
    rows, warps = launch_shape(num_tokens, router_logits.shape[1])
    consts["BLOCK_T"] = rows
    _launch.launch(
        _routing_kernel,
        (_cdiv(num_tokens, rows),),
        router_logits,
        bias,
        weights,
        ids,
        num_tokens,
        stride_t,
        float(routed_scaling_factor),
        **consts,
        options=DEFAULT_OPTIONS,
        num_warps=warps,
    )


def _constants(
    logits_shape,
    has_bias,
    routed_scaling_factor,
    top_k,
    scoring_func,
    renormalize,
    num_expert_group,
    topk_group,
    group_score,
) -> dict:
    """The routing constexprs of ``_route_rows`` for ``[T, E]`` logits and these settings."""
    num_tokens, num_experts = logits_shape
    e_pow2 = _pow2(num_experts)
    grouped = num_expert_group is not None
    num_groups = num_expert_group if grouped else 0
    return dict(
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        E_POW2=e_pow2,
        K_POW2=_pow2(top_k),
        BLOCK_T=block_rows(num_tokens, num_experts),
        SIGMOID=scoring_func != "softmax",
        HAS_BIAS=has_bias,
        NUM_GROUPS=num_groups,
        GROUP_SIZE=num_experts // num_groups if grouped else 1,
        TOPK_GROUP=topk_group if grouped else 0,
        G_POW2=_pow2(num_groups) if grouped else 1,
        RENORMALIZE=bool(renormalize),
        SCALED=routed_scaling_factor != 1.0,
        GROUP_MAX=group_score == "max",
        ON_LOGITS=scoring_func == "topk_sigmoid",
    )


def launch_shape(num_tokens: int, num_experts: int) -> tuple[int, int]:
    """(rows per program, warps) of ``_routing_kernel``. From 64 to 512 experts, one row per
    one-warp program: every reduction of the row then stays inside the warp (shuffles, no
    shared-memory round trips between warps). Measured on an H100 (graph replay of 200
    launches, T = 1 to 1024, nvidia-h100-routing-kernel-2026-12-07.txt): DeepSeek-V3's grouped
    routing took 7.8-9.4 us a launch this way against 9.8-15.1 us with 1-4 rows on 4 warps
    before its groups were scored in one reduction each, 4.7-6.1 against 7.4-8.8 us after;
    Qwen3's 3.9-4.5 against 4.6-6.3 us. Fewer
    experts keep ``block_rows``' blocks on 4 warps (not measured otherwise), and so do more
    than 512 (a row would not fit one warp's registers)."""
    if 64 <= _pow2(num_experts) <= 512:
        return 1, 1
    return block_rows(num_tokens, num_experts), 4


def block_rows(num_tokens: int, num_experts: int) -> int:
    """Rows of one routing program (``BLOCK_T``): up to ``_TILE`` elements of [rows, E_POW2]."""
    return max(1, min(_pow2(num_tokens), _TILE // _pow2(num_experts)))


def route_aligned(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    *,
    options,
    top_k: int,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    group_score: str = "top2_sum",
) -> None:
    """``route`` and the experts' one-program alignment (``_align.align_rows``) of its ids
    in one launch of one program: ``weights`` [T, k] float32 and ``ids`` [T, k] int32
    (contiguous) get what ``route`` returns, ``layout`` = (sorted_rows, block_expert,
    num_padded) what ``align_rows(ids.view(-1), E, block_m, ...)`` writes, bit for bit.

    For decode sizes: the T rows must fit the one block that ``route`` gives one program
    (``block_rows``; routing several blocks in turn in one program cost more than the launch
    it saves). ``router_logits`` [T >= 1, E] with unit stride along E on the device of the
    other tensors; settings already validated as for ``route``. ``options``: the experts'
    (launches)."""
    num_tokens, num_experts = router_logits.shape
    consts = _constants(
        router_logits.shape,
        correction_bias is not None,
        routed_scaling_factor,
        top_k,
        scoring_func,
        renormalize,
        num_expert_group,
        topk_group,
        group_score,
    )
    if num_tokens > consts["BLOCK_T"]:
        raise ValueError(
            f"route_aligned: {num_tokens} tokens do not fit one routing block of "
            f"{consts['BLOCK_T']} rows at {num_experts} experts"
        )
    align = one_program_constants(num_experts, block_m, consts["BLOCK_T"] * top_k)
    sorted_rows, block_expert, num_padded = layout
    _launch.launch(
        _route_align_kernel,
        (1,),
        router_logits,
        router_logits if correction_bias is None else correction_bias,
        weights,
        ids,
        sorted_rows,
        block_expert,
        num_padded,
        num_tokens,
        router_logits.stride(0),
        float(routed_scaling_factor),
        **consts,
        BLOCK_M=block_m,
        ALIGN_E_POW2=align["E_POW2"],
        ROWS_POW2=align["ROWS_POW2"],
        FILL=align["FILL"],
        options=options,
        num_warps=4,
    )
