"""Build the protocols TrajectoryRecord of every sample of a step (trained, filtered or failed)."""

from __future__ import annotations

from protocols import TrajectoryRecord


def _record(run, step: int, header, prompt_ids, response_ids, behaviour_logprobs, advantage: float, status: str,
            reason: str, policy_logprobs=None, entropy=None, token_versions=None, learner_version: int = -1):
    """``entropy``: the learner's full-distribution entropy per response token when it trained the
    sample; otherwise the sampled token's surprisal (−behaviour log-prob), an estimate of it."""
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
        policy_logprobs=policy_logprobs.tolist() if policy_logprobs is not None else [],
        entropy=(entropy if entropy is not None else -behaviour_logprobs).tolist(),
        reward=header.reward,
        reward_components=dict(header.reward_components),
        advantage=advantage,
        status=status,
        reason=reason,
        finish_reason=c.finish_reason,
        timings={"generate": c.generate_seconds, "score": header.score_seconds},
        media=list(c.media),
        token_versions=token_versions.tolist() if token_versions is not None else [c.policy_version] * len(response_ids),
        learner_version=learner_version,
    )


def trajectory_records(run, step: int, batch, dropped=()) -> list[TrajectoryRecord]:
    """``batch``: the step's TrainBatch (trained samples, and those dropped as stale at take time);
    ``dropped``: (ScoredSample, tensors, status, reason) from the AdvantageStage."""
    records = []
    policy, entropy = run.actor.last_policy_logprobs, run.actor.last_entropy
    for i, s in enumerate(batch):
        adv = float(s.advantages[0]) if s.advantages is not None and len(s.advantages) else 0.0
        lp = policy[i] if i < len(policy) else None
        ent = entropy[i] if i < len(entropy) else None
        records.append(_record(run, step, s.header, s.prompt_ids, s.response_ids, s.behaviour_logprobs, adv,
                               "trained", "", lp, ent, s.token_versions, batch.learner_version))
    for header, tensors, status, reason in dropped:
        records.append(_record(run, step, header, tensors["prompt_ids"], tensors["response_ids"],
                               tensors["behaviour_logprobs"], 0.0, status, reason, token_versions=tensors.get("token_versions")))
    for s in batch.stale:
        records.append(_record(run, step, s.header, s.prompt_ids, s.response_ids, s.behaviour_logprobs, 0.0,
                               "filtered", "stale", token_versions=s.token_versions, learner_version=batch.learner_version))
    return records
