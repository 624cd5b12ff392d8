"""Issue 16 items 1 and 2: failures are loud (the failure policy) and user calls are bounded.

Item 1: every way a reward source can fail (raise, NaN, a string, a timeout, a service that is down,
HTTP 500) is tallied per step and source by the real scorer and stops the run with a message naming
the source, the counts, the step and the first failure's cause; ranks decide from summed counts.
Item 2: a sync reward function runs in its source's own bounded daemon-thread pool: a hung call fails
its sample at the deadline, leaves the loop's default executor free, and does not keep the process alive.
"""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest

from protocols import RewardItem
from streamrft.config.base import ConfigError
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.rewards import build_reward_scorer
from streamrft.rewards.bounded import BoundedExecutor
from streamrft.rewards.scorer import SourceTally
from streamrft.runtime.accounting import Accounting
from streamrft.runtime.failure_policy import check_step, exceeds, failure_line
from tests.ports import free_port

FUNCS = textwrap.dedent(
    """
    import math, threading

    def boom(response, reference):
        raise ValueError("boom")

    def nan(response, reference):
        return math.nan

    def string(response, reference):
        return "seven"

    def hangs(response, reference):
        threading.Event().wait()

    def fine(response, reference):
        return 1.0
    """
)


@pytest.fixture
def funcs(tmp_path):
    path = tmp_path / "funcs.py"
    path.write_text(FUNCS)
    return str(path)


class _Answer500(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"error": "scorer crashed"}'
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_500():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def refused_address():
    return f"http://127.0.0.1:{free_port()}"  # a port with no listener


def sample_items(n: int, step: int = 2) -> list[RewardItem]:
    return [RewardItem(sample_id=f"s{step}-p5-{j}", prompt="1+1=", response="2", reference="2") for j in range(n)]


def tallies(cfg: RewardConfig, items: list[RewardItem], step: int = 2) -> dict[str, SourceTally]:
    """Score as the reward stage does (one call per sample, concurrently) and take the step's tallies."""

    async def go():
        scorer = build_reward_scorer(cfg)
        try:
            await asyncio.gather(*(scorer.score([it], step=step) for it in items))
            await scorer.score(sample_items(3, step=99))  # evaluation-like calls without a step are not tallied
            return scorer.take_step(step)
        finally:
            await scorer.close()

    return asyncio.run(go())


def alone(local):  # one rank: the sum over ranks is the local vector
    return local


