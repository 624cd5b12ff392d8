"""Build the protocols TrajectoryRecord of every sample of a step (trained, filtered or failed)."""

from __future__ import annotations

from protocols import TrajectoryRecord


def _record(run, step: int, header, prompt_ids, response_ids, behaviour_logprobs, advantage: float, status: str, reason: str):
    c = header.completion
    return TrajectoryRecord(
        run_id=run.run_id,
        rank=run.dist.rank,
        step=step,
        sample_id=c.sample_id,
        group_id=c.group_id,
        policy_version=c.policy_version,
        prompt=c.prompt_text,
        response=c.response_text,
        prompt_ids=prompt_ids.tolist(),
        response_ids=response_ids.tolist(),
        behaviour_logprobs=behaviour_logprobs.tolist(),
        entropy=(-behaviour_logprobs).tolist(),  # surprisal of the sampled token: a per-token entropy estimate
        reward=header.reward,
        reward_components=dict(header.reward_components),
        advantage=advantage,
        status=status,
        reason=reason,
        finish_reason=c.finish_reason,
        timings={"generate": c.generate_seconds, "score": header.score_seconds},
        media=list(getattr(c, "media", [])),
    )


def trajectory_records(run, step: int, batch, dropped=()) -> list[TrajectoryRecord]:
    """``batch``: the trained TrainSamples; ``dropped``: (ScoredSample, tensors, status, reason)."""
    records = []
    for s in batch:
        adv = float(s.advantages[0]) if s.advantages is not None and len(s.advantages) else 0.0
        records.append(_record(run, step, s.header, s.prompt_ids, s.response_ids, s.behaviour_logprobs, adv, "trained", ""))
    for header, tensors, status, reason in dropped:
        records.append(_record(run, step, header, tensors["prompt_ids"], tensors["response_ids"],
                               tensors["behaviour_logprobs"], 0.0, status, reason))
    return records
