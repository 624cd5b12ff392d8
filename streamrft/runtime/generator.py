"""The Generator stage: admits prompt groups, samples them with the engine, streams completions on.

It lives for the whole run: it plans step after step and admits each step's groups through the
AdmissionGate (groups in flight, staleness bound, open while the engine may generate), while a
companion task consumes the AdvantageStage's ``group_done`` feedback as it comes (refills, the step's
``end_of_step``), so no setting of ``rollout.channel_capacity`` or ``prompts_per_step`` can deadlock it.

Each rank takes its slice of the step's global prompts. A group's samples are seeded by
(run seed, step, global prompt index, sample index), so rollouts do not depend on the number of ranks.
With dynamic sampling (DAPO), groups the AdvantageStage filters out are replaced by refill prompts
until this rank's quota of kept groups is met or ``algorithm.max_extra_prompts`` is spent.

Media rows (``data.image_field`` / ``video_field`` / ``audio_field`` set): the row's media become
``MediaRef``s on the PromptGroup / Completion (by reference, never pixels), the prompt ids are the
processor's (with the expanded placeholders), and the engine gets the decoded processor inputs as
``mm_inputs``. A row whose media is missing or corrupt fails its ``n_samples`` samples (counted under
``media_error`` with the message naming file, row and field) and the run goes on, or stops under
``fail_fast``. With no media field the text path is exactly as before.

Multi-turn episodes (``env.name`` set; docs/agents.md): each sample is an episode driven by
``streamrft.envs.episode.run_episode`` (model turn, ``env.step``, observation rendered with the chat
template, ...); the Completion carries every turn after the prompt as one sequence with a ``loss_mask``
frame and the turn metadata. The environment's optional reset text is appended to the prompt (a user
message for message-list prompts, plain text otherwise), so it is never trained. An environment that
raises fails its sample (counted under ``env_error``, named) and the run goes on, or stops under
``fail_fast``; its ``close()`` always runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from protocols import Completion, Control, PromptGroup
from streamrft.data import DataError, EpochOrder, PromptDataset
from streamrft.data.chat import has_media_parts, prompt_ids
from streamrft.engines.base import GenerationRequest
from streamrft.engines.sampling import sample_seed
from streamrft.rewards.conventions import reward_columns
from streamrft.runtime.gate import AdmissionGate
from streamrft.runtime.stage import Stage, StageContext, StageError

# Refill prompts come from a second order over the dataset, so they never shift the main order.
_REFILL_SEED_OFFSET = 7919
log = logging.getLogger("streamrft")


def vector(values: list, dtype: type) -> torch.Tensor:
    """A 1-D tensor of a Python list through numpy: torch.tensor converts a list element by element, ~4x slower
    for a 512-token response (three per sample, on the event loop, after the decode: v16 in benchmarks/NOTES.md)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


@dataclass
class StepPlan:
    step: int
    positions: list[int]  # global prompt positions this rank owns for the step
    quota: int  # groups this rank must deliver (kept) for the step


@dataclass
class _StepState:
    """A step's groups while they are generated, scored and resolved."""

    quota: int
    pending: set[str] = field(default_factory=set)  # group ids admitted and not yet resolved
    kept: int = 0
    filtered_in_wave: int = 0  # filtered since the last refill decision
    all_admitted: bool = False  # every planned group has been admitted
    ended: bool = False  # end_of_step sent
    deferred: bool = False  # a refill is due but the gate was closed