CASES = {
    "raises": ("custom", "boom", "ValueError('boom') in sample s2-p5-"),
    "returns_nan": ("custom", "nan", "returned nan (rewards must be finite) in sample s2-p5-"),
    "returns_a_string": ("custom", "string", "TypeError(\"reward must be a number, got str 'seven'\") in sample s2-p5-"),
    "times_out": ("custom", "hangs", "timeout after 0.3s (reward.timeout_s) in sample s2-p5-"),
    "service_down": ("remote", "refused", "Connection refused"),
    "service_down_zmq": ("remote", "silent", "no reply within 0.3s; is `streamrft serve-reward` running at that address"),
    "http_500": ("remote", "500", "HTTP 500 {\"error\": \"scorer crashed\"}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_item1_every_kind_of_reward_failure_stops_the_step_naming_source_and_cause(case, funcs, http_500, refused_address):
    kind, what, cause = CASES[case]
    if kind == "custom":
        src = RewardSourceConfig(name="my_fn", type="custom", fn=f"{funcs}:{what}")
    else:
        address = {"500": http_500, "refused": refused_address, "silent": refused_address.replace("http", "tcp")}[what]
        src = RewardSourceConfig(name="my_fn", type="remote", address=address)
    cfg = RewardConfig(sources=[src], timeout_s=0.3 if what in ("hangs", "silent") else 5.0, retries=0, max_concurrency=4)
    started = time.monotonic()
    sources = tallies(cfg, sample_items(6))
    assert time.monotonic() - started < 10
    assert (sources["my_fn"].scored, sources["my_fn"].failed) == (6, 6)
    line, error = check_step(3, 0.5, 0, Counter(reward=6), {"reward": "reward: source 'my_fn': ..."}, sources, alone)
    assert line == "step 3: failed 6 (reward: 6) — first: reward: source 'my_fn': ..."
    prefix = "reward source 'my_fn' failed 6 of 6 samples at step 3 (limit 0.5, reward.max_failed_fraction): first failure: "
    assert error.startswith(prefix), error
    assert cause in error, error


def test_item1_a_working_source_beside_a_failing_one_is_not_blamed(funcs):
    cfg = RewardConfig(sources=[RewardSourceConfig(name="ok", type="custom", fn=f"{funcs}:fine"),
                                RewardSourceConfig(name="bad", type="custom", fn=f"{funcs}:boom")])
    sources = tallies(cfg, sample_items(4))
    assert [(n, t.scored, t.failed) for n, t in sources.items()] == [("ok", 4, 0), ("bad", 4, 4)]
    _, error = check_step(3, 0.5, 0, Counter(reward=4), {}, sources, alone)
    assert error.startswith("reward source 'bad' failed 4 of 4 samples at step 3")


def run_ranks(per_rank: list[dict], limit: float = 0.5) -> list[tuple[str, str | None]]:
    """check_step on simulated ranks whose reduce sums every rank's local vector (as all_reduce_sum)."""
    vectors = []
    for args in per_rank:
        check_step(3, limit, reduce=lambda v: vectors.append(list(v)) or v, **args)
    total = [sum(col) for col in zip(*vectors)]
    return [check_step(3, limit, reduce=lambda v: total, **args) for args in per_rank]


def rank_args(trained: int, failed: int, first: str = "", scored: int = 32) -> dict:
    tally = SourceTally(scored=scored, failed=failed, first_failure=first)
    return dict(trained=trained, failed_by_kind=Counter(reward=failed) if failed else Counter(),
                first_by_kind={"reward": "reward: x"} if failed else {}, sources={"my_fn": tally})


def test_item1_ranks_decide_from_summed_counts_so_they_stop_together_or_not_at_all():
    # rank 0 fails all its 32 samples, rank 1 none: 32 of 64 is the limit, not past it; no rank stops,
    # though rank 0 alone would have (100%).
    results = run_ranks([rank_args(0, 32, "ValueError('boom') in sample s2-p0-0"), rank_args(32, 0)])
    assert [err for _, err in results] == [None, None]
    assert [line for line, _ in results] == ["step 3: failed 32 (reward: 32) — first: reward: x",
                                             "step 3: failed 32 (reward: 32)"]  # global counts on every rank
    # one more failure on rank 1 (33 of 64): both stop; rank 1 quotes its own first failure.
    (_, e0), (_, e1) = run_ranks([rank_args(0, 32, "ValueError('boom') in sample s2-p0-0"),
                                  rank_args(31, 1, "ValueError('late') in sample s2-p9-1")])
    assert e0 == ("reward source 'my_fn' failed 33 of 64 samples at step 3 (limit 0.5, reward.max_failed_fraction): "
                  "first failure: ValueError('boom') in sample s2-p0-0")
    assert e1.endswith("first failure: ValueError('late') in sample s2-p9-1") and e1.startswith(e0.split(": first")[0])
    # a rank that saw no failure says so instead of inventing one
    (_, e0), (_, e1) = run_ranks([rank_args(0, 32, "ValueError('boom') in sample s2-p0-0"), rank_args(16, 0, scored=16)])
    assert e0.startswith("reward source 'my_fn' failed 32 of 48 samples at step 3")
    assert e1 == e0.split(": first")[0] + ": first failure: (on another rank)"


def test_item1_a_step_that_trains_nothing_stops_even_when_no_source_is_over_the_limit():
    sources = {"my_fn": SourceTally(scored=8, failed=0)}
    teacher = Counter(teacher=8)
    _, error = check_step(4, 0.5, 0, teacher, {"teacher": "teacher: connection refused"}, sources, alone)
    assert error == ("step 4 trained no sample on any rank: failed 8 (teacher: 8); first failure: teacher: connection "
                     "refused; stopping (reward.max_failed_fraction=0.5, 1.0 = never stop)")
    _, error = check_step(4, 0.5, 0, Counter(), {}, sources, alone)
    assert error.startswith("step 4 trained no sample on any rank: every sample was filtered")
    assert check_step(4, 0.5, 1, Counter(), {}, sources, alone) == ("", None)


def test_item1_limit_one_never_stops_but_still_prints_the_failures():
    sources = {"my_fn": SourceTally(scored=8, failed=8, first_failure="x")}
    line, error = check_step(2, 1.0, 0, Counter(reward=8), {"reward": "reward: boom"}, sources, alone)
    assert error is None and line == "step 2: failed 8 (reward: 8) — first: reward: boom"


def test_item1_the_limit_is_strict_and_the_console_line_lists_kinds():
    assert not exceeds(32, 64, 0.5) and exceeds(33, 64, 0.5) and not exceeds(0, 0, 0.0) and not exceeds(64, 64, 1.0)
    assert exceeds(1, 64, 0.0)  # 0.0: any failure stops
    line = failure_line(3, {"reward": 10, "teacher": 2, "media_error": 0}, "reward: source 'f': ValueError: boom")
    assert line == "step 3: failed 12 (reward: 10, teacher: 2) — first: reward: source 'f': ValueError: boom"
    assert failure_line(3, {"reward": 0}, "x") == ""


def test_item1_accounting_keeps_the_first_reason_per_kind_per_step():
    acct = Accounting()
    acct.admit(5, step=0)
    acct.admit(3, step=1)
    acct.fail("reward: source 'f': ValueError: boom", step=0)
    acct.fail("reward: source 'f': ValueError: later", step=0)
    acct.fail("teacher: connection refused", 2, step=0)
    acct.fail("media_error: row 3", step=1)
    counts, first = acct.take_step_failures(0)
    assert counts == Counter(reward=2, teacher=2)
    assert first == {"reward": "reward: source 'f': ValueError: boom", "teacher": "teacher: connection refused"}
    assert acct.take_step_failures(0) == (Counter(), {})  # taken once
    assert acct.take_step_failures(1)[0] == Counter(media_error=1)
    assert acct.failed == Counter(reward=2, teacher=2, media_error=1)  # the run's counters are untouched


@pytest.mark.parametrize("value", ["-0.1", "1.5", ".nan"])
def test_item1_max_failed_fraction_outside_zero_one_is_a_config_error(value):
    from streamrft.config import load_config
    from streamrft.rewards.validate import validate_reward

    cfg = load_config(None, ["reward.sources=[{name: c, type: rule, fn: arith}]", f"reward.max_failed_fraction={value}"])
    with pytest.raises(ConfigError, match=r"reward.max_failed_fraction=.* must be in \[0, 1\]"):
        validate_reward(cfg)


def test_item2_a_hung_sync_reward_uses_its_own_bounded_threads_not_the_default_executor(funcs):
    cfg = RewardConfig(sources=[RewardSourceConfig(name="h", type="custom", fn=f"{funcs}:hangs")],
                       timeout_s=0.2, max_concurrency=2)

    async def go():
        scorer = build_reward_scorer(cfg)
        try:
            # 20 hung calls: more than the default executor has threads (min(32, cores + 4))
            outcomes = await asyncio.gather(*(scorer.score(sample_items(1)) for _ in range(20)))
            # the loop's default executor (the hf engine's forwards) is free
            free = await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(lambda: 7) for _ in range(8))), 2.0)
            return outcomes, free, scorer.sources[0].backend.fn.executor
        finally:
            await scorer.close()

    started = time.monotonic()
    outcomes, free, executor = asyncio.run(go())
    assert time.monotonic() - started < 5
    assert {o.error for (o,) in outcomes} == {"source 'h': timeout after 0.2s (reward.timeout_s)"}
    assert free == [7] * 8
    assert len(executor._threads) == 2 and executor.running == 2  # bounded by reward.max_concurrency
    assert all(t.daemon for t in executor._threads)


