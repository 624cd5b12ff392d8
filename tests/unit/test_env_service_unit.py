"""EnvService in process (no sockets): what the environment answers is checked before it travels,
joined retries, bounds on episodes and idle episodes, and the env.timeout_s / env.retries keys."""

from __future__ import annotations

import asyncio
import math
import types

import pytest

from protocols import decode, encode
from protocols.env import EnvClose, EnvReply, EnvReset, EnvStep
from streamrft.config import ConfigError, load_config
from streamrft.config.env import validate_env
from streamrft.envs import EnvStep as StepResult
from streamrft.envs.service import EnvService, EnvServiceLimits
from streamrft.rewards.service import ServiceLimits
from tests.ports import free_port


class Scripted:
    """step() answers what the test put in ``answers`` (after ``delay``); counts its calls."""

    calls = 0

    def __init__(self, answers=None, delay=0.0):
        self.answers, self.delay = list(answers or []), delay

    async def reset(self, row):
        return None

    async def step(self, action):
        Scripted.calls += 1
        await asyncio.sleep(self.delay)
        return self.answers.pop(0)

    async def close(self):
        pass


def service(answers=None, delay=0.0, **limits) -> EnvService:
    Scripted.calls = 0
    return EnvService(lambda: Scripted(answers, delay), "scripted_test", EnvServiceLimits(**limits))


@pytest.mark.parametrize("answer, message", [
    (StepResult("x", reward=math.nan), "scripted_test: step() returned reward nan; expected a finite number"),
    (StepResult("x", role="system"), "scripted_test: step() returned role 'system'; expected one of ['tool', 'user']"),
    (StepResult(3), "scripted_test: step() returned observation of type int; expected str or None"),
    ("just text", "scripted_test: step() returned a str without 'observation'; return streamrft.envs.EnvStep"),
    (StepResult("x", info={"f": object()}), "scripted_test: step() returned info that cannot travel as msgpack: "),
    (StepResult("x", info={1: 2.0}), "scripted_test: step() returned info with non-string key(s) [1]; info keys must be str"),
])
def test_an_answer_that_cannot_travel_fails_the_episode_with_env_error_naming_the_field(answer, message):
    async def go():
        svc = service([answer])
        await svc.handle(EnvReset(episode_id="e", row={}))
        first = await svc.handle(EnvStep(episode_id="e", turn=1, action="a"))
        later = await svc.handle(EnvStep(episode_id="e", turn=2, action="b"))
        return first, later

    first, later = asyncio.run(go())
    assert first.code == "env_error" and first.error.startswith(message)
    assert later.code == "env_error" and later.error.startswith("episode 'e' failed at turn 1: " + message)


def test_a_retry_that_arrives_while_its_turn_is_stepped_joins_it_and_the_env_steps_once():
    async def go():
        svc = service([StepResult("obs", reward=2.0, info={"tool_calls": 1})], delay=0.1)
        await svc.handle(EnvReset(episode_id="e", row={"x": 1}))
        # the wire round trip too: the reply is what a peer decodes
        frames = await asyncio.gather(*[svc.answer_frame(encode(EnvStep(episode_id="e", turn=1, action="a")))
                                        for _ in range(3)])
        return svc, [decode(f, EnvReply) for f in frames]

    svc, replies = asyncio.run(go())
    assert Scripted.calls == 1 and svc.n_steps == 1 and svc.n_cached == 2
    assert all(r == replies[0] for r in replies)
    assert (replies[0].observation, replies[0].reward, replies[0].info) == ("obs", 2.0, {"tool_calls": 1})


def test_episodes_are_bounded_and_idle_ones_are_closed():
    async def go():
        svc = service(max_episodes=2, episode_idle_s=0.2)
        for eid in ("a", "b"):
            assert not (await svc.handle(EnvReset(episode_id=eid, row={}))).error
        full = await svc.handle(EnvReset(episode_id="c", row={}))
        stop = asyncio.Event()
        reaper = asyncio.create_task(svc.reap(stop))
        await asyncio.sleep(1.5)  # the reaper looks every second
        stop.set()
        await reaper
        after = await svc.handle(EnvStep(episode_id="a", turn=1, action="x"))
        again = await svc.handle(EnvReset(episode_id="c", row={}))
        closed = await svc.handle(EnvClose(episode_id="zz"))  # closing an unknown episode is no error
        return svc, full, after, again, closed

    svc, full, after, again, closed = asyncio.run(go())
    assert full.code == "busy" and full.error == "busy: 2 episodes are open, the limit is --max-episodes=2; retry later"
    assert svc.n_reaped == 2 and after.code == "unknown_episode"
    assert not again.error and not closed.error and closed.turn == -1


