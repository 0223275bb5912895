"""Layer-level expert parallelism: dispatch -> experts -> combine on this rank of a group.

Stages 2-4 for one MoE layer whose experts are spread over the ranks of a
``torch.distributed`` process group. ``ExpertParallelMoE`` holds this rank's expert weights
(prepared once for the chosen backend), a dispatcher and a ``MoeRunner``; ``forward(hidden,
topk)`` takes routing with *global* expert ids and returns this rank's ``[T, H]`` output.

Dispatchers (``DISPATCHERS``):

- ``"standard"``: every rank passes the *same* tokens; experts are split by ownership
  (``shard="experts"``) or every expert's I is split (``shard="intermediate"``, tensor
  parallel); partial outputs are summed with an all-reduce;
- ``"all_to_all"``: each rank passes its own tokens; rows travel to the owning ranks;
- ``"masked"``: as all_to_all with a fixed capacity per expert (static shapes, decode).

Shared experts: give the placement ``num_shared`` and weights ``[E + S, ...]`` (routed then
shared); call ``append_shared_slots`` on the routing; they then run as extra local experts in
the same pass. ``forward(..., timer=StageTimer(...))`` times the three stages.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch

from .backends.base import MoeProblem
from .config import Activation
from .dispatch.all_to_all import AllToAllDispatcher
from .dispatch.expert_map import ExpertPlacement, shard_expert_weights
from .dispatch.masked import MaskedDispatcher
from .dispatch.standard import StandardDispatcher
from .dispatch.tensor_parallel import shard_intermediate
from .distributed import check_consistent, rank_and_size
from .errors import MoeInputError
from .profiling import trace_range
from .routing import TopK
from .runner import MoeRunner
from .weights import ExpertWeights

__all__ = ["DISPATCHERS", "ExpertParallelMoE", "StageTimer", "time_stages"]

DISPATCHERS = ("standard", "all_to_all", "masked")
STAGES = ("dispatch", "experts", "combine")


class StageTimer:
    """Milliseconds per stage: CUDA events on a GPU (no sync until ``result``), else wall time.

    Use one timer per measured step: ``forward(..., timer=t)`` then ``t.result()``.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._marks: dict[str, tuple] = {}

    @contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._marks[stage] = (start, end)
        else:
            start = time.perf_counter()
            yield
            self._marks[stage] = (start, time.perf_counter())

    def result(self) -> dict[str, float]:
        """Stage name -> milliseconds (synchronises the GPU once)."""
        if self.cuda:
            torch.cuda.synchronize()
            return {k: s.elapsed_time(e) for k, (s, e) in self._marks.items()}
        return {k: (e - s) * 1e3 for k, (s, e) in self._marks.items()}