def test_item2_a_call_that_timed_out_while_queued_never_runs():
    executor = BoundedExecutor("t", 1)
    gate, ran = threading.Event(), []

    async def go():
        first = asyncio.ensure_future(executor.run(gate.wait))
        await asyncio.sleep(0.05)  # the blocking call is in the only thread
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await executor.run(ran.append, "late")  # queued behind the blocked call
        gate.set()
        await first
        assert await executor.run(lambda: 5) == 5

    asyncio.run(go())
    executor.close()
    assert ran == []


def test_close_ends_the_idle_threads_before_it_returns_and_abandons_a_hung_one():
    """Idle threads end inside close() (not later, racing the interpreter's teardown at exit); a thread stuck in a
    call is not waited for."""
    executor = BoundedExecutor("t", 3)
    gate, started = threading.Event(), threading.Event()

    def hang():
        started.set()
        gate.wait()

    async def go():
        hung = asyncio.ensure_future(executor.run(hang))
        await asyncio.to_thread(started.wait, 5)  # the hung call holds one thread
        # two calls at once while it hangs: the pool grows to its bound of three threads
        assert await asyncio.gather(executor.run(lambda: 1), executor.run(lambda: 2)) == [1, 2]
        return hung

    loop = asyncio.new_event_loop()
    try:
        hung = loop.run_until_complete(go())
        assert len(executor._threads) == 3 and executor.running == 1
        began = time.monotonic()
        executor.close()
        took = time.monotonic() - began
        alive = [t for t in executor._threads if t.is_alive()]
        assert len(alive) == 1 and alive[0] in executor._busy  # only the hung one, abandoned
        assert took < 1.0  # the idle threads ended at once; the hung one cost no wait
        gate.set()
        loop.run_until_complete(hung)
    finally:
        gate.set()
        loop.close()


