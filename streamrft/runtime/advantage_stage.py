"""AdvantageStage: groups samples by prompt, releases each group as soon as it is complete.

On release: failed samples are counted and dropped; reward shaping (overlong penalty) is applied;
groups without signal are filtered (dynamic sampling) with a ``group_done`` note back to the
Generator so it can refill; group-scope estimators (GRPO & co.) compute advantages here, per group.
Batch-scope estimators (reinforce++, gae, ...) are computed by the learner over the whole step.
"""

from __future__ import annotations

import time

import torch

from protocols import Control, ScoredSample
from streamrft.algorithms import ADVANTAGE_ESTIMATORS, clip_rewards, one_group_advantages
from streamrft.algorithms.filters import overlong_penalty, zero_variance_groups
from streamrft.runtime.stage import Stage, StageContext


class AdvantageStage(Stage):
    name = "advantage"

    def __init__(self, ctx: StageContext, inbox, outbox, feedback, cfg):
        super().__init__(ctx, inbox)
        self.outbox = outbox
        self.feedback = feedback
        self.cfg = cfg
        self.algo = cfg.algorithm
        self.estimator = ADVANTAGE_ESTIMATORS[self.algo.advantage_estimator]
        self.groups: dict[str, list[tuple[ScoredSample, dict]]] = {}
        # Samples that will not be trained, with status ("failed" | "filtered") and reason, until the
        # driver takes them for the trajectory sinks (Pipeline.take_dropped).
        self.dropped: list[tuple[ScoredSample, dict, str, str]] = []

    async def handle(self, header, tensors) -> bool:
        if isinstance(header, Control):
            if header.signal == "end_of_step":
                # groups of later steps may be open (max_staleness > 0); this step's must all be complete
                open_groups = sorted(g for g, samples in self.groups.items() if samples[0][0].completion.step == header.step)
                if open_groups:
                    raise RuntimeError(f"advantage rank {self.ctx.rank}: end of step {header.step} with incomplete "
                                       f"groups {open_groups[:3]}")
            await self.outbox.send(header, timeout=self.ctx.stage_timeout_s)
            return header.signal == "stop"
        group = self.groups.setdefault(header.completion.group_id, [])
        group.append((header, tensors))
        if len(group) == header.completion.n_samples:
            del self.groups[header.completion.group_id]
            await self._release(header.completion.group_id, header.completion.step, group)
        return False

    async def _release(self, group_id: str, step: int, group) -> None:
        started = time.perf_counter()
        acct = self.ctx.accounting
        ok = []
        for scored, tensors in group:
            if scored.status != "ok":
                acct.fail(scored.fail_reason, step=step)
                self.dropped.append((scored, tensors, "failed", scored.fail_reason))
            elif self.algo.overlong_filter and scored.completion.finish_reason == "length":
                acct.filter("overlong", step=step)
                self.dropped.append((scored, tensors, "filtered", "overlong"))
            else:
                ok.append((scored, tensors))
        reason = "kept"
        if not ok:
            reason = "filtered:no_usable_samples"
        else:
            rewards = torch.tensor([s.reward for s, _ in ok], dtype=torch.float64)
            if self.algo.overlong_buffer_len > 0:
                lens = torch.tensor([s.completion.response_len for s, _ in ok], dtype=torch.float64)
                rewards = rewards + overlong_penalty(
                    lens, self.cfg.engine.max_new_tokens, self.algo.overlong_buffer_len, self.algo.overlong_penalty_factor
                )
                for (s, _), r in zip(ok, rewards.tolist()):
                    s.reward_components["overlong_penalty"] = r - s.reward
                    s.reward = r
            if self.algo.reward_clip > 0:
                rewards = clip_rewards(rewards, self.algo.reward_clip)
                for (s, _), r in zip(ok, rewards.tolist()):
                    s.reward = r
            if self.algo.dynamic_sampling and bool(
                zero_variance_groups(rewards, torch.zeros(len(ok), dtype=torch.int64)).all()
            ):
                acct.filter("zero_variance", len(ok), step=step)
                self.dropped.extend((s, t, "filtered", "zero_variance") for s, t in ok)
                reason = "filtered:zero_variance"
        if reason == "kept":
            if self.estimator.scope == "group":
                advs = one_group_advantages(rewards, [s.completion.response_len for s, _ in ok], self.algo)
                for (s, tensors), adv in zip(ok, advs):
                    tensors["advantages"] = adv.to(torch.float32)
            for s, tensors in ok:
                await self.outbox.send(s, tensors, timeout=self.ctx.stage_timeout_s)
        self.observe_latency(started)
        await self.feedback.send(
            Control(signal="group_done", step=step, group_id=group_id, reason=reason),
            timeout=self.ctx.stage_timeout_s,
        )
