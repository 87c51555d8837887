"""Exact tests and intervals for counts, paired signs and times to an event (pure Python, no SciPy).

The collapse replication (experiments/sanity/collapse/PREREGISTRATION.md) compares how often two arms collapse on
the same seeds. Its rules need:

- ``fisher_greater``: the one-sided Fisher exact test of two independent proportions (H1: the first is larger),
  summed exactly over the hypergeometric tail;
- ``wilson`` and ``newcombe``: the Wilson score interval of a proportion and Newcombe's hybrid score interval of a
  difference of two proportions (Newcombe 1998, method 10);
- ``mcnemar_greater``: the exact McNemar test on paired binary outcomes (a one-sided binomial test of the
  discordant pairs);
- ``clopper_pearson``: the exact (Clopper-Pearson) interval of a proportion;
- ``holm``: Holm's step-down adjusted p-values;
- ``signed_rank``: the exact Wilcoxon signed-rank test, zeros dropped, ties given mid-ranks (the exact permutation
  distribution of the mid-ranks);
- ``kaplan_meier`` and ``logrank``: the survival curve of times to an event with censoring, and the log-rank test
  of two groups;
- ``fisher_power``: the exact power of the one-sided Fisher test for given true rates (every pair of outcomes
  enumerated).
"""

from __future__ import annotations

import math
from fractions import Fraction

Z975 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95% intervals


def _check_count(name: str, x: int, n: int) -> None:
    if not (isinstance(x, int) and isinstance(n, int)) or n < 1 or not 0 <= x <= n:
        raise ValueError(f"{name} must be a count 0 <= x <= n with n >= 1, got x={x!r}, n={n!r}")


