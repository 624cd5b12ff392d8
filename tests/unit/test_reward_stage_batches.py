"""The reward stage scores the samples already waiting together in its inbox with one scorer call (per train
step), keeps each sample's own outcome, and forwards a control message behind them only after all of them."""

import asyncio
import uuid

import zmq.asyncio

from protocols import Completion, Control, ScoredSample
from streamrft.rewards.scorer import RewardOutcome
from streamrft.runtime.accounting import Accounting
from streamrft.runtime.channels import ChannelReceiver, ChannelSender, channel_address
from streamrft.runtime.scoring import SCORE_BATCH, RewardScorerStage
from streamrft.runtime.stage import StageContext


class RecordingScorer:
    """Scores a response by its length; responses with "bad" fail; records each call's size and step."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    async def score(self, items, step=None):
        self.calls.append((len(items), step))
        return [RewardOutcome(float("nan"), {}, "boom") if "bad" in it.response else
                RewardOutcome(float(len(it.response)), {"len": float(len(it.response))}) for it in items]


def _completion(i: int, step: int = 0, response: str | None = None, error: str = "") -> Completion:
    return Completion(sample_id=f"g{i // 4}-{i % 4}", group_id=f"g{i // 4}", step=step, prompt_index=i // 4,
                      sample_index=i % 4, prompt_text="p", response_text=response or "x" * (i + 1), n_samples=4,
                      finish_reason="stop", policy_version=0, prompt_len=1, response_len=1, error=error)


def test_samples_waiting_together_are_scored_by_one_call_per_step():
    run_id = uuid.uuid4().hex[:8]
    ctx = zmq.asyncio.Context()
    scorer = RecordingScorer()

    async def body():
        inbox = ChannelReceiver(channel_address("inproc", "reward", 0, run_id), 256, name="reward", rank=0,
                                message_type=Completion | Control, ctx=ctx)
        outbox = ChannelReceiver(channel_address("inproc", "advantage", 0, run_id), 256, name="advantage", rank=0,
                                 message_type=ScoredSample | Control, ctx=ctx)
        to_stage = ChannelSender(inbox.address, name="reward", rank=0, ctx=ctx)
        from_stage = ChannelSender(outbox.address, name="advantage", rank=0, ctx=ctx)
        try:
            sent = [_completion(i) for i in range(SCORE_BATCH + 6)]  # more than one batch
            sent[3] = _completion(3, response="bad")  # fails alone
            sent[5] = _completion(5, error="env raised")  # failed before scoring: not scored
            sent += [_completion(100, step=1), _completion(101, step=1)]  # a later step (max_staleness > 0)
            for c in sent:
                await to_stage.send(c, timeout=5)
            await to_stage.send(Control(signal="stop"), timeout=5)
            while inbox.qsize() < len(sent) + 1:  # every item waits in the inbox before the stage starts
                await asyncio.sleep(0.01)
            stage = RewardScorerStage(StageContext(rank=0, stage_timeout_s=5.0, accounting=Accounting()), inbox,
                                      from_stage, scorer, max_concurrency=4)
            await asyncio.wait_for(stage.run(), 10)
            return sent, [await outbox.recv(5) for _ in range(len(sent) + 1)]
        finally:
            for channel in (to_stage, from_stage, inbox, outbox):
                channel.close()

    sent, got = asyncio.run(body())
    ctx.term()
    # the first batch holds SCORE_BATCH samples (one not scored), the second the rest of step 0 and step 1's
    assert scorer.calls == [(SCORE_BATCH - 1, 0), (6, 0), (2, 1)]
    *scored, (stop, _) = got
    assert isinstance(stop, Control) and stop.signal == "stop"
    # batches are scored concurrently (reward.max_concurrency), so only the samples, not their order, are fixed
    by_id = {s.completion.sample_id: s for s, _ in scored}
    assert len(scored) == len(by_id) == len(sent) and set(by_id) == {c.sample_id for c in sent}
    for c in sent:
        s = by_id[c.sample_id]
        if c.error:
            assert s.status == "failed" and s.fail_reason == "env raised"
        elif "bad" in c.response_text:
            assert s.status == "failed" and s.fail_reason == "reward: boom" and s.reward == 0.0
        else:
            assert s.status == "ok" and s.reward == len(c.response_text) == s.reward_components["len"]
