"""The GAE critic at world size 1 (FSDP2 on a one-rank gloo group), on unpacked and packed microbatches."""

import pytest
import torch
from transformers import AutoModel

from streamrft.algorithms import value_loss
from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner.critic import Critic, ValueModel
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.learner.packing import make_packed_microbatches, rows_by_sample

EPS = 0.2


def _samples():
    g = torch.Generator().manual_seed(5)
    return [SequenceSample(torch.randint(3, 30, (p,), generator=g).tolist(),
                           torch.randint(3, 30, (r,), generator=g).tolist(),
                           {"returns": torch.randn(r, generator=g)}) for p, r in [(3, 5), (6, 2), (2, 7), (4, 4)]]


def _critic(model_dir, dist, **train):
    t = dict(lr=1.0, critic_lr=1e-3, grad_clip=0.0, weight_decay=0.0)
    t.update(train)
    return Critic(ModelConfig(path=model_dir, critic_path=model_dir), TrainConfig(**t), EPS, dist, total_steps=10)


def test_values_and_the_first_value_loss_match_an_unsharded_backbone_and_head(dist, model_dir):
    critic = _critic(model_dir, dist)
    ref = ValueModel(AutoModel.from_pretrained(model_dir, dtype=torch.float32))
    samples = _samples()
    mbs = make_microbatches(samples, token_budget=30)
    n_tokens = float(sum(len(s.response_ids) for s in samples))
    for mb in mbs:
        with torch.no_grad():
            h = ref.backbone(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                             position_ids=mb["position_ids"]).last_hidden_state
            v = h @ ref.head.weight[0] + ref.head.bias[0]
        expected = torch.zeros_like(mb["response_mask"])
        expected[:, 1:] = v[:, :-1] * mb["response_mask"][:, 1:]
        values = critic.values(mb)
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
        old = values + 0.3 * torch.randn_like(values) * mb["response_mask"]  # some tokens hit the clip
        loss_BL, _ = value_loss(expected, old, mb["returns"], mb["response_mask"], EPS)
        out = critic.forward_backward(mb, mb["returns"], old, n_tokens)
        assert out["value_loss"] == pytest.approx(float(loss_BL.sum()) / n_tokens, abs=1e-6)


def test_packed_values_equal_unpacked_and_training_lowers_the_value_loss(dist, model_dir):
    critic = _critic(model_dir, dist)
    samples = _samples()
    unpacked, packed = make_microbatches(samples, 30), make_packed_microbatches(samples, 20)
    assert any(len(mb["sample_index"]) > 1 for mb in packed)
    a, b = {}, {}
    for mbs, out in ((unpacked, a), (packed, b)):
        for mb in mbs:
            mb["values"] = critic.values(mb)
            out.update(rows_by_sample(mb, "values"))
    for i in a:
        torch.testing.assert_close(b[i], a[i], atol=1e-5, rtol=0)
    n_tokens = float(sum(len(s.response_ids) for s in samples))
    losses = []
    for _ in range(8):
        for mb in packed:  # PPO-style: the clip is around the values before each update
            mb["old_values"] = critic.values(mb)
        losses.append(critic.train_step(packed, n_tokens)["value_loss"])
    assert losses[-1] < 0.7 * losses[0], losses
    assert critic.step()["critic_lr"] == pytest.approx(1e-3)  # train.critic_lr, not train.lr


def test_a_missing_critic_path_names_the_key(dist):
    with pytest.raises(ValueError, match="model.critic_path is empty"):
        Critic(ModelConfig(path="x"), TrainConfig(), EPS, dist, total_steps=1)


class _RunsCode:
    """Unpickling it calls os.system: what a hostile checkpoint's scheduler entry would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_critic_checkpoint_round_trips_and_a_hostile_one_runs_no_code(dist, model_dir, tmp_path):
    """The critic reads its checkpoint as the policy does (learner/sharded_state.py): after a trained step,
    a fresh critic loaded from the save gives the same values and schedule; a metadata file that would run
    code when unpickled is refused, and nothing runs."""
    import pickle
    import shutil

    critic = _critic(model_dir, dist)
    mbs = make_microbatches(_samples(), 30)
    for mb in mbs:
        mb["old_values"] = critic.values(mb)
    critic.train_step(mbs, float(sum(len(s.response_ids) for s in _samples())))
    critic.save(str(tmp_path / "good"))
    fresh = _critic(model_dir, dist)
    assert not torch.equal(fresh.values(mbs[0]), critic.values(mbs[0]))  # the step changed the values
    fresh.load(str(tmp_path / "good"))
    assert torch.equal(fresh.values(mbs[0]), critic.values(mbs[0]))
    assert fresh.scheduler.state_dict() == critic.scheduler.state_dict()

    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile"
    shutil.copytree(tmp_path / "good", hostile)
    (hostile / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _RunsCode(marker)}))
    # with a process group up, DCP raises each rank's error inside a CheckpointException (a BaseException)
    with pytest.raises(BaseException, match=r"checkpoint metadata refers to (posix|os)\.system, which a DCP "
                                            r"metadata file never holds"):
        _critic(model_dir, dist).load(str(hostile))
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"critic checkpoint '.*missing' \(rank 0\) does not exist; check "
                                         r"checkpoint.resume"):
        _critic(model_dir, dist).load(str(tmp_path / "missing"))
