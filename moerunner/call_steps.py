"""Steps of the functional path: a pre-routed call replayed behind one key lookup.

``fused_moe`` and the transformers integration's experts function run ``api.run_experts``:
the argument checks, the backend choice, the prepared-weights lookup and the routing's
dtypes, then the backend's fused op with Python of its own before its launches. For calls
on the same weights with the same shapes, dtypes, strides and alignments all of it decides
the same again. Where the chosen fused op offers a step (``call_step``: the triton backend
on CUDA, ``backends.triton._step.ExpertsStep``), the first calls of such a key take the
ordinary path and make the step from the launches it recorded; later calls are a key
lookup and the step's replay, as the ``MoE`` layer's eager calls are (``layer.py``).

The key: the caller (thread and CUDA stream), the runner's request, registry and the
registry's ``generation`` (registering a backend or forgetting choices makes every step
stale), ``backend_forms``, the activation, w13's row order and the biases (identity and
state: ``runner.form_variant``), the id check, and each input's shape, dtype, device, strides
and 16-byte alignment. Steps live on the weights' memo of prepared forms
(``runner.prepared_memo``), which is current only while w13 and w2 are as they were
(identity, address, in-place version): an edit or a ``.data`` assignment takes the ordinary
path, which prepares again and drops the steps.

Not served by steps: CPU tensors, calls while ``torch.compile`` traces or a CUDA graph is
captured (captured once, as recorded), calls that need gradients, runners with a custom
preference or table or that force the permute path, inputs on a GPU other than the current
one, and routing the fused op had to convert (a step replays the caller's tensors as given).
"""

from __future__ import annotations

from typing import Any

import torch

from .backends.base import caller
from .memo import StepCache
from .runner import MoeRunner, form_variant, prepared_memo
from .weights import ExpertWeights, PreparedWeights

__all__ = ["STEP_TRIES", "STEPS_MAX", "make_step", "replay_step", "step_key"]

#: Steps kept per weights (least recently used dropped first), and the ordinary calls of
#: one key that may try to make its step (a backend without steps, or a call that recorded
#: no plan, stops trying after these): ``memo.StepCache``'s.
STEPS_MAX = StepCache.MAX
STEP_TRIES = StepCache.TRIES


def _layout(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.stride(), t.data_ptr() & 15)


def step_key(
    runner: MoeRunner,
    weights: ExpertWeights,
    hidden_states: Any,
    topk_weights: Any,
    topk_ids: Any,
    act,
    check_ids: bool,
) -> tuple | None:
    """The step key of a pre-routed call (module comment), or None where no step serves it
    (decided before any part of the key is computed). The caller has checked that the call
    needs no gradients and has no shared experts, hooks or input weighting."""
    if (
        not isinstance(hidden_states, torch.Tensor)
        or not hidden_states.is_cuda
        or not isinstance(topk_weights, torch.Tensor)
        or not isinstance(topk_ids, torch.Tensor)
        or runner.force_permute
        or runner.preference is not None
        or runner.table is not None
        or torch.compiler.is_compiling()
        or torch.cuda.is_current_stream_capturing()
    ):
        return None
    device = hidden_states.device
    if device.index is not None and device.index != torch.cuda.current_device():
        return None
    registry = runner.registry
    return (
        caller(device),
        id(registry),
        registry.generation,
        runner.requested,
        runner.backend_forms,
        act,
        form_variant(weights),  # w13's order and the biases
        bool(check_ids),
        _layout(hidden_states),
        _layout(topk_weights),
        _layout(topk_ids),
    )


def replay_step(
    key: tuple,
    weights: ExpertWeights,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """The output of the step of ``key`` on ``weights``, or None: no step, stale weights or
    a step that cannot replay now (the caller takes the ordinary path)."""
    memo = prepared_memo(weights)
    if memo is None:
        return None
    # A step exists only for contiguous routing weights (their strides are in the key).
    return memo.steps.replay(
        key, lambda step: step.run(hidden_states, topk_ids, topk_weights.view(-1))
    )


def make_step(
    key: tuple,
    weights: ExpertWeights,
    fused,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedWeights,
    checks_ids: bool,
) -> None:
    """After an ordinary call of ``key`` that ran ``fused`` (the fused op) on ``prepared``
    with the routing as given (``topk_weights`` / ``topk_ids`` unconverted): the step of
    such calls, where ``fused`` makes one (``call_step``)."""
    memo = prepared_memo(weights)
    make = getattr(fused, "call_step", None)
    if memo is None:
        return
    if make is None or not topk_weights.is_contiguous():
        memo.steps.offer(key, lambda: None)
        return
    route_w = topk_weights.view(-1)
    memo.steps.offer(key, lambda: make(hidden_states, topk_ids, route_w, prepared, checks_ids))
