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
