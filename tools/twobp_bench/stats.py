"""Robust summaries of repeated timings: median, quartiles and range.

Timings on a shared machine have outliers (another process takes the core
for a while), so the bench reports medians and the interquartile range
rather than means. Ratios of two variants are taken round by round (the two
ran next to each other, under the same load) and then summarised.
This module imports no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Summary:
    """Median, quartiles and range of some samples.

    Args:
        median: the median.
        q1: the first quartile (25 %).
        q3: the third quartile (75 %).
        low: the smallest sample.
        high: the largest sample.
        n: the number of samples.
    """

    median: float
    q1: float
    q3: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary."""
        return asdict(self)

    def scaled(self, factor: float) -> Summary:
        """Every figure multiplied by ``factor`` (``factor > 0``)."""
        return Summary(
            self.median * factor,
            self.q1 * factor,
            self.q3 * factor,
            self.low * factor,
            self.high * factor,
            self.n,
        )

    def inverse(self, numerator: float = 1.0) -> Summary:
        """``numerator / x`` of every figure (quartiles and range swap ends)."""
        return Summary(
            numerator / self.median,
            numerator / self.q3,
            numerator / self.q1,
            numerator / self.high,
            numerator / self.low,
            self.n,
        )

    @property
    def iqr_fraction(self) -> float:
        """The interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median else math.nan


def summarize(samples: Sequence[float]) -> Summary:
    """The summary of ``samples``.

    Raises:
        ValueError: if there are no samples.
    """
    if not samples:
        raise ValueError("cannot summarise no samples")
    values = sorted(float(s) for s in samples)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Summary(statistics.median(values), q1, q3, values[0], values[-1], len(values))


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[r] / denominator[r]`` for every round ``r`` both have.

    Raises:
        ValueError: if a denominator is not positive.
    """
    if any(d <= 0 for d in denominator):
        raise ValueError(f"ratios need positive denominators, got {list(denominator)}")
    return [a / b for a, b in zip(numerator, denominator, strict=False)]


def speedup(baseline_times: Sequence[float], candidate_times: Sequence[float]) -> Summary:
    """How many times faster the candidate is than the baseline, round by round.

    Args:
        baseline_times: step times of the baseline, one per round.
        candidate_times: step times of the candidate, one per round.

    Returns:
        The summary of ``baseline[r] / candidate[r]`` (above 1: the candidate is faster).
    """
    return summarize(paired_ratios(baseline_times, candidate_times))
