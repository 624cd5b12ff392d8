"""Client of ``streamrft serve-env``: :class:`RemoteEnvironment`, an Environment whose episodes run in a
service (used when ``env.address`` is set).

One :class:`RemoteEnvClient` per address and rank holds the sockets (streamrft.dealer.DealerPool for
``tcp://`` / ``ipc://``; urllib in its own bounded daemon threads for ``http://``) and the counters;
:meth:`RemoteEnvClient.factory` makes one RemoteEnvironment per episode.

Every request is retried with back-off when no reply comes within ``timeout_s`` or the service is
busy, up to ``retries`` times, with the same (episode_id, turn) key, so the service answers a retry
from its cache and never steps a turn twice. Past the last attempt the call raises
:class:`EnvServiceError` naming the stage ("env"), the rank and the address: a failed sample with a
reason, never a hang (a call takes at most :attr:`RemoteEnvClient.deadline_s`).

A restarted service has lost its episodes and answers ``unknown_episode``. The client then rebuilds
the episode: it sends the reset (same row) and every earlier action again, and checks that each
replayed turn answers exactly what it answered the first time. A deterministic environment thus
continues where it was, with nothing lost and nothing counted twice (the episode's turns and rewards
are the ones it had). When a replayed answer differs (the environment is not deterministic, or the
service now runs another one) the episode cannot be continued faithfully and fails with reason
``env_lost``; so does one that needs more than ``MAX_REBUILDS`` rebuilds.

Failure reasons (``EnvServiceError.reason``, the first word of its message, the accounting label):
``env_unreachable`` (no reply after every attempt), ``env_lost`` (above), ``env_timeout`` (the
environment passed the service's --step-timeout-s), ``env_error`` (the environment raised or answered
something unsendable, a bad request, a protocol mismatch).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import urllib.error
import urllib.request
import uuid
from typing import Any

import msgspec
import zmq

from protocols import ProtocolError, decode, encode
from protocols.env import EnvClose, EnvReply, EnvReset, EnvStep
from streamrft.dealer import DealerPool
from streamrft.envs.base import EnvStep as StepResult
from streamrft.envs.service import peek_episode
from streamrft.rewards.bounded import BoundedExecutor

MAX_REBUILDS = 3  # service restarts one episode survives
REASONS = ("env_unreachable", "env_lost", "env_timeout", "env_error")


class EnvServiceError(RuntimeError):
    """A remote environment call that ended without a usable answer; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class _NoReply(Exception):
    """An attempt that may succeed if sent again (no reply in time, connection refused, busy)."""


