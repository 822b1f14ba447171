"""Argument checks of the built-in components: a wrong value is a UserError naming its key
(`model.channels=8: ...`), not a TypeError from deep inside PyTorch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from app.errors import UserError


def whole(key: str, value: Any, minimum: int) -> int:
    """`value` as a whole number >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{key}={value}: expected a whole number")
    if value < minimum:
        raise UserError(f"{key}={value}: must be {minimum} or more")
    return value


# The largest seed: the loop and the data sets derive per-epoch and per-sample seeds from it
# (seed * 100_003 + epoch ...), and torch's generators take 64 bits; NumPy's seeds are 32 bits.
SEED_MAX = 2**32 - 1


def seed_value(key: str, value: Any) -> int:
    """`value` as a seed: a whole number from 0 to SEED_MAX."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise UserError(f"{key}={value}: a seed is a whole number from 0 to {SEED_MAX} (2**32 - 1)")
    return value


def widths(key: str, value: Any) -> list[int]:
    """`value` as a list of positive whole numbers (layer widths, a shape)."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise UserError(f"{key}={value}: expected a list of positive whole numbers, "
                        f"such as [16,32]")
    items = list(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise UserError(f"{key}={items}: each entry must be a positive whole number")
    return items
