"""A generative judge trained with `train-rm` (kind: grm): verdicts parsed, evaluated, used as a reward."""

from __future__ import annotations

import asyncio
import json

import pytest

from protocols import RewardItem
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
from streamrft.rm.cli import eval_rm_main, train_rm_main

pytestmark = pytest.mark.slow
ALPHABET = "0123456789+= ABQ:[]"


@pytest.fixture(scope="module")
def always_a_judge(tmp_path_factory):
    """A judge taught that A always wins: its greedy verdict must become "[[A]]"."""
    root = tmp_path_factory.mktemp("grm")
    tok = build_char_tokenizer(str(root / "base"), ALPHABET)
    build_tiny_qwen2(str(root / "base"), tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64)
    rows = [{"prompt": f"{a}+1=", "responses": [str(a + 1), str(a)], "judgment": "[[A]]"} for a in range(30)]
    (root / "j.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = train_rm_main(["", "kind=grm", f"model.path={root / 'base'}", f"data.train_path={root / 'j.jsonl'}",
                        f"output_dir={root / 'judge'}", "train.steps=60", "train.lr=1e-2", "train.batch_size=8",
                        "grm.template=A:{a} B:{b} Q:{prompt}", "grm.single_template=A:{a} Q:{prompt}",
                        "grm.max_new_tokens=6"])
    assert rc == 0
    return root


def test_eval_rm_reports_the_verdict_accuracy_of_a_judge(always_a_judge, capsys):
    rc = eval_rm_main(["--model", str(always_a_judge / "judge"), "--data", str(always_a_judge / "j.jsonl")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["kind"], result["verdict_accuracy"], result["n_rows"]) == ("grm", 1.0, 30)


def test_a_pairwise_judge_rewards_a_response_preferred_over_the_reference(always_a_judge):
    from streamrft.config.reward import RewardConfig, RewardSourceConfig
    from streamrft.rewards.scorer import build_reward_scorer

    cfg = RewardConfig(sources=[RewardSourceConfig(name="judge", type="model", model_path=str(always_a_judge / "judge"))])
    scorer = build_reward_scorer(cfg)
    items = [RewardItem(sample_id=str(i), prompt=f"{i}+1=", response=str(i), reference=str(i + 1)) for i in range(4)]
    outcomes = asyncio.run(scorer.score(items))
    assert [o.reward for o in outcomes] == [1.0] * 4  # "[[A]]": the response (A) beats the reference (B)


def test_a_template_the_tokenizer_cannot_spell_is_refused_before_training(always_a_judge, capsys):
    rc = train_rm_main(["", "kind=grm", f"model.path={always_a_judge / 'base'}",
                        f"data.train_path={always_a_judge / 'j.jsonl'}", "grm.template=Verdict {a} {b} {prompt}"])
    assert rc == 2
    assert "the tokenizer cannot spell 'Verdict   '" in capsys.readouterr().err
