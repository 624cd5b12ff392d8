"""One actor update per train step: old/reference log-probs, batch-scope advantages, the policy loss.

The algorithm lives in ``streamrft.algorithms`` (chosen by name); this module only moves tensors:
it computes global normalisers (tokens and sequences across all ranks) so that summing the loss over
microbatches and ranks equals the loss of the whole global batch, whatever the split.
"""

from __future__ import annotations

import torch

from streamrft.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    RunningMeanStd,
    aggregate_loss,
    make_kl_controller,
    pad_rows,
)
from streamrft.algorithms.filters import high_entropy_token_mask
from streamrft.algorithms.turns import turn_end_indices, turn_token_rewards
from streamrft.learner.memory import out_of_memory_advice
from streamrft.learner.microbatch import SequenceSample, make_microbatches, padding_microbatch
from streamrft.learner.packing import make_packed_microbatches, n_sequences, rows_by_sample, scatter_by_sample
from streamrft.runtime.distributed import all_reduce_max
from streamrft.runtime.feed import TrainSample

# Per-token metrics of the policy loss, averaged over the global batch's response tokens, and the
# names they are reported under (the same names in steps.jsonl, Prometheus, TensorBoard).
_TOKEN_METRICS = {
    "clipped": "clip_fraction",
    "dual_clipped": "dual_clip_fraction",
    "ratio": "ratio_mean",
    "tis_clipped": "tis_clipped_fraction",
    "tis_weight": "tis_weight_mean",
    # off-policy correction (algorithms/offpolicy.py): tokens dropped by algorithm.offpolicy_mask, and
    # the k3 KL(behaviour || proximal) over response tokens
    "offpolicy_masked": "offpolicy_masked_fraction",
    "behaviour_proximal_kl": "behaviour_proximal_kl",
}


def _rows_from_microbatches(mbs, key: str, n: int) -> list[torch.Tensor | None]:
    """Per-sample response vectors (float32) of a per-token field, gathered back into sample order
    (packed or unpacked microbatches; padding microbatches give nothing; None where no microbatch
    recorded the field)."""
    rows: list[torch.Tensor | None] = [None] * n
    for mb in mbs:
        if key in mb:
            for idx, values in rows_by_sample(mb, key).items():
                rows[idx] = values.float()
    return rows


def _records_to_host(mbs) -> None:
    """The log-probs and entropy each microbatch's loss recorded on the device, copied to host memory once
    the step's work is queued (one copy per microbatch after the optimizer step, not a sync inside each)."""
    for mb in mbs:
        for key in ("policy_logprobs", "entropy"):
            if key in mb:
                mb[key] = mb[key].cpu()


def _scatter_rows(mbs, key: str, rows: list[torch.Tensor]) -> None:
    for mb in mbs:
        scatter_by_sample(mb, key, rows)


