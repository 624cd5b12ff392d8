"""TRL reward functions on conversational rows: ``prompts`` are the rows' message lists and ``completions``
are ``[[{"role": "assistant", "content": text}], ...]``, as TRL's GRPOTrainer passes them; through the real
dataset reader, the scorer, and the reward wire (msgpack) that a remote serve-reward reads."""

from __future__ import annotations

import asyncio
import json
import re

from protocols import RewardItem, RewardRequest, decode, encode
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.data.prompts import PromptDataset
from streamrft.rewards.conventions import reward_columns
from streamrft.rewards.scorer import build_reward_scorer

HERE = "tests.unit.test_trl_conversational"
SEEN: list[dict] = []  # the arguments the function below received, per call


def conversational_accuracy(prompts, completions, solution, **kwargs):
    """TRL's documented conversational shape: completion[0]["content"] is the generated text."""
    SEEN.append({"prompts": prompts, "completions": completions, "kwargs": sorted(kwargs)})
    out = []
    for completion, truth in zip(completions, solution):
        found = re.findall(r"-?\d+", completion[0]["content"])
        out.append(1.0 if found and found[-1] == truth else 0.0)
    return out


ROWS = [
    {"prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "23+45="}],
     "solution": "68", "level": 1},
    {"prompt": [{"role": "user", "content": "7*6="}], "solution": "42", "level": 2},
]
RESPONSES = ["it is 68", "41"]


def _items(tmp_path) -> list[RewardItem]:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data = PromptDataset(path, format="trl")
    # as the Generator builds them: prompt = the rendered text, columns = reward_columns(row.extra, row.prompt)
    return [RewardItem(sample_id=f"s{i}", prompt=f"<rendered {i}>", response=RESPONSES[i], reference=row.reference,
                       label=row.label, columns=reward_columns(row.extra, row.prompt)) for i, row in enumerate(data)]


def _score(batch: list[RewardItem]):
    scorer = build_reward_scorer(RewardConfig(sources=[RewardSourceConfig(
        name="acc", type="custom", fn=f"{HERE}:conversational_accuracy", convention="trl")]))

    async def go():
        try:
            return await scorer.score(batch)
        finally:
            await scorer.close()

    return asyncio.run(go())


def test_conversational_rows_give_trl_message_prompts_and_assistant_completions(tmp_path):
    SEEN.clear()
    outcomes = _score(_items(tmp_path))
    assert [o.error for o in outcomes] == ["", ""]
    assert [o.reward for o in outcomes] == [1.0, 0.0]  # "41" != "42": the function really read the content
    prompts = [p for call in SEEN for p in call["prompts"]]
    completions = [c for call in SEEN for c in call["completions"]]
    assert prompts == [ROWS[0]["prompt"], ROWS[1]["prompt"]]  # the rows' own messages, not the rendered text
    assert completions == [[{"role": "assistant", "content": "it is 68"}], [{"role": "assistant", "content": "41"}]]
    # the dataset's other columns still arrive as keywords; the messages are not passed twice as `prompt`
    assert all("level" in call["kwargs"] and "prompt" not in call["kwargs"] for call in SEEN)


def test_the_messages_survive_the_reward_wire_so_a_remote_service_sees_a_conversation(tmp_path):
    SEEN.clear()
    request = RewardRequest(request_id="r1", items=_items(tmp_path))
    received = decode(encode(request), RewardRequest)  # what serve-reward decodes from the ZeroMQ frame
    assert received.items[1].columns["prompt"] == ROWS[1]["prompt"]
    outcomes = _score(received.items)
    assert [o.reward for o in outcomes] == [1.0, 0.0]
    assert SEEN[-1]["completions"][-1] == [{"role": "assistant", "content": "41"}]


def test_text_rows_keep_text_prompts_and_completions(tmp_path):
    SEEN.clear()
    columns = reward_columns({"solution": "68"}, "23+45=")
    assert columns == {"solution": "68"}  # a text prompt adds no column
    (outcome,) = _score([RewardItem(sample_id="t0", prompt="23+45=", response="68", reference="68", columns=columns)])
    assert SEEN[-1]["prompts"] == ["23+45="]
    assert SEEN[-1]["completions"] == ["68"]  # plain text, not a message list
    # so a conversational-only function fails on it, naming the error, instead of scoring garbage
    assert "TypeError" in outcome.error and "conversational_accuracy" in outcome.error
