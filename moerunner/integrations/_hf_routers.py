"""transformers' MoE routers on moerunner's routing kernel (private helper of
``moerunner.integrations.transformers.fuse_routers``).

A transformers 5 MoE block calls its router as ``router(hidden_states) -> (router_logits,
weights, ids)``: a linear layer, then a handful of launches (softmax or sigmoid, top-k,
group masks, gathers, sums). At decode sizes those launches cost more than the work they do:
about 45 us a layer for DeepSeek-V3's router on an H100, in a compiled and captured step.
``fuse_router`` keeps the linear layer as the router computes it and replaces what follows by
one ``select_experts`` call, which runs as one launch of the routing kernel (a graph node
under ``torch.compile``).

Which routing a router computes is read from its attributes (``top_k``,
``e_score_correction_bias``, ``n_group`` / ``num_group``, ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``, a linear ``bias``) and then checked numerically: copies of the
router with random weights, in bf16 and in fp32, route random probes through their own
forward and through each candidate recipe; the first recipe that gives, in both, the same
logits bits and dtypes, the same experts per token (tokens whose logits tie exactly aside)
and weights equal to the output dtype's rounding is kept. The two dtypes tell apart what one
cannot: whether the logits are fp32 whatever the input (DeepSeek-V3) or in the input's dtype,
and whether the weights are fp32 (Mixtral) or in the logits' dtype (Qwen3-MoE, GPT-OSS), so
the recipe holds after ``model.to(dtype)``. A router no recipe reproduces is left alone, with
the reason; so is one whose forward is already replaced on the instance (an accelerate hook:
offloaded or device-mapped models) or whose weights are not materialised. Slot order may
differ from the router's own (``torch.topk(sorted=False)`` leaves it unspecified); the
experts' sum over a token's slots does not depend on it.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..routing import IDS_DTYPES, WEIGHTS_DTYPES, select_experts

_PROBE_TOKENS = 32
_PROBE_SEED = 0
#: The probes' dtypes (module docstring).
PROBE_DTYPES = (torch.bfloat16, torch.float32)
#: Router attributes a block's router goes by, in the order looked up.
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class RouterRecipe:
    """How one router computes: its logits (``fp32_logits``: ``linear(x.float(),
    weight.float())`` as DeepSeek-V3's; else ``linear(x, weight[, bias])`` in the input's
    dtype), ``select_experts``' settings (``routing``, as (name, value) pairs), the attribute
    holding its correction bias, and its outputs' dtypes (``weights_dtype`` None: the
    logits')."""

    fp32_logits: bool
    linear_bias: bool
    routing: tuple
    correction_bias: str | None
    weights_dtype: torch.dtype | None
    ids_dtype: torch.dtype

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.routing)
        logits = "fp32 logits" if self.fp32_logits else "logits in the input dtype"
        bias = f", correction_bias={self.correction_bias}" if self.correction_bias else ""
        return f"{logits}, {settings}{bias}"


def route(router: torch.nn.Module, recipe: RouterRecipe, hidden_states: torch.Tensor, backend):
    """``router(hidden_states)`` by ``recipe``: (logits, weights, ids)."""
    weight = router.weight
    x = hidden_states.reshape(-1, weight.shape[-1])
    if recipe.fp32_logits:
        logits = F.linear(x.float(), weight.float())
    else:
        logits = F.linear(x, weight, router.bias if recipe.linear_bias else None)
    weights_dtype = recipe.weights_dtype or logits.dtype
    if weights_dtype not in WEIGHTS_DTYPES:  # (float64 logits: the router's own forward)
        return type(router).forward(router, hidden_states)
    bias = None if recipe.correction_bias is None else getattr(router, recipe.correction_bias)
    topk = select_experts(
        logits,
        router.top_k,
        correction_bias=bias,
        weights_dtype=weights_dtype,
        ids_dtype=recipe.ids_dtype,
        backend=backend,
        **dict(recipe.routing),
    )
    return logits, topk.weights, topk.ids


class RoutedForward:
    """A router's forward by its recipe (installed on the instance), bound to the router
    weakly (a bound method in its ``__dict__`` would be a reference cycle). Where gradients
    are needed it runs the router's own forward: the routing kernel has no backward."""

    __slots__ = ("router", "recipe")

    def __init__(self, router: torch.nn.Module, recipe: RouterRecipe) -> None:
        self.router = weakref.ref(router)
        self.recipe = recipe

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        router = self.router()
        if (args or kwargs) or (
            torch.is_grad_enabled() and (router.weight.requires_grad or hidden_states.requires_grad)
        ):  # (arguments the probe never saw; gradients)
            return type(router).forward(router, hidden_states, *args, **kwargs)
        return route(router, self.recipe, hidden_states, "auto")

    def __deepcopy__(self, memo: dict) -> RoutedForward:
        router = self.router()
        return RoutedForward(memo.get(id(router), router), self.recipe)

    def __reduce__(self):
        return (RoutedForward, (self.router(), self.recipe))


