"""The ``MoE`` layer's dispatcher: how it is built from a placement and a process group, and
the forward through it when the layer is expert parallel (dispatch -> experts -> combine).

``DispatchedForward`` is a base class of ``moerunner.MoE``; its methods read the layer's
runner, config and weights (``_inputs``, ``expert_weights``, ``_prepared``). A single process
with the ``standard`` dispatcher never calls ``_forward_dispatched``: the layer runs its
experts directly. Failures on one rank become the same ``RankFailedError`` on every rank
(``distributed.agree``) instead of leaving the others blocked in an exchange.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .device_checks import capturing
from .dispatch.all_to_all import DTYPE_CODES
from .dispatch.base import DispatchSetup
from .dispatch.expert_map import ExpertPlacement
from .dispatch.masked import OVERFLOW_POLICIES
from .errors import MoeInputError
from .ops import registry_note
from .profiling import trace_range
from .routing import TopK
from .runner import MoeRunner
from .weights import PLAIN_DTYPES, is_quantized

if TYPE_CHECKING:  # annotations only
    from .config import MoeConfig
    from .weights import ExpertWeights

__all__ = ["DispatchedForward"]


def _layout_digest(config) -> int:
    """A 62-bit digest of what every rank's layer must compute alike beyond the shapes: the
    activation (name and scalar parameters), biases, gate/up row order, top_k and routing."""
    from .distributed import digest

    act = config.activation
    params = tuple(
        "tensor" if isinstance(v, torch.Tensor) else v for v in (act.alpha, act.limit, act.beta)
    )
    return digest(
        repr((act.name, params, config.bias, config.gate_up_interleaved, config.top_k,
              config.routing))
    )  # fmt: skip


class DispatchedForward:
    """The dispatcher of a ``MoE`` layer and its expert-parallel forward (see the module)."""

    def _check_arguments(self, dtype, on_overflow, backend, registry, backend_forms) -> None:
        """The constructors' own checks; makes the runner."""
        if dtype is not None and dtype not in PLAIN_DTYPES:
            raise TypeError(
                f"dtype must be one of the experts' float dtypes (bf16, fp16, fp32) or None, "
                f"got {dtype}; quantize with quantize_() after building the layer"
            )
        if on_overflow not in OVERFLOW_POLICIES:
            raise MoeInputError(
                f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}"
            )
        self.runner = MoeRunner(backend, registry=registry, backend_forms=backend_forms)
        self._op_registry = registry_note(self.runner.registry, backend)

    def _checked_locally(self, placement, group, checks) -> BaseException | None:
        """Run a constructor's own ``checks``. With one process their failure raises; with
        a group it is returned, for ``_setup_dispatch`` to carry to every rank (a rank
        raising alone left the others waiting in the consistency exchange). A runner is
        made in any case, since the dispatch setup reads its registry."""
        try:
            checks()
        except Exception as err:  # noqa: BLE001  (every rank learns of it in the exchange)
            if placement is None and group is None:
                raise
            self.runner = MoeRunner("torch")
            self._op_registry = None
            return err
        return None

    def _setup_dispatch(
        self,
        dispatcher: str,
        placement: ExpertPlacement | None,
        group: Any,
        capacity: int | None,
        on_overflow: str,
        num_experts: int,
        config: MoeConfig | None,
        num_local: int | None = None,
        combine_dtype: torch.dtype | None = None,
        error: BaseException | None = None,
    ) -> int:
        """Build the dispatcher; return how many experts this rank holds. ``error``: the
        constructor's own checks failed on this rank (``_checked_locally``): every rank
        raises ``RankFailedError`` in the consistency exchange."""
        if not isinstance(dispatcher, str):
            raise TypeError(f"dispatcher must be a str, got {type(dispatcher).__name__}")
        if placement is not None and not isinstance(placement, ExpertPlacement):
            raise TypeError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
        distributed = placement is not None or group is not None
        rank = 0
        if distributed:
            import torch.distributed as dist

            from .distributed import rank_and_size

            if group is None:  # dispatchers read None as "no group": name the default one
                group = dist.group.WORLD
            rank, _ = rank_and_size(group)
        registry = self.runner.registry
        try:
            if error is not None:
                raise error
            num_local = self._check_placement(placement, rank, num_experts, num_local)
            if combine_dtype is not None and (
                not isinstance(combine_dtype, torch.dtype) or combine_dtype not in DTYPE_CODES
            ):
                raise TypeError(
                    f"combine_dtype must be None or one of {list(DTYPE_CODES)}, "
                    f"got {combine_dtype!r}"
                )
            if dispatcher not in registry.dispatchers:
                raise MoeInputError(
                    f"dispatcher must be one of {sorted(registry.dispatchers)}, got {dispatcher!r}"
                )
        except Exception as err:
            if not distributed:
                raise
            error = err  # every rank raises RankFailedError in the exchange below
        if distributed:
            from .distributed import check_consistent

            names = sorted(registry.dispatchers)
            check_consistent(
                group,
                f"MoE(dispatcher={dispatcher!r})",
                {
                    "dispatcher": names.index(dispatcher) if error is None else -1,
                    "hidden_size": config.hidden_size if config else -1,
                    "intermediate_size": config.intermediate_size if config else -1,
                    "placement": -1 if placement is None else placement.fingerprint(),
                    "combine_dtype": DTYPE_CODES.get(combine_dtype, -1) if error is None else -1,
                    # (the dispatcher's own checks of these run after this exchange: equal on
                    # every rank, they fail on every rank alike instead of one rank alone)
                    "capacity": -1 if not isinstance(capacity, int) else int(capacity),
                    "on_overflow": (
                        OVERFLOW_POLICIES.index(on_overflow)
                        if on_overflow in OVERFLOW_POLICIES
                        else -1
                    ),
                    "layout (activation, bias, gate/up order, top_k, routing)": (
                        _layout_digest(config) if config else -1
                    ),
                },
                error=error,
            )
        self.dispatcher_kind = dispatcher
        self.placement = placement
        self.group = group
        self.rank = rank
        self.dispatcher = registry.make_dispatcher(
            dispatcher,
            DispatchSetup(
                num_local_experts=num_local,
                hidden_size=config.hidden_size,
                placement=placement,
                group=group,
                rank=rank,
                capacity=capacity,
                on_overflow=on_overflow,
                combine_dtype=combine_dtype,
            ),
        )
        self.last_overflow: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None  # of the last call that could run (stand-in)
        self._top_k: int | None = None
        # per grad mode: (key of the parameters, the ExpertWeights of them)
        self._weights_views: dict[bool, tuple[tuple, ExpertWeights]] = {}
        return num_local

    @property
    def _standard_dispatch(self) -> bool:
        """The layer's dispatcher is the standard one (every rank passes the same tokens; on
        one process, the plain layer), whatever name it was registered under."""
        from .dispatch.standard import StandardDispatcher

        return isinstance(self.dispatcher, StandardDispatcher)

    @staticmethod
    def _check_placement(
        placement: ExpertPlacement | None, rank: int, num_experts: int, num_local: int | None
    ) -> int:
        """How many experts this rank holds, checked against the placement."""
        if placement is None:
            return num_experts if num_local is None else num_local
        if placement.num_experts != num_experts:
            raise MoeInputError(
                f"placement has {placement.num_experts} routed experts but the layer "
                f"{num_experts} (config.num_experts)"
            )
        expected = placement.num_local(rank)
        if num_local is not None and num_local != expected:
            raise MoeInputError(
                f"rank {rank} holds {expected} local experts in the placement but the "
                f"weights have {num_local}"
            )
        return expected

    def _forward_dispatched(self, hidden_states, router_logits, topk, timer) -> torch.Tensor:
        """Expert parallel: dispatch -> experts -> combine through the dispatcher.

        A failure on this rank alone (its input, its backend, its experts) must not leave
        the other ranks blocked in an exchange: this rank goes on with an empty batch (no
        experts run), takes part in every exchange, and before ``combine`` all ranks agree
        (``distributed.agree``: one small all_gather and host read) and raise the same
        ``RankFailedError``. The masked dispatcher in ``on_overflow="flag"`` mode reads
        nothing on the host: there only the failing rank raises, after the step's exchanges
        (so the others finish the step instead of waiting for it).
        """
        from contextlib import nullcontext

        from .distributed import agree

        stage = timer if timer is not None else (lambda name: nullcontext())
        # masked, on_overflow="flag": no host read in the step (and rows in the wire dtype)
        sync_free = getattr(self.dispatcher, "on_overflow", None) == "flag"
        error = None
        try:
            x, topk, _ = self._inputs(hidden_states, router_logits, topk)
            self._top_k = topk.ids.shape[1]
            if self._trains(x, topk.weights):
                raise MoeInputError(
                    "an expert-parallel layer runs inference only (its dispatch has no "
                    "backward), but grad mode is on and the input, the routing weights or a "
                    "parameter requires grad: call it under torch.no_grad() or "
                    "torch.inference_mode() (or requires_grad_(False) its parameters)"
                )
            weights = self.expert_weights()
            prepared = self._prepared(
                x, weights, self.dispatcher.dispatch_format, topk.ids.shape[1]
            )
            if (
                not sync_free  # (its rows travel in the wire dtype, converted back: accepted)
                and not is_quantized(weights.w13)
                and x.dtype != weights.w13.dtype
            ):
                raise TypeError(
                    f"hidden_states dtype {x.dtype} must equal the weights' dtype "
                    f"{weights.w13.dtype} (or quantize the layer)"
                )
        except Exception as err:  # noqa: BLE001  (every rank learns of it below)
            if self.group is None:  # one process: nobody waits for it
                raise
            error, prepared = err, None
            x, topk = self._stand_in()
        what = f"expert-parallel MoE forward ({self.dispatcher_kind})"
        # standard: every rank passes the same tokens and routing, and the partial outputs
        # are summed, so T must agree before that sum (else gloo aborts or a rank waits
        # forever), and so must top_k (a rank routing with another k summed its own
        # experts' share of other routing, finite and wrong); both agreements below carry
        # them, so every rank exchanges the same values.
        same = None
        if self._standard_dispatch:
            same = {"the token count T": x.shape[0], "top_k": topk.ids.shape[1]}
        with stage("dispatch"), trace_range("moerunner.dispatch"):
            try:
                if error is not None and getattr(self.dispatcher, "takes_failure", False):
                    dispatched = self.dispatcher.dispatch(x, topk, failure=error)
                else:
                    dispatched = self.dispatcher.dispatch(x, topk)
            except Exception as err:  # noqa: BLE001
                # Raised by a dispatcher's own world checks (then on every rank alike) or
                # locally before its exchanges (e.g. the standard one, which has none).
                if self.group is None or sync_free:
                    raise
                agree(self.group, what, err, same=same)
                raise  # unreachable: agree raises  # pragma: no cover
        # masked, on_overflow="flag": the step's device-side overflow flag (else None)
        self.last_overflow = getattr(dispatched, "overflow", None)
        with stage("experts"):
            try:
                if error is None:
                    out = self.runner.run(dispatched, prepared)
            except Exception as err:  # noqa: BLE001
                if self.group is None:
                    raise
                error = err
            if error is not None:  # the step has failed: its output is never returned
                # In flag mode the other ranks finish the step: the tokens this rank's experts
                # served come back to them as NaN, not as if those experts had output zero.
                out = torch.full_like(dispatched.hidden_states, float("nan"))
        if self.group is not None and not sync_free and not capturing():
            agree(self.group, what, error, same=same)
        with stage("combine"), trace_range("moerunner.combine"):
            combined = self.dispatcher.combine(out, dispatched)
        if error is not None:  # "flag" mode, or while capturing: this rank alone
            from .errors import RankFailedError

            text = f"{type(error).__name__}: {error}"
            raise RankFailedError(
                f"{what} failed on rank {self.rank} (rank {self.rank}: {text})",
                (self.rank,),
                (text,),
            ) from error
        shape = hidden_states.shape
        return combined.reshape(shape)

    def _stand_in(self) -> tuple[torch.Tensor, TopK]:
        """An empty batch in the dtype and top-k of this layer's last good call (what the
        other ranks pass), for a rank whose own input failed its checks; before any good
        call, in the plain weights' dtype (what a good call must pass), else float32."""
        weights = self.expert_weights()
        dtype = self._dtype
        if dtype is None:
            plain = not is_quantized(weights.w13)
            dtype = weights.w13.dtype if plain else torch.float32
        device = weights.device
        x = torch.zeros((0, self.config.hidden_size), dtype=dtype, device=device)
        k = self._top_k if self._top_k is not None else self.config.top_k
        ids = torch.zeros((0, k), dtype=torch.int32, device=device)
        return x, TopK(torch.zeros((0, k), dtype=torch.float32, device=device), ids)
