"""Build the protocols TrajectoryRecord of every sample of a step (trained, filtered or failed)."""

from __future__ import annotations

from protocols import TrajectoryRecord


def _record(run, step: int, header, prompt_ids, response_ids, behaviour_logprobs, advantage: float, status: str,
            reason: str, policy_logprobs=None, entropy=None, token_versions=None, learner_version: int = -1,
            loss_mask=None):
    """``entropy``: the learner's full-distribution entropy per response token when it trained the
    sample; otherwise the sampled token's surprisal (−behaviour log-prob), an estimate of it.
    ``loss_mask`` (multi-turn): the learner's values cover the model tokens only; they are spread back
    over the response (0 at observation tokens), so every per-token list has one value per response token."""
    c = header.completion
    if loss_mask is not None:
        from streamrft.algorithms.turns import expand_to_response

        if policy_logprobs is not None:
            policy_logprobs = expand_to_response(policy_logprobs, loss_mask)
        if entropy is not None:
            entropy = expand_to_response(entropy, loss_mask)
        else:
            entropy = -behaviour_logprobs * loss_mask.to(behaviour_logprobs.dtype)
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
        loss_mask=loss_mask.to(int).tolist() if loss_mask is not None else [],
        turn_starts=list(c.turn_starts),
        turn_rewards=list(c.turn_rewards),
        observation_roles=list(c.observation_roles),
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
                               "trained", "", lp, ent, s.token_versions, batch.learner_version, s.loss_mask))
    for header, tensors, status, reason in dropped:
        records.append(_record(run, step, header, tensors["prompt_ids"], tensors["response_ids"],
                               tensors["behaviour_logprobs"], 0.0, status, reason, token_versions=tensors.get("token_versions"),
                               loss_mask=tensors.get("loss_mask")))
    for s in batch.stale:
        records.append(_record(run, step, s.header, s.prompt_ids, s.response_ids, s.behaviour_logprobs, 0.0,
                               "filtered", "stale", token_versions=s.token_versions, learner_version=batch.learner_version,
                               loss_mask=s.loss_mask))
    return records
