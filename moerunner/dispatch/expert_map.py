"""Expert placement for expert parallelism: which rank owns each expert, and its local slot.

Stage 2 (dispatch) input. A placement is a value passed to every expert-parallel dispatcher
and weight-sharding helper; it is never read from process globals. Global expert ids are
``[0, E)`` for routed experts, then ``[E, E + S)`` for ``S`` shared experts.

Invariants:

- a routed expert has exactly one owner rank in ``[0, world_size)`` and a local id there; the
  local ids of one rank's routed experts are exactly ``0 .. n_rank - 1``;
- a shared expert is replicated: every rank holds a copy as an extra local slot after its
  routed experts (local id ``n_rank + j`` for shared expert ``j``), so routing a token to it
  never leaves the token's rank. Append the shared slots to the routing with
  ``append_shared_slots`` and the dispatchers treat them like any other expert.

Contiguous placement (rank ``r`` owns ``[r * E / W, (r + 1) * E / W)``) is the default; any
permutation (as expert load balancers produce) or uneven ownership can be given explicitly.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import INDEX_DTYPES_TEXT, MoeInputError, is_index_tensor
from ..routing import TopK
from ..weights import ExpertWeights, is_quantized


def _int_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if not is_index_tensor(values) or values.dim() != 1:
            raise MoeInputError(
                f"{name} must be a 1-D tensor of {INDEX_DTYPES_TEXT}, got {values.dtype} "
                f"of shape {list(values.shape)}"
            )
        return [int(v) for v in values.tolist()]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # (numpy ints too)
            raise TypeError(f"{name} must hold ints, got {type(v).__name__}")
        out.append(int(v))
    return out


def _positive(value: int, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MoeInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Owner rank and local id of every routed expert, plus replicated shared experts.

    Build with ``contiguous``, ``from_permutation`` or ``from_owners``; the constructor checks
    the invariants of the module docstring.

    Args:
        owner: ``[E]`` owner rank of each routed expert.
        local_id: ``[E]`` local id of each routed expert on its owner.
        world_size: number of ranks.
        num_shared: shared experts replicated on every rank (global ids ``E .. E+S-1``).
    """

    owner: tuple[int, ...]
    local_id: tuple[int, ...]
    world_size: int
    num_shared: int = 0

    def __post_init__(self) -> None:
        _positive(self.world_size, "world_size")
        _positive(self.num_shared, "num_shared", minimum=0)
        if len(self.owner) != len(self.local_id) or not self.owner:
            raise MoeInputError(
                f"owner and local_id must be non-empty and of equal length, got "
                f"{len(self.owner)} and {len(self.local_id)}"
            )
        bad = [(e, r) for e, r in enumerate(self.owner) if not 0 <= r < self.world_size]
        if bad:
            raise MoeInputError(
                f"owner ranks must be in [0, world_size={self.world_size}); expert {bad[0][0]} "
                f"has owner {bad[0][1]}"
            )
        for rank in range(self.world_size):
            ids = sorted(self.local_id[e] for e in self.experts_of(rank))
            if ids != list(range(len(ids))):
                raise MoeInputError(
                    f"local ids of rank {rank}'s experts must be 0..{len(ids) - 1} once each, "
                    f"got {ids}"
                )

    # -- constructors ----------------------------------------------------------------------

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int, num_shared: int = 0) -> ExpertPlacement:
        """Rank ``r`` owns experts ``[r * E / W, (r + 1) * E / W)``; E must divide evenly."""
        _positive(num_experts, "num_experts")
        _positive(world_size, "world_size")
        if num_experts % world_size:
            raise MoeInputError(
                f"num_experts={num_experts} is not divisible by world_size={world_size}: pass an "
                "explicit placement (ExpertPlacement.from_owners / from_permutation) to place "
                "experts unevenly"
            )
        return cls.from_permutation(range(num_experts), world_size, num_shared)

    @classmethod
    def from_permutation(
        cls, order: Sequence[int] | torch.Tensor, world_size: int, num_shared: int = 0
    ) -> ExpertPlacement:
        """``order[s]`` is the expert in slot ``s``; slot ``s`` is local id ``s % n`` of rank
        ``s // n`` with ``n = E / W`` (the layout expert load balancers produce)."""
        order = _int_list(order, "order")
        _positive(world_size, "world_size")
        num_experts = len(order)
        if sorted(order) != list(range(num_experts)):
            raise MoeInputError(f"order must be a permutation of 0..{num_experts - 1}")
        if num_experts % world_size:
            raise MoeInputError(
                f"a permutation places E / world_size experts per rank: num_experts="
                f"{num_experts} is not divisible by world_size={world_size}; use from_owners"
            )
        per_rank = num_experts // world_size
        owner, local = [0] * num_experts, [0] * num_experts
        for slot, expert in enumerate(order):
            owner[expert], local[expert] = slot // per_rank, slot % per_rank
        return cls(tuple(owner), tuple(local), world_size, num_shared)

    @classmethod
    def from_owners(
        cls, owners: Sequence[int] | torch.Tensor, world_size: int, num_shared: int = 0
    ) -> ExpertPlacement:
        """Any ownership, even uneven (ranks may own no expert); local ids follow global order."""
        owners = _int_list(owners, "owners")
        counter = [0] * max(world_size, 1)
        local = []
        for rank in owners:
            if not 0 <= rank < world_size:
                raise MoeInputError(f"owners must be ranks in [0, {world_size}), got {rank}")
            local.append(counter[rank])
            counter[rank] += 1
        return cls(tuple(owners), tuple(local), world_size, num_shared)

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        """Routed experts E (global)."""
        return len(self.owner)

    @property
    def num_total(self) -> int:
        """Routed plus shared experts: the id range routing may use."""
        return self.num_experts + self.num_shared

    def check_rank(self, rank: object, name: str = "rank") -> int:
        """``rank`` if it is one of the placement's ranks, ``[0, world_size)``; else raises."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{name} must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise MoeInputError(f"{name} must be in [0, world_size={self.world_size}), got {rank}")
        return rank

    def check_world(self, world_size: int) -> None:
        """The placement is for a group of ``world_size`` ranks; else raises (a placement for
        more ranks would leave their experts to nobody, one for fewer give ranks nothing)."""
        if self.world_size != world_size:
            raise MoeInputError(
                f"placement is for world_size={self.world_size} but the process group has "
                f"{world_size} ranks"
            )

    def experts_of(self, rank: int) -> list[int]:
        """Global ids of the routed experts ``rank`` owns, in local-id order."""
        self.check_rank(rank)
        mine = [e for e, r in enumerate(self.owner) if r == rank]
        return sorted(mine, key=lambda e: self.local_id[e])

    def num_local_routed(self, rank: int) -> int:
        """Routed experts held by ``rank``."""
        self.check_rank(rank)
        return sum(1 for r in self.owner if r == rank)

    def num_local(self, rank: int) -> int:
        """Local expert slots of ``rank``: its routed experts, then every shared expert."""
        return self.num_local_routed(rank) + self.num_shared

    @property
    def max_local(self) -> int:
        """Largest number of local slots on any rank (static buffer size of the masked path)."""
        return max(self.num_local(r) for r in range(self.world_size))

    def global_ids(self, rank: int) -> list[int]:
        """Global id of each local slot of ``rank`` (routed, then shared)."""
        return self.experts_of(rank) + list(range(self.num_experts, self.num_total))

    def expert_map(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 ``[E + S]``: local id on ``rank`` of every global expert, -1 if not held
        (every rank holds the shared experts). For a ``StandardDispatcher``, whose ranks all
        compute every token, take ``standard_map``."""
        table = torch.full((self.num_total,), -1, dtype=torch.int32)
        for local, expert in enumerate(self.global_ids(rank)):
            table[expert] = local
        return table.to(device) if device is not None else table

    def standard_map(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``expert_map(rank)`` with the shared experts on rank 0 only: the
        ``StandardDispatcher`` argument. Its ranks all see every token and its combine sums
        their outputs, so shared experts computed on every rank would be added once per
        rank."""
        table = self.expert_map(rank, device)
        if self.num_shared and rank != 0:
            table[self.num_experts :] = -1
        return table

    def routing_table(
        self, rank: int, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[E + S]`` destination rank and local id there of every global expert, as
        seen from ``rank`` (shared experts stay on ``rank``)."""
        self.check_rank(rank)
        dest = list(self.owner) + [rank] * self.num_shared
        local = list(self.local_id) + [
            self.num_local_routed(rank) + j for j in range(self.num_shared)
        ]
        kw = {"dtype": torch.int64, "device": device}
        return torch.tensor(dest, **kw), torch.tensor(local, **kw)

    def fingerprint(self) -> int:
        """A 62-bit digest of the placement, equal on ranks that agree on it."""
        from ..distributed import digest

        return digest(f"{self.owner}|{self.local_id}|{self.world_size}|{self.num_shared}")


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Global expert ids ``[T, k]`` to this rank's local ids through ``expert_map``
    (``[E_global]``, local id of each global expert or -1, ``ExpertPlacement.expert_map``):
    -1 stays -1, an expert held elsewhere becomes -1. int32, on the ids' device, no host
    read. Ids outside ``[0, E_global)`` become -1 too (never another expert); check them
    first where a bad id should raise."""
    num_global = expert_map.shape[0]
    local = expert_map[topk_ids.clamp(min=0, max=max(num_global - 1, 0)).long()]
    valid = (topk_ids >= 0) & (topk_ids < num_global)
    return torch.where(valid, local, torch.full_like(local, -1)).to(torch.int32)


def append_shared_slots(
    topk: TopK, placement: ExpertPlacement, weight: float | torch.Tensor = 1.0
) -> TopK:
    """Routing with one extra slot per shared expert (ids ``E + j``, weight ``weight``).

    This is how shared experts fuse into one expert pass: their weights sit in the local slots
    after the routed experts (``shard_expert_weights`` puts them there), and every token
    reaches them without leaving its rank. ``weight`` may be a float or ``[T]`` / ``[T, S]``.
    """
    if not isinstance(topk, TopK):
        raise TypeError(f"append_shared_slots: topk must be a TopK, got {type(topk).__name__}")
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(
            f"append_shared_slots: placement must be an ExpertPlacement, got "
            f"{type(placement).__name__}"
        )
    if isinstance(weight, bool) or not isinstance(weight, (numbers.Real, torch.Tensor)):
        raise TypeError(
            f"append_shared_slots: weight must be a number or a tensor, got {type(weight).__name__}"
        )
    num_tokens = topk.ids.shape[0]
    shared = placement.num_shared
    if shared == 0:
        return topk
    device = topk.ids.device
    ids = torch.arange(
        placement.num_experts, placement.num_total, dtype=torch.int32, device=device
    ).expand(num_tokens, shared)
    w = torch.as_tensor(weight, dtype=torch.float32, device=device)
    if w.shape not in ((), (num_tokens,), (num_tokens, shared), (num_tokens, 1)):
        raise MoeInputError(
            f"append_shared_slots: weight must be a number, [T={num_tokens}], "
            f"[T={num_tokens}, 1] or [T={num_tokens}, S={shared}], got shape {list(w.shape)}"
        )
    w = (w[:, None] if w.dim() == 1 else w).expand(num_tokens, shared)
    return TopK(
        weights=torch.cat([topk.weights.float(), w], dim=1),
        ids=torch.cat([topk.ids.to(torch.int32), ids], dim=1),
    )


def shard_expert_weights(
    weights: ExpertWeights, placement: ExpertPlacement, rank: int
) -> ExpertWeights:
    """The local slots of ``rank`` from global weights ``[E + S, ...]`` (routed then shared)."""
    if weights.num_experts != placement.num_total:
        raise MoeInputError(
            f"weights hold {weights.num_experts} experts but the placement has "
            f"{placement.num_experts} routed + {placement.num_shared} shared"
        )
    index = torch.tensor(placement.global_ids(rank), dtype=torch.int64, device=weights.device)

    def take(t):
        if t is None:
            return None
        if is_quantized(t):
            # Every tensor of a quantized weight has experts on dim 0 (quant layout contract).
            picked = {f: v.index_select(0, index) for f, v in t.tensors().items()}
            return type(t)(t.scheme, (index.numel(),) + tuple(t.shape[1:]), **picked)
        return t.index_select(0, index)

    return ExpertWeights(
        take(weights.w13),
        take(weights.w2),
        take(weights.w13_bias),
        take(weights.w2_bias),
        w13_order=weights.w13_order,
    )
