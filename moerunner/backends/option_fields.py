"""Validation and ``repr`` shared by the backends' frozen options values (``TritonOptions``,
``TorchOptions``): errors name the class and the field."""

from __future__ import annotations

import dataclasses

import torch


def check_bool(options, name: str) -> None:
    """``options.<name>`` is a bool (TypeError otherwise)."""
    value = getattr(options, name)
    if not isinstance(value, bool):
        raise TypeError(
            f"{type(options).__name__}.{name} must be a bool, got {type(value).__name__}"
        )


def check_int(options, name: str, least: int) -> None:
    """``options.<name>`` is an int (not a bool) of at least ``least``."""
    value = getattr(options, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{type(options).__name__}.{name} must be an int, got {type(value).__name__}"
        )
    if value < least:
        raise ValueError(f"{type(options).__name__}.{name} must be at least {least}, got {value}")


def dtype_set(options, name: str) -> None:
    """``options.<name>``, an iterable of ``torch.dtype``, stored as a frozenset."""
    value = getattr(options, name)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"{type(options).__name__}.{name} must be a set of torch dtypes, "
            f"got {type(value).__name__}"
        )
    items = frozenset(value)
    for item in items:
        if not isinstance(item, torch.dtype):
            raise TypeError(f"{type(options).__name__}.{name} must hold torch dtypes, got {item!r}")
    object.__setattr__(options, name, items)


def changed_repr(options) -> str:
    """The fields that differ from the defaults, as a call that rebuilds the value."""
    changed = [
        f"{f.name}={getattr(options, f.name)!r}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != f.default
    ]
    return f"{type(options).__name__}({', '.join(changed)})"
