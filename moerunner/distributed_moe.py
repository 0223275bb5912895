"""Layer-level expert parallelism: dispatch -> experts -> combine on this rank of a group.

Stages 2-4 for one MoE layer whose experts are spread over the ranks of a
``torch.distributed`` process group. ``ExpertParallelMoE`` is the ``MoE`` module built from
this rank's expert weights (prepared once for the chosen backend), with a dispatcher from the
registry and the layer's ``MoeRunner``; ``forward(hidden, topk)`` takes routing with *global*
expert ids and returns this rank's ``[T, H]`` output.

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
from contextlib import contextmanager

import torch

from .config import Activation
from .dispatch.builtin import default_dispatchers
from .dispatch.expert_map import ExpertPlacement, shard_expert_weights
from .dispatch.tensor_parallel import shard_intermediate
from .distributed import rank_and_size
from .errors import MoeInputError
from .layer import MoE
from .routing import TopK
from .weights import ExpertWeights

__all__ = ["DISPATCHERS", "ExpertParallelMoE", "StageTimer", "time_stages"]

DISPATCHERS = tuple(default_dispatchers())  # the built-in ones: standard, all_to_all, masked
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


class ExpertParallelMoE(MoE):
    """This rank's part of one expert-parallel MoE layer, built from local weights.

    The same module as ``MoE`` (route -> dispatch -> experts -> combine), constructed from
    the experts this rank holds and called with routing: ``forward(hidden_states, topk)``.

    Args:
        local_weights: the experts this rank holds, in its local-slot order (see
            ``from_global`` to cut them from full weights).
        placement: expert ownership, equal on every rank (for ``shard="intermediate"``: a
            placement with every expert on every rank is implied; pass ``None``).
        group: the ``torch.distributed`` process group (``None``: default group).
        dispatcher: a registered dispatcher (``DISPATCHERS``).
        activation: expert activation (name or ``Activation``).
        backend: runner backend name or ``"auto"``.
        capacity: rows per local expert for ``"masked"`` (required there).
        on_overflow: ``"raise"`` or ``"flag"`` for ``"masked"``.
        combine_dtype: ``"all_to_all"``'s return precision (as in ``MoE``).
        dtype: hidden-state dtype the layer will see (the backend is chosen and the weights
            prepared at construction, so an unservable request fails here on every rank).
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
        combine_dtype: torch.dtype | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if group is None:  # name the default group, so the layer is distributed
            import torch.distributed as dist

            group = dist.group.WORLD
        self._init_from_weights(
            local_weights,
            activation=activation,
            num_experts=None,
            backend=backend,
            dispatcher=dispatcher,
            placement=placement,
            group=group,
            capacity=capacity,
            on_overflow=on_overflow,
            combine_dtype=combine_dtype,
            registry=None,
        )
        self.kind = dispatcher
        self.activation = self.config.activation
        _, self.world_size = rank_and_size(group)
        self.prepare(dtype or _plain_dtype(local_weights))

    @property
    def weights(self) -> ExpertWeights:
        """This rank's experts as the layer runs them (its state: after a
        ``load_state_dict``, the loaded ones)."""
        return self.expert_weights()

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
            with _together(group, world, "ExpertParallelMoE.from_global (sharding I)"):
                local = shard_intermediate(weights, act, rank, world, tp_align)
            return cls(local, None, group, **kwargs)
        if shard != "experts":
            raise MoeInputError(f"shard must be 'experts' or 'intermediate', got {shard!r}")
        # A rank that cannot place or cut its share (other weights than the others') must
        # not leave the others waiting in the layer's first collective: every rank raises.
        with _together(group, world, "ExpertParallelMoE.from_global (placement and shards)"):
            if placement is None:
                placement = ExpertPlacement.contiguous(weights.num_experts, world)
            local = shard_expert_weights(weights, placement, rank)
        return cls(local, placement, group, **kwargs)

    def forward(self, hidden_states: torch.Tensor, topk: TopK, timer=None) -> torch.Tensor:
        """``hidden_states [T, H]`` with ``topk`` (global ids) -> ``[T, H]``.

        ``timer``: optional callable ``timer(stage)`` returning a context manager (e.g. a
        ``StageTimer``), entered around ``dispatch``, ``experts`` and ``combine``. With the
        masked dispatcher, ``self.last_overflow`` is the step's overflow flag (0-d bool on
        the device; check it after the step in ``on_overflow="flag"`` mode).
        """
        return super().forward(hidden_states, topk=topk, timer=timer)


def _together(group, world: int, what: str):
    """``failing_together`` across the ranks of ``group``; nothing on one process."""
    from contextlib import nullcontext

    from .distributed import failing_together

    return failing_together(group, what) if world > 1 else nullcontext()


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
