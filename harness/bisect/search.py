"""The search: the first index whose probe fails, in O(log n) probes.

Both stages of the bisection (module boundaries, then ops) cut the step's program after position
i and ask whether the values live there have diverged. Divergence only grows along a prefix, so
the answer is a binary search over a predicate that is False and then True. A probe may also have
*no answer* (None): it could not be compiled or run, though the whole program could. Such a probe
is never read as a divergence: the cut moves on to the next position that gives an answer, and
the result says which positions were stepped over.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SearchResult:
    index: int | None  # the first failing position; None when the last one passes
    unknown: list[int] = field(default_factory=list)  # positions whose probe gave no answer
    asked: list[int] = field(default_factory=list)  # positions probed, in order

    @property
    def uncertain_from(self) -> int | None:
        """When unknown positions lie just before `index`, the divergence may start at the first of them."""
        if self.index is None:
            return None
        start = self.index
        while start - 1 in self.unknown:
            start -= 1
        return start if start != self.index else None


def first_failing(n: int, fails: Callable[[int], bool | None], max_skip: int = 3) -> SearchResult:
    """The smallest i in [0, n) with fails(i) True, assuming fails is monotone (False...True).

    `fails(i)` returning None (no answer) is replaced by the answer of the next position, up to
    `max_skip` positions on; a run of unknowns that reaches the end counts as passing."""
    result = SearchResult(None)
    memo: dict[int, bool | None] = {}

    def ask(i: int) -> bool | None:
        if i not in memo:
            result.asked.append(i)
            memo[i] = fails(i)
            if memo[i] is None:
                result.unknown.append(i)
        return memo[i]

    def answer(i: int) -> bool:
        for j in range(i, min(n, i + max_skip + 1)):
            value = ask(j)
            if value is not None:
                return value
        return False

    if n == 0 or not answer(n - 1):
        return result
    i = bisect.bisect_left(range(n), True, key=answer)
    while i < n and memo.get(i) is None:  # name a position whose own probe failed
        i += 1
    result.index = i if i < n else None
    return result

