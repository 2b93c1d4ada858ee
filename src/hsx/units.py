"""Figures in human units, for every message that states a size."""

from __future__ import annotations


def size(n: float) -> str:
    """Bytes in a human unit (decimal, as disks are sold and df -H prints)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
