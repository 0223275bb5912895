"""The built-in dispatchers (``standard``, ``all_to_all``, ``masked``) as factories of a
``DispatchSetup``: what ``moerunner.registry`` registers at import.

Each factory checks what its dispatcher needs from the setup (a placement, a capacity) and
raises ``MoeInputError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..distributed import rank_and_size
from ..errors import MoeInputError
from .all_to_all import AllToAllDispatcher
from .base import Dispatcher, DispatchSetup
from .expert_map import ExpertPlacement
from .masked import MaskedDispatcher
from .standard import StandardDispatcher

__all__ = ["default_dispatchers"]


def _no_combine_dtype(name: str, setup: DispatchSetup, why: str) -> None:
    if setup.combine_dtype is not None:
        raise MoeInputError(
            f"combine_dtype is an option of the 'all_to_all' dispatcher; {name!r} {why}"
        )


def _standard(setup: DispatchSetup) -> Dispatcher:
    _no_combine_dtype("standard", setup, "sums the experts' outputs in fp32 already")
    if setup.placement is None:
        return StandardDispatcher(group=setup.group, num_local_experts=setup.num_local_experts)
    setup.placement.check_world(rank_and_size(setup.group)[1])
    table = setup.placement.standard_map(setup.rank)
    return StandardDispatcher(table, setup.group, num_local_experts=setup.num_local_experts)


def _needs_placement(name: str, setup: DispatchSetup) -> ExpertPlacement:
    if setup.placement is None:
        raise MoeInputError(f"dispatcher {name!r} needs an ExpertPlacement (placement=)")
    return setup.placement


def _all_to_all(setup: DispatchSetup) -> Dispatcher:
    return AllToAllDispatcher(
        _needs_placement("all_to_all", setup), setup.group, combine_dtype=setup.combine_dtype
    )


def _masked(setup: DispatchSetup) -> Dispatcher:
    placement = _needs_placement("masked", setup)
    _no_combine_dtype(
        "masked", setup, "sends each pair's expert output back unsummed (weighted in fp32)"
    )
    if setup.capacity is None:
        raise MoeInputError("dispatcher 'masked' needs capacity=")
    return MaskedDispatcher(
        placement, setup.capacity, setup.hidden_size, setup.group, on_overflow=setup.on_overflow
    )


def default_dispatchers() -> dict[str, Callable[[DispatchSetup], Dispatcher]]:
    """The built-in dispatchers by name: ``standard``, ``all_to_all`` and ``masked``."""
    return {"standard": _standard, "all_to_all": _all_to_all, "masked": _masked}
