"""The Generator stage: admits prompt groups, samples them with the engine, streams completions on.

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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from protocols import Completion, Control, PromptGroup
from streamrft.data import DataError, EpochOrder, PromptDataset
from streamrft.engines.base import GenerationRequest
from streamrft.engines.sampling import sample_seed
from streamrft.runtime.stage import Stage, StageContext

# Refill prompts come from a second order over the dataset, so they never shift the main order.
_REFILL_SEED_OFFSET = 7919
log = logging.getLogger("streamrft")


@dataclass
class StepPlan:
    step: int
    positions: list[int]  # global prompt positions this rank owns for the step
    quota: int  # groups this rank must deliver (kept) for the step


class Generator(Stage):
    name = "generator"

    def __init__(self, ctx: StageContext, feedback_inbox, outbox, engine, tokenizer, dataset: PromptDataset, cfg, world_size: int):
        super().__init__(ctx, feedback_inbox)
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
        if cfg.data.image_field or cfg.data.video_field or cfg.data.audio_field:
            self._init_media()

    def _init_media(self) -> None:
        import inspect

        from streamrft.models.media_inputs import MediaCodec, load_processor

        if "mm_inputs" not in inspect.signature(self.engine.generate).parameters:
            raise ValueError(f"engine.type={self.cfg.engine.type!r} cannot take media prompts yet; "
                             "use engine.type=hf for rows with data.image_field / video_field / audio_field")
        self.media = MediaCodec.from_config(load_processor(self.cfg.model.path), self.cfg.data)

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
        if self.media is not None:  # raises MediaError (file, row, field) for missing / corrupt media
            refs = self.media.refs(row, self.dataset.path)
            inputs = self.media.inputs(row.prompt, refs, f"{self.dataset.path} row {row.row}")
            ids = inputs["input_ids"][0].tolist()
        else:
            ids = self.tokenizer.encode(row.prompt, add_special_tokens=False)
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
            prompt_text=row.prompt,
            reference=row.reference,
            label=row.label,
            n_samples=self.cfg.rollout.n_samples_per_prompt,
            prompt_len=len(ids),
            data_row=row.row,
            media=refs,
        )
        if inputs is not None:
            self.mm_inputs[group.group_id] = inputs
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
            self.ctx.accounting.admit(n)
            self.ctx.accounting.fail(f"{kind}: {exc}", n)
            log.warning("generator rank %d: %d samples failed: %s", self.ctx.rank, n, exc)
            return None

    async def run_step(self, step: int) -> None:
        """Admit, generate and stream this rank's groups for ``step``; return once every admitted
        group is resolved (kept or filtered) and end_of_step has been sent downstream."""
        plan = self.plan(step)
        algo = self.cfg.algorithm
        batch = [g for g in (self._admit(step, pos, None) for pos in plan.positions) if g is not None]
        kept = 0
        while batch:
            await self._generate(batch)
            pending = {g.group_id for g, _ in batch}
            filtered = 0
            while pending:
                header, _ = await self.recv()
                if not isinstance(header, Control) or header.signal != "group_done":
                    raise RuntimeError(f"generator rank {self.ctx.rank}: unexpected feedback {header!r}")
                pending.discard(header.group_id)
                if header.reason == "kept":
                    kept += 1
                else:
                    filtered += 1
            batch = []
            deficit = plan.quota - kept
            if algo.dynamic_sampling and filtered and deficit > 0:
                n = min(deficit, algo.max_extra_prompts - self.refills_used)
                for _ in range(max(n, 0)):
                    position = self.refills_used * self.world_size + self.ctx.rank
                    admitted = self._admit(step, position, self.refills_used)
                    if admitted is not None:
                        batch.append(admitted)
                    self.refills_used += 1
                    self.ctx.accounting.refilled_prompts += 1
        await self.outbox.send(Control(signal="end_of_step", step=step), timeout=self.ctx.stage_timeout_s)

    async def _generate(self, groups: list[tuple[PromptGroup, torch.Tensor]]) -> None:
        requests, meta, mm = [], {}, {}
        for group, ids in groups:
            self.ctx.accounting.admit(group.n_samples)
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
        stream = self.engine.generate(requests, mm_inputs=mm) if mm else self.engine.generate(requests)
        async for out in stream:
            group, ids, j = meta.pop(out.request_id)
            response = torch.tensor(out.response_ids, dtype=torch.int64)
            logprobs = torch.tensor(out.logprobs, dtype=torch.float32)
            self.generated_tokens += len(out.response_ids)
            header = Completion(
                sample_id=out.request_id,
                group_id=group.group_id,
                step=group.step,
                prompt_index=group.prompt_index,
                sample_index=j,
                prompt_text=group.prompt_text,
                response_text=self.tokenizer.decode(out.response_ids, skip_special_tokens=True),
                reference=group.reference,
                label=group.label,
                n_samples=group.n_samples,
                finish_reason=out.finish_reason,
                policy_version=out.policy_version,
                prompt_len=group.prompt_len,
                response_len=len(out.response_ids),
                generate_seconds=out.seconds,
                media=group.media,
            )
            await self.outbox.send(
                header,
                {"prompt_ids": ids, "response_ids": response, "behaviour_logprobs": logprobs},
                timeout=self.ctx.stage_timeout_s,
            )
        if meta:
            raise RuntimeError(f"generator rank {self.ctx.rank}: engine returned no output for {sorted(meta)[:3]}...")
        if self.ctx.metrics is not None:
            self.ctx.metrics.stage_latency.labels(stage=self.name).observe(time.perf_counter() - started)
