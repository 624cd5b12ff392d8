"""One episode: model turns and environment turns alternating, as one token sequence with a loss mask.

    context = prompt ids
    for turn k = 0 .. env.max_turns - 1:
        model turn: engine.generate(context, seed(run seed, step, prompt, sample, k), max_new_tokens =
                    min(engine.max_new_tokens, budget left)); ends on a stop token / EOS or its limit
        step      = await env.step(decoded model turn)
        stop if step.done, the budget (env.max_tokens) is spent, or this was the last allowed turn
        observation ids = ObservationRenderer.ids(step.role, step.observation, stop token sampled)
        context += model ids + observation ids (observation cut to the budget left)

The response is every id after the prompt; ``loss_mask`` is 1 on the model's ids and 0 on observation
ids; behaviour log-probs and token versions exist for model ids (observation positions hold 0 and, for
versions, the version of the model token before them). ``turn_starts[k]`` is the response offset of
model turn k's first id and ``turn_rewards[k]`` the environment's reward for it. An episode cut by the
budget or by max_turns ends with finish_reason "length"; one the environment ends, with the model
turn's own reason ("stop").

Turn 0 is seeded exactly as a single-turn sample (``sample_seed(seed, step, prompt, sample)``), later
turns by ``turn_seed``: a sample's episode does not depend on batch composition or on the number of ranks.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

from streamrft.engines.base import GenerationRequest
from streamrft.engines.sampling import sample_seed
from streamrft.envs.base import OBSERVATION_ROLES, EnvStep

_SEED_MASK = (1 << 63) - 1


def turn_seed(run_seed: int, step: int, prompt_index: int, sample_index: int, turn: int) -> int:
    """Seed of model turn ``turn``: the single-turn sample seed for turn 0, blake2b over the five integers after."""
    if turn == 0:
        return sample_seed(run_seed, step, prompt_index, sample_index)
    digest = hashlib.blake2b(f"{run_seed}:{step}:{prompt_index}:{sample_index}:turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


@dataclass
class Episode:
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 at observation ids
    loss_mask: list[int] = field(default_factory=list)  # 1 = model id (trained), 0 = observation id
    token_versions: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # response offset of each model turn's first id
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward per model turn
    observation_roles: list[str] = field(default_factory=list)  # role of each observation span, in order
    finish_reason: str = "stop"
    policy_version: int = 0  # the version of the episode's first token
    info: dict[str, float] = field(default_factory=dict)  # summed numeric EnvStep.info (tool_calls, ...)
    tool_error_reasons: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.turn_starts)


class TurnBatcher:
    """Gathers the model-turn requests of concurrent episodes into shared ``engine.generate`` calls.

    Episodes run as separate coroutines, and each model turn is one request; sent one by one they would
    decode as batches of one. A request waits here until every unfinished episode has asked for its next
    turn (episodes of one admission move in step when their turns end together) or ``window_s`` has passed
    since the first waiting request (an episode whose turn ended early, or whose environment takes its
    time, holds the others back no longer than that); then the waiting requests go to the engine as one
    call. Each request keeps its own seed, so its tokens do not depend on what it was batched with (the
    same run gives the same losses batched or not).
    """

    def __init__(self, engine, window_s: float = 0.05) -> None:
        self.engine = engine
        self.window_s = window_s
        self.active = 0  # episodes registered and not finished
        self.waiting: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task] = set()  # engine calls in flight (referenced: the loop keeps weak ones)

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        self._maybe_flush()

    async def generate(self, request: GenerationRequest):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((request, future))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._flush)
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        if self.waiting and len(self.waiting) >= self.active:
            self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self.waiting = self.waiting, []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def drain(self) -> None:
        """Wait for the engine calls to end (every episode has its answer; a call may still be closing)."""
        if self._calls:
            await asyncio.gather(*list(self._calls))

    def close(self) -> None:
        """Cancel what is still waiting or decoding (the episodes were cancelled: shutdown or a failure)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, future in self.waiting:
            future.cancel()
        self.waiting = []
        for task in list(self._calls):
            task.cancel()

    async def _run(self, batch) -> None:
        futures = {request.request_id: future for request, future in batch}
        try:
            async for out in self.engine.generate([request for request, _ in batch]):
                future = futures.pop(out.request_id)
                if not future.done():
                    future.set_result(out)
            if futures:
                raise RuntimeError(f"engine returned no output for {sorted(futures)[:3]}")
        except BaseException as exc:  # every request of the call fails with the engine's error
            for future in futures.values():
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise


class EnvTimeoutError(TimeoutError):
    """An environment call (reset, step, close) did not return within its bound."""


async def env_call(awaitable, what: str, timeout_s: float | None):
    """``await awaitable`` within ``timeout_s`` (None: no bound); EnvTimeoutError naming the call otherwise.
    Only a call that awaits can be interrupted: an environment that blocks the event loop stalls it."""
    if timeout_s is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise EnvTimeoutError(f"{what} did not return within {timeout_s:g}s (rollout.stage_timeout_s)") from None


class EngineTurnError(RuntimeError):
    """The engine failed a model turn: not the environment's fault, so the run fails as a single-turn
    generate failure would (the Generator re-raises it), instead of counting samples as env errors."""


