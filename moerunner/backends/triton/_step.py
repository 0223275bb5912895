# One eager MoE layer call, routing and experts, as one launch plan (private).
#
# A layer's eager call runs ``select_experts`` (one routing launch) and the experts' kernel
# sequence, each replaying its own launch plan (``_plan``) behind its own Python: argument
# checks, the backend choice, the prepared-weights lookup, key building, the routing
# outputs' allocation. For a layer whose weights and routing settings do not change between
# calls, all of that is decided by the call's shapes, so ``LayerStep`` joins the two plans
# into one, with the routing outputs in buffers of its own:
#
#   roles: hidden [T, H], router logits [T, E], out [T, H], weights [T, k], ids [T, k]
#          (, correction bias [E])
#
# and a call is a key lookup, one output allocation and the replay of the joined launches.
# The routing buffers are reused call after call: the steps of one caller (thread and CUDA
# stream, part of the layer's key) run in stream order, so a call's routing writes them only
# after the previous call's experts have read them.
#
# A step is made from the plans that the ordinary path recorded for the same shapes (so a
# layer's first calls take that path); where either has none (it compiled, the interpreter or
# a profiler is on, a hidden size padded for the kernels) there is no step.
#
# At decode sizes (``TritonOptions.route_align_max_tokens``) where the experts align their
# rows in one program, the step routes and aligns in one launch (``_routing.route_aligned``)
# and the experts run on that layout: ``routed_sequence``, recorded once when the step is
# made, replaces the routing launch and the alignment launch of the joined plans.
#
# Pre-routed calls (``fused_moe``, the transformers integration's experts function) have the
# same Python in front of the experts' plan. ``ExpertsStep`` is that plan alone, for the
# functional path's own steps (``moerunner.call_steps``): roles hidden [T, H], ids [T, k],
# routing weights [T * k] as the caller gives them (the dtypes ``fused_standard`` reads
# unconverted), out [T, H]; with the id check, the flags are read as the ordinary call
# reads them.

from __future__ import annotations

from collections import OrderedDict

import torch

from ...device_checks import ID_FLAGS
from ...memory import kept
from ...profiling import trace_range
from ...weights import PreparedWeights
from . import _plan, _routing, experts


