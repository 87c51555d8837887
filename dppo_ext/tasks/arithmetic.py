"""The embedded default task: two-operand integer arithmetic with an exact reward.

A prompt is ``"a+b="`` or ``"a-b="`` with ``0 <= a <= max_operand`` and
``0 <= b <= max_second_operand``; the answer is the exact integer result (``"12+7="`` -> ``"19"``,
``"3-45="`` -> ``"-42"``). All problems are
enumerated, shuffled with a fixed seed and split into disjoint held-out, warm-start and RL
sets, so the held-out accuracy measures generalisation, not memorisation.
"""

from __future__ import annotations

import random

from dppo_ext.tasks.base import Problem, Task

OPERATORS = ("+", "-")


def arithmetic_problems(
    max_operand: int, operators: tuple[str, ...] = OPERATORS, max_second_operand: int | None = None
) -> list[Problem]:
    """Every problem ``a<op>b=`` with ``0 <= a <= max_operand`` and ``0 <= b <= max_second_operand``
    (default: ``max_operand``), in a fixed order."""
    second = max_operand if max_second_operand is None else max_second_operand
    if max_operand < 1 or second < 1:
        raise ValueError(f"max_operand and max_second_operand must be >= 1, got {max_operand} and {second}")
    unknown = [op for op in operators if op not in OPERATORS]
    if unknown or not operators:
        raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {operators!r}")
    problems = []
    for op in operators:
        for a in range(max_operand + 1):
            for b in range(second + 1):
                result = a + b if op == "+" else a - b
                problems.append(Problem(prompt=f"{a}{op}{b}=", answer=str(result)))
    return problems


def make_arithmetic_task(
    *,
    max_operand: int = 99,
    max_second_operand: int | None = None,
    operators: tuple[str, ...] = OPERATORS,
    num_eval: int = 500,
    num_sft: int = 2000,
    seed: int = 0,
) -> Task:
    """Build the arithmetic task with disjoint eval / warm-start / RL splits.

    Args:
        max_operand: largest first operand.
        max_second_operand: largest second operand (default ``max_operand``; 99 and 99 give the
            20,000 two-digit problems with + and -).
        operators: subset of ``("+", "-")``.
        num_eval: held-out problems for accuracy.
        num_sft: problems reserved for the supervised warm start (disjoint from eval; the RL
            set is everything else).
        seed: shuffle seed (the split depends only on it and the sizes).

    Returns:
        A ``Task`` with the ``exact`` verifier.
    """
    problems = arithmetic_problems(max_operand, operators, max_second_operand)
    if num_eval < 1 or num_sft < 0 or num_eval + num_sft >= len(problems):
        raise ValueError(
            f"num_eval={num_eval} (>= 1) + num_sft={num_sft} (>= 0) must leave RL problems out of "
            f"{len(problems)} (max_operand={max_operand}, max_second_operand={max_second_operand}, "
            f"operators={operators!r})"
        )
    random.Random(seed).shuffle(problems)
    eval_set = problems[:num_eval]
    sft_set = problems[num_eval : num_eval + num_sft]
    train_set = problems[num_eval + num_sft :]
    return Task(name="arithmetic", train=train_set, eval=eval_set, verifier="exact", sft=sft_set)
