"""Problems, tasks and answer verifiers shared by the embedded task and user JSONL data.

A problem is a prompt string plus the reference answer string. The reward of a response is
1.0 when the verifier accepts it and 0.0 otherwise (an exact, verifiable reward).

Verifiers:
- ``exact``: the response, cut at the first newline and stripped, equals the stripped answer.
- ``numeric``: the answer is a number; the response is accepted when the number it states
  equals it (``#### 42`` / ``\\boxed{42}`` markers first, else the last number in the response;
  thousands separators and a trailing ``.0`` are ignored).
- ``auto``: ``numeric`` when the answer parses as a number, else ``exact``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

VERIFIERS = ("auto", "numeric", "exact")

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_MARKED_RE = re.compile(r"####\s*(" + _NUMBER + r")|\\boxed\{\s*(" + _NUMBER + r")\s*\}")


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (both plain strings)."""

    prompt: str
    answer: str


@dataclass
class Task:
    """A verifiable task: training problems, held-out problems and a verifier name.

    Attributes:
        name: short name for logs.
        train: problems the RL loop samples prompts from.
        eval: held-out problems for accuracy (never trained on).
        verifier: one of ``VERIFIERS``.
        sft: problems for the supervised warm start (embedded task only; may be empty).
    """

    name: str
    train: list[Problem]
    eval: list[Problem]
    verifier: str = "auto"
    sft: list[Problem] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; expected one of {VERIFIERS}")
        if not self.train:
            raise ValueError(f"task {self.name!r} has no training problems")
        if not self.eval:
            raise ValueError(f"task {self.name!r} has no held-out (eval) problems")

    def reward(self, response: str, answer: str) -> float:
        """1.0 if ``response`` is accepted for ``answer`` by this task's verifier, else 0.0."""
        return float(get_verifier(self.verifier)(response, answer))


def parse_number(text: str) -> float | None:
    """Parse ``text`` as a number (``1,234``, ``-3.50``, ``7``); None when it is not one."""
    cleaned = text.strip().replace(",", "")
    if cleaned.startswith("$"):
        cleaned = cleaned[1:]
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def extract_number(response: str) -> float | None:
    """The number a response states: a ``#### x`` or ``\\boxed{x}`` marker, else its last number."""
    marked = _MARKED_RE.findall(response)
    if marked:
        first, second = marked[-1]
        return parse_number(first or second)
    numbers = _NUMBER_RE.findall(response)
    return parse_number(numbers[-1]) if numbers else None


def verify_numeric(response: str, answer: str) -> bool:
    """True when the number stated in ``response`` equals the numeric ``answer``."""
    expected = parse_number(answer)
    if expected is None:
        raise ValueError(f"numeric verifier needs a numeric answer, got {answer!r}")
    got = extract_number(response)
    return got is not None and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)


def verify_exact(response: str, answer: str) -> bool:
    """True when the response's first line, stripped, equals the stripped answer."""
    first_line = response.strip().split("\n", 1)[0].strip()
    return first_line == answer.strip()


def verify_auto(response: str, answer: str) -> bool:
    """``verify_numeric`` for numeric answers, ``verify_exact`` otherwise."""
    if parse_number(answer) is not None:
        return verify_numeric(response, answer)
    return verify_exact(response, answer)


def get_verifier(name: str) -> Callable[[str, str], bool]:
    """The verifier function called ``name`` (one of ``VERIFIERS``)."""
    table = {"auto": verify_auto, "numeric": verify_numeric, "exact": verify_exact}
    if name not in table:
        raise ValueError(f"unknown verifier {name!r}; expected one of {VERIFIERS}")
    return table[name]
