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


def frozen_set(options, name: str, what: str, valid) -> None:
    """``options.<name>``, an iterable (not a string) of items ``valid(item)`` accepts, stored
    as a frozenset; TypeError naming ``what`` (the items, e.g. "torch dtypes") otherwise."""
    value = getattr(options, name)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"{type(options).__name__}.{name} must be a set of {what}, got {type(value).__name__}"
        )
    items = frozenset(value)
    for item in items:
        if not valid(item):
            raise TypeError(f"{type(options).__name__}.{name} must hold {what}, got {item!r}")
    object.__setattr__(options, name, items)


def dtype_set(options, name: str) -> None:
    """``options.<name>``, an iterable of ``torch.dtype``, stored as a frozenset."""
    frozen_set(options, name, "torch dtypes", lambda item: isinstance(item, torch.dtype))


def options_and_name(options, kind: type, default, name):
    """A backend's ``(options, name)`` as its constructor takes them: ``default`` for None,
    else a ``kind``; a non-empty str name (TypeError otherwise)."""
    if options is None:
        options = default
    elif not isinstance(options, kind):
        raise TypeError(f"options must be a {kind.__name__}, got {type(options).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    return options, name


def changed_repr(options) -> str:
    """The fields that differ from the defaults, as a call that rebuilds the value."""
    changed = [
        f"{f.name}={getattr(options, f.name)!r}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != f.default
    ]
    return f"{type(options).__name__}({', '.join(changed)})"