class ActorUpdate:
    def __init__(self, strategy, reference, cfg, all_reduce_sum, critic=None):
        self.strategy, self.reference, self.cfg = strategy, reference, cfg
        self.critic = critic  # value model for estimators that need one (gae)
        self.algo = cfg.algorithm
        self.all_reduce_sum = all_reduce_sum
        self.estimator = ADVANTAGE_ESTIMATORS[self.algo.advantage_estimator]
        self.policy_loss = POLICY_LOSSES[self.algo.policy_loss]
        self.kl_fn = KL_ESTIMATORS[self.algo.kl_estimator]
        self.temperature = cfg.engine.temperature
        self.kl_ctl = make_kl_controller(self.algo)  # fixed or adaptive (algorithm.kl_ctl_type)
        # Running reward statistics, identical on every rank (batch-scope estimators only).
        self.reward_norm = RunningMeanStd(self.algo.norm_eps) if self.algo.reward_running_norm else None
        self._codec = None  # MediaCodec, built on the first batch with media
        # Per trained sample of the last step (batch order): the learner's log-probs and entropy.
        self.last_policy_logprobs: list[torch.Tensor | None] = []
        self.last_entropy: list[torch.Tensor | None] = []

    @property
    def kl_coef(self) -> float:
        return float(self.kl_ctl.value)

    def _global(self, value: float) -> float:
        return float(self.all_reduce_sum(torch.tensor([float(value)], dtype=torch.float64)).item())

    def _microbatches(self, batch: list[TrainSample]):
        seqs = []
        for s in batch:
            tensors = {"behaviour_logprobs": s.behaviour_logprobs}
            if s.advantages is not None:
                tensors["advantages"] = s.advantages
            if s.teacher_logprobs is not None:
                tensors["teacher_logprobs"] = s.teacher_logprobs
            seqs.append(SequenceSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, tensors=tensors,
                                       loss_mask=s.loss_mask))  # multi-turn: observation tokens out of every term
        pack = make_packed_microbatches if self.cfg.train.packing else make_microbatches
        mbs = pack(seqs, self.cfg.train.micro_batch_tokens) if seqs else []
        if any(s.header.completion.media for s in batch):
            self._attach_media(batch, mbs)
        # Every rank must run the same number of forwards (FSDP all-gathers inside each one):
        # ranks with fewer microbatches add empty ones (no response tokens, loss 0).
        n_max = int(all_reduce_max(torch.tensor([len(mbs)]), stage="count_microbatches").item())
        fields = ["behaviour_logprobs", "advantages"] + (["teacher_logprobs"] if self.cfg.teacher.type != "none" else [])
        mbs += [padding_microbatch(fields) for _ in range(n_max - len(mbs))]
        return mbs

    def _attach_media(self, batch: list[TrainSample], mbs) -> None:
        """Re-decode each sample's media from its MediaRefs (hash-checked) and give every microbatch the
        media tensors of its rows, concatenated in row order (pixel_values, image_grid_thw, ...)."""
        from streamrft.models.media_inputs import MediaCodec, media_tensors

        # Packed rows keep their samples' clips in sample_index order, the order their <|AUDIO|> placeholders
        # appear in the row, so audio packs; images need 3-D M-RoPE positions (refused at model load too).
        visual = sorted({r.kind for s in batch for r in s.header.completion.media if r.kind != "audio"})
        if self.cfg.train.packing and visual:
            raise ValueError(f"train.packing=true cannot carry per-sample {'/'.join(visual)} media (M-RoPE "
                             "positions cannot be packed); set train.packing=false for vision-language data")
        processor = getattr(self.strategy, "processor", None)
        if processor is None:
            raise ValueError(f"train.strategy={self.cfg.train.strategy!r} has no processor for media samples; "
                             "use train.strategy=fsdp2 with a multimodal model.path")
        if self._codec is None:
            # the Generator's frame sampling (data.max_video_frames / video_fps): the same frames, the same ids
            self._codec = MediaCodec(processor, max_video_frames=self.cfg.data.max_video_frames,
                                     video_fps=self.cfg.data.video_fps)
        per_sample = []
        for s in batch:
            c = s.header.completion
            inputs = self._codec.inputs(c.prompt_text, list(c.media), f"sample {c.sample_id}") if c.media else {"input_ids": s.prompt_ids[None]}
            if inputs["input_ids"][0].tolist() != s.prompt_ids.tolist():
                raise RuntimeError(f"sample {c.sample_id}: prompt ids re-built from its media differ from the "
                                   "generator's; the processor or media changed during the run")
            per_sample.append(media_tensors(inputs))
        for mb in mbs:
            rows = [per_sample[i] for i in mb["sample_index"].tolist() if i >= 0]
            for key in sorted({k for r in rows for k in r}):
                mb[key] = torch.cat([r[key] for r in rows if key in r])

    def _batch_advantages(self, batch: list[TrainSample], mbs) -> None:
        """Batch-scope estimators (reinforce++, reinforce, ...) over the whole local batch, with
        global statistics through all_reduce_sum."""
        n = len(batch)
        group_of: dict[str, int] = {}
        group_index = torch.tensor([group_of.setdefault(s.header.completion.group_id, len(group_of)) for s in batch])
        # Multi-turn samples: the rows below are the model-token subsequence (response_mask holds the loss
        # mask); per-turn rewards sit at each turn's last model token, the reward sources' part at the last
        # (algorithms/turns.py). The running norm normalises that final part only.
        final = [s.header.reward - s.header.reward_components.get("env_turns", 0.0) for s in batch]
        rewards = torch.tensor(final, dtype=torch.float32)
        if self.reward_norm is not None:
            self.reward_norm.update(rewards, self.all_reduce_sum)
            rewards = self.reward_norm.normalize(rewards)
        lengths = [_model_tokens(s) for s in batch]
        mask_rows = [torch.ones(k) for k in lengths]
        _, mask_BT = pad_rows(mask_rows)
        token_rewards = None
        if self.kl_coef > 0 and self.algo.kl_mode == "reward":
            kl_BT, _ = pad_rows(_rows_from_microbatches(mbs, "kl_tokens", n))
            token_rewards = -self.kl_coef * kl_BT
        turn_rows = [_turn_rewards(s, k) for s, k in zip(batch, lengths)]
        if any(r is not None for r in turn_rows):
            turn_BT, _ = pad_rows([r if r is not None else torch.zeros(k) for r, k in zip(turn_rows, lengths)])
            token_rewards = turn_BT if token_rewards is None else token_rewards + turn_BT
        values_BT = None
        if self.estimator.needs_critic:
            values_BT, _ = pad_rows(_rows_from_microbatches(mbs, "old_values", n))
        out = self.estimator.fn(
            AdvantageInputs(rewards=rewards, group_index=group_index, response_mask=mask_BT, token_rewards=token_rewards, values=values_BT),
            self.algo,
            self.all_reduce_sum,
        )
        rows = [out.advantages[i, :k] for i, k in enumerate(lengths)]
        _scatter_rows(mbs, "advantages", rows)
        if out.returns is not None and self.critic is not None:
            _scatter_rows(mbs, "returns", [out.returns[i, :k] for i, k in enumerate(lengths)])

    def train_step(self, batch: list[TrainSample]) -> dict[str, float]:
        """One step over this rank's samples: returns metrics already reduced over all ranks. Out of device memory,
        the error names the rank, the microbatch and the settings that lower the learner's peak
        (``learner/memory.out_of_memory_advice``)."""
        mbs = self._microbatches(batch)
        try:
            return self._train_microbatches(batch, mbs)
        except torch.OutOfMemoryError as exc:
            s = self.strategy
            device = torch.device(s.device)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
            largest = max((mb["input_ids"].numel() for mb in mbs), default=0)
            raise torch.OutOfMemoryError(out_of_memory_advice(self.cfg, s.rank, s.world_size, device.type, largest,
                                                              peak, total)) from exc

    def _train_microbatches(self, batch: list[TrainSample], mbs) -> dict[str, float]:
        n_updates = self.cfg.train.ppo_epochs * self.cfg.train.mini_batches_per_step
        for mb in mbs:
            if self.reference is not None and self.kl_coef > 0:
                ref_logp, _ = self.reference.compute_logprobs(mb, self.temperature), None
                mb["ref_logp"] = ref_logp
            if n_updates > 1 or (self.kl_coef > 0 and self.algo.kl_mode == "reward"):
                old_logp, _ = self.strategy.compute_logprobs(mb, self.temperature)
                mb["old_logp"] = old_logp
                if "ref_logp" in mb:  # log-probs on the learner's device, the batch's mask and rewards on the host
                    kl_BL = self.kl_fn(old_logp, mb["ref_logp"])
                    mb["kl_tokens"] = (kl_BL * mb["response_mask"].to(kl_BL.device)).cpu()
        if self.critic is not None:
            for mb in mbs:
                mb["old_values"] = self.critic.values(mb).float().cpu()
        if self.estimator.scope == "batch":
            self._batch_advantages(batch, mbs)

        totals: dict[str, float] = {}
        n_tokens = self._global(sum(float(mb["response_mask"].sum()) for mb in mbs))
        n_seqs = self._global(len(batch))
        step_stats: dict[str, float] = {}
        for _epoch in range(self.cfg.train.ppo_epochs):
            for mini in _split(mbs, self.cfg.train.mini_batches_per_step):
                mini_tokens = self._global(sum(float(mb["response_mask"].sum()) for mb in mini))
                mini_seqs = self._global(sum(n_sequences(mb) for mb in mini))
                for i, mb in enumerate(mini):
                    # stats stay on the device: no host sync between microbatches (read once, below)
                    stats = self.strategy.forward_backward(
                        mb, self._loss_fn(mini_tokens, mini_seqs, record=mb), self.temperature, with_entropy=True,
                        stats_on_device=True, last_before_step=i == len(mini) - 1,
                    )
                    for k, v in stats.items():  # float64 sums: the same numbers as summing Python floats
                        totals[k] = totals.get(k, 0.0) + (v.double() if isinstance(v, torch.Tensor) else v)
                step_stats = self.strategy.step()
        _records_to_host(mbs)
        reduced = {k: self._global(float(v)) for k, v in sorted(totals.items())}
        updates = float(n_updates)
        out = {
            "loss": reduced.pop("loss_sum", 0.0) / updates,
            "kl": reduced.pop("kl_sum", 0.0) / max(n_tokens * updates, 1.0),
            "entropy": reduced.pop("entropy_sum", 0.0) / max(n_tokens * updates, 1.0),
            "tokens_kept_fraction": reduced.pop("kept_sum", 0.0) / max(n_tokens * updates, 1.0),
        }
        for name, reported in _TOKEN_METRICS.items():
            if f"{name}_sum" in reduced:
                out[reported] = reduced.pop(f"{name}_sum") / max(n_tokens * updates, 1.0)
        out.update({k: float(v) for k, v in step_stats.items()})
        if self.critic is not None:
            critic_stats = self.critic.train_step(mbs, max(n_tokens, 1.0))
            out["value_loss"] = self._global(critic_stats.pop("value_loss"))
            out["value_clip_fraction"] = self._global(critic_stats.pop("vf_clipped_sum")) / max(n_tokens, 1.0)
            out.update(critic_stats)
        if self.algo.kl_coef > 0:
            out["kl_coef"] = self.kl_coef
            kl_per_sequence = out["kl"] * n_tokens / max(n_seqs, 1.0)  # the adaptive target is per sequence
            self.kl_ctl.update(kl_per_sequence, int(n_seqs))
        out["train_tokens"] = n_tokens
        out["train_sequences"] = n_seqs
        self.last_policy_logprobs = _rows_from_microbatches(mbs, "policy_logprobs", len(batch))
        self.last_entropy = _rows_from_microbatches(mbs, "entropy", len(batch))
        return out

    def _loss_fn(self, n_tokens_global: float, n_seqs_global: float, record: dict | None = None):
        """The loss of one microbatch; ``record`` (the caller's microbatch dict; the strategy may pass a
        moved copy to loss_fn) receives this pass's log-probs and entropy for the trajectory sinks."""
        algo, max_len = self.algo, self.cfg.engine.max_new_tokens

        def loss_fn(mb, logp_BL, entropy_BL):
            mask = mb["response_mask"].to(logp_BL.dtype)
            # The proximal policy of decoupled PPO (algorithms/offpolicy.py): recomputed at step start when
            # there are several updates per step; otherwise this single pass's detached log-probs are it.
            old_logp = mb["old_logp"] if "old_logp" in mb else logp_BL.detach()
            advantages = self._advantages(mb, old_logp).to(logp_BL.dtype)
            loss_mask = mask
            if algo.high_entropy_ratio < 1.0 and entropy_BL is not None:
                loss_mask = mask * high_entropy_token_mask(entropy_BL.detach(), mask, algo.high_entropy_ratio).to(mask.dtype)
            out = self.policy_loss(
                PolicyLossInputs(
                    logp=logp_BL,
                    old_logp=old_logp,
                    advantages=advantages,
                    mask=loss_mask,
                    behaviour_logp=mb["behaviour_logprobs"].to(logp_BL.dtype),
                ),
                algo,
            )
            loss = aggregate_loss(out.loss, loss_mask, algo.loss_agg_mode, n_tokens_global, n_seqs_global, max_len)
            metrics = {"kept_sum": loss_mask.sum().detach()}
            if "ref_logp" in mb:
                kl_BL = self.kl_fn(logp_BL, mb["ref_logp"].to(logp_BL.dtype))
                if algo.kl_mode == "loss":
                    loss = loss + self.kl_coef * aggregate_loss(kl_BL, mask, algo.loss_agg_mode, n_tokens_global, n_seqs_global, max_len)
                metrics["kl_sum"] = (kl_BL.detach() * mask).sum()
            if entropy_BL is not None:
                metrics["entropy_sum"] = (entropy_BL.detach() * mask).sum()
                if algo.entropy_coef:
                    loss = loss - algo.entropy_coef * aggregate_loss(entropy_BL, mask, algo.loss_agg_mode, n_tokens_global, n_seqs_global, max_len)
            for name in _TOKEN_METRICS:
                if name in out.metrics:
                    metrics[f"{name}_sum"] = (out.metrics[name].detach().to(mask.dtype) * mask).sum()
            metrics["loss_sum"] = loss.detach()
            if record is not None:  # the learner's log-probs and entropy in this (last) pass, on the device
                record["policy_logprobs"] = logp_BL.detach().float()  # until the step ends (_records_to_host)
                if entropy_BL is not None:
                    record["entropy"] = entropy_BL.detach().float()
            return loss, metrics

        return loss_fn

    def _advantages(self, mb, student_logp):
        """Task advantages, replaced (``teacher.mode=pure``) or complemented (``hybrid``) by the
        on-policy distillation advantage teacher_logp − student_logp per token (reverse KL)."""
        if "teacher_logprobs" not in mb:
            return mb["advantages"]
        distill = (mb["teacher_logprobs"] - student_logp.detach()) * mb["response_mask"]
        if self.cfg.teacher.mode == "pure":
            return distill
        return mb["advantages"] + self.cfg.teacher.weight * distill


def _model_tokens(s: TrainSample) -> int:
    """Tokens the loss trains: the response, or a multi-turn sample's model tokens."""
    return len(s.response_ids) if s.loss_mask is None else int(s.loss_mask.to(torch.int64).sum())


def _turn_rewards(s: TrainSample, n_model: int) -> torch.Tensor | None:
    """(n_model,) per-turn rewards at each turn's last model token; None for a single-turn sample."""
    c = s.header.completion
    if not c.turns or s.loss_mask is None:
        return None
    return turn_token_rewards(list(c.turn_rewards), turn_end_indices(list(c.turn_starts), s.loss_mask), n_model)


def _split(items: list, parts: int) -> list[list]:
    """Split microbatches into ``parts`` contiguous mini-batches (sizes differ by at most one)."""
    if parts <= 1:
        return [items]
    k, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (1 if i < r else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out
