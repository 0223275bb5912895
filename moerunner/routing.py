"""Stage 1, route: pick each token's top-k experts and their weights from router logits.

``select_experts`` covers the routers of the major MoE families:

- softmax -> top-k (optionally renormalized): Mixtral, Qwen2/3-MoE, GPT-OSS (top-k of logits
  then softmax over the k equals softmax -> top-k -> renormalize, except where two logits
  a float32 ulp apart round to one score: this path then takes the lower expert id, GPT-OSS
  the larger logit, of two weights equal to ~1e-7);
- sigmoid -> (+ correction bias, used only to choose) -> grouped top-k: DeepSeek-V3. A group's
  score is the sum of its two best biased scores (``group_score="top2_sum"``); only
  ``topk_group`` groups stay eligible. Weights come from the unbiased scores, renormalized
  with +1e-20, times the scaling factor;
- softmax -> grouped top-k with a group's score its best score (``group_score="max"``):
  DeepSeek-V2;
- top-k of the raw logits, weights the sigmoid of the chosen logits
  (``scoring_func="topk_sigmoid"``): Llama-4 (top-1, no renormalisation);
- a user function ``custom_routing_function(hidden_states, router_logits, top_k,
  renormalize) -> (weights, ids)`` (vLLM's convention), its output checked.

Output: ``TopK(weights [T, k] float32, ids [T, k] int32)`` (other dtypes on request:
``weights_dtype``, ``ids_dtype``). T = 0 gives empty tensors.

Numerics, defined so that every implementation (this torch path on any device, the Triton
kernel of ``backends/triton/_routing.py``) gives the same bits:

- scores are computed in float64 from the float32 logits (float64 logits are rounded to
  float32 first) and rounded once to float32 (an fp32 ``exp`` differs in the last bit
  between libraries; rounded from fp64 it does not, bar a ~2^-28 chance per value);
- choosing is a stable descending sort: equal scores go to the lowest expert id first, slots
  are ordered by descending choice score (``torch.topk`` breaks ties by implementation);
- the renormalising sum (exact for the k weights in all but extreme ranges) and the division
  run in float64, rounded once; ``routed_scaling_factor`` then multiplies in float32.
"""

from __future__ import annotations

import torch

from .config import GROUP_SCORES, SCORING_FUNCS, check_groups, check_routing_values
from .device_checks import check_ids_async
from .errors import INDEX_DTYPES_TEXT, BackendUnavailableError, MoeInputError, is_index_tensor
from .topk import TopK

ROUTING_BACKENDS = ("auto", "torch", "triton")
#: The dtypes ``select_experts`` can return its weights and ids in (the first: the default).
WEIGHTS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IDS_DTYPES = (torch.int32, torch.int64)
#: ``select_experts``' settings that the routing kernel takes besides the logits, top_k and
#: the correction bias, in the order of the custom op ``moerunner::route``'s arguments.
KERNEL_SETTINGS = (
    "scoring_func",
    "renormalize",
    "num_expert_group",
    "topk_group",
    "routed_scaling_factor",
    "group_score",
    "weights_dtype",
    "ids_dtype",
)