def _cfg(*overrides):
    cfg = load_config("pipelines/arith/config.yaml", ["env.name=scripted", "data.chat_template=auto", *overrides])
    # validate_env alone, without the tokenizer check (the arith model may not be prepared here)
    return types.SimpleNamespace(env=cfg.env, engine=cfg.engine, data=cfg.data, model=types.SimpleNamespace(path=""))


def test_env_timeout_and_retries_apply_to_env_address_only():
    validate_env(_cfg("env.address=tcp://127.0.0.1:5557", "env.timeout_s=5", "env.retries=0"))
    with pytest.raises(ConfigError) as info:
        validate_env(_cfg("env.timeout_s=5"))
    assert str(info.value) == ("env.timeout_s=5.0 is set but env.address is empty (an in-process environment); "
                               "env.timeout_s applies to requests to a serve-env service only")
    with pytest.raises(ConfigError, match=r"env.timeout_s=30.0 must be > 0 and env.retries=-1 >= 0"):
        validate_env(_cfg("env.address=tcp://127.0.0.1:5557", "env.retries=-1"))
    for key, value in (("retries", "0"), ("timeout_s", "5")):  # without env.name they would do nothing either
        with pytest.raises(ConfigError) as info:
            validate_env(_cfg("env.name=", f"env.{key}={value}"))
        assert str(info.value).startswith(f"env.{key}={float(value) if key == 'timeout_s' else int(value)!r} is set "
                                          "but env.name is empty (single-turn rollouts)"), str(info.value)


def test_closing_an_episode_after_its_client_closed_is_not_counted_as_a_failure():
    from streamrft.envs.remote import RemoteEnvClient, RemoteEnvironment

    async def go():
        client = RemoteEnvClient("tcp://127.0.0.1:9", timeout_s=0.2, retries=0)
        env = RemoteEnvironment(client)
        await client.close()
        await env.close()  # the episode's outcome is known: a close that cannot be sent is no failure
        with pytest.raises(Exception, match="env_error: env stage, rank 0, .*: the remote environment client is closed"):
            await env.reset({})
        return client

    client = asyncio.run(go())
    assert client.n_failed == 1 and client.failed_by_reason == {"env_error": 1}  # the reset only


def test_a_held_out_evaluation_closes_the_serve_env_client_it_made(monkeypatch):
    """Each evaluation makes its own RemoteEnvClient (sockets, threads); it must not outlive the evaluation."""
    from streamrft.engines.base import GenerationRequest
    from streamrft.envs import episode
    from streamrft.runtime.evaluation import _evaluate_episodes

    port = free_port()  # a port nobody listens on: every reset goes unanswered
    made = []
    real = episode.environment_factory
    monkeypatch.setattr(episode, "environment_factory", lambda cfg, rank=0: made.append(real(cfg, rank)) or made[-1])
    env = types.SimpleNamespace(name="echo", address=f"tcp://127.0.0.1:{port}", timeout_s=0.2, retries=0,
                                max_turns=2, max_tokens=16, kwargs={})
    row = types.SimpleNamespace(extra={}, prompt="p", reference="r", label="", row=0)
    tokenizer = types.SimpleNamespace(chat_template="{{ messages }}", name_or_path="fake")
    out = asyncio.run(_evaluate_episodes(None, tokenizer, env, "", 4, [GenerationRequest("0", [1, 2], 0)],
                                         [(0, row)], {0: "p"}, None, 0, lambda t: t, 1.0, "auto", "", "eval.jsonl",
                                         5.0))
    assert out["heldout_env_errors"] == 1.0 and out["heldout_n"] == 1.0
    assert len(made) == 1 and made[0].client._closed


@pytest.mark.parametrize(
    "limits, bad, message",
    [
        (EnvServiceLimits, {"max_episodes": 0}, "--max-episodes=0 must be >= 1"),
        (EnvServiceLimits, {"episode_idle_s": 0.0}, "--episode-idle-s=0.0 must be > 0"),
        (ServiceLimits, {"cache_bytes": -1}, "--cache-bytes=-1 must be >= 0"),
        (ServiceLimits, {"max_items": 0}, "--max-items=0 must be >= 1"),
        (ServiceLimits, {"http_timeout_s": -1.0}, "--http-timeout-s=-1.0 must be > 0"),
    ],
)
def test_a_service_bound_out_of_range_names_its_flag_and_its_bound(limits, bad, message):
    limits().check()  # the defaults are in range
    with pytest.raises(ValueError) as error:
        limits(**bad).check()
    assert str(error.value) == message


def test_a_reward_cache_of_zero_bytes_is_allowed():
    ServiceLimits(cache_bytes=0).check()  # 0 turns the cache off
