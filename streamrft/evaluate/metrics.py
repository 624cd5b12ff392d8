"""Sampling metrics over n samples per problem: pure functions.

pass@k, the unbiased estimator of Chen et al. 2021 (Evaluating LLMs trained on code, eq. 1): with
n samples of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

(1 when n - c < k), computed as ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` for stability.

maj@k (majority voting, Wang et al. 2023, self-consistency): the most frequent extracted answer among
the FIRST k samples (ties broken by first occurrence; samples with no answer do not vote) is correct.
It is exact for those k samples, not an estimate over all n.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent non-None answer (first occurrence wins ties); None when no sample answered."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == best)
