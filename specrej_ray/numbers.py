"""How figures are written in text: fixed digits (n/a for none), SI prefixes."""

from __future__ import annotations


def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def si(value: float, unit: str) -> str:
    """1.23e9, 'B' -> '1.23 GB' (decimal prefixes, as bandwidths and FLOP rates are quoted)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