class LayerStep:
    """The joined plan of one layer call (module comment) and its routing buffers."""

    __slots__ = ("plan", "weights", "ids", "options")

    def __init__(self, plan, weights: torch.Tensor, ids: torch.Tensor, options) -> None:
        self.plan = plan
        self.weights = weights
        self.ids = ids
        self.options = options

    def run(
        self, hidden_TH: torch.Tensor, router_logits: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``[T, H]`` out of one replay; None where the step cannot replay now (a profiler
        records, a launch hook is set, or a workspace it used was dropped): take the
        ordinary path."""
        if not _plan.enabled(self.options, hidden_TH.device) or not self.plan.alive():
            return None
        out = torch.empty(hidden_TH.shape, dtype=hidden_TH.dtype, device=hidden_TH.device)
        roles = (hidden_TH, router_logits, out, self.weights, self.ids)
        self.plan.replay(roles if bias is None else (*roles, bias))
        return out


class ExpertsStep:
    """The recorded experts' plan of one pre-routed call shape (module comment)."""

    __slots__ = ("plan", "options", "checks_ids")

    def __init__(self, plan, options, checks_ids: bool) -> None:
        self.plan = plan
        self.options = options
        self.checks_ids = checks_ids

    def run(
        self, hidden_TH: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor
    ) -> torch.Tensor | None:
        """``[T, H]`` out of one replay, as ``experts.fused_standard`` gives it; None where
        the step cannot replay now (as ``LayerStep.run``): take the ordinary path."""
        dev = hidden_TH.device
        if not _plan.enabled(self.options, dev) or not self.plan.alive():
            return None
        out = torch.empty(hidden_TH.shape, dtype=hidden_TH.dtype, device=dev)
        self.plan.replay((hidden_TH, ids, route_w, out))
        if self.checks_ids:
            ID_FLAGS.poll(dev)
        return out


def experts_step(
    hidden_TH: torch.Tensor,
    ids: torch.Tensor,
    route_w: torch.Tensor,
    prepared: PreparedWeights,
    checks_ids: bool,
) -> ExpertsStep | None:
    """The step of pre-routed calls like this one, whose ordinary call just ran
    ``experts.fused_standard(hidden_TH, weights, ids, prepared, check_ids=checks_ids)``:
    ``route_w`` the weights as ``[T * k]``. None where that call made no plan, or where its
    inputs were not the plan's roles as given (not contiguous, converted dtypes, a hidden
    size padded for the kernels)."""
    dev = hidden_TH.device
    if (
        not _plan.enabled(prepared.options, dev)
        or not (hidden_TH.is_contiguous() and ids.is_contiguous() and route_w.is_contiguous())
        or ids.dtype not in experts.ROUTING_DTYPES[0]
        or route_w.dtype not in experts.ROUTING_DTYPES[1]
        or prepared.spec.hidden_size != hidden_TH.shape[-1]
    ):
        return None
    out = torch.empty(hidden_TH.shape, dtype=hidden_TH.dtype, device=dev)
    plan = experts.standard_plan((hidden_TH, ids, route_w, out), prepared, checks_ids)
    return None if plan is None else ExpertsStep(plan, prepared.options, checks_ids)


def layer_step(
    hidden_TH: torch.Tensor,
    router_logits: torch.Tensor,
    routing: dict,
    prepared: PreparedWeights,
) -> LayerStep | None:
    """The step of layer calls like this one: ``hidden_TH [T, H]`` contiguous,
    ``router_logits [T, E]`` with unit stride along E, ``routing``: ``select_experts``'
    keyword arguments with ``top_k`` and ``correction_bias``, ``prepared``: the weights the
    experts ran on. None where the ordinary path made no plan for either half."""
    dev = hidden_TH.device
    if (
        not _plan.enabled(prepared.options, dev)
        or not hidden_TH.is_contiguous()
        or router_logits.stride(-1) != 1
        or prepared.spec.hidden_size != hidden_TH.shape[-1]  # padded: a pad op per call
    ):
        return None
    settings = dict(routing)
    top_k = settings.pop("top_k")
    bias = settings.pop("correction_bias", None)
    if bias is not None and not bias.is_contiguous():
        return None
    tokens = hidden_TH.shape[0]
    weights, ids = kept(  # the step's own routing buffers, outside any graph's pool
        lambda: (
            torch.empty((tokens, top_k), dtype=torch.float32, device=dev),
            torch.empty((tokens, top_k), dtype=torch.int32, device=dev),
        ),
        dev,
    )
    out = torch.empty(hidden_TH.shape, dtype=hidden_TH.dtype, device=dev)
    route_roles = (router_logits, weights, ids) + (() if bias is None else (bias,))
    route = _routing.routing_plan(route_roles, top_k, **settings)
    run = experts.standard_plan((hidden_TH, ids, weights.view(-1), out), prepared)
    if route is None or run is None:  # the ordinary path: not both halves triton kernels
        return None
    if fuses_routing_and_alignment(tokens, top_k, router_logits.shape[-1], prepared.options):
        roles = (hidden_TH, router_logits, out, weights, ids) + (() if bias is None else (bias,))
        plans: OrderedDict = OrderedDict()
        for _ in range(2):  # the first run may compile the kernel (no plan from that run)
            with _plan.recorded(plans, "step", roles):
                routed_sequence(
                    hidden_TH, router_logits, bias, settings, top_k, prepared, *roles[2:5]
                )
            if isinstance(plans.get("step"), _plan.LaunchPlan):
                return LayerStep(plans["step"], weights, ids, prepared.options)
    # step roles: 0 hidden, 1 logits, 2 out, 3 weights, 4 ids, 5 bias
    plan = _plan.LaunchPlan.join([(route, (1, 3, 4, 5)), (run, (0, 4, 3, 2))])
    return LayerStep(plan, weights, ids, prepared.options)


def fuses_routing_and_alignment(num_tokens: int, top_k: int, num_experts: int, options) -> bool:
    """Whether a layer call of ``num_tokens`` tokens routes and aligns in one launch
    (module comment): at most ``options.route_align_max_tokens`` tokens, all of them in
    one block of the routing kernel (routing several blocks one after the other in one
    program cost more than the launch it saves: on an H200, 1-3 % at 8 tokens over 256
    experts and 32 over 128), and the experts align their ``num_tokens * top_k`` rows in
    one program."""
    return (
        1 <= num_tokens <= options.route_align_max_tokens
        and num_tokens <= _routing.block_rows(num_tokens, num_experts)
        and experts.aligns_in_one_program(num_tokens * top_k, top_k, options)
    )


def routed_sequence(
    hidden_TH: torch.Tensor,
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    settings: dict,
    top_k: int,
    prepared: PreparedWeights,
    out: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """A layer call's launches with routing and alignment in one (``_routing.route_aligned``
    into the experts' workspace, then the experts on that layout): ``out`` [T, H], the
    routing into ``weights`` [T, k] float32 and ``ids`` [T, k] int32, all as the ordinary
    path (``select_experts`` on the triton kernel, then ``experts.fused_standard``) gives
    them, bit for bit. Only where ``fuses_routing_and_alignment``; ``settings``:
    ``select_experts``' keyword arguments without ``top_k`` and ``correction_bias``, already
    checked; ``hidden_TH`` contiguous, ``router_logits`` with unit stride along E."""
    tokens = hidden_TH.shape[0]
    tiles, ws, _ = experts.sequence_workspace(hidden_TH, tokens * top_k, top_k, prepared)
    layout = (ws["sorted_rows"], ws["block_expert"], ws["num_padded"])
    with experts._on_device(hidden_TH):
        with trace_range("route"):
            _routing.route_aligned(
                router_logits,
                bias,
                weights,
                ids,
                layout,
                tiles.gemm1.block_m,
                options=prepared.options,
                top_k=top_k,
                **settings,
            )
        experts.standard_sequence(
            hidden_TH, ids, weights.view(-1), out, prepared, tiles, prealigned=True
        )
