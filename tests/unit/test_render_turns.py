"""``streamrft trajectories render`` on multi-turn records: observation spans drawn apart, labelled by role."""

from __future__ import annotations

import re

from protocols import TrajectoryRecord
from streamrft.sinks.render import render_records


def _record() -> TrajectoryRecord:
    # model "ab", user observation "<x>", model "c", tool observation "=7", model "d"
    response = "ab<x>c=7d"
    mask = [1, 1, 0, 0, 0, 1, 0, 0, 1]
    return TrajectoryRecord(
        run_id="r", rank=0, step=1, sample_id="s1-p0-0", group_id="s1-p0", policy_version=0, prompt="q",
        response=response, prompt_ids=[5], response_ids=list(range(10, 19)), behaviour_logprobs=[-0.5] * 9,
        entropy=[0.2 if m else 0.0 for m in mask], reward=1.5, loss_mask=mask, turn_starts=[0, 5, 8],
        turn_rewards=[0.5, 0.0, 1.0], observation_roles=["user", "tool"])


def test_observation_spans_are_wrapped_with_their_role_and_model_tokens_keep_their_entropy_shade():
    page = render_records([_record()], "t")
    spans = re.findall(r'<span class="obs" title="observation \((\w+)\), not trained"><span class="role">\w+</span>(.*?)</span></span>', page)
    assert [role for role, _ in spans] == ["user", "tool"]
    assert [re.findall(r">([^<]*)</span>", body + "</span>") for _, body in spans] == [["&lt;", "x", "&gt;"], ["=", "7"]]
    shaded = re.findall(r'<span class="tok" style="background:[^"]+" title="id (\d+), H=', page)
    assert shaded == ["0", "0", "0", "10", "11", "15", "18"]  # the legend (id 0; its last is outlined "tok hi"), then the model's tokens only
    assert "3 turns (turn rewards 0.5, 0, 1)" in page


def test_single_turn_records_render_as_before():
    r = _record()
    r.loss_mask, r.turn_starts, r.turn_rewards, r.observation_roles = [], [], [], []
    page = render_records([r], "t")
    assert 'class="obs"' not in page.split("</style>")[1] and "turns" not in page
    assert len(re.findall(r'<span class="tok[^"]*" style=', page)) == 9 + 4  # nine tokens and the legend's four