def fisher_greater(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided Fisher exact p-value of H1: p1 > p2, for ``x1`` events of ``n1`` against ``x2`` of ``n2``:
    the probability, given the margins, of ``x1`` or more events in the first group."""
    _check_count("group 1", x1, n1)
    _check_count("group 2", x2, n2)
    total = x1 + x2
    tail = sum(math.comb(n1, k) * math.comb(n2, total - k) for k in range(x1, min(n1, total) + 1))
    return float(Fraction(tail, math.comb(n1 + n2, total)))


def wilson(x: int, n: int, z: float = Z975) -> tuple[float, float]:
    """Wilson score interval ``(lo, hi)`` of the proportion ``x / n``."""
    _check_count("the proportion", x, n)
    p = x / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(x1: int, n1: int, x2: int, n2: int, z: float = Z975) -> tuple[float, float, float]:
    """``(difference, lo, hi)``: p1 − p2 and its hybrid score interval (Newcombe 1998, method 10)."""
    p1, p2 = x1 / n1, x2 / n2
    l1, u1 = wilson(x1, n1, z)
    l2, u2 = wilson(x2, n2, z)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def binomial_tail(k: int, n: int, p: float = 0.5) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if p == 0.5:
        return float(Fraction(sum(math.comb(n, i) for i in range(k, n + 1)), 2**n))
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def mcnemar_greater(only_first: int, only_second: int) -> float:
    """Exact one-sided McNemar p-value of H1: the first arm has the event more often than the second on paired
    units; ``only_first``: pairs where only the first had it, ``only_second``: only the second."""
    if only_first < 0 or only_second < 0:
        raise ValueError(f"discordant pair counts must be >= 0, got {only_first}, {only_second}")
    return binomial_tail(only_first, only_first + only_second)


def clopper_pearson(x: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided ``level`` interval ``(lo, hi)`` of a proportion: hi solves P(X <= x | hi) = (1 − level) / 2,
    lo solves P(X >= x | lo) = (1 − level) / 2 (bisection on the binomial tails)."""
    _check_count("the proportion", x, n)
    tail = (1 - level) / 2

    def solve(f, increasing: bool) -> float:  # the p in (0, 1) where f(p) = tail, f monotone
        lo, hi = 0.0, 1.0
        for _ in range(200):
            mid = (lo + hi) / 2
            if (f(mid) < tail) == increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    upper = 1.0 if x == n else solve(lambda p: 1 - binomial_tail(x + 1, n, p), increasing=False)
    lower = 0.0 if x == 0 else solve(lambda p: binomial_tail(x, n, p), increasing=True)
    return lower, upper


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (reject where adjusted <= the familywise alpha)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def signed_rank(differences: list[float], alternative: str = "greater") -> tuple[float, int, float]:
    """Exact Wilcoxon signed-rank test of paired ``differences``: ``(W+, n used, p)``.

    Zeros are dropped; tied |d| share their mid-rank, and p comes from the exact distribution of W+ over the 2^n
    equally likely sign patterns of these ranks. ``alternative``: "greater" (H1: the differences tend to be
    positive, large W+) or "less"."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    if any(math.isnan(d) for d in differences):
        raise ValueError("differences must not hold NaN")
    d = [v for v in differences if v != 0]
    n = len(d)
    if n == 0:
        return 0.0, 0, 1.0
    order = sorted(range(n), key=lambda i: abs(d[i]))
    twice = [0] * n  # twice each mid-rank: an integer
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            twice[order[k]] = i + j + 2  # (i + 1 + j + 1) / 2 doubled
        i = j + 1
    observed = sum(t for t, v in zip(twice, d) if v > 0)
    counts = {0: 1}  # the number of sign patterns with each doubled W+
    for t in twice:
        nxt = dict(counts)
        for s, c in counts.items():
            nxt[s + t] = nxt.get(s + t, 0) + c
        counts = nxt
    if alternative == "greater":
        tail = sum(c for s, c in counts.items() if s >= observed)
    else:
        tail = sum(c for s, c in counts.items() if s <= observed)
    return observed / 2, n, float(Fraction(tail, 2**n))


def kaplan_meier(times: list[float], events: list[bool]) -> list[tuple[float, float]]:
    """The Kaplan-Meier estimate ``[(t, S(t))]`` at each distinct event time (censored at a tied time counts as
    still at risk)."""
    if len(times) != len(events):
        raise ValueError(f"times and events must have the same length, got {len(times)} and {len(events)}")
    curve, s = [], 1.0
    for t in sorted({t for t, e in zip(times, events) if e}):
        at_risk = sum(u >= t for u in times)
        died = sum(u == t and e for u, e in zip(times, events))
        s *= 1 - died / at_risk
        curve.append((t, s))
    return curve


def logrank(
    times1: list[float], events1: list[bool], times2: list[float], events2: list[bool]
) -> tuple[float, float, float, float, float]:
    """Log-rank test of two groups: ``(O1, E1, V, chi2, p_greater)``, O1 and E1 the observed and expected events
    of group 1, V the hypergeometric variance, chi2 = (O1 − E1)² / V, ``p_greater`` the one-sided p of H1: group 1
    has its events sooner (z = (O1 − E1) / √V large)."""
    times, events = [*times1, *times2], [*events1, *events2]
    group1 = [True] * len(times1) + [False] * len(times2)
    o1 = e1 = v = 0.0
    for t in sorted({t for t, e in zip(times, events) if e}):
        risk = [u >= t for u in times]
        n = sum(risk)
        n1 = sum(r and g for r, g in zip(risk, group1))
        d = sum(u == t and e for u, e in zip(times, events))
        o1 += sum(u == t and e and g for u, e, g in zip(times, events, group1))
        e1 += d * n1 / n
        if n > 1:
            v += d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1)
    if v == 0:
        return o1, e1, v, math.nan, 1.0
    z = (o1 - e1) / math.sqrt(v)
    return o1, e1, v, z * z, 0.5 * math.erfc(z / math.sqrt(2))


def binomial_pmf(k: int, n: int, p: float) -> float:
    return math.comb(n, k) * p**k * (1 - p) ** (n - k)


def fisher_power(n: int, p1: float, p2: float, alpha: float = 0.025, min_excess: float = 0.0) -> float:
    """Exact power of the one-sided Fisher test at ``alpha`` with ``n`` units an arm, true rates ``p1`` > ``p2``:
    the probability that p <= ``alpha`` and the observed excess (x1 − x2) / n >= ``min_excess``."""
    power = 0.0
    for x1 in range(n + 1):
        w1 = binomial_pmf(x1, n, p1)
        for x2 in range(n + 1):
            if (x1 - x2) / n >= min_excess - 1e-12 and fisher_greater(x1, n, x2, n) <= alpha:
                power += w1 * binomial_pmf(x2, n, p2)
    return power
