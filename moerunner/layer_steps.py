"""Eager calls of a ``MoE`` layer as one replay (``backends.triton._step``).

An eager call of a plain single-process layer, after its first calls of a shape, is a
lookup of the step made for (caller, input shapes, dtypes, strides, alignments, weight
state) and one replay of the routing and expert launches: no argument checks, backend
choice or prepared-weights lookup per call, since the key fixes all of their outcomes.
The key holds every tensor's identity, address and in-place version, so a replaced or
edited weight, a quantize_ or a load_state_dict takes the ordinary path (which prepares
again) and makes a new step. Steps exist only where the experts' fused op offers them
(the triton backend on CUDA); they are kept in a bounded ``memo.StepCache``.

``EagerSteps`` is a base class of ``moerunner.MoE``; its methods read the layer's routing,
weights, runner and step cache (``_steps``).
"""

from __future__ import annotations

import torch

from .backends.base import caller
from .dispatch.formats import STANDARD
from .runner import tensor_state

__all__ = ["EagerSteps"]


class EagerSteps:
    """The eager-step cache of a ``MoE`` layer (see the module)."""

    def _step_key(self, hidden_states, router_logits) -> tuple | None:
        """The step key of an eager call, or None where no step applies."""
        if (
            not isinstance(hidden_states, torch.Tensor)
            or not isinstance(router_logits, torch.Tensor)
            or not hidden_states.is_cuda
            or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()  # captured once: the ordinary path
            or not self.routes
            or not self._single_process()
            or self._given_shared is not None
            or self.shared_w13 is not None
            or self._trains(hidden_states, router_logits)
        ):
            return None
        return (
            caller(hidden_states.device),
            hidden_states.shape,
            hidden_states.dtype,
            hidden_states.device,
            hidden_states.stride(),
            hidden_states.data_ptr() & 15,
            router_logits.shape,
            router_logits.dtype,
            router_logits.device,
            router_logits.stride(),
            router_logits.data_ptr() & 15,
            self._weight_state(),
        )

    def _weight_state(self) -> tuple:
        """Identity, address, shape and in-place version of every tensor the call reads
        besides its inputs (``runner.tensor_state``); no device sync."""
        w = self.quantized
        tensors = (
            (self.w13, self.w2, self.w13_bias, self.w2_bias)
            if w is None
            else (w.w13, w.w2, w.w13_bias, w.w2_bias, self.w13, self.w2)
            + (self.w13_bias, self.w2_bias)
        )
        return (
            id(w),
            *[(id(t), tensor_state(t)) for t in tensors],
            (id(self.correction_bias), tensor_state(self.correction_bias)),
            # held buffers by identity (replaced ones: the ordinary path, which rebuilds)
            *[id(self._buffers[n]) for n in self._quantized_buffers()],
        )

    def _replay_step(self, key: tuple, hidden_states, router_logits) -> torch.Tensor | None:
        out = self._steps.replay(
            key,
            lambda step: step.run(
                hidden_states.reshape(-1, hidden_states.shape[-1]),
                router_logits.reshape(-1, router_logits.shape[-1]),
                self.correction_bias,
            ),
        )
        return None if out is None else out.reshape(hidden_states.shape)

    def _make_step(self, key: tuple, x: torch.Tensor, router_logits) -> None:
        """After an ordinary routed call of ``key``: the step of such calls, where the
        experts' fused op makes one (``layer_step``) from the plans that call recorded."""

        def make():
            weights = self.expert_weights()
            prepared = self._prepared(x, weights, STANDARD, self.config.top_k)
            fused = self.runner.registry.fused_op(STANDARD, prepared.backend)
            layer_step = getattr(fused, "layer_step", None)
            if layer_step is None:
                return None
            logits = router_logits.reshape(-1, router_logits.shape[-1])
            return layer_step(x, logits, self._routing_kwargs(), prepared)

        self._steps.offer(key, make)
