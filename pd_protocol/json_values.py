"""Checks of values decoded from JSON, where ``bool`` is a subclass of ``int``: ``true`` is no
count, port, room or token id, so every integer field is read through :func:`is_int`."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
