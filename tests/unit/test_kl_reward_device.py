"""algorithm.kl_mode=reward: the per-token KL the reference gives is folded into the token rewards on the host,
while the learner's and the reference's log-probs live on the learner's device. On a GPU the two met in one
product and the step failed ("Expected all tensors to be on the same device"); on a CPU both are the host, so
this test shows the bug only where a GPU runs it (the device tool: `python -m pytest tests/unit/test_kl_reward_device.py`).
It also checks the folded KL against the formula on every device."""

import math

import torch

from protocols import Completion, ScoredSample
from streamrft.compose import build_learner
from streamrft.config import load_config
from streamrft.runtime.feed import TrainSample


def _sample(i: int, prompt: list[int], response: list[int]) -> TrainSample:
    c = Completion(sample_id=f"g-{i}", group_id="g", step=0, prompt_index=0, sample_index=i, prompt_text="",
                   response_text="", n_samples=2, finish_reason="stop", policy_version=0, prompt_len=len(prompt),
                   response_len=len(response))
    return TrainSample(header=ScoredSample(completion=c, reward=float(i)), prompt_ids=torch.tensor(prompt),
                       response_ids=torch.tensor(response), behaviour_logprobs=torch.full((len(response),), -2.0),
                       advantages=None)


def test_kl_in_the_reward_trains_a_step_on_the_learners_device(dist, model_dir):
    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "train.lr=1e-3",
                             "algorithm.advantage_estimator=reinforce++", "algorithm.kl_coef=0.5",
                             "algorithm.kl_mode=reward", "algorithm.kl_estimator=k1"])
    strategy, reference, _, actor = build_learner(cfg, dist)
    strategy.step = lambda: {"grad_norm": 0.0}  # no update: the reference and the policy stay equal below
    batch = [_sample(0, [5, 6, 7], [8, 9, 10, 11]), _sample(1, [5, 6], [12, 13])]
    captured = {}
    original = actor._batch_advantages

    def spy(batch_, mbs):
        captured["kl"] = [mb["kl_tokens"] for mb in mbs]
        return original(batch_, mbs)

    actor._batch_advantages = spy
    stats = actor.train_step(batch)
    assert all(math.isfinite(v) for v in stats.values() if isinstance(v, float))
    for kl in captured["kl"]:  # on the host, and k1 = log pi - log ref = 0 (one set of weights, no update)
        assert kl.device.type == "cpu"
        torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-6, rtol=0)