class Generator(Stage):
    name = "generator"

    def __init__(self, ctx: StageContext, feedback_inbox, outbox, engine, tokenizer, dataset: PromptDataset, cfg, world_size: int,
                 gate: AdmissionGate, start_step: int = 0):
        super().__init__(ctx, feedback_inbox)
        self.gate = gate
        self.start_step = start_step  # first step to plan (a resumed run starts after its checkpoint)
        self.steps: dict[int, _StepState] = {}
        self.generating: set[asyncio.Task] = set()  # generate calls in flight
        self._idle: asyncio.Future | None = None
        self._failure: asyncio.Future | None = None
        self._send_lock: asyncio.Lock | None = None
        # wall-clock intervals with a generate call running (async placement: the overlap report)
        self.busy: list[tuple[float, float]] = []
        self._busy_since: float | None = None
        self.outbox = outbox
        self.engine = engine
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.cfg = cfg
        self.world_size = world_size
        self.order = EpochOrder(len(dataset), cfg.seed, cfg.data.shuffle)
        self.refill_order = EpochOrder(len(dataset), cfg.seed + _REFILL_SEED_OFFSET, cfg.data.shuffle)
        self.refills_used = 0  # run-wide counter, strided by rank for distinct refill prompts
        self.generated_tokens = 0
        self.media = None  # MediaCodec when the data has media fields; None = text-only
        self.mm_inputs: dict[str, dict] = {}  # group_id -> decoded processor inputs (in flight only)
        # media from data.*_field, or from image / video / audio parts of message prompts (Qwen2-VL / -Audio format)
        if cfg.data.image_field or cfg.data.video_field or cfg.data.audio_field or any(
                has_media_parts(r.prompt) for r in dataset.rows):
            self._init_media()
        self.env_factory = None  # a fresh Environment per episode; None = single-turn samples
        self.prompts: dict[str, object] = {}  # group_id -> the row's prompt (text or messages), in flight only
        if cfg.env.name:
            self._init_env()

    def _init_env(self) -> None:
        from streamrft.envs.episode import environment_factory, max_positions
        from streamrft.envs.render import ObservationRenderer

        self.env_factory = environment_factory(self.cfg.env, self.ctx.rank)  # in process, or a serve-env client
        self.renderer = ObservationRenderer(self.tokenizer, self.cfg.data.chat_template)
        self.context_limit = max_positions(self.cfg.model.path)  # episodes are cut ("length") before it

    def _init_media(self) -> None:
        from streamrft.models.media_inputs import MediaCodec, load_processor

        if not self.engine.supports_media:
            raise ValueError(f"engine.type={self.cfg.engine.type!r} cannot take media prompts yet; "
                             "use engine.type=hf for rows with data.image_field / video_field / audio_field")
        self.media = MediaCodec.from_config(load_processor(self.cfg.model.path), self.cfg.data, message_media=True)

    def state_dict(self) -> dict:
        """What a checkpoint needs beyond (seed, step): the run-wide refill counter."""
        return {"refills_used": self.refills_used}

    def load_state_dict(self, state: dict) -> None:
        self.refills_used = state["refills_used"]

    def plan(self, step: int) -> StepPlan:
        per_step = self.cfg.rollout.prompts_per_step
        local = per_step // self.world_size
        start = step * per_step + self.ctx.rank * local
        return StepPlan(step=step, positions=list(range(start, start + local)), quota=local)

    def _group(self, step: int, position: int, refill: int | None) -> tuple[PromptGroup, torch.Tensor]:
        order = self.order if refill is None else self.refill_order
        row = self.dataset[order.row_at(position)]
        refs, inputs = [], None
        d, loc = self.cfg.data, f"{self.dataset.path}: row {row.row} field {self.cfg.data.prompt_field!r}"
        if self.media is not None:  # raises MediaError (file, row, field) for missing / corrupt media
            # a text prompt with data.*_field media, or messages with media parts rendered by the chat template
            field = getattr(self.dataset, "fields", {}).get("prompt", d.prompt_field)
            prompt_text, refs, inputs = self.media.prompt(row, self.dataset.path, field, d.chat_template, d.system_prompt)
            ids = inputs["input_ids"][0].tolist()
        else:  # text as-is, or messages through the chat template (streamrft.data.chat, shared with evaluation)
            prompt_text, ids = prompt_ids(self.tokenizer, row.prompt, d.chat_template, d.system_prompt, loc)
        if len(ids) > self.cfg.data.max_prompt_tokens:
            raise DataError(
                f"{self.dataset.path}: row {row.row} field {self.cfg.data.prompt_field!r} has {len(ids)} tokens, "
                f"more than data.max_prompt_tokens={self.cfg.data.max_prompt_tokens}"
            )
        suffix = "" if refill is None else f"-r{refill}"
        # Refill prompt indices live above any main-order index so seeds never collide.
        prompt_index = position if refill is None else (1 << 40) + position
        group = PromptGroup(
            group_id=f"s{step}-p{position}{suffix}",
            step=step,
            prompt_index=prompt_index,
            prompt_text=prompt_text,
            reference=row.reference,
            label=row.label,
            n_samples=self.cfg.rollout.n_samples_per_prompt,
            prompt_len=len(ids),
            data_row=row.row,
            media=refs,
            columns=reward_columns(row.extra, row.prompt),  # TRL columns (+ messages), verl extra_info
        )
        if inputs is not None:
            self.mm_inputs[group.group_id] = inputs
        if self.env_factory is not None:
            self.prompts[group.group_id] = row.prompt
        return group, torch.tensor(ids, dtype=torch.int64)

    def _admit(self, step: int, position: int, refill: int | None):
        """``_group``, or None after failing the group's samples when its row cannot be used (media
        that cannot be read, a prompt over data.max_prompt_tokens): counted, named, the run goes on."""
        from streamrft.data.media import MediaError

        try:
            return self._group(step, position, refill)
        except (MediaError, DataError) as exc:
            if self.ctx.fail_fast:
                raise
            kind = "media_error" if isinstance(exc, MediaError) else "data_error"
            n = self.cfg.rollout.n_samples_per_prompt
            self.ctx.accounting.admit(n, step=step)
            self.ctx.accounting.fail(f"{kind}: {exc}", n, step=step)
            log.warning("generator rank %d: %d samples failed: %s", self.ctx.rank, n, exc)
            return None

    # ------------------------------------------------------------------ the long-lived loop

    async def run(self) -> None:
        """Admit groups step after step, through the gate, until ``train.max_steps``; consume
        ``group_done`` feedback concurrently (refills, step ends). Runs for the whole run."""
        self._send_lock = asyncio.Lock()
        feedback = asyncio.create_task(self._consume_feedback(), name=f"generator-feedback-rank{self.ctx.rank}")
        self._failure = asyncio.get_running_loop().create_future()
        feedback.add_done_callback(self._on_task_done)
        try:
            step = self.start_step
            while step < self.cfg.train.max_steps:
                await self._admit_step(step)
                step += 1
            await self._failure  # nothing more to admit: wait for a failure or cancellation
        finally:
            feedback.cancel()
            for task in list(self.generating):
                task.cancel()
            if self._failure.done() and not self._failure.cancelled():
                self._failure.exception()  # retrieved: the pipeline reports this stage's failure (or it is shutdown's ChannelClosed)
            # Nothing waits on it from here: a task that ends later (the feedback task, with the ChannelClosed of
            # the sockets that stop() closes) must not set an exception that nobody retrieves.
            self._failure.cancel()
            client = getattr(self.env_factory, "client", None)  # a serve-env client: its sockets and threads
            if client is not None:
                await client.close()

    def _on_task_done(self, task: asyncio.Task) -> None:
        self.generating.discard(task)
        if not self.generating and self._busy_since is not None:
            self.busy.append((self._busy_since, time.time()))
            self._busy_since = None
        if not task.cancelled() and task.exception() is not None and not self._failure.done():
            self._failure.set_exception(task.exception())
        if not self.generating and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _raise_failure(self) -> None:
        if self._failure is not None and self._failure.done() and not self._failure.cancelled():
            raise self._failure.exception()

    async def _admit_step(self, step: int) -> None:
        plan = self.plan(step)
        state = _StepState(quota=plan.quota)
        self.steps[step] = state
        positions = list(plan.positions)
        while positions:
            room = await self._wait_gate(step)
            batch, positions = positions[:room], positions[room:]
            self._launch(state, step, [(pos, None) for pos in batch])
        state.all_admitted = True
        await self._maybe_end(step)

    async def _wait_gate(self, step: int) -> int:
        """The gate, watched together with the generator's own tasks (a failure ends the wait)."""
        wait = asyncio.ensure_future(self.gate.wait_admissible(step))
        try:
            await asyncio.wait({wait, self._failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not wait.done():
                wait.cancel()
        self._raise_failure()
        return wait.result()

    def _launch(self, state: "_StepState", step: int, picks: list[tuple[int, int | None]]) -> None:
        """Admit groups (position, refill index or None) of ``step`` and start generating them."""
        groups = [g for g in (self._admit(step, pos, refill) for pos, refill in picks) if g is not None]
        if not groups:
            return
        for group, _ in groups:
            state.pending.add(group.group_id)
            self.ctx.accounting.admit(group.n_samples, step=step)
        self.gate.admit(len(groups))
        if not self.generating:
            self._busy_since = time.time()
        task = asyncio.create_task(self._generate(groups), name=f"generator-batch-rank{self.ctx.rank}")
        self.generating.add(task)
        task.add_done_callback(self._on_task_done)

    async def _consume_feedback(self) -> None:
        while True:
            header, _ = await self.recv()
            if not isinstance(header, Control) or header.signal != "group_done":
                raise RuntimeError(f"generator rank {self.ctx.rank}: unexpected feedback {header!r}")
            state = self.steps[header.step]
            state.pending.discard(header.group_id)
            await self.gate.release(1)
            if header.reason == "kept":
                state.kept += 1
            else:
                state.filtered_in_wave += 1
            await self._maybe_end(header.step)

    def _refill(self, state: "_StepState", step: int) -> bool:
        """DAPO dynamic sampling: once a wave of groups is resolved and some were filtered, admit refill
        prompts for the step's shortfall of kept groups (as one wave, like the step loop did; refills
        belong to a step already admitted, so they bypass the staleness bound). True if any started."""
        algo = self.cfg.algorithm
        deficit = state.quota - state.kept
        if not (algo.dynamic_sampling and state.filtered_in_wave and deficit > 0):
            state.filtered_in_wave = 0
            return False
        if not self.gate.open:  # the learner has the devices: refill once the gate reopens (``reopened``)
            state.deferred = True
            return True
        state.filtered_in_wave = 0
        picks = []
        for _ in range(max(min(deficit, algo.max_extra_prompts - self.refills_used), 0)):
            picks.append((self.refills_used * self.world_size + self.ctx.rank, self.refills_used))
            self.refills_used += 1
            self.ctx.accounting.refilled_prompts += 1
        self._launch(state, step, picks)
        return bool(state.pending)

    async def _maybe_end(self, step: int) -> None:
        """Every group of ``step`` is resolved and no refill is coming: end_of_step follows the step's
        last sample downstream (group_done is sent after the group's samples, on the same path)."""
        state = self.steps.get(step)
        if state is None or state.ended or not state.all_admitted or state.pending:
            return
        if self._refill(state, step):
            return
        state.ended = True
        async with self._send_lock:
            await self.outbox.send(Control(signal="end_of_step", step=step), timeout=self.ctx.stage_timeout_s)

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait until no generate call is running (colocated: before the learner takes the devices)."""
        if not self.generating:
            return
        self._idle = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait({self._idle, self._failure}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise StageError(f"stage generator on rank {self.ctx.rank}: generation still running after "
                             f"{timeout_s:.0f}s when the learner needed the devices (rollout.stage_timeout_s)") from None
        self._raise_failure()

    async def reopened(self) -> None:
        """The gate is open again: start the refills deferred while it was closed."""
        for step in sorted(s for s, state in self.steps.items() if state.deferred):
            self.steps[step].deferred = False
            await self._maybe_end(step)

    def forget_through(self, step: int) -> None:
        """Drop the bookkeeping of steps up to ``step`` (trained)."""
        for s in [s for s in self.steps if s <= step]:
            del self.steps[s]

    def _completion(self, group: PromptGroup, j: int, sid: str, response_ids: list[int] | torch.Tensor, finish_reason: str,
                    policy_version: int, seconds: float, prompt_len: int, **episode) -> Completion:
        return Completion(
            sample_id=sid,
            group_id=group.group_id,
            step=group.step,
            prompt_index=group.prompt_index,
            sample_index=j,
            prompt_text=episode.pop("prompt_text", group.prompt_text),
            response_text=self.tokenizer.decode(response_ids, skip_special_tokens=True),
            reference=group.reference,
            label=group.label,
            n_samples=group.n_samples,
            finish_reason=finish_reason,
            policy_version=policy_version,
            prompt_len=prompt_len,
            response_len=len(response_ids),
            generate_seconds=seconds,
            media=group.media,
            columns=group.columns,
            **episode,
        )

    async def _send(self, header: Completion, frames: dict) -> None:
        async with self._send_lock:
            await self.outbox.send(header, frames, timeout=self.ctx.stage_timeout_s)

    async def _generate(self, groups: list[tuple[PromptGroup, torch.Tensor]]) -> None:
        if self.env_factory is not None:
            return await self._generate_episodes(groups)
        requests, meta, mm = [], {}, {}
        for group, ids in groups:
            for j in range(group.n_samples):
                sid = f"{group.group_id}-{j}"
                seed = sample_seed(self.cfg.seed, group.step, group.prompt_index, j)
                requests.append(GenerationRequest(request_id=sid, prompt_ids=ids.tolist(), seed=seed))
                meta[sid] = (group, ids, j)
                if group.group_id in self.mm_inputs:
                    mm[sid] = self.mm_inputs[group.group_id]
        for group, _ in groups:
            self.mm_inputs.pop(group.group_id, None)
        started = time.perf_counter()
        stream = self.engine.generate(requests, mm_inputs=mm or None)
        async for out in stream:
            group, ids, j = meta.pop(out.request_id)
            response = vector(out.response_ids, np.int64)
            logprobs = vector(out.logprobs, np.float32)
            versions = (vector(out.token_versions, np.int64) if out.token_versions
                        else torch.full((len(response),), out.policy_version, dtype=torch.int64))
            self.generated_tokens += len(response)
            # the tensor, not the list: the tokenizer's list check walks every id (~40 % of a 512-token decode)
            header = self._completion(group, j, out.request_id, response, out.finish_reason,
                                      out.policy_version, out.seconds, group.prompt_len)
            await self._send(header, {"prompt_ids": ids, "response_ids": response, "behaviour_logprobs": logprobs,
                                      "token_versions": versions})
        if meta:
            raise RuntimeError(f"generator rank {self.ctx.rank}: engine returned no output for {sorted(meta)[:3]}...")
        if self.ctx.metrics is not None:
            self.ctx.metrics.stage_latency.labels(stage=self.name).observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ multi-turn episodes

    async def _episode(self, group: PromptGroup, ids: torch.Tensor, prompt, j: int, batcher) -> None:
        """One sample as an episode; an environment that raises fails the sample (``env_error``, counted by the
        AdvantageStage like any failed sample), not the run."""
        from streamrft.envs.episode import EngineTurnError, env_call, prompt_with_reset_text, run_episode

        e, sid = self.cfg.env, f"{group.group_id}-{j}"
        env = None
        try:
            env = self.env_factory()
            row = {**group.columns, "prompt": prompt, "reference": group.reference, "label": group.label,
                   "data_row": group.data_row, "sample_id": sid}
            bound = self.ctx.stage_timeout_s  # every environment call is bounded, like any wait of a stage
            greeting = await env_call(env.reset(row), f"{type(env).__name__}.reset", bound)
            d = self.cfg.data
            prompt_text, p_ids = prompt_with_reset_text(self.tokenizer, prompt, group.prompt_text, ids.tolist(), greeting,
                                                        d.chat_template, d.system_prompt,
                                                        f"{self.dataset.path}: row {group.data_row}")
            ep = await run_episode(env, batcher, self.renderer, p_ids, sid,
                                   (self.cfg.seed, group.step, group.prompt_index, j), e.max_turns, e.max_tokens,
                                   self.cfg.engine.max_new_tokens, self.context_limit, bound)
        except (asyncio.CancelledError, StageError):
            raise
        except EngineTurnError as exc:
            raise StageError(f"stage generator on rank {self.ctx.rank}: {exc}") from exc
        except Exception as exc:
            if self.ctx.fail_fast:
                raise StageError(f"stage generator on rank {self.ctx.rank}: sample {sid}: environment "
                                 f"{e.name!r} failed: {type(exc).__name__}: {exc} (fail_fast: true)") from exc
            log.warning("generator rank %d: sample %s failed in environment %r: %s: %s", self.ctx.rank, sid,
                        e.name, type(exc).__name__, exc)
            # sent on as a failed sample (Completion.error), so its group completes and it is counted once, downstream
            empty = torch.zeros(0, dtype=torch.int64)
            # a serve-env client's failure carries its reason (env_unreachable, env_lost, env_timeout): the label
            reason = getattr(exc, "reason", "env_error")
            header = self._completion(group, j, sid, [], "error", self.engine.policy_version, 0.0, group.prompt_len,
                                      error=f"{reason}: environment {e.name!r}: {type(exc).__name__}: {exc}")
            await self._send(header, {"prompt_ids": ids, "response_ids": empty,
                                      "behaviour_logprobs": torch.zeros(0, dtype=torch.float32), "token_versions": empty})
            return
        finally:
            if env is not None:
                try:
                    await env_call(env.close(), f"{type(env).__name__}.close", self.ctx.stage_timeout_s)
                except Exception as exc:  # a failing close must not hide the episode's own outcome
                    log.warning("generator rank %d: environment %r close() of %s raised %s: %s", self.ctx.rank,
                                e.name, sid, type(exc).__name__, exc)
        self.generated_tokens += int(sum(ep.loss_mask))
        if self.ctx.metrics is not None:
            self.ctx.metrics.observe_episode(ep)
        header = self._completion(
            group, j, sid, ep.response_ids, ep.finish_reason, ep.policy_version, ep.seconds, len(p_ids),
            prompt_text=prompt_text, turns=ep.turns, turn_starts=ep.turn_starts, turn_rewards=ep.turn_rewards,
            observation_roles=ep.observation_roles, env_info=ep.info, tool_error_reasons=ep.tool_error_reasons)
        await self._send(header, {
            "prompt_ids": vector(p_ids, np.int64),
            "response_ids": vector(ep.response_ids, np.int64),
            "behaviour_logprobs": vector(ep.logprobs, np.float32),
            "token_versions": vector(ep.token_versions, np.int64),
            "loss_mask": vector(ep.loss_mask, np.uint8),
        })

    async def _generate_episodes(self, groups: list[tuple[PromptGroup, torch.Tensor]]) -> None:
        """Every sample of ``groups`` as a concurrent episode (each sends its own Completion when it ends); their
        model turns share engine calls through one TurnBatcher."""
        from streamrft.envs.episode import TurnBatcher

        started = time.perf_counter()
        batcher = TurnBatcher(self.engine)
        tasks = []

        async def episode(group, ids, prompt, j):
            try:
                await self._episode(group, ids, prompt, j, batcher)
            finally:
                batcher.leave()

        for group, ids in groups:
            prompt = self.prompts.pop(group.group_id, group.prompt_text)
            for j in range(group.n_samples):
                batcher.enter()  # all registered before the first asks for a turn: turn 0 is one call
                tasks.append(asyncio.ensure_future(episode(group, ids, prompt, j)))
        try:
            await asyncio.gather(*tasks)
            await batcher.drain()
        except BaseException:
            for t in tasks:
                t.cancel()
            batcher.close()
            raise
        if self.ctx.metrics is not None:
            self.ctx.metrics.stage_latency.labels(stage=self.name).observe(time.perf_counter() - started)