def select_experts(
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
    custom_routing_function=None,
    hidden_states: torch.Tensor | None = None,
    backend: str = "auto",
    weights_dtype: torch.dtype = torch.float32,
    ids_dtype: torch.dtype = torch.int32,
) -> TopK:
    """Choose ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]`` floating tensor of raw router outputs.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring_func: ``"softmax"``, ``"sigmoid"`` or ``"topk_sigmoid"`` (choose on the raw
            logits, weight = sigmoid of the chosen logit: Llama-4).
        renormalize: divide the k weights by their sum (sigmoid adds 1e-20 to the sum).
        correction_bias: ``[E]`` bias added to the scores for choosing only (DeepSeek-V3).
        num_expert_group, topk_group: grouped top-k; both or neither.
        routed_scaling_factor: multiplies the final weights.
        group_score: a group's score in grouped top-k: ``"top2_sum"`` (the sum of its two
            best choice values, DeepSeek-V3) or ``"max"`` (its best, DeepSeek-V2).
        custom_routing_function: ``fn(hidden_states, router_logits, top_k, renormalize) ->
            (weights [T, top_k] floating, ids [T, top_k] integer)``, called instead of the
            rules above (which must then keep their defaults); its output is checked and
            returned as float32 / int32.
        hidden_states: passed to ``custom_routing_function`` (unused otherwise).
        backend: ``"auto"`` (the one-launch Triton kernel for CUDA logits when Triton is
            importable, unless the weights need gradients; else the torch path), ``"torch"``
            (this module's reference path, differentiable in the logits) or ``"triton"``
            (the kernel, which has no backward; CUDA, or CPU under Triton's interpreter).
            Both give the same bits (module docstring). Under ``torch.compile`` the kernel
            is one graph node (the custom op ``moerunner::route``).
        weights_dtype: dtype of the returned weights: float32 (default), bfloat16 or
            float16 (rounded once from the float32 weights, to nearest even; the kernel
            writes them so, with no conversion launch). Models whose routers hand their
            experts bf16 weights (Qwen3-MoE, GPT-OSS) ask for bfloat16.
        ids_dtype: dtype of the returned ids: int32 (default) or int64 (transformers'
            routers return int64).

    NaN and infinite logits are not refused (that would read values on the host every call):
    a NaN or +inf logit makes its token's weights NaN, as in the models' own routers.
    Under ``torch.compile`` a correction bias's values are not checked (a host read): check
    them where the bias is set (``check_correction_bias_values``), as ``MoE`` does.

    Returns:
        ``TopK`` with ``weights_dtype`` weights and ``ids_dtype`` ids (float32 and int32 by
        default), both ``[T, top_k]``.
    """
    _check_routing_args(
        router_logits, top_k, scoring_func, correction_bias, num_expert_group, topk_group
    )
    _check_out_dtypes(weights_dtype, ids_dtype)
    if group_score not in GROUP_SCORES:
        raise MoeInputError(f"group_score: got {group_score!r}; accepted: {GROUP_SCORES}")
    check_routing_values(renormalize, routed_scaling_factor)
    if backend not in ROUTING_BACKENDS:
        raise MoeInputError(f"backend: got {backend!r}; accepted: {ROUTING_BACKENDS}")
    if custom_routing_function is not None:
        rules = {
            "scoring_func": scoring_func != "softmax",
            "correction_bias": correction_bias is not None,
            "num_expert_group": num_expert_group is not None,
            "routed_scaling_factor": routed_scaling_factor != 1.0,
            "group_score": group_score != "top2_sum",
        }
        given = [name for name, set_ in rules.items() if set_]
        if given:
            raise MoeInputError(
                f"custom_routing_function replaces the built-in routing; {', '.join(given)} "
                "must keep its default with it"
            )
        out = _custom_route(
            custom_routing_function, hidden_states, router_logits, top_k, renormalize
        )
        return TopK(
            weights=out[0].float().to(weights_dtype).contiguous(),
            ids=out[1].to(ids_dtype).contiguous(),
        )
    route = _kernel(router_logits, backend)
    if route is not None:
        values = (scoring_func, renormalize, num_expert_group, topk_group)
        values += (routed_scaling_factor, group_score, weights_dtype, ids_dtype)
        settings = dict(zip(KERNEL_SETTINGS, values, strict=True))  # (no locals(): traced)
        return route(router_logits, top_k, correction_bias=correction_bias, **settings)
    num_tokens, num_experts = router_logits.shape
    wide = _wide_dtype(router_logits.device)
    logits = router_logits.float()  # (float64 logits too: the kernel's rounding, documented)
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=wide).float()
    else:
        scores = torch.sigmoid(logits.to(wide)).float()

    # What is chosen on: the scores, or for topk_sigmoid the float32 logits themselves.
    choice = logits if scoring_func == "topk_sigmoid" else scores
    if correction_bias is not None:
        choice = choice + correction_bias.float()
    if num_expert_group is not None and num_tokens > 0:
        group_size = num_experts // num_expert_group
        grouped = choice.view(num_tokens, num_expert_group, group_size)
        best = 1 if group_score == "max" else min(2, group_size)
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
        keep = _top(group_scores, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, group_size)
        expert_mask = expert_mask.reshape(num_tokens, num_experts)  # (-1 is ambiguous at T = 0)
        choice = choice.masked_fill(~expert_mask, float("-inf"))

    ids = _top(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        widened = weights.to(wide)
        denominator = widened.sum(dim=-1, keepdim=True)
        if scoring_func != "softmax":
            denominator = denominator + 1e-20
        weights = (widened / denominator).float()
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return TopK(
        weights=weights.float().to(weights_dtype).contiguous(), ids=ids.to(ids_dtype).contiguous()
    )


def _check_out_dtypes(weights_dtype: object, ids_dtype: object) -> None:
    for name, value, accepted in (
        ("weights_dtype", weights_dtype, WEIGHTS_DTYPES),
        ("ids_dtype", ids_dtype, IDS_DTYPES),
    ):
        if value not in accepted:
            raise MoeInputError(
                f"{name}: got {value!r}; accepted: {', '.join(str(d) for d in accepted)}"
            )


def _custom_route(fn, hidden_states, router_logits, top_k: int, renormalize: bool) -> tuple:
    """Call a user routing function and check what it returns (shapes, dtypes, device):
    its (weights, ids) as returned."""
    if not callable(fn):
        raise TypeError(f"custom_routing_function must be callable, got {type(fn).__name__}")
    out = fn(hidden_states, router_logits, top_k, renormalize)
    where = "custom_routing_function"
    if not isinstance(out, (tuple, list)) or len(out) < 2:
        raise MoeInputError(
            f"{where} must return (topk_weights, topk_ids), got {type(out).__name__}"
        )
    weights, ids = out[0], out[1]
    want = (router_logits.shape[0], top_k)
    for name, t in (("topk_weights", weights), ("topk_ids", ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where} returned {name} of type {type(t).__name__}, not a tensor")
        if tuple(t.shape) != want:
            raise MoeInputError(
                f"{where} returned {name} of shape {list(t.shape)}; expected [T, top_k] = "
                f"{list(want)}"
            )
        if t.device != router_logits.device:
            raise MoeInputError(
                f"{where} returned {name} on {t.device} but router_logits are on "
                f"{router_logits.device}"
            )
    if not weights.is_floating_point():
        raise TypeError(f"{where} returned topk_weights of dtype {weights.dtype}; need floating")
    if not is_index_tensor(ids):
        raise TypeError(f"{where} returned topk_ids of dtype {ids.dtype}; need {INDEX_DTYPES_TEXT}")
    # In [-1, E) for the router's E: at once on CPU, on a GPU without waiting (raised by a
    # later check or ``check_errors()``, as every id check there).
    check_ids_async(ids, router_logits.shape[-1], where=where)
    return weights, ids


def _wide_dtype(device: torch.device) -> torch.dtype:
    """float64 for the score math; float32 where the device has no float64 (Apple MPS: there
    the results are not bit-identical to other devices)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest along the last dim: descending, equal values lowest index
    first (NaN counts as the largest), by a stable sort."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _kernel(router_logits: torch.Tensor, backend: str):
    """The Triton routing function when ``select_experts`` runs it (see its ``backend``),
    else None."""
    if backend == "torch":
        return None
    grads = torch.is_grad_enabled() and router_logits.requires_grad
    if backend == "triton":
        route = _kernel_route()
        if route is None:
            raise BackendUnavailableError("backend='triton': triton is not importable here")
        if grads:
            raise MoeInputError(
                "backend='triton': the routing kernel has no backward, but router_logits "
                "requires grad and grad mode is on; pass backend='auto' or 'torch' to "
                "differentiate the weights, or detach the logits"
            )
        return route
    if backend != "auto":
        raise MoeInputError(f"backend: got {backend!r}; accepted: {ROUTING_BACKENDS}")
    if not router_logits.is_cuda or grads:
        return None
    return _kernel_route()


def _kernel_route():
    """The routing kernel's function (``backends.triton._routing.route``'s arguments): the
    custom op's graph node under ``torch.compile`` (the compiler cannot trace a launch),
    else the function itself; None without triton."""
    route = _triton_route()
    if route is not None and torch.compiler.is_compiling():
        return _route_node
    return route


def _triton_route():
    """``backends.triton._routing.route``, imported once (None without triton). Cached in a
    plain list, not ``functools.cache``, whose wrapper ``torch.compile`` does not honour."""
    if not _TRITON_ROUTE:
        try:
            from .backends.triton._routing import route
        except ImportError:
            route = None
        _TRITON_ROUTE.append(route)
    return _TRITON_ROUTE[0]


_TRITON_ROUTE: list = []


def _route_node(router_logits, top_k, *, correction_bias=None, **settings) -> TopK:
    """``backends.triton._routing.route`` as the graph node ``moerunner::route``."""
    settings["routed_scaling_factor"] = float(settings["routed_scaling_factor"])
    values = [settings[name] for name in KERNEL_SETTINGS]
    weights, ids = torch.ops.moerunner.route(router_logits, correction_bias, top_k, *values)
    return TopK(weights=weights, ids=ids)


@torch.library.custom_op("moerunner::route", mutates_args=())
def route_op(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    group_score: str,
    weights_dtype: torch.dtype,
    ids_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing kernel as an opaque graph node: ``select_experts``' arguments (already
    validated), positional; returns (weights, ids)."""
    settings = {name: value for name, value in locals().items() if name in KERNEL_SETTINGS}
    out = _triton_route()(router_logits, top_k, correction_bias=correction_bias, **settings)
    return out.weights, out.ids


@route_op.register_fake
def _route_fake(router_logits, correction_bias, top_k, *settings):
    weights_dtype, ids_dtype = settings[-2:]
    rows = (router_logits.shape[0], top_k)
    return router_logits.new_empty(rows, dtype=weights_dtype), router_logits.new_empty(
        rows, dtype=ids_dtype
    )


def check_router_width(
    router_logits: torch.Tensor, num_experts: int, where: str, name: str = "router_logits"
) -> None:
    """``router_logits [..., E]`` (the argument ``name``) must score every expert of the
    weights it routes to: a narrower router would use only the first experts, a wider one
    route to experts that do not exist (both silently: its ids are in range for it)."""
    if router_logits.dim() >= 1 and router_logits.shape[-1] != num_experts:
        raise MoeInputError(
            f"{where}: {name} last dim must be num_experts E={num_experts}, got "
            f"{router_logits.shape[-1]} (it scores every expert of the weights)"
        )


def _check_routing_args(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    correction_bias: torch.Tensor | None,
    num_expert_group: int | None,
    topk_group: int | None,
) -> None:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise MoeInputError(
            f"router_logits must be 2-D [T, E], got shape {tuple(router_logits.shape)}"
        )
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating tensor, got {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise MoeInputError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    if scoring_func not in SCORING_FUNCS:
        raise MoeInputError(f"scoring_func: got {scoring_func!r}; accepted: {SCORING_FUNCS}")
    if correction_bias is not None:
        _check_correction_bias(correction_bias, num_experts, router_logits.device)
    check_groups(num_experts, top_k, num_expert_group, topk_group)


def _check_correction_bias(bias: object, num_experts: int, device: torch.device) -> None:
    """Type, shape and device always; NaN / infinite values only where that needs no device
    sync.

    A NaN or +inf bias entry would win every comparison of the top-k (every token routed to
    it, with finite weights), so a CPU bias with one is rejected here. On a GPU reading the values
    would synchronise every call: validate the bias where it is set
    (``check_correction_bias_values``)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(
            f"correction_bias must be a torch.Tensor [E={num_experts}] or None, "
            f"got {type(bias).__name__}"
        )
    if tuple(bias.shape) != (num_experts,):
        raise MoeInputError(
            f"correction_bias must have shape [E={num_experts}], got {tuple(bias.shape)}"
        )
    if not bias.is_floating_point():
        raise TypeError(f"correction_bias must be a floating tensor, got {bias.dtype}")
    if bias.device != device:
        raise MoeInputError(f"correction_bias is on {bias.device} but router_logits on {device}")
    if bias.device.type == "cpu" and not torch.compiler.is_compiling():  # (a value read)
        check_correction_bias_values(bias)


def check_correction_bias_values(bias: torch.Tensor) -> None:
    """Raise ``MoeInputError`` if ``bias`` has a NaN or infinite entry (reads values: on a
    GPU this synchronises; call it where the bias is set, not per forward)."""
    finite = torch.isfinite(bias)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten().tolist()
        values = [float(bias[e]) for e in bad[:8]]
        raise MoeInputError(
            f"correction_bias has NaN or infinite values {values} at experts {bad[:8]}: a NaN "
            "or +inf bias routes every token to its expert, -inf none (and gives NaN group "
            "scores with grouped routing); use finite values"
        )


def check_loaded_correction_bias(module, state_dict, prefix: str, *rest) -> None:
    """A ``load_state_dict`` pre-hook of a module with a ``correction_bias`` buffer: a NaN or
    infinite bias misroutes every token, so it is rejected at load time (one read of E
    values; checking a GPU bias per forward would synchronise), before the module copies
    anything (a check after the copy left the bad values in it)."""
    incoming = state_dict.get(f"{prefix}correction_bias")
    if isinstance(incoming, torch.Tensor):
        check_correction_bias_values(incoming)
