"""``Range``: the values a numeric trainer setting may take, and how an error message writes them.

``TrainConfig.validate`` checks its ``RANGES`` table (dppo_ext.trainer.config) with it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Range"]


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: ``low`` to ``high`` (None: no upper bound), each end included unless
    ``*_open``; ``why`` is said with it in the error."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        return f"{text} ({self.why})" if self.why else text


def _number(value: float) -> str:
    """``2**32`` for a large power of two (a seed's bound), else the number as ``:g`` writes it."""
    if isinstance(value, int) and value > 2**16 and not value & (value - 1):
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}"
