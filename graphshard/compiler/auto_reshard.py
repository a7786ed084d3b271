"""reshard_after_forward="auto": how many units to keep gathered from forward to backward.

One search, shared by the backend (each candidate measured on a real partition of the joint
graph) and the planner (each candidate interpolated between its probes): the candidates are
the prefixes of a ranking of units, the longest one whose predicted peak fits the budget wins.
"""

from __future__ import annotations

from typing import Callable


def longest_fitting_prefix(count: int, peak_bytes: Callable[[int], float], budget_bytes: float) -> int:
    """The largest n in 0..count with peak_bytes(n) <= budget_bytes, where n = 0 (keeping no
    unit beyond the default) is the caller's to check and is taken to fit.

    Measures all `count` first (the peak need not grow with each unit kept: keeping a unit can
    spare backward its gather), then binary-searches between the longest prefix known to fit
    and the shortest known not to. Exact where the prefixes that fit are 0..m for some m, as
    they are when the peak is monotone or convex in n (the maximum of a forward and a backward
    peak, each linear in the units kept); each measurement is one partition in the backend,
    so the search costs 1 + log2(count) of them."""
    if count <= 0:
        return 0
    if peak_bytes(count) <= budget_bytes:
        return count
    fits, misses = 0, count  # peak_bytes(fits) <= budget_bytes < peak_bytes(misses)
    while misses - fits > 1:
        probe = (fits + misses) // 2
        if peak_bytes(probe) <= budget_bytes:
            fits = probe
        else:
            misses = probe
    return fits
