"""Helpers for running MoE stages over ``torch.distributed``: world checks and small exchanges.

Stage: dispatch / combine support. Contract:

- every check that involves other ranks is *collective and symmetric*: each rank contributes
  its values with one ``all_gather`` and every rank evaluates the same table, so a
  misconfigured world raises the same ``MoeInputError`` on every rank instead of leaving some
  ranks blocked in a later collective;
- a rank whose local work fails (bad input, an exception in its experts) still takes part
  in the next exchange with a failure flag instead of leaving the others blocked: every
  rank then raises the same ``RankFailedError`` naming the failing ranks and their errors
  (``agree``, ``failing_together``, and the ``error=`` of ``check_consistent``);
- collectives run on the device the process group's backend needs (CUDA for NCCL, CPU for
  gloo); their timeout is the process group's (set it with ``init_process_group(timeout=)``),
  so a peer that died surfaces as an error, not a hang.

Nothing here reads environment variables; the group is always passed in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from .errors import MoeInputError, RankFailedError

__all__ = [
    "agree",
    "all_gather_ints",
    "check_consistent",
    "collective_device",
    "failing_together",
    "init_world",
    "rank_and_size",
    "raise_on_every_rank",
]


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise MoeInputError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(or launch with torchrun) before building an expert-parallel dispatcher"
        )
    return dist


def init_world(device_type: str, local_rank: int = 0, timeout_s: float = 300.0) -> torch.device:
    """Join the default process group for ``device_type`` and return this process's device.

    ``"cuda"``: NCCL, on GPU ``local_rank`` (made the current device first, as NCCL needs);
    ``"cpu"``: gloo. Rank, world size and rendezvous come from ``torch.distributed``'s
    ``env://`` contract (what ``torchrun`` provides); the caller reads ``LOCAL_RANK`` at its
    own edge and passes it here. ``timeout_s`` bounds every collective, so a rank that dies
    or never arrives surfaces as an error on the others instead of a hang.
    """
    from datetime import timedelta

    import torch.distributed as dist

    if device_type not in ("cuda", "cpu"):
        raise MoeInputError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise MoeInputError("device_type='cuda' but CUDA is not available here")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
        )
    return device


def rank_and_size(group=None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (``None``: the default group)."""
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group=None) -> torch.device:
    """Where tensors of small collectives must live: the current CUDA device for NCCL, CPU
    otherwise."""
    dist = _dist()
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: torch.Tensor, group=None) -> torch.Tensor:
    """``[world, n]`` int64: every rank's ``values`` (an int tensor ``[n]``, same n everywhere)."""
    dist = _dist()
    _, world = rank_and_size(group)
    flat = values.reshape(-1).to(torch.int64)
    out = torch.empty((world, flat.numel()), dtype=torch.int64, device=flat.device)
    if flat.is_cuda:
        dist.all_gather_into_tensor(out, flat, group=group)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), flat, group=group)
    return out


def digest(text: str) -> int:
    """A 62-bit digest of ``text``, equal on ranks that describe the same thing alike (a value
    ``check_consistent`` compares; it fits the int64 its exchange carries)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_consistent(
    group,
    what: str,
    values: Mapping[str, int],
    local: Mapping[str, int] | None = None,
    *,
    error: BaseException | None = None,
) -> torch.Tensor:
    """Raise ``MoeInputError`` on every rank unless all ranks passed equal ``values``.

    ``local`` values travel along without being compared (e.g. per-rank token counts); the
    gathered ``[world, len(values) + len(local)]`` table is returned for the caller's own
    checks. One host read; call it when building a dispatcher, not inside a captured step.
    ``error``: this rank's local checks failed (``values`` are then ignored): every rank
    raises ``RankFailedError`` instead of this rank raising alone before the exchange.
    """
    local = dict(local or {})
    names = list(values) + list(local)
    numbers = [0] * len(names) if error is not None else [int(values[n]) for n in values]
    if error is None:
        numbers += [int(local[n]) for n in local]
    row = torch.tensor(
        [int(error is not None), *numbers], dtype=torch.int64, device=collective_device(group)
    )
    gathered = all_gather_ints(row, group).cpu()
    raise_failed(gathered[:, 0], group, what, error)
    table = gathered[:, 1:]
    differing = [
        n for i, n in enumerate(names[: len(values)]) if bool((table[:, i] != table[0, i]).any())
    ]
    if differing:
        detail = "; ".join(
            f"{n}: "
            + ", ".join(f"rank {r}={int(table[r, names.index(n)])}" for r in range(table.shape[0]))
            for n in differing
        )
        raise MoeInputError(f"{what}: ranks disagree on {', '.join(differing)} ({detail})")
    return table


def raise_on_every_rank(problems: list[str], what: str) -> None:
    """Raise one ``MoeInputError`` listing ``problems`` (computed identically on every rank)."""
    if problems:
        raise MoeInputError(f"{what}: " + "; ".join(problems))


def raise_failed(
    failed: torch.Tensor | list[int], group, what: str, error: BaseException | None
) -> None:
    """After an exchange that carried every rank's failure flag (``failed``, host values, the
    same on every rank): if some ranks failed, all raise the same ``RankFailedError``; if
    every rank failed, each raises its own error (a check every rank made alike).

    Only then is more exchanged (each failing rank's error text, one ``all_gather_object``),
    so the flag costs nothing on a step where every rank succeeded.
    """
    flags = [int(f) for f in (failed.tolist() if isinstance(failed, torch.Tensor) else failed)]
    if not any(flags):
        return
    if all(flags) and error is not None:
        raise error  # every rank failed (a check all ranks make alike): each raises its own
    import torch.distributed as dist

    text = None if error is None else f"{type(error).__name__}: {error}"
    texts: list = [None] * len(flags)
    dist.all_gather_object(texts, text, group=group)
    ranks = tuple(r for r, f in enumerate(flags) if f)
    errors = tuple(str(texts[r]) for r in ranks)
    detail = "; ".join(f"rank {r}: {e}" for r, e in zip(ranks, errors, strict=True))
    plural = "s" if len(ranks) > 1 else ""
    message = f"{what} failed on rank{plural} {', '.join(map(str, ranks))} ({detail})"
    raise RankFailedError(message, ranks, errors) from error


def agree(
    group, what: str, error: BaseException | None = None, same: Mapping[str, int] | None = None
) -> None:
    """Collective: every rank calls it at the same point, with its local failure or None; if
    any rank passed one, every rank raises ``RankFailedError`` naming the failing ranks.
    ``same``: named values every rank must pass alike (else every rank raises
    ``MoeInputError`` listing each rank's), carried by the same exchange; every rank passes
    the same names.

    One small all_gather and one host read (a synchronisation on a GPU).
    """
    same = dict(same or {})
    values = [int(error is not None)] + [int(v) for v in same.values()]
    table = all_gather_ints(torch.tensor(values).to(collective_device(group)), group).cpu()
    raise_failed(table[:, 0], group, what, error)
    for column, name in enumerate(same, start=1):
        if not bool((table[:, column] == table[0, column]).all()):
            each = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(table[:, column]))
            raise MoeInputError(f"{what}: {name} differs across ranks ({each})")


@contextmanager
def failing_together(group, what: str) -> Iterator[None]:
    """Run the block on every rank, then ``agree`` on whether it failed anywhere: a rank whose
    block raised does not leave the others waiting in their next collective."""
    error = None
    try:
        yield
    except Exception as err:  # noqa: BLE001  (handed to every rank by ``agree``)
        error = err
    agree(group, what, error)