class ExpertParallelMoE:
    """This rank's part of one expert-parallel MoE layer.

    Args:
        local_weights: the experts this rank holds, in its local-slot order (see
            ``from_global`` to cut them from full weights).
        placement: expert ownership, equal on every rank (for ``shard="intermediate"``: a
            placement with every expert on every rank is implied; pass ``None``).
        group: the ``torch.distributed`` process group (``None``: default group).
        dispatcher: one of ``DISPATCHERS``.
        activation: expert activation (name or ``Activation``).
        backend: runner backend name or ``"auto"``.
        capacity: rows per local expert for ``"masked"`` (required there).
        on_overflow: ``"raise"`` or ``"flag"`` for ``"masked"``.
        dtype: hidden-state dtype the layer will see (selects the backend).
    """

    def __init__(
        self,
        local_weights: ExpertWeights,
        placement: ExpertPlacement | None,
        group=None,
        *,
        dispatcher: str = "all_to_all",
        activation: Activation | str = "silu",
        backend: str = "auto",
        capacity: int | None = None,
        on_overflow: str = "raise",
        dtype: torch.dtype | None = None,
    ) -> None:
        if dispatcher not in DISPATCHERS:
            raise MoeInputError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
        act = Activation.of(activation)
        local_weights.validate(act)
        self.rank, self.world_size = rank_and_size(group)
        if group is None:  # StandardDispatcher reads None as "no group": name the default one
            import torch.distributed as dist

            group = dist.group.WORLD
        self.group, self.kind, self.activation = group, dispatcher, act
        hidden_size = local_weights.hidden_size
        check_consistent(
            group,
            f"ExpertParallelMoE({dispatcher!r})",
            {
                "dispatcher": DISPATCHERS.index(dispatcher),
                "hidden_size": hidden_size,
                "intermediate_size": local_weights.intermediate_size(act),
                "placement": -1 if placement is None else placement.fingerprint(),
            },
        )
        if placement is None:
            if dispatcher != "standard":
                raise MoeInputError(f"dispatcher {dispatcher!r} needs an ExpertPlacement")
            self.dispatcher = StandardDispatcher(
                group=group, num_local_experts=local_weights.num_experts
            )
        else:
            expected = placement.num_local(self.rank)
            if local_weights.num_experts != expected:
                raise MoeInputError(
                    f"rank {self.rank} holds {expected} local experts in the placement but "
                    f"local_weights has {local_weights.num_experts}"
                )
            if dispatcher == "standard":
                self.dispatcher = StandardDispatcher(placement.expert_map(self.rank), group)
            elif dispatcher == "all_to_all":
                self.dispatcher = AllToAllDispatcher(placement, group)
            else:
                if capacity is None:
                    raise MoeInputError("dispatcher 'masked' needs capacity=")
                self.dispatcher = MaskedDispatcher(
                    placement, capacity, hidden_size, group, on_overflow=on_overflow
                )
        self.placement = placement
        self.weights = local_weights
        self.last_overflow: torch.Tensor | None = None
        self.runner = MoeRunner(backend)
        spec = local_weights.spec(act)
        probe = torch.empty(
            (0, hidden_size),
            device=local_weights.device,
            dtype=dtype or _plain_dtype(local_weights),
        )
        problem = MoeProblem.of(probe, local_weights, spec, self.dispatcher.dispatch_format)
        self.prepared = self.runner.prepare(local_weights, problem, spec)

    @classmethod
    def from_global(
        cls,
        weights: ExpertWeights,
        group=None,
        *,
        placement: ExpertPlacement | None = None,
        shard: str = "experts",
        tp_align: int = 16,
        **kwargs,
    ) -> ExpertParallelMoE:
        """Cut this rank's share out of full weights ``[E + S, ...]`` and build the layer.

        ``shard="experts"``: the placement's local slots (contiguous by default);
        ``shard="intermediate"``: every expert's I split over the ranks, zero-padded to
        ``tp_align`` (``standard`` dispatcher only; see ``dispatch.tensor_parallel``).
        """
        rank, world = rank_and_size(group)
        act = Activation.of(kwargs.get("activation", "silu"))
        if shard == "intermediate":
            if kwargs.get("dispatcher", "all_to_all") != "standard":
                raise MoeInputError(
                    "shard='intermediate' (tensor parallel) needs dispatcher='standard'"
                )
            local = shard_intermediate(weights, act, rank, world, tp_align)
            return cls(local, None, group, **kwargs)
        if shard != "experts":
            raise MoeInputError(f"shard must be 'experts' or 'intermediate', got {shard!r}")
        if placement is None:
            placement = ExpertPlacement.contiguous(weights.num_experts, world)
        return cls(shard_expert_weights(weights, placement, rank), placement, group, **kwargs)

    def forward(self, hidden_states: torch.Tensor, topk: TopK, timer=None) -> torch.Tensor:
        """``hidden_states [T, H]`` with ``topk`` (global ids) -> ``[T, H]``.

        ``timer``: optional callable ``timer(stage)`` returning a context manager (e.g. a
        ``StageTimer``), entered around ``dispatch``, ``experts`` and ``combine``. With the
        masked dispatcher, ``self.last_overflow`` is the step's overflow flag (0-d bool on
        the device; check it after the step in ``on_overflow="flag"`` mode).
        """
        stage = timer if timer is not None else (lambda name: nullcontext())
        with stage("dispatch"), trace_range("moerunner.dispatch"):
            dispatched = self.dispatcher.dispatch(hidden_states, topk)
        # masked, on_overflow="flag": the step's device-side overflow flag (else None)
        self.last_overflow = getattr(dispatched, "overflow", None)
        with stage("experts"):
            out = self.runner.run(dispatched, self.prepared)
        with stage("combine"), trace_range("moerunner.combine"):
            return self.dispatcher.combine(out, dispatched)

    __call__ = forward


def time_stages(
    moe: ExpertParallelMoE,
    hidden_states: torch.Tensor,
    topk: TopK,
    *,
    warmup: int = 2,
    iters: int = 10,
) -> dict[str, float]:
    """Median milliseconds of ``dispatch``, ``experts`` and ``combine`` on this rank.

    Collective: every rank of ``moe.group`` must call it with the same ``warmup`` / ``iters``
    (a barrier before each step aligns the ranks, so ``dispatch`` includes waiting for the
    slowest one, as in serving). The entry point ``moerunner bench --ep-size`` uses.
    """
    import statistics

    import torch.distributed as dist

    for _ in range(warmup):
        moe(hidden_states, topk)
    samples: dict[str, list[float]] = {name: [] for name in STAGES}
    for _ in range(iters):
        dist.barrier(group=moe.group)
        timer = StageTimer(hidden_states.device)
        moe(hidden_states, topk, timer)
        for name, ms in timer.result().items():
            samples[name].append(ms)
    return {name: statistics.median(v) for name, v in samples.items() if v}


def _plain_dtype(weights: ExpertWeights) -> torch.dtype:
    w13 = weights.w13
    return w13.dtype if isinstance(w13, torch.Tensor) else torch.bfloat16
