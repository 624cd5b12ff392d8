"""Client of a remote reward service: the reward source of type "remote".

Two transports, one behaviour:

* ``tcp://host:port``: a ZeroMQ DEALER speaking protocols.RewardRequest / RewardReply (msgpack).
* ``http://host:port[/path]``: a JSON POST of ``{"request_id", "queries", "prompts", "references",
  "labels"}`` answered by ``{"rewards": [...]}`` (``null`` = that sample failed) or ``{"error": "..."}``;
  ``queries`` are prompt + response, as the service's HTTP mode expects. Runs urllib in the client's own bounded daemon threads.
  With ``protocol="openrlhf"`` (``reward.sources[].protocol``) the body is OpenRLHF's remote-RM request
  ``{"query": [prompt + response], "prompts": [...], "labels": [references]}`` and the rewards are read
  from ``rewards`` (or ``scores`` when a server sends only that); it carries no request id, so a retry
  may be scored twice by the server.

Each call of :meth:`RemoteRewardClient.score` is one request with one id, stable across its retries,
so the service (which caches replies by id) scores a batch once even when a reply is lost and the
request is sent again. Within one service lifetime a retried id is answered from the cache; across a
service restart the cache is gone and the batch is scored again (at-least-once scoring, exactly one
result per item on this side).

ZeroMQ details (streamrft.dealer.DealerPool): every in-flight request owns a DEALER socket from a small
pool (at most ``max_concurrency`` sockets). A socket whose request timed out is closed (``linger=0``)
and replaced, so a late reply to it is dropped with the socket and can never be read as the answer to
a later request; a reply whose id is not the one awaited is discarded and counted in ``n_discarded``.
Deterministic failures (an error reply, a malformed reply, a version mismatch, a wrong number of
rewards) are not retried: sending the same request again would give the same answer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import urllib.error
import urllib.request
import uuid
from typing import Sequence

import msgspec
import zmq

from protocols import ProtocolError, ProtocolVersionError, RewardItem, RewardReply, RewardRequest, decode, encode
from streamrft.dealer import DealerPool
from streamrft.rewards.bounded import BoundedExecutor
from protocols.base import check_frame


PROTOCOLS = ("streamrft", "openrlhf")


def _openrlhf_body(items: Sequence[RewardItem]) -> dict:
    """OpenRLHF's remote-RM request (openrlhf/utils/remote_rm_utils.py): ``query`` prompt + response
    texts, ``prompts``, ``labels`` = gold answers (our references, not our task labels)."""
    return {
        "query": [it.prompt + it.response for it in items],
        "prompts": [it.prompt for it in items],
        "labels": [it.reference for it in items],
    }


def _reward_key(answer: dict, protocol: str) -> str:
    """Where the rewards are in a reply: ``rewards``; an OpenRLHF server may answer ``scores`` only
    (OpenRLHF reads ``rewards`` for advantages and ``scores`` for filtering; older servers sent one)."""
    if protocol == "openrlhf" and "rewards" not in answer and "scores" in answer:
        return "scores"
    if "rewards" not in answer:
        expected = "'rewards' (or 'scores')" if protocol == "openrlhf" else "'rewards'"
        raise ValueError(f"no {expected} in the reply; its keys: {', '.join(map(str, answer))[:200] or 'none'}")
    return "rewards"


class RemoteRewardError(RuntimeError):
    """A request to a remote reward service that ended without usable rewards; names service and cause."""


class _IdProbe(msgspec.Struct, forbid_unknown_fields=False):
    request_id: str = ""


def peek_request_id(data: bytes) -> str:
    """The request_id of a frame that may not decode as our protocol version ("" when unreadable)."""
    try:
        check_frame(data, max_bytes=len(data))  # depth first: msgspec skips unknown fields recursively
        return msgspec.msgpack.decode(data, type=_IdProbe).request_id
    except Exception:  # ProtocolError, DecodeError, ValidationError: whatever the bytes, no id
        return ""


class _Retryable(Exception):
    """An attempt that may succeed if sent again (timeout, connection refused)."""


class RemoteRewardClient:
    """Scores batches on a remote reward service with timeouts, same-id retries and bounded concurrency.

    Counters (read them for metrics): ``n_requests`` batches asked, ``n_timeouts`` attempts that got
    no reply in time, ``n_retries`` attempts sent again, ``n_failed`` batches that ended in an error,
    ``n_discarded`` replies dropped because their id was not the one awaited, ``peak_in_flight`` the
    most requests ever in flight at once (never above ``max_concurrency``).
    """

    def __init__(self, address: str, timeout_s: float = 30.0, max_concurrency: int = 16, retries: int = 3,
                 protocol: str = "streamrft") -> None:
        if not address.startswith(("tcp://", "http://", "https://")):
            raise ValueError(f"remote reward address {address!r} must start with tcp://, http:// or https://")
        if protocol not in PROTOCOLS:
            raise ValueError(f"remote reward client for {address}: protocol={protocol!r} is not one of {PROTOCOLS}")
        if protocol != "streamrft" and address.startswith("tcp://"):
            raise ValueError(f"remote reward client for {address}: protocol={protocol!r} is an HTTP JSON body; "
                             "give an http:// address")
        if timeout_s <= 0 or max_concurrency < 1 or retries < 0:
            raise ValueError(
                f"remote reward client for {address}: timeout_s={timeout_s} must be > 0, "
                f"max_concurrency={max_concurrency} >= 1, retries={retries} >= 0"
            )
        self.address = address
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.n_requests = 0
        self.n_timeouts = 0
        self.n_retries = 0
        self.n_failed = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._ids = itertools.count()
        self._client_id = uuid.uuid4().hex[:12]  # makes ids unique across clients of one service
        self._slots = asyncio.Semaphore(max_concurrency)
        self._is_zmq = address.startswith("tcp://")
        self._dealers = DealerPool(address) if self._is_zmq else None
        # HTTP: urllib blocks, so posts run in this client's own daemon threads, never in the loop's
        # default executor that the hf engine's forwards use (a stalled service must not stall them).
        self._http_threads = None if self._is_zmq else BoundedExecutor(f"reward-http-{address}", max_concurrency)
        self._closed = False

    @property
    def n_discarded(self) -> int:
        return self._dealers.n_discarded if self._dealers is not None else 0

    @property
    def deadline_s(self) -> float:
        """Longest a score() call can take: every attempt timing out, plus the back-off between them."""
        return (self.retries + 1) * (self.timeout_s + 1.0) + 1.0

    async def score(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        """One reward per item, or the exception that explains why there is none (never raises for
        a service failure)."""
        try:
            rewards = await self.score_batch(items)
        except RemoteRewardError as exc:
            return [exc] * len(items)
        out: list[float | Exception] = []
        for item, value in zip(items, rewards):
            if value is None or not math.isfinite(value):
                out.append(RemoteRewardError(
                    f"remote reward service {self.address} gave no finite reward for sample "
                    f"{item.sample_id!r} ({value}); its log names the exception"
                ))
            else:
                out.append(float(value))
        return out

    async def score_batch(self, items: Sequence[RewardItem]) -> list[float | None]:
        """Rewards for ``items`` in order (None/NaN = that sample failed remotely); raises RemoteRewardError."""
        if self._closed:
            raise RemoteRewardError(f"remote reward client for {self.address} is closed")
        request_id = f"{self._client_id}-{next(self._ids)}"
        self.n_requests += 1
        async with self._slots:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                return await self._with_retries(request_id, list(items))
            except RemoteRewardError:
                self.n_failed += 1
                raise
            finally:
                self.in_flight -= 1

    async def _with_retries(self, request_id: str, items: list[RewardItem]) -> list[float | None]:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.n_retries += 1
            try:
                if self._is_zmq:
                    rewards = await self._attempt_zmq(request_id, items)
                else:
                    rewards = await self._attempt_http(request_id, items)
            except _Retryable as exc:
                last = str(exc)
                if not self._is_zmq and attempt < self.retries:
                    await asyncio.sleep(min(1.0, 0.1 * 2**attempt))  # refused connection: let it come up
                continue
            if len(rewards) != len(items):
                raise RemoteRewardError(
                    f"remote reward service {self.address} answered request {request_id} with "
                    f"{len(rewards)} rewards for {len(items)} samples"
                )
            return rewards
        hint = ""
        if self._is_zmq and last.startswith("no reply"):  # ZeroMQ cannot tell "nobody listens" from "slow"
            hint = "; is `streamrft serve-reward` running at that address, and does it finish within reward.timeout_s?"
        attempts = self.retries + 1
        raise RemoteRewardError(
            f"remote reward service {self.address}: request {request_id} failed after {attempts} "
            f"attempt{'s' if attempts > 1 else ''} (reward.timeout_s={self.timeout_s:g}, reward.retries={self.retries}); "
            f"last: {last}{hint}"
        )

    # --- ZeroMQ ---------------------------------------------------------------------------------

    async def _attempt_zmq(self, request_id: str, items: list[RewardItem]) -> list[float | None]:
        assert self._dealers is not None
        try:
            data = await self._dealers.request(encode(RewardRequest(request_id=request_id, items=items)),
                                               self.timeout_s, lambda d: peek_request_id(d) in ("", request_id))
        except zmq.ZMQError as exc:  # the socket was closed under us (client closed) or broke
            raise RemoteRewardError(f"remote reward service {self.address}: socket error: {exc}") from None
        if data is None:
            self.n_timeouts += 1
            raise _Retryable(f"no reply within {self.timeout_s}s")
        return list(self._decode_reply(data, request_id).rewards)

    def _decode_reply(self, data: bytes, request_id: str) -> RewardReply:
        try:
            reply = decode(data, RewardReply)
        except ProtocolVersionError as exc:
            raise RemoteRewardError(f"remote reward service {self.address}: {exc}") from None
        except ProtocolError as exc:
            raise RemoteRewardError(
                f"remote reward service {self.address}: malformed reply to request {request_id}: {exc}"
            ) from None
        if reply.error:
            raise RemoteRewardError(f"remote reward service {self.address} failed request {request_id}: {reply.error}")
        return reply

    # --- HTTP -----------------------------------------------------------------------------------

    async def _attempt_http(self, request_id: str, items: list[RewardItem]) -> list[float | None]:
        payload = _openrlhf_body(items) if self.protocol == "openrlhf" else {
            "request_id": request_id,
            "queries": [it.prompt + it.response for it in items],
            "prompts": [it.prompt for it in items],
            "references": [it.reference for it in items],
            "labels": [it.label for it in items],
        }
        if self.protocol == "streamrft" and any(it.images for it in items):  # a list of base64 images per sample
            payload["images"] = [list(it.images) for it in items]
        body = json.dumps(payload).encode()
        try:
            # The outer guard covers a thread stuck past urllib's own socket timeout.
            return await asyncio.wait_for(self._http_threads.run(self._post, body, request_id), self.timeout_s + 1.0)
        except asyncio.TimeoutError:
            self.n_timeouts += 1
            raise _Retryable(f"no reply within {self.timeout_s}s") from None

    def _post(self, body: bytes, request_id: str) -> list[float | None]:
        req = urllib.request.Request(self.address, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:  # the service answered with an error status: deterministic
            detail = exc.read().decode(errors="replace")[:500]
            raise RemoteRewardError(
                f"remote reward service {self.address} failed request {request_id}: HTTP {exc.code} {detail}"
            ) from None
        except (TimeoutError, socket.timeout):
            self.n_timeouts += 1
            raise _Retryable(f"no reply within {self.timeout_s}s") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                self.n_timeouts += 1
            raise _Retryable(f"cannot reach {self.address}: {reason}") from None
        try:
            answer = json.loads(raw)
            if not isinstance(answer, dict):
                raise TypeError(f"the reply is a {type(answer).__name__}, not a JSON object")
            rewards = answer[_reward_key(answer, self.protocol)]
            if not isinstance(rewards, list) or not all(r is None or isinstance(r, (int, float)) for r in rewards):
                raise TypeError(f"'rewards' must be a list of numbers or null, got {str(rewards)[:200]}")
            values = [None if r is None else float(r) for r in rewards]
        except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as exc:  # nested too deep, 10**400
            raise RemoteRewardError(
                f"remote reward service {self.address}: malformed reply to request {request_id}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return values

    async def close(self) -> None:
        """Close every socket (linger 0) and the ZeroMQ context; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._http_threads is not None:
            self._http_threads.close()  # never joins a post still waiting on a stalled service
        if self._dealers is not None:
            self._dealers.close()