def _add_info(episode: Episode, step: EnvStep) -> None:
    reasons = step.info.get("tool_error_reasons")  # every error's reason; else the one tool_error_reason
    if isinstance(reasons, (list, tuple)):
        episode.tool_error_reasons += [str(r) for r in reasons if r]
    elif step.info.get("tool_error_reason"):
        episode.tool_error_reasons.append(str(step.info["tool_error_reason"]))
    for key, value in step.info.items():
        if key in ("tool_error_reason", "tool_error_reasons"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            episode.info[key] = episode.info.get(key, 0.0) + float(value)


async def run_episode(env, engine, renderer, prompt_ids: list[int], request_id: str, seeds: tuple[int, int, int, int],
                      max_turns: int, max_tokens: int, max_new_tokens: int, context_limit: int | None = None,
                      call_timeout_s: float | None = None) -> Episode:
    """Drive ``env`` (already reset) with ``engine`` from ``prompt_ids``; see the module docstring.
    ``seeds`` = (run seed, step, prompt index, sample index). ``engine``: a RolloutEngine, or a
    :class:`TurnBatcher` shared by concurrent episodes (one call per turn of many episodes).
    ``context_limit``: the model's positions (max_position_embeddings); the episode is cut ("length")
    rather than asking the engine for a context it cannot hold. ``call_timeout_s`` bounds each env.step."""
    started = time.perf_counter()
    ep = Episode()
    context = list(prompt_ids)
    for turn in range(max_turns):
        budget = max_tokens - len(ep.response_ids)
        if context_limit is not None:
            budget = min(budget, context_limit - len(context))
        if budget <= 0:  # only reachable through context_limit: the prompt fills the model's positions
            raise ValueError(f"the prompt of {request_id} has {len(context)} tokens, the model holds {context_limit}")
        request = GenerationRequest(request_id=f"{request_id}-t{turn}", prompt_ids=context,
                                    seed=turn_seed(*seeds, turn), max_new_tokens=min(max_new_tokens, budget))
        try:
            if isinstance(engine, TurnBatcher):
                out = await engine.generate(request)
            else:
                (out,) = await engine.generate_all([request])
        except Exception as exc:
            raise EngineTurnError(f"model turn {turn} of {request_id} ({len(context)} context tokens): "
                                  f"{type(exc).__name__}: {exc}") from exc
        if turn == 0:
            ep.policy_version = out.policy_version
        ep.turn_starts.append(len(ep.response_ids))
        ep.response_ids += out.response_ids
        ep.logprobs += list(out.logprobs)
        ep.loss_mask += [1] * len(out.response_ids)
        ep.token_versions += list(out.token_versions or [out.policy_version] * len(out.response_ids))
        ep.finish_reason = out.finish_reason
        text = renderer.tokenizer.decode(out.response_ids, skip_special_tokens=True)
        step = await env_call(env.step(text), f"{type(env).__name__}.step (turn {turn})", call_timeout_s)
        if not isinstance(step, EnvStep):
            raise TypeError(f"environment {type(env).__name__}.step returned {type(step).__name__}, not an EnvStep")
        ep.turn_rewards.append(float(step.reward))
        _add_info(ep, step)
        budget = max_tokens - len(ep.response_ids)
        if context_limit is not None:
            budget = min(budget, context_limit - len(prompt_ids) - len(ep.response_ids))
        if step.done or step.observation is None:
            break
        if turn == max_turns - 1 or budget <= 0:
            ep.finish_reason = "length"  # the episode was cut, not ended by the environment
            break
        if step.role not in OBSERVATION_ROLES:
            raise ValueError(f"environment {type(env).__name__}.step answered role {step.role!r}; expected one of "
                             f"{list(OBSERVATION_ROLES)}")
        obs = renderer.ids(step.role, step.observation, list(prompt_ids) + ep.response_ids)
        if len(obs) >= budget:  # no room left for another model turn after it
            ep.finish_reason = "length"
            break
        ep.observation_roles.append(step.role)
        version = ep.token_versions[-1] if ep.token_versions else out.policy_version
        ep.response_ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.loss_mask += [0] * len(obs)
        ep.token_versions += [version] * len(obs)
        context = list(prompt_ids) + ep.response_ids
    ep.seconds = time.perf_counter() - started
    return ep


def prompt_with_reset_text(tokenizer, prompt, prompt_text: str, prompt_ids_: list[int], reset_text: str | None,
                           chat_template: str, system_prompt: str, loc: str) -> tuple[str, list[int]]:
    """The episode's prompt (text, ids): the row's, or with the environment's reset text appended, as a final
    user message for message-list prompts and as plain text otherwise (never trained either way)."""
    from streamrft.data.chat import prompt_ids

    if not reset_text:
        return prompt_text, list(prompt_ids_)
    if isinstance(prompt, (list, tuple)):
        prompt = [*prompt, {"role": "user", "content": reset_text}]
    else:
        prompt = f"{prompt_text}{reset_text}"
    return prompt_ids(tokenizer, prompt, chat_template, system_prompt, f"{loc} (with the environment's reset text)")


def max_positions(model_path: str) -> int | None:
    """The model's max_position_embeddings from its config.json (None when it has none we can read)."""
    import json
    from pathlib import Path

    from streamrft.models.hub import resolve_model_dir

    try:
        config = json.loads((Path(resolve_model_dir(model_path, "model.path")) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    limit = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return limit if isinstance(limit, int) else None


def environment_factory(env_cfg, rank: int = 0):
    """A fresh Environment per episode for the config's ``env`` section: in process, or a serve-env client."""
    if env_cfg.address:
        from streamrft.envs.remote import remote_environment_factory

        return remote_environment_factory(env_cfg, rank)
    from streamrft.envs.base import load_environment

    return load_environment(env_cfg.name, **env_cfg.kwargs)
