"""Ranks as threads with a real (in-memory) all_reduce_sum, for the algorithms' global statistics.

Each rank's call deposits its tensor and waits for the others (a 10 s barrier timeout, so a rank that
skips a collective fails the test instead of hanging it); every rank gets the elementwise sum. Unlike
replaying a recorded tensor, this is right for functions that make several all-reduces in sequence.
"""

from __future__ import annotations

import threading


def run_ranks(fns):
    """Run fns[r](all_reduce_sum_r) on len(fns) threads; return their results in rank order."""
    n = len(fns)
    barrier = threading.Barrier(n, timeout=10)
    slots: list = [None] * n
    results: list = [None] * n
    errors: list = []

    def reducer(rank):
        def all_reduce_sum(x):
            slots[rank] = x.clone()
            barrier.wait()
            out = slots[0].clone()
            for other in slots[1:]:
                out = out + other
            barrier.wait()  # nobody overwrites a slot before every rank has summed
            return out

        return all_reduce_sum

    def body(rank):
        try:
            results[rank] = fns[rank](reducer(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results
