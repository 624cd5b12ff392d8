"""Build the protocols TrajectoryRecord of every trained sample, for the streaming sinks."""

from __future__ import annotations

from protocols import TrajectoryRecord


def trajectory_records(run, step: int, batch) -> list[TrajectoryRecord]:
    records = []
    for s in batch:
        c = s.header.completion
        adv = float(s.advantages[0]) if s.advantages is not None and len(s.advantages) else 0.0
        records.append(
            TrajectoryRecord(
                run_id=run.run_id,
                rank=run.dist.rank,
                step=step,
                sample_id=c.sample_id,
                group_id=c.group_id,
                policy_version=c.policy_version,
                prompt=c.prompt_text,
                response=c.response_text,
                prompt_ids=s.prompt_ids.tolist(),
                response_ids=s.response_ids.tolist(),
                behaviour_logprobs=s.behaviour_logprobs.tolist(),
                entropy=(-s.behaviour_logprobs).tolist(),  # surprisal of the sampled token: a per-token entropy estimate
                reward=s.header.reward,
                reward_components=dict(s.header.reward_components),
                advantage=adv,
                status="trained",
                finish_reason=c.finish_reason,
                timings={"generate": c.generate_seconds, "score": s.header.score_seconds},
            )
        )
    return records
