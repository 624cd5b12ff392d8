"""Multi-turn episodes through the whole pipeline (Generator -> scorer -> advantage -> learner -> sinks):
env/* scalars in steps.jsonl, turns in the trajectory records, and an environment that raises fails its
sample (counted, named) while the run goes on."""

from __future__ import annotations

import json

from streamrft.config import load_config, validate_config
from streamrft.envs import EnvStep


class FlakyEnv:
    """A reset text, two user observations, then done; sample 1 of every group raises in its second step."""

    def __init__(self) -> None:
        self.turn, self.sample = 0, ""

    async def reset(self, row: dict) -> str | None:
        self.sample = row["sample_id"]
        return "go"  # appended to the message prompt as a user message

    async def step(self, action: str) -> EnvStep:
        self.turn += 1
        if self.turn == 2 and self.sample.endswith("-1"):
            raise RuntimeError("boom")
        if self.turn == 3:
            return EnvStep(observation=None, reward=1.0, done=True)
        return EnvStep(observation=f"n{self.turn}", reward=0.5, role="user",
                       info={"tool_calls": 1, "tool_errors": 0, "tool_seconds": 0.25})

    async def close(self) -> None:
        return None


def test_episodes_train_end_to_end_and_a_failing_environment_fails_only_its_sample(tmp_path):
    from streamrft.compose import train
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    model = tmp_path / "model"
    tok = build_char_tokenizer(str(model), "0123456789+= n", chat=True)
    build_tiny_qwen2(str(model), tok, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=32, max_position_embeddings=128)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1"}], "reference": str(i + 1)}) + "\n"
                            for i in range(8)))
    cfg = load_config(None, [
        f"model.path={model}", f"data.train_path={data}", f"data.eval_path={data}", "data.eval_size=4",
        f"output_dir={tmp_path / 'out'}",
        f"sinks.jsonl={tmp_path / 'traj'}", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.stage_timeout_s=60", "train.max_steps=2", "engine.max_new_tokens=4",
        "reward.sources=[{name: exact, type: rule, fn: gsm8k}]",
        f"env.name={__name__}:FlakyEnv", "env.max_turns=4", "env.max_tokens=40",
    ])
    validate_config(cfg)
    summary = train(cfg)
    assert summary["steps"] == 2
    assert summary["samples_admitted"] == 8 and summary["samples_trained"] == 4
    # held-out rows are greedy episodes too: 4 rows, "heldout-1" fails in its environment (scores 0, counted)
    for when in ("before", "after"):
        assert summary[f"heldout_n_{when}"] == 4 and summary[f"heldout_env_errors_{when}"] == 1
        assert summary[f"heldout_env_turns_mean_{when}"] == 3.0 and summary[f"heldout_env_tool_calls_{when}"] == 2.0

    steps = [json.loads(line) for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    for s in steps:
        assert s["env/turns_mean"] == 3.0 and s["env/tool_calls"] == 2.0 and s["env/tool_seconds"] == 0.5
        assert 0.0 < s["env/observation_token_fraction"] < 1.0
        assert s["reward_mean/env_turns"] == 2.0  # 0.5 + 0.5 + 1.0 over the three turns
    records = [json.loads(line) for f in sorted((tmp_path / "traj").glob("*.jsonl")) for line in f.read_text().splitlines()]
    trained = [r for r in records if r["status"] == "trained"]
    failed = [r for r in records if r["status"] == "failed"]
    assert len(trained) == 4 and len(failed) == 4
    for r in trained:
        assert r["prompt"].endswith("<eos><|user|>go<eos><|assistant|>") and r["prompt"].startswith("<|user|>")
        assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["policy_logprobs"]) == len(r["behaviour_logprobs"])
        assert r["turn_rewards"] == [0.5, 0.5, 1.0] and r["observation_roles"] == ["user", "user"]
        assert len(r["turn_starts"]) == 3 and r["turn_starts"][0] == 0
        obs = [i for i, m in enumerate(r["loss_mask"]) if m == 0]
        assert obs and all(r["policy_logprobs"][i] == 0.0 and r["behaviour_logprobs"][i] == 0.0 for i in obs)
        model = [i for i, m in enumerate(r["loss_mask"]) if m == 1]
        assert max(abs(r["policy_logprobs"][i] - r["behaviour_logprobs"][i]) for i in model) < 1e-4
    for r in failed:
        assert r["sample_id"].endswith("-1")
        assert r["reason"] == f"env_error: environment '{__name__}:FlakyEnv': RuntimeError: boom"