class RemoteEnvClient:
    """The connection of one rank to one environment service, shared by all its episodes.

    Counters (read them for metrics): ``n_requests`` calls made, ``n_timeouts`` attempts without a
    reply in time, ``n_retries`` attempts sent again, ``n_busy`` busy replies, ``n_rebuilt`` episodes
    rebuilt after a service restart, ``n_failed`` calls that raised EnvServiceError (by reason in
    ``failed_by_reason``).
    """

    def __init__(self, address: str, env: str = "", timeout_s: float = 30.0, retries: int = 3, rank: int = 0,
                 max_concurrency: int = 64) -> None:
        if not address.startswith(("tcp://", "ipc://", "http://")):
            raise ValueError(f"env.address={address!r} must be tcp://host:port, ipc://path or http://host:port")
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"remote environment {address}: timeout_s={timeout_s} must be > 0 and retries={retries} >= 0")
        self.address, self.env, self.rank = address, env, rank
        self.timeout_s, self.retries = timeout_s, retries
        self.n_requests = self.n_timeouts = self.n_retries = self.n_busy = self.n_rebuilt = self.n_failed = 0
        self.failed_by_reason: dict[str, int] = {}
        self._client_id = uuid.uuid4().hex[:12]  # episode ids unique across clients of one service
        self._episodes = itertools.count()
        self._http = address.startswith("http://")
        self._dealers = None if self._http else DealerPool(address)
        self._http_threads = BoundedExecutor(f"env-http-{address}", max_concurrency) if self._http else None
        self._closed = False

    @property
    def deadline_s(self) -> float:
        """Longest one call can take: every attempt timing out, plus the back-off between them."""
        return (self.retries + 1) * (self.timeout_s + 1.0) + 1.0

    def factory(self):
        """A zero-argument callable making one RemoteEnvironment per episode (like load_environment's)."""
        return lambda: RemoteEnvironment(self)

    def new_episode_id(self) -> str:
        return f"{self._client_id}-r{self.rank}-{next(self._episodes)}"

    def fail(self, reason: str, message: str, count: bool = True) -> EnvServiceError:
        if count:
            self.n_failed += 1
            self.failed_by_reason[reason] = self.failed_by_reason.get(reason, 0) + 1
        return EnvServiceError(reason, f"env stage, rank {self.rank}, service {self.address}: {message}")

    async def call(self, request: EnvReset | EnvStep | EnvClose, attempts: int | None = None,
                   count: bool = True) -> EnvReply:
        """The service's reply (maybe an error reply: the caller reads ``code``); EnvServiceError when no
        reply came after ``attempts`` (default retries + 1) attempts."""
        if self._closed:
            raise self.fail("env_error", "the remote environment client is closed", count=count)
        self.n_requests += 1
        attempts = self.retries + 1 if attempts is None else attempts
        turn = getattr(request, "turn", 0 if isinstance(request, EnvReset) else -1)
        last = ""
        for attempt in range(attempts):
            if attempt:
                self.n_retries += 1
                await asyncio.sleep(min(1.0, 0.05 * 2**attempt))  # back-off: a restarting service comes up
            try:
                reply = await (self._attempt_http(request) if self._http else self._attempt_zmq(request))
            except _NoReply as exc:
                last = str(exc)
                continue
            if reply.code == "busy":
                self.n_busy += 1
                last = reply.error
                continue
            return reply
        raise self.fail("env_unreachable", count=count, message=f"{type(request).__name__} of episode {request.episode_id!r} turn {turn} "
                                           f"got no answer after {attempts} attempt(s) (timeout_s={self.timeout_s:g}, "
                                           f"retries={self.retries}); last: {last}; is `streamrft serve-env` running there?")

    async def _attempt_zmq(self, request: Any) -> EnvReply:
        assert self._dealers is not None
        # the reply to a reset is turn 0, to a close turn -1 (what EnvService answers)
        key = (request.episode_id, request.turn if isinstance(request, EnvStep) else 0 if isinstance(request, EnvReset) else -1)

        def ours(data: bytes) -> bool:
            eid, turn = peek_episode(data)
            return eid == "" or (eid, turn) == key

        try:
            data = await self._dealers.request(encode(request), self.timeout_s, ours)
        except zmq.ZMQError as exc:
            raise self.fail("env_error", f"socket error: {exc}") from None
        if data is None:
            self.n_timeouts += 1
            raise _NoReply(f"no reply within {self.timeout_s}s")
        try:
            return decode(data, EnvReply)
        except ProtocolError as exc:
            raise self.fail("env_error", f"malformed reply: {exc}") from None

    async def _attempt_http(self, request: Any) -> EnvReply:
        assert self._http_threads is not None
        body = msgspec.json.encode(request)
        try:
            return await asyncio.wait_for(self._http_threads.run(self._post, body), self.timeout_s + 1.0)
        except asyncio.TimeoutError:
            self.n_timeouts += 1
            raise _NoReply(f"no reply within {self.timeout_s}s") from None

    def _post(self, body: bytes) -> EnvReply:
        req = urllib.request.Request(self.address, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:  # an error reply still carries an EnvReply (or {"error"})
            raw = exc.read()
            try:
                return msgspec.json.decode(raw, type=EnvReply)
            except msgspec.DecodeError:
                detail = raw.decode(errors="replace")[:300]
                if exc.code == 503:
                    return EnvReply(episode_id="", error=detail, code="busy")
                return EnvReply(episode_id="", error=f"HTTP {exc.code} {detail}", code="bad_request")
        except (TimeoutError, socket.timeout, urllib.error.URLError, ConnectionError) as exc:
            raise _NoReply(f"cannot reach {self.address}: {getattr(exc, 'reason', exc)}") from None
        try:
            return msgspec.json.decode(raw, type=EnvReply)
        except msgspec.DecodeError as exc:
            return EnvReply(episode_id="", error=f"malformed reply: {exc}", code="bad_request")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dealers is not None:
            self._dealers.close()
        if self._http_threads is not None:
            self._http_threads.close()


_CODE_REASON = {"timeout": "env_timeout", "unknown_episode": "env_lost"}


class RemoteEnvironment:
    """One episode on a remote service (an Environment: async reset / step / close)."""

    def __init__(self, client: RemoteEnvClient) -> None:
        self.client = client
        self.episode_id = client.new_episode_id()
        self.row: dict | None = None
        self.reset_reply: EnvReply | None = None
        self.turns: list[tuple[str, EnvReply]] = []  # (action, reply) of every step answered so far
        self.rebuilds = 0

    def _failed(self, reply: EnvReply, what: str) -> EnvServiceError:
        reason = _CODE_REASON.get(reply.code, "env_error")
        return self.client.fail(reason, f"{what} of episode {self.episode_id!r}: {reply.error}")

    async def reset(self, row: dict) -> str | None:
        self.row = dict(row)
        reply = await self.client.call(EnvReset(episode_id=self.episode_id, row=self.row, env=self.client.env))
        if reply.error:
            raise self._failed(reply, "reset")
        self.reset_reply = reply
        return reply.observation

    async def step(self, action: str) -> StepResult:
        if self.row is None:
            raise self.client.fail("env_error", f"step before reset in episode {self.episode_id!r}")
        turn = len(self.turns) + 1
        request = EnvStep(episode_id=self.episode_id, turn=turn, action=action)
        reply = await self.client.call(request)
        while reply.code == "unknown_episode":  # the service restarted (or reaped the episode): rebuild it
            await self._rebuild()
            reply = await self.client.call(request)
        if reply.error:
            raise self._failed(reply, f"step {turn}")
        self.turns.append((action, reply))
        return StepResult(observation=reply.observation, reward=reply.reward, done=reply.done, role=reply.role,
                          info=dict(reply.info))

    async def _rebuild(self) -> None:
        """Replay reset and the earlier actions; every replayed answer must equal the first one."""
        self.rebuilds += 1
        if self.rebuilds > MAX_REBUILDS:
            raise self.client.fail("env_lost", f"episode {self.episode_id!r} was lost by the service "
                                               f"{self.rebuilds} times (MAX_REBUILDS={MAX_REBUILDS})")
        self.client.n_rebuilt += 1
        assert self.reset_reply is not None and self.row is not None
        first = await self.client.call(EnvReset(episode_id=self.episode_id, row=self.row, env=self.client.env))
        if first.error:
            raise self._failed(first, "rebuilding reset")
        if first.observation != self.reset_reply.observation:
            raise self.client.fail("env_lost", f"episode {self.episode_id!r} was lost by a service restart and its "
                                               "reset now answers another observation (not deterministic)")
        for turn, (action, before) in enumerate(self.turns, start=1):
            again = await self.client.call(EnvStep(episode_id=self.episode_id, turn=turn, action=action))
            if again.code == "unknown_episode":
                return  # restarted again during the replay: the caller's loop rebuilds once more
            if again.error:
                raise self._failed(again, f"rebuilding step {turn}")
            if (again.observation, again.reward, again.done, again.role) != (
                    before.observation, before.reward, before.done, before.role):
                raise self.client.fail("env_lost", f"episode {self.episode_id!r} was lost by a service restart and "
                                                   f"replaying turn {turn} answered differently (the environment is "
                                                   "not deterministic), so it cannot be continued")

    async def close(self) -> None:
        """Frees the episode on the service: one attempt; a lost close is left to --episode-idle-s."""
        try:  # not counted as a failure: the episode's outcome is already known
            await self.client.call(EnvClose(episode_id=self.episode_id), attempts=1, count=False)
        except EnvServiceError:
            pass


def remote_environment_factory(env_cfg: Any, rank: int = 0):
    """The per-episode factory for the config's ``env`` section when ``env.address`` is set (what
    load_environment is for an in-process environment). One RemoteEnvClient per call, reachable as
    ``factory.client`` (its counters; ``await factory.client.close()`` at the end of the run)."""
    client = RemoteEnvClient(env_cfg.address, env_cfg.name, getattr(env_cfg, "timeout_s", 30.0),
                             getattr(env_cfg, "retries", 3), rank)
    factory = client.factory()
    factory.client = client
    return factory


__all__ = ["EnvServiceError", "RemoteEnvClient", "RemoteEnvironment", "remote_environment_factory", "REASONS"]
