"""Accuracy with confidence intervals, and paired comparisons between modes.

Every mode answers the same tasks from the same worker outputs, so comparisons
are paired: a percentile bootstrap over tasks for intervals, and McNemar's exact
test on the discordant pairs for significance, as the papers report.
"""

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float


def _bootstrap_indices(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(BOOTSTRAP_SAMPLES, n))


def accuracy_ci(correct: list[bool], seed: int = 0, level: float = 0.95) -> Interval:
    x = np.asarray(correct, dtype=float)
    if x.size == 0:
        raise ValueError("no results to summarise")
    means = x[_bootstrap_indices(x.size, seed)].mean(axis=1)
    tail = 100 * (1 - level) / 2
    return Interval(float(x.mean()), float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail)))


def paired_difference_ci(a: list[bool], b: list[bool], seed: int = 0, level: float = 0.95) -> Interval:
    """Accuracy of a minus accuracy of b over the same tasks, with a paired bootstrap interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired results must have the same, non-zero length: {len(a)} vs {len(b)}")
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    means = d[_bootstrap_indices(d.size, seed)].mean(axis=1)
    tail = 100 * (1 - level) / 2
    return Interval(float(d.mean()), float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail)))


def mcnemar_p(a: list[bool], b: list[bool]) -> float:
    """Two-sided exact McNemar p-value: a binomial test on the pairs where a and b disagree."""
    if len(a) != len(b):
        raise ValueError(f"paired results must have the same length: {len(a)} vs {len(b)}")
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


# ---- one-sided exact bounds: how far a verification may trust a mode (evals.harness.verify) ----------------------
def binomial_upper_bound(k: int, n: int, level: float = 0.95) -> float:
    """The exact (Clopper-Pearson) one-sided upper confidence bound, at `level`, on a rate seen `k` times in `n`
    trials: the rate p at which seeing k or fewer has probability 1 - level (1.0 when k == n). For k = 0 it is
    1 - (1 - level) ** (1 / n)."""
    if not (0 <= k <= n and n >= 1) or not 0 < level < 1:
        raise ValueError(f"need 0 <= k <= n, n >= 1 and 0 < level < 1; got k={k}, n={n}, level={level}")
    alpha = 1 - level
    if k == n:
        return 1.0
    if k == 0:
        return 1 - alpha ** (1 / n)

    def at_most_k(p: float) -> float:  # P(X <= k) for X ~ Binomial(n, p), 0 < p < 1 (terms in logs)
        logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
                + (n - i) * math.log1p(-p) for i in range(k + 1)]
        top = max(logs)
        return math.exp(top) * sum(math.exp(x - top) for x in logs)

    low, high = k / n, 1.0  # (P(X <= k) falls as p grows: bisect for the p where it is alpha)
    for _ in range(200):
        mid = (low + high) / 2
        if at_most_k(mid) > alpha:
            low = mid
        else:
            high = mid
        if high - low < 1e-15:
            break
    return high


def paired_lower_bound(a: list[bool], b: list[bool], level: float = 0.95) -> float:
    """A one-sided lower confidence bound, at `level`, on the paired difference mean(a) - mean(b) over the same
    tasks: minus the exact upper bound (binomial_upper_bound) on the rate of pairs where a is wrong and b right.
    mean(a - b) is the rate where only a is right minus the rate where only b is, so it is at least minus the
    latter: the bound holds with at least `level` confidence whatever the pairs. It is exact where b is right on
    every pair (a trace's text answer, which every mode is held to), and conservative where a also wins pairs b
    loses (those do not make up for its losses). Unlike the bootstrap's, it does not collapse to 0 on pairs that all
    agree: then it is -(1 - (1 - level) ** (1 / n)), which only more pairs raise."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired results must have the same, non-zero length: {len(a)} vs {len(b)}")
    losses = sum(y and not x for x, y in zip(a, b))
    return -binomial_upper_bound(losses, len(a), level)


def samples_needed(tolerance: float, level: float = 0.95) -> int:
    """The fewest pairs at which perfect agreement (no pair where the mode is wrong and its reference right) has a
    paired_lower_bound >= -tolerance: ceil(log(1 - level) / log(1 - tolerance)); fewer pairs cannot pass however
    they come out."""
    if not 0 < tolerance < 1 or not 0 < level < 1:
        raise ValueError(f"tolerance and level must be in (0, 1), got {tolerance} and {level}")
    n = max(1, math.ceil(math.log(1 - level) / math.log(1 - tolerance)))
    while binomial_upper_bound(0, n, level) > tolerance:  # (the closed form's rounding, either way)
        n += 1
    while n > 1 and binomial_upper_bound(0, n - 1, level) <= tolerance:
        n -= 1
    return n
