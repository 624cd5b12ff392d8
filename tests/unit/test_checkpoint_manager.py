"""Checkpointer with a real FSDP2Strategy at world size 1: when it saves, what meta.json says, exact resume."""

import json

import pytest
import torch

from streamrft.algorithms import AdaptiveKLController, RunningMeanStd
from streamrft.checkpoint import Checkpointer, complete_checkpoints, read_meta, step_dir
from streamrft.checkpoint.layout import rank_file
from streamrft.config import Config
from streamrft.config.checkpoint import CheckpointConfig
from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
from streamrft.runtime.accounting import Accounting


class Counter:
    """Stands in for the Generator's refill counter."""

    def __init__(self):
        self.refills_used = 0

    def state_dict(self):
        return {"refills_used": self.refills_used}

    def load_state_dict(self, state):
        self.refills_used = state["refills_used"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer(d, "0123456789+-=abc")
    return build_tiny_qwen2(d, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=64)


def config(model_dir, out, **checkpoint):
    return Config(output_dir=str(out), seed=3, model=ModelConfig(path=str(model_dir)),
                  train=TrainConfig(max_steps=4, lr=1e-2, weight_decay=0.01),
                  checkpoint=CheckpointConfig(**checkpoint))


def parts(cfg, dist):
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=cfg.train.max_steps)
    accounting, counter = Accounting(), Counter()
    ckpt = Checkpointer(cfg, dist, strategy, accounting)
    return strategy, accounting, counter, ckpt


def train_step(strategy, accounting, counter, step):
    """One optimizer step on a step-dependent batch; returns the loss."""
    g = torch.Generator().manual_seed(step)
    samples = [SequenceSample(torch.randint(3, 15, (4,), generator=g).tolist(),
                              torch.randint(3, 15, (5,), generator=g).tolist(),
                              {"adv": torch.randn(5, generator=g)}) for _ in range(3)]
    (mb,) = make_microbatches(samples, token_budget=100)
    noise = torch.rand(())  # a draw from the global RNG, which a checkpoint must restore

    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / 15 * (1 + noise), {}

    loss = strategy.forward_backward(mb, loss_fn, temperature=1.0)["loss"]
    strategy.step()
    accounting.admit(3), accounting.train(3)
    counter.refills_used += 1
    return loss


def weights(strategy):
    return {k: v.full_tensor().clone() for k, v in strategy.module.state_dict().items()}


def test_saves_every_n_steps_and_at_the_end_with_complete_meta(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=3, keep=5)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    assert ckpt.resume({"generator": counter}) is None
    ckpt.summary_before = {"heldout_accuracy_before": 0.25}
    saved = []
    for step in range(1, 5):
        train_step(strategy, accounting, counter, step)
        saved.append(ckpt.step_done(step, policy_version=step))
    assert saved == [None, None, step_dir(tmp_path, 3), step_dir(tmp_path, 4)]
    meta = read_meta(step_dir(tmp_path, 4))
    assert {k: meta[k] for k in ("step", "policy_version", "world_size", "seed", "reason", "summary_before")} == {
        "step": 4, "policy_version": 4, "world_size": 1, "seed": 3, "reason": "final",
        "summary_before": {"heldout_accuracy_before": 0.25}}
    assert read_meta(step_dir(tmp_path, 3))["reason"] == "periodic"
    rank0 = json.loads(rank_file(step_dir(tmp_path, 3), 0).read_text())
    assert rank0["generator"] == {"refills_used": 3}
    assert rank0["accounting"]["admitted"] == rank0["accounting"]["trained"] == 9
    assert (step_dir(tmp_path, 4) / "hf" / "config.json").is_file()


def test_resume_restores_weights_optimizer_schedule_rng_and_counters_exactly(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=2, keep=1)
    a, acc_a, counter_a, ckpt_a = parts(cfg, dist)
    norm, kl = RunningMeanStd(), AdaptiveKLController(0.1, 6.0, 100, 0.2)
    ckpt_a.resume({"generator": counter_a, "reward_norm": norm, "kl_ctl": kl})
    for step in (1, 2):
        train_step(a, acc_a, counter_a, step)
        norm.update(torch.rand(5, dtype=torch.float64) / 3)
        kl.update(step * 2.7, 9)
        ckpt_a.step_done(step, policy_version=step)
    norm_at_2, kl_at_2 = norm.state_dict(), kl.value
    losses_a = [train_step(a, acc_a, counter_a, step) for step in (3, 4)]

    b, acc_b, counter_b, ckpt_b = parts(cfg, dist)
    norm_b, kl_b = RunningMeanStd(), AdaptiveKLController(0.1, 6.0, 100, 0.2)
    resumed = ckpt_b.resume({"generator": counter_b, "reward_norm": norm_b, "kl_ctl": kl_b})
    assert (resumed.step, resumed.policy_version, resumed.path) == (2, 2, step_dir(tmp_path, 2))
    assert norm_b.state_dict() == norm_at_2 and kl_b.value == kl_at_2  # float64 tensors through JSON, exact
    assert counter_b.refills_used == 2 and acc_b.trained == 6
    losses_b = [train_step(b, acc_b, counter_b, step) for step in (3, 4)]
    assert losses_b == losses_a  # bitwise: same weights, Adam moments, LR step and RNG draw
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]  # keep=1


def test_signal_saves_the_last_completed_step_once(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=0)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    assert ckpt.save_on_signal() is None  # nothing completed yet
    train_step(strategy, accounting, counter, 1)
    assert ckpt.step_done(1, policy_version=1) is None
    strategy.unshard_for_rollout()  # a signal usually lands mid-rollout
    assert ckpt.save_on_signal() == step_dir(tmp_path, 1)
    assert read_meta(step_dir(tmp_path, 1))["reason"] == "signal"
    assert ckpt.save_on_signal() == step_dir(tmp_path, 1)  # already on disk: not written again
    strategy.reshard_after_rollout()
    train_step(strategy, accounting, counter, 2)
    ckpt.step_done(2, policy_version=2)
    assert ckpt.save_on_signal() == step_dir(tmp_path, 2)  # a signal between train and rollout
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2]


def test_existing_checkpoints_need_resume_on_and_the_same_world_size(dist, model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, save_every=1)
    strategy, accounting, counter, ckpt = parts(cfg, dist)
    ckpt.resume({"generator": counter})
    train_step(strategy, accounting, counter, 1)
    ckpt.step_done(1, policy_version=1)
    step_dir(tmp_path, 7).mkdir()  # an interrupted save: removed on resume, never loaded
    off = Checkpointer(config(model_dir, tmp_path, resume=False), dist, strategy, Accounting())
    with pytest.raises(ValueError, match="step_00000001 holds a checkpoint of an earlier run and checkpoint.resume=never"):
        off.resume({})
    meta_path = step_dir(tmp_path, 1) / "meta.json"
    meta_path.write_text(meta_path.read_text().replace('"world_size": 1', '"world_size": 2'))
    (step_dir(tmp_path, 1) / "rank_00001.json").write_text(rank_file(step_dir(tmp_path, 1), 0).read_text())
    with pytest.raises(ValueError, match="saved with world_size=2, seed=3; this run has world_size=1, seed=3"):
        Checkpointer(cfg, dist, strategy, Accounting()).resume({})
    assert not step_dir(tmp_path, 7).exists()