def block_router(block: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(attribute, module) of the router a MoE block calls, or None."""
    for name in ROUTER_NAMES:
        module = getattr(block, name, None)
        if isinstance(module, torch.nn.Module):
            return name, module
    return None


def find_recipe(router: torch.nn.Module) -> RouterRecipe | str:
    """The recipe that reproduces ``router``'s forward on probes in bf16 and fp32 (module
    docstring), or why none is tried or none matched."""
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "it has no 2-D weight [E, H]"
    if isinstance(router, torch.nn.Linear):
        return "it is a plain linear layer (the block routes its logits itself)"
    top_k = getattr(router, "top_k", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= len(weight):
        return "it has no top_k in [1, E]"
    own = router.__dict__.get("forward")
    if hasattr(router, "_hf_hook") or (own is not None and not isinstance(own, RoutedForward)):
        return "its forward is replaced on the instance (an accelerate hook or another wrapper)"
    if weight.device.type == "meta":
        return "its weight is not materialised (on the meta device)"
    probes = []
    for dtype in PROBE_DTYPES:
        probe_router, x = _probe(router, dtype)
        try:
            with torch.no_grad():
                want = type(router).forward(probe_router, x)
        except Exception as exc:  # a router that cannot run alone on a plain [T, H] input
            return f"its forward failed on a {dtype} probe: {type(exc).__name__}: {exc}"
        if not (
            isinstance(want, tuple)
            and len(want) == 3
            and all(isinstance(t, torch.Tensor) for t in want)
            and want[1].dtype in WEIGHTS_DTYPES
            and want[2].dtype in IDS_DTYPES
        ):
            return "its forward does not return (logits, weights, ids) in dtypes moerunner writes"
        probes.append((probe_router, x, want))
    for recipe in _recipes(router, probes[0][2][2].dtype):
        if all(_reproduces(recipe, *probe) for probe in probes):
            return recipe
    return "no routing moerunner computes reproduces its forward on a probe"


def _reproduces(recipe: RouterRecipe, probe_router, x, want) -> bool:
    with torch.no_grad():
        try:
            got = route(probe_router, recipe, x, "torch")
        except Exception:  # noqa: BLE001  (a recipe its attributes do not admit)
            return False
    return _same_routing(got, want)


def _recipes(router, ids_dtype) -> Iterator[RouterRecipe]:
    """Recipes that the router's attributes suggest, most likely first."""
    linear_bias = isinstance(getattr(router, "bias", None), torch.Tensor)
    correction = getattr(router, "e_score_correction_bias", None)
    corr_name = "e_score_correction_bias" if isinstance(correction, torch.Tensor) else None
    groups = _int_attr(router, "n_group", "num_group", "num_expert_group")
    topk_group = _int_attr(router, "topk_group")
    grouping = (
        [(("num_expert_group", groups), ("topk_group", topk_group))]
        if groups is not None and topk_group is not None
        else [()]
    )
    norm = getattr(router, "norm_topk_prob", None)
    renorms = [norm] if isinstance(norm, bool) else [True, False]
    scale = getattr(router, "routed_scaling_factor", None)
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    scaling = (("routed_scaling_factor", float(scale)),) if number else ()
    scorings = ["sigmoid"] if corr_name is not None else ["softmax", "sigmoid"]
    for fp32, weights_dtype in itertools.product((True, False), (None, torch.float32)):
        for scoring, renorm, group in itertools.product(scorings, renorms, grouping):
            routing = (("scoring_func", scoring), ("renormalize", renorm), *group, *scaling)
            bias = linear_bias and not fp32
            yield RouterRecipe(fp32, bias, routing, corr_name, weights_dtype, ids_dtype)


def _int_attr(module, *names: str) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _probe(router: torch.nn.Module, dtype: torch.dtype):
    """A copy of ``router`` with random parameters and buffers (so no ties decide the
    comparison, whatever the loaded values) and a random ``[T, H]`` input, seeded."""
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    probe = copy.deepcopy(router).to(dtype)
    hidden = router.weight.shape[-1]
    with torch.no_grad():
        for _, t in [*probe.named_parameters(), *probe.named_buffers()]:
            if t.is_floating_point():
                scale = 2.0 / hidden**0.5 if t.dim() == 2 else 0.1
                t.copy_(torch.randn(t.shape, generator=gen) * scale)
    x = torch.randn(_PROBE_TOKENS, hidden, generator=gen).to(router.weight.device, dtype)
    return probe, x


def _same_routing(got, want) -> bool:
    """Same logits bits and dtypes, the same experts per token, weights equal to the output
    dtype's rounding (each side rounds once from its own float32 / float64 math)."""
    (g_logits, g_w, g_ids), (w_logits, w_w, w_ids) = got, want
    if g_logits.dtype != w_logits.dtype or not torch.equal(g_logits, w_logits):
        return False
    if g_w.shape != w_w.shape or g_ids.shape != w_ids.shape or g_w.dtype != w_w.dtype:
        return False
    if g_ids.dtype != w_ids.dtype:
        return False
    # Exact ties (common among bf16 logits) are broken differently: those rows say nothing.
    untied = (w_logits.float().sort(dim=-1).values.diff(dim=-1) != 0).all(dim=-1)
    if int(untied.sum()) < _PROBE_TOKENS // 4:
        return False
    g_w, g_ids, w_w, w_ids = g_w[untied], g_ids[untied], w_w[untied], w_ids[untied]
    g_ids, g_order = g_ids.long().sort(dim=-1)
    w_ids, w_order = w_ids.long().sort(dim=-1)
    if not torch.equal(g_ids, w_ids):
        return False
    a = g_w.gather(1, g_order).double()
    b = w_w.gather(1, w_order).double()
    eps = torch.finfo(w_w.dtype).eps
    return bool(torch.allclose(a, b, rtol=4 * eps, atol=eps * float(b.abs().max())))
