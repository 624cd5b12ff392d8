"""``streamrft serve-env``: environments behind ZeroMQ (and optionally HTTP), one episode per sample.

    streamrft serve-env --env NAME|module:Class --bind tcp://127.0.0.1:5557 [--http 127.0.0.1:8001]
                        [--env-kwargs JSON]

NAME is a registered environment (``scripted``, ``echo``, B's ``tool`` ...) or ``module:Class`` /
``path/to/file.py:Class``; ``--env-kwargs`` is a JSON object passed to the class (the config's
``env.kwargs``). The spec and the kwargs are checked before the socket is bound.

ZeroMQ: a ROUTER socket speaking protocols.EnvReset / EnvStep / EnvClose -> EnvReply (msgpack, never
pickle), with the scaffolding of serve-reward (streamrft.serving). HTTP: POST the same messages as JSON
(``{"kind": "EnvStep", "episode_id": ..., "turn": 1, "action": ...}``) and get the EnvReply as JSON
(HTTP 400 bad request, 404 unknown episode, 500 environment error, 503 busy, 504 timeout);
``GET /health`` answers ``{"status": "ok", "env": ..., "episodes": ...}``.

Idempotency: every request is keyed by (episode_id, turn), EnvReset being turn 0. The reply to each
turn is kept with its episode, so a retried request is answered from there (and one arriving while
its first copy is still being stepped waits for that result): no turn is stepped twice in one service
lifetime. A retry must carry the same action (and, for EnvReset, the same row); another one is a bad
request. Episodes live in memory: a restarted service answers a step of an episode it does not hold
with ``code="unknown_episode"`` and the client rebuilds it (streamrft.envs.remote).

Bounds (every one a flag; a request past one gets an error reply, never a hang):
``--max-message-bytes`` (16 MiB), ``--max-queued`` (256) / ``--max-queued-bytes`` (256 MiB) requests
not yet answered (past them: ``busy: ...``), ``--step-timeout-s`` (60) for each reset / step / close
call of the environment, ``--max-episodes`` (4096) open at once, ``--episode-idle-s`` (600): an episode
that gets no request for that long is closed (its client is gone), ``--http-timeout-s`` (30).
A timed-out call leaves its environment in an unknown state, so that episode fails for good
(``code="timeout"``). Environment calls run on the service's event loop: an environment must await its
slow work (a subprocess, a thread), never block; one that blocks stalls every episode of the service.

Prints ``serve-env: listening on <address>`` per bound address, then ``serve-env: ready``; SIGTERM /
SIGINT stop it cleanly (open episodes are closed). Start-up errors are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from protocols import PROTOCOL_VERSION, ProtocolError, decode, encode
from protocols.base import check_frame
from protocols.env import EnvClose, EnvReply, EnvRequest, EnvReset, EnvStep
from streamrft.envs.base import OBSERVATION_ROLES, load_environment
from streamrft.serving import (
    QueueBound,
    bind_router,
    check_bind,
    check_limits,
    json_http_handler,
    parse_http,
    run_until_signal,
    serve_router,
    start_http,
    stop_http,
)

REAP_EVERY_S = 1.0  # how often idle episodes are looked for
CODE_STATUS = {"bad_request": 400, "unknown_episode": 404, "env_error": 500, "busy": 503, "timeout": 504}


def _log(msg: str) -> None:
    print(f"serve-env: {msg}", flush=True)


@dataclass(frozen=True)
class EnvServiceLimits:
    """The bounds of one service (see the module docstring); the CLI flags have the same names."""

    max_message_bytes: int = 16 * 1024 * 1024
    max_queued: int = 256
    max_queued_bytes: int = 256 * 1024 * 1024
    step_timeout_s: float = 60.0
    max_episodes: int = 4096
    episode_idle_s: float = 600.0
    http_timeout_s: float = 30.0

    def check(self) -> None:
        at_least_one = ("max_message_bytes", "max_queued", "max_queued_bytes", "max_episodes")
        check_limits(self, dict.fromkeys(at_least_one, 1), ("step_timeout_s", "episode_idle_s", "http_timeout_s"))


@dataclass
class _Episode:
    env: Any
    row_digest: bytes
    # turn -> (digest of the request that made it, reply); turn 0 is the reset
    replies: dict[int, tuple[bytes, EnvReply]] = field(default_factory=dict)
    pending: dict[int, tuple[bytes, asyncio.Future]] = field(default_factory=dict)  # turns being stepped
    next_turn: int = 0
    failed: EnvReply | None = None  # set when a call failed: the environment's state is unknown after it
    done_at: int = -1
    last_used: float = field(default_factory=time.monotonic)


class _EpisodeProbe(msgspec.Struct, forbid_unknown_fields=False):
    episode_id: str = ""
    turn: int = 0


def peek_episode(data: bytes) -> tuple[str, int]:
    """(episode_id, turn) of a frame that may not decode as our protocol version (("", 0) if unreadable)."""
    try:
        check_frame(data, max_bytes=len(data))
        probe = msgspec.msgpack.decode(data, type=_EpisodeProbe)
        return probe.episode_id, probe.turn
    except Exception:  # whatever the bytes: no id
        return "", 0


_digest_encoder = msgspec.msgpack.Encoder()


def _digest(value: Any) -> bytes:
    return hashlib.blake2b(_digest_encoder.encode(value), digest_size=16).digest()


def _step_reply(episode_id: str, turn: int, result: Any) -> EnvReply:
    """The wire form of an environment's EnvStep; ValueError naming the field that is not sendable."""
    for name in ("observation", "reward", "done", "role", "info"):
        if not hasattr(result, name):
            raise ValueError(f"step() returned a {type(result).__name__} without {name!r}; return streamrft.envs.EnvStep")
    if result.observation is not None and not isinstance(result.observation, str):
        raise ValueError(f"step() returned observation of type {type(result.observation).__name__}; expected str or None")
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        raise ValueError(f"step() returned reward {result.reward!r}; expected a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"step() returned reward {reward}; expected a finite number")
    if result.role not in OBSERVATION_ROLES:
        raise ValueError(f"step() returned role {result.role!r}; expected one of {list(OBSERVATION_ROLES)}")
    if not isinstance(result.info, dict):
        raise ValueError(f"step() returned info of type {type(result.info).__name__}; expected a dict")
    bad_keys = [k for k in result.info if not isinstance(k, str)]
    if bad_keys:  # msgpack would carry them, but the client's EnvReply (info: dict[str, Any]) refuses the reply
        raise ValueError(f"step() returned info with non-string key(s) {bad_keys[:3]!r}; info keys must be str")
    try:
        _digest_encoder.encode(result.info)
    except (TypeError, UnicodeEncodeError, OverflowError) as exc:
        raise ValueError(f"step() returned info that cannot travel as msgpack: {exc}") from None
    return EnvReply(episode_id=episode_id, turn=turn, observation=result.observation, reward=reward,
                    done=bool(result.done), role=result.role, info=dict(result.info))


class EnvService:
    """Answers EnvReset / EnvStep / EnvClose for many episodes at once; idempotent per (episode, turn)."""

    def __init__(self, factory: Callable[[], Any], name: str, limits: EnvServiceLimits | None = None) -> None:
        self.factory = factory
        self.name = name
        self.limits = limits or EnvServiceLimits()
        self.queue = QueueBound(self.limits.max_queued, self.limits.max_queued_bytes, doing="stepped")
        self.episodes: dict[str, _Episode] = {}
        self.n_requests = 0  # requests received (retries included)
        self.n_resets = 0  # environment reset() calls made
        self.n_steps = 0  # environment step() calls made
        self.n_cached = 0  # retries answered from the episode's replies (or joined to a call in progress)
        self.n_errors = 0  # error replies of any kind
        self.n_timeouts = 0  # environment calls past --step-timeout-s
        self.n_unknown = 0  # steps for an episode this service does not hold (e.g. after a restart)
        self.n_reaped = 0  # episodes closed after --episode-idle-s without a request

    # --- the frame interface of streamrft.serving.serve_router ------------------------------------

    def release(self, nbytes: int) -> None:
        self.queue.release(nbytes)

    def reject_frame(self, payload: bytes) -> bytes | None:
        limit = self.limits.max_message_bytes
        if len(payload) > limit:  # not even peeked: reading a frame this size is what the limit prevents
            return encode(self._error("", 0, "bad_request", f"request of {len(payload)} bytes exceeds "
                                                            f"--max-message-bytes={limit}"))
        busy = self.queue.admit(len(payload))
        if busy:
            return encode(self._error(*peek_episode(payload), "busy", busy))
        return None

    async def answer_frame(self, payload: bytes) -> bytes:
        try:
            request = decode(payload, EnvRequest, max_bytes=self.limits.max_message_bytes)
        except ProtocolError as exc:  # includes ProtocolVersionError
            return encode(self._error(*peek_episode(payload), "bad_request", str(exc)))
        return encode(await self.handle(request))

    # --- episodes ------------------------------------------------------------------------------

    def _error(self, episode_id: str, turn: int, code: str, message: str) -> EnvReply:
        self.n_errors += 1
        return EnvReply(episode_id=episode_id, turn=turn, error=message, code=code)

    async def handle(self, request: EnvReset | EnvStep | EnvClose) -> EnvReply:
        self.n_requests += 1
        try:
            if isinstance(request, EnvClose):
                return await self._close(request.episode_id)
            if isinstance(request, EnvReset):
                if request.env and request.env != self.name:
                    return self._error(request.episode_id, 0, "bad_request", f"this service runs environment "
                                       f"{self.name!r} (serve-env --env), the client asks for {request.env!r} (env.name)")
                return await self._turn(request.episode_id, 0, _digest(request.row), request)
            if request.turn < 1:
                return self._error(request.episode_id, request.turn, "bad_request",
                                   f"EnvStep turn {request.turn}: steps count from 1 (turn 0 is the reset)")
            return await self._turn(request.episode_id, request.turn, _digest(request.action), request)
        except Exception as exc:  # an unexpected bug here: answer with it rather than leave the peer waiting
            return self._error(request.episode_id, getattr(request, "turn", 0), "env_error", f"{type(exc).__name__}: {exc}")

    async def _turn(self, eid: str, turn: int, digest: bytes, request: EnvReset | EnvStep) -> EnvReply:
        episode = self.episodes.get(eid)
        if episode is None:
            if turn > 0:
                self.n_unknown += 1
                return self._error(eid, turn, "unknown_episode",
                                   f"episode {eid!r} is not open on this service (closed, idle past "
                                   f"--episode-idle-s={self.limits.episode_idle_s}, or the service restarted)")
            if len(self.episodes) >= self.limits.max_episodes:
                return self._error(eid, 0, "busy", f"busy: {len(self.episodes)} episodes are open, the limit is "
                                                   f"--max-episodes={self.limits.max_episodes}; retry later")
            try:
                env = self.factory()
            except Exception as exc:
                return self._error(eid, 0, "env_error", f"creating environment {self.name!r} failed: "
                                                        f"{type(exc).__name__}: {exc}")
            episode = self.episodes[eid] = _Episode(env=env, row_digest=digest)
        episode.last_used = time.monotonic()
        kept = episode.replies.get(turn)
        if kept is not None or turn in episode.pending:
            if (kept or episode.pending[turn])[0] != digest:
                what = "row" if turn == 0 else "action"
                return self._error(eid, turn, "bad_request", f"episode {eid!r} turn {turn} was already "
                                   f"requested with another {what}; a retry must resend the same one")
            self.n_cached += 1
            return kept[1] if kept is not None else await asyncio.shield(episode.pending[turn][1])
        if episode.failed is not None:
            failed = episode.failed
            return self._error(eid, turn, failed.code, f"episode {eid!r} failed at turn {failed.turn}: {failed.error}")
        if 0 <= episode.done_at < turn:
            return self._error(eid, turn, "bad_request", f"episode {eid!r} ended at turn {episode.done_at}; "
                                                         f"turn {turn} cannot follow")
        if turn != episode.next_turn:
            return self._error(eid, turn, "bad_request", f"episode {eid!r}: turn {turn} arrived but the "
                                                         f"environment is at turn {episode.next_turn}")
        future = asyncio.get_running_loop().create_future()
        episode.pending[turn] = (digest, future)  # a joined retry checks it carries the same action
        episode.next_turn += 1
        try:
            reply = await self._call(episode, eid, turn, request)
        except asyncio.CancelledError:
            future.cancel()  # a retry joined to this one must not wait forever
            raise
        finally:
            del episode.pending[turn]
        if reply.error:
            episode.failed = reply
        elif reply.done:
            episode.done_at = turn
        episode.replies[turn] = (digest, reply)
        if not future.done():  # cancelled when the episode was closed meanwhile
            future.set_result(reply)
        return reply

    async def _call(self, episode: _Episode, eid: str, turn: int, request: EnvReset | EnvStep) -> EnvReply:
        what = "reset" if turn == 0 else "step"
        try:
            async with asyncio.timeout(self.limits.step_timeout_s):
                if turn == 0:
                    self.n_resets += 1
                    observation = await episode.env.reset(dict(request.row))
                else:
                    self.n_steps += 1
                    result = await episode.env.step(request.action)
        except TimeoutError:
            self.n_timeouts += 1
            return self._error(eid, turn, "timeout", f"{self.name}.{what} passed --step-timeout-s="
                                                     f"{self.limits.step_timeout_s}")
        except Exception as exc:
            return self._error(eid, turn, "env_error", f"{self.name}.{what} raised {type(exc).__name__}: {exc}")
        try:
            if turn == 0:
                if observation is not None and not isinstance(observation, str):
                    raise ValueError(f"reset() returned {type(observation).__name__}; expected str or None")
                return EnvReply(episode_id=eid, turn=0, observation=observation, role="user")
            return _step_reply(eid, turn, result)
        except ValueError as exc:
            return self._error(eid, turn, "env_error", f"{self.name}: {exc}")

    async def _close(self, eid: str) -> EnvReply:
        episode = self.episodes.pop(eid, None)
        if episode is None:
            return EnvReply(episode_id=eid, turn=-1)  # already closed (a retried close, or a restart)
        for _, future in episode.pending.values():  # a step still running: its reply goes to nobody now
            future.cancel()
        try:
            async with asyncio.timeout(self.limits.step_timeout_s):
                await episode.env.close()
        except TimeoutError:
            self.n_timeouts += 1
            return self._error(eid, -1, "timeout", f"{self.name}.close passed --step-timeout-s={self.limits.step_timeout_s}")
        except Exception as exc:
            return self._error(eid, -1, "env_error", f"{self.name}.close raised {type(exc).__name__}: {exc}")
        return EnvReply(episode_id=eid, turn=-1)

    async def reap(self, stop: asyncio.Event) -> None:
        """Close episodes idle past --episode-idle-s (their client crashed or gave up) until ``stop``."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), REAP_EVERY_S)
            except TimeoutError:
                pass
            cutoff = time.monotonic() - self.limits.episode_idle_s
            for eid in [e for e, ep in self.episodes.items() if ep.last_used < cutoff and not ep.pending]:
                self.n_reaped += 1
                await self._close(eid)

    async def close_all(self) -> None:
        for eid in list(self.episodes):
            await self._close(eid)


def _http_handler(service: EnvService, loop: asyncio.AbstractEventLoop) -> type:
    limits = service.limits
    wait_s = limits.step_timeout_s * (1 + limits.max_queued) + 5.0

    def count_error() -> None:
        service.n_errors += 1

    def health() -> dict:
        return {"env": service.name, "episodes": len(service.episodes), "queued": service.queue.queued,
                "requests": service.n_requests, "resets": service.n_resets, "steps": service.n_steps,
                "cached": service.n_cached, "errors": service.n_errors}

    def post(raw: bytes) -> tuple[int, dict]:
        try:
            request = msgspec.json.decode(raw, type=EnvRequest)
        except msgspec.DecodeError as exc:  # includes ValidationError
            service.n_errors += 1
            return 400, {"error": f"body is not an EnvReset, EnvStep or EnvClose JSON object: {exc}", "code": "bad_request"}
        if request.protocol_version != PROTOCOL_VERSION:
            service.n_errors += 1
            return 400, {"error": f"protocol version mismatch: peer sent version {request.protocol_version}, this "
                                  f"side speaks version {PROTOCOL_VERSION}", "code": "bad_request"}
        future = asyncio.run_coroutine_threadsafe(service.handle(request), loop)
        try:
            reply = future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return 504, {"error": f"no reply within {wait_s:.0f}s", "code": "timeout"}
        except RuntimeError as exc:  # the loop is shutting down
            return 503, {"error": f"the service is stopping: {exc}", "code": "busy"}
        return (CODE_STATUS.get(reply.code, 500) if reply.error else 200), msgspec.to_builtins(reply)

    return json_http_handler(max_message_bytes=limits.max_message_bytes, http_timeout_s=limits.http_timeout_s,
                             queue=service.queue, health=health, post=post, count_error=count_error,
                             what="POST an EnvReset, EnvStep or EnvClose JSON body")


async def _serve(service: EnvService, bind: str, http: str | None, stop: asyncio.Event) -> EnvService:
    ctx = zmq.asyncio.Context()
    sock: zmq.asyncio.Socket | None = None
    server = http_thread = None
    reaper = asyncio.create_task(service.reap(stop))
    try:
        sock = bind_router(ctx, bind, service.limits.max_message_bytes)
        _log(f"listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}")
        if http:
            server, http_thread = start_http(http, _http_handler(service, asyncio.get_running_loop()),
                                             service.limits.max_queued, "env-http")
            _log(f"listening on http://{server.server_address[0]}:{server.server_address[1]}")
        _log(f"ready (env={service.name}, step_timeout_s={service.limits.step_timeout_s})")
        await serve_router(service, sock, stop, _log)
    finally:
        stop.set()
        await reaper
        stop_http(server, http_thread)
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
        await service.close_all()
    return service


def serve_env(env_spec: str, bind: str = "tcp://127.0.0.1:0", http: str | None = None,
              env_kwargs: dict | None = None, limits: EnvServiceLimits | None = None) -> None:
    """Serve ``env_spec`` until SIGTERM / SIGINT (blocking). ValueError for a bad spec, kwargs, address or limit."""
    limits = limits or EnvServiceLimits()
    limits.check()
    check_bind(bind, 5557)
    if http:
        parse_http(http)
    try:
        factory = load_environment(env_spec, **(env_kwargs or {}))
    except ValueError as exc:  # EnvSpecError: unknown name, bad module:Class, kwargs the class does not take
        raise ValueError(f"--env {env_spec!r}: {exc}") from None
    service = EnvService(factory, env_spec, limits)
    service, reason = run_until_signal(lambda stop: _serve(service, bind, http, stop))
    _log(f"stopped on {reason}: {service.n_requests} requests, {service.n_resets} resets, {service.n_steps} steps, "
         f"{service.n_cached} from cache, {service.n_errors} errors, {service.n_timeouts} timed out, "
         f"{service.n_unknown} unknown episodes, {service.n_reaped} idle episodes closed")


def _parse_kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--env-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--env-kwargs must be a JSON object (the config's env.kwargs), got {type(value).__name__}")
    return value


def serve_env_main(argv: list[str]) -> int:
    """Entry of ``streamrft serve-env``; returns the exit status."""
    d = EnvServiceLimits()
    parser = argparse.ArgumentParser(prog="streamrft serve-env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, help="registered environment name or module:Class")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address; port 0 = any free port")
    parser.add_argument("--http", default=None, help="also serve JSON over HTTP on host:port")
    parser.add_argument("--env-kwargs", default="{}", help="JSON object passed to the environment class")
    parser.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                        help="largest request frame or HTTP body")
    parser.add_argument("--max-queued", type=int, default=d.max_queued,
                        help="requests waiting or being stepped before new ones get a busy reply")
    parser.add_argument("--max-queued-bytes", type=int, default=d.max_queued_bytes,
                        help="bytes of requests waiting or being stepped before new ones get a busy reply")
    parser.add_argument("--step-timeout-s", type=float, default=d.step_timeout_s,
                        help="a reset, step or close call of the environment not done within this fails its episode")
    parser.add_argument("--max-episodes", type=int, default=d.max_episodes, help="episodes open at once")
    parser.add_argument("--episode-idle-s", type=float, default=d.episode_idle_s,
                        help="an episode without a request for this long is closed")
    parser.add_argument("--http-timeout-s", type=float, default=d.http_timeout_s,
                        help="an HTTP client must send its request within this")
    args = parser.parse_args(argv)
    limits = EnvServiceLimits(
        max_message_bytes=args.max_message_bytes, max_queued=args.max_queued, max_queued_bytes=args.max_queued_bytes,
        step_timeout_s=args.step_timeout_s, max_episodes=args.max_episodes, episode_idle_s=args.episode_idle_s,
        http_timeout_s=args.http_timeout_s,
    )
    try:
        serve_env(args.env, args.bind, args.http, _parse_kwargs(args.env_kwargs), limits)
    except (ValueError, zmq.ZMQError, OSError) as exc:  # EnvSpecError is a ValueError
        print(f"serve-env: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(serve_env_main(sys.argv[1:]))