def test_item2_a_process_with_a_reward_call_hung_forever_still_exits(funcs):
    """Before: asyncio.run joined the default executor's threads at exit, so this never ended."""
    script = textwrap.dedent(f"""
        import asyncio
        from protocols import RewardItem
        from streamrft.config.reward import RewardConfig, RewardSourceConfig
        from streamrft.rewards import build_reward_scorer

        async def main():
            cfg = RewardConfig(sources=[RewardSourceConfig(name="h", type="custom", fn={funcs + ':hangs'!r})], timeout_s=0.2)
            scorer = build_reward_scorer(cfg)
            (out,) = await scorer.score([RewardItem(sample_id="a", prompt="", response="", reference="")])
            await scorer.close()
            print(out.error, flush=True)

        asyncio.run(main())
    """)
    # the bound is generous (the child imports torch; slow on a loaded machine): before the fix it never ended
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "source 'h': timeout after 0.2s (reward.timeout_s)"


def test_item2_a_stalled_http_reward_service_leaves_the_default_executor_free():
    import socket

    from streamrft.rewards.remote import RemoteRewardClient

    with socket.socket() as listener:  # accepts connections (backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        client = RemoteRewardClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0, max_concurrency=12, retries=0)

        async def go():
            posts = [asyncio.ensure_future(client.score(sample_items(1))) for _ in range(12)]
            await asyncio.sleep(0.2)  # 12 posts blocked in urllib: more threads than the default executor has
            started = time.monotonic()
            await asyncio.gather(*(asyncio.to_thread(lambda: None) for _ in range(8)))
            free_after = time.monotonic() - started
            outcomes = await asyncio.gather(*posts)
            await client.close()
            return free_after, outcomes

        free_after, outcomes = asyncio.run(go())
    assert free_after < 0.3, f"the default executor waited {free_after:.2f}s behind stalled reward posts"
    assert all("last: no reply within 1.0s" in str(out[0]) for out in outcomes), outcomes[0]
