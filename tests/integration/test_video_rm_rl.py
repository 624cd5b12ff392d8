"""The video reward-model RL demo (pipelines/video_rm_rl), end to end on CPU: mp4 videos, a tiny Qwen2-VL scalar
RM trained on video preferences by train-rm, then GRPO of a tiny Qwen2-VL policy against it through the
`streamrft train` runtime (reward type: model, the RM reading each sample's video by reference).

Acceptance (issue 19): the policy's held-out RM score and the rule metric the RM was trained to track
(colour_correct, greedy, on held-out videos) both rise."""

from __future__ import annotations

import pytest

pytest.importorskip("av")


@pytest.mark.slow
def test_video_rm_rl_raises_the_heldout_rm_score_and_the_rule_metric(tmp_path):
    from pipelines.video_rm_rl.demo import run_demo

    result = run_demo(str(tmp_path / "run"), ["train.max_steps=30", "data.eval_size=100"],
                      prepare_kwargs=dict(sft_steps=30, n_train=480, n_eval=100, n_pairs=1000, n_pair_eval=200))
    assert result["steps"] == 30 and result["n_eval"] == 100
    assert result["rm_pairwise_accuracy"] >= 0.8, result  # the RM sees the video: chance is 0.5
    assert result["rm_score_after"] > result["rm_score_before"] + 0.1, result
    assert result["colour_correct_after"] >= result["colour_correct_before"] + 0.05, result
