"""Issue 18 acceptance (multi-turn core): a scripted environment and a scripted tool through the real tiny
model and the real learner. The sample's ids are the concatenation of every turn's ids, the loss mask
covers exactly the model's tokens, and loss and gradients equal those computed on the model tokens alone;
every estimator of the algorithm matrix trains with the masks, per-turn credit runs over the model-token
subsequence (checked against an independent loop)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from protocols import Completion, ScoredSample
from streamrft.config import load_config
from streamrft.engines.hf import HFEngine
from streamrft.envs import EnvStep, load_environment
from streamrft.envs.episode import run_episode, turn_seed
from streamrft.envs.render import ObservationRenderer
from streamrft.engines.base import GenerationRequest
from streamrft.learner.actor import ActorUpdate
from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy
from streamrft.runtime.distributed import all_reduce_sum
from streamrft.runtime.feed import TrainSample

torch.set_num_threads(1)
EOS = 1
SEEDS = (7, 3, 11, 2)  # run seed, step, prompt index, sample index


class CalcTool:
    """A scripted tool environment: turn k's observation is a tool result of the model's text length;
    the second call 'times out' (a tool error with a reason); done after the third model turn."""

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, row: dict) -> str | None:
        return None

    async def step(self, action: str) -> EnvStep:
        self.turn += 1
        if self.turn == 3:
            return EnvStep(observation=None, reward=1.0, done=True)
        failed = self.turn == 2
        return EnvStep(observation=f"={len(action)}", reward=0.25 * self.turn, role="user",
                       info={"tool_calls": 1, "tool_errors": int(failed), "tool_seconds": 0.5,
                             "tool_error_reason": "timeout" if failed else ""})

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tinychat"))
    tok = build_char_tokenizer(d, "0123456789+-= abcdefghij", chat=True)
    return build_tiny_qwen2(d, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=128)


@pytest.fixture(scope="module")
def episode(model_dir):
    """(episode, prompt ids, tokenizer, engine) of one CalcTool episode on the real tiny model."""
    module, tok = load_policy(model_dir)
    cfg = load_config(None, ["engine.max_new_tokens=6", "engine.temperature=1.0"])
    engine = HFEngine(module, cfg.engine, eos_token_ids=[EOS], pad_token_id=0, device=torch.device("cpu"))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "12+3"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    env = load_environment(f"{__name__}:CalcTool")()
    ep = asyncio.run(run_episode(env, engine, ObservationRenderer(tok), prompt, "s0", SEEDS, max_turns=4,
                                 max_tokens=60, max_new_tokens=6))
    return ep, prompt, tok, engine


def test_episode_ids_are_every_turns_ids_concatenated_and_the_mask_covers_the_model_tokens(episode):
    ep, prompt, tok, engine = episode
    # independently: each model turn re-generated from its context with its own seed, each observation
    # rendered by hand from the tiny template ("<|user|>content<eos><|assistant|>", the turn's <eos> closing it)
    expected, mask, starts, context = [], [], [], list(prompt)
    for turn in range(3):
        (out,) = asyncio.run(engine.generate_all([GenerationRequest(
            f"check{turn}", context, seed=turn_seed(*SEEDS, turn), max_new_tokens=min(6, 60 - len(expected)))]))
        starts.append(len(expected))
        expected += out.response_ids
        mask += [1] * len(out.response_ids)
        if turn == 2:
            break
        closing = "" if out.response_ids[-1] == EOS else "<eos>"
        text = tok.decode(out.response_ids, skip_special_tokens=True)
        obs = tok.encode(f"{closing}<|user|>={len(text)}<eos><|assistant|>", add_special_tokens=False)
        expected += obs
        mask += [0] * len(obs)
        context = prompt + expected
    assert ep.response_ids == expected
    assert ep.loss_mask == mask and 0 < sum(mask) < len(mask)
    assert ep.turn_starts == starts and ep.turns == 3
    assert ep.turn_rewards == [0.25, 0.5, 1.0]
    assert ep.observation_roles == ["user", "user"]
    assert all((lp == 0.0) == (m == 0) for lp, m in zip(ep.logprobs, ep.loss_mask))
    assert ep.info == {"tool_calls": 2.0, "tool_errors": 1.0, "tool_seconds": 1.0}
    assert ep.tool_error_reasons == ["timeout"]


def test_episode_metrics_count_turns_tool_calls_and_errors_by_reason(episode):
    from prometheus_client import generate_latest

    from streamrft.metrics.registry import PipelineMetrics

    m = PipelineMetrics(rank=0)
    m.observe_episode(episode[0])
    text = generate_latest(m.registry).decode()
    assert 'streamrft_env_turns_per_episode_count{rank="0"} 1.0' in text
    assert 'streamrft_env_turns_per_episode_sum{rank="0"} 3.0' in text
    assert 'streamrft_env_tool_calls_total{rank="0"} 2.0' in text
    assert 'streamrft_env_tool_errors_total{rank="0",reason="timeout"} 1.0' in text
    assert 'streamrft_env_tool_seconds_sum{rank="0"} 1.0' in text


def _cfg(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "train.lr=1e-3", "train.grad_clip=0",
                              "train.micro_batch_tokens=4096", "engine.max_new_tokens=6", *extra])


def _sample(ep, prompt, reward=1.0, adv=None, sample_index=0, env_turns=None) -> TrainSample:
    r = len(ep.response_ids)
    c = Completion(sample_id=f"g-{sample_index}", group_id="g", step=0, prompt_index=0, sample_index=sample_index,
                   prompt_text="", response_text="", n_samples=2, finish_reason="stop", policy_version=0,
                   prompt_len=len(prompt), response_len=r, turns=ep.turns, turn_starts=ep.turn_starts,
                   turn_rewards=ep.turn_rewards)
    turns = sum(ep.turn_rewards) if env_turns is None else env_turns
    header = ScoredSample(completion=c, reward=reward + turns, reward_components={"env_turns": turns})
    return TrainSample(header=header, prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(ep.response_ids),
                       behaviour_logprobs=torch.tensor(ep.logprobs), advantages=adv,
                       loss_mask=torch.tensor(ep.loss_mask, dtype=torch.uint8))


def test_loss_and_gradients_equal_those_on_the_model_tokens_alone(dist, model_dir, episode):
    ep, prompt, _, _ = episode
    cfg = _cfg(model_dir)
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=10)
    actor = ActorUpdate(strategy, None, cfg, all_reduce_sum)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(len(ep.response_ids), generator=g)
    batch = [_sample(ep, prompt, adv=adv)]
    (mb,) = actor._microbatches(batch)
    n_model = float(sum(ep.loss_mask))
    assert float(mb["response_mask"].sum()) == n_model
    stats = strategy.forward_backward(mb, actor._loss_fn(n_model, 1.0), cfg.engine.temperature)

    # independent: the whole sequence as context, log-probs of the model tokens only, ppo_clip on-policy
    # (ratio 1, the gradient of -A * ratio is -A * grad logp), token-mean over the model tokens
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + ep.response_ids])
    logits = ref(input_ids=ids).logits[0, :-1].float() / cfg.engine.temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)[len(prompt) - 1:]
    model = torch.tensor(ep.loss_mask, dtype=torch.bool)
    ratio = torch.exp(logp[model] - logp[model].detach())
    loss = -(adv[model] * ratio).sum() / n_model
    loss.backward()
    assert stats["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    grads = dict(ref.named_parameters())
    strategy.release_gathered_weights()  # one rank keeps the weights gathered until the step (no .grad on them)
    for name, p in strategy.module.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(full, grads[name].grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    # the behaviour log-probs of the model tokens are the learner's own (token-in/token-out, same weights)
    torch.testing.assert_close(torch.tensor(ep.logprobs)[model], logp[model].detach(), atol=1e-5, rtol=0)


def _returns_over_model_tokens(rewards_by_pos: dict[int, float], n: int, gamma: float) -> list[float]:
    """G_j = sum_{k >= j} gamma^(k - j) r_k over the model-token subsequence (independent loop)."""
    out = []
    for j in range(n):
        out.append(sum(gamma ** (k - j) * rewards_by_pos.get(k, 0.0) for k in range(j, n)))
    return out


def test_per_turn_rewards_sit_at_each_turns_last_model_token_and_gaps_do_not_discount(dist, model_dir, episode):
    ep, prompt, _, _ = episode
    cfg = _cfg(model_dir, "algorithm.advantage_estimator=reinforce", "algorithm.gamma=0.9")
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=10)
    actor = ActorUpdate(strategy, None, cfg, all_reduce_sum)
    batch = [_sample(ep, prompt, reward=2.0)]
    mbs = actor._microbatches(batch)
    actor._batch_advantages(batch, mbs)
    mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
    got = mbs[0]["advantages"][0, len(prompt):len(prompt) + len(ep.response_ids)]
    assert torch.all(got[~mask] == 0)
    n = int(mask.sum())
    # turn ends in subsequence indices: model tokens of turns 0..k, minus one
    per_turn = [sum(ep.loss_mask[s:e]) for s, e in zip(ep.turn_starts, ep.turn_starts[1:] + [len(ep.loss_mask)])]
    ends = [sum(per_turn[:k + 1]) - 1 for k in range(3)]
    rewards = {ends[0]: 0.25, ends[1]: 0.5}
    rewards[ends[2]] = 1.0 + 2.0  # the last turn's reward and the reward sources' final reward
    want = _returns_over_model_tokens(rewards, n, 0.9)
    torch.testing.assert_close(got[mask], torch.tensor(want), atol=1e-6, rtol=0)


def test_gae_bootstraps_across_turns_from_the_next_model_token_value(dist, model_dir, episode):
    ep, prompt, _, _ = episode
    cfg = _cfg(model_dir, "algorithm.advantage_estimator=gae", "algorithm.gamma=0.95", "algorithm.lam=0.9")
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=10)
    actor = ActorUpdate(strategy, None, cfg, all_reduce_sum)
    batch = [_sample(ep, prompt, reward=1.0)]
    mbs = actor._microbatches(batch)
    g = torch.Generator().manual_seed(1)
    values = torch.randn(mbs[0]["response_mask"].shape, generator=g)
    mbs[0]["old_values"] = values  # at every position; only the model positions may be read
    actor._batch_advantages(batch, mbs)
    mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
    sl = slice(len(prompt), len(prompt) + len(ep.response_ids))
    v = values[0, sl][mask].tolist()
    n = len(v)
    per_turn = [sum(ep.loss_mask[s:e]) for s, e in zip(ep.turn_starts, ep.turn_starts[1:] + [len(ep.loss_mask)])]
    ends = [sum(per_turn[:k + 1]) - 1 for k in range(3)]
    r = [0.0] * n
    r[ends[0]] += 0.25
    r[ends[1]] += 0.5
    r[ends[2]] += 1.0 + 1.0
    adv, nxt_a = [0.0] * n, 0.0
    for j in range(n - 1, -1, -1):
        delta = r[j] + 0.95 * (v[j + 1] if j + 1 < n else 0.0) - v[j]
        nxt_a = delta + 0.95 * 0.9 * nxt_a
        adv[j] = nxt_a
    got = mbs[0]["advantages"][0, sl]
    assert torch.all(got[~mask] == 0)
    torch.testing.assert_close(got[mask], torch.tensor(adv), atol=1e-5, rtol=0)


ESTIMATORS = {
    "group_norm": [], "dr_grpo": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"], "rloo": [],
    "reinforce_baseline": [], "cpgd": ["algorithm.policy_loss=cpg"], "reinforce": [],
    "reinforce++": ["algorithm.whiten_advantages=true", "algorithm.kl_coef=0.05", "algorithm.kl_mode=reward"],
    "gae": ["algorithm.lam=0.95"],  # with a real critic (the tiny model + value head)
    "group_norm+packing": ["train.packing=true", "algorithm.kl_coef=0.05"],  # packed rows; KL in the loss
}


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_trains_with_masks_and_ignores_observation_positions(dist, model_dir, episode, estimator):
    """One tiny step per estimator (with TIS on, so the behaviour log-probs matter): finite, and the same
    loss and gradient norm when the observation positions' behaviour log-probs and advantages are garbage."""
    from streamrft.algorithms import one_group_advantages

    ep, prompt, _, _ = episode
    from streamrft.learner.critic import Critic
    from streamrft.learner.reference import FrozenReference

    critic_path = [f"model.critic_path={model_dir}"] if estimator == "gae" else []
    cfg = _cfg(model_dir, f"algorithm.advantage_estimator={estimator.split('+')[0]}", "algorithm.tis_mode=token",
               *ESTIMATORS[estimator], *critic_path)
    obs = ~torch.tensor(ep.loss_mask, dtype=torch.bool)
    results = []
    for garbage in (False, True):
        strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=10)
        reference = FrozenReference(model_dir, cfg.model, dist) if cfg.algorithm.kl_coef > 0 else None
        critic = Critic(cfg.model, cfg.train, cfg.algorithm.value_clip_eps, dist, 10) if critic_path else None
        actor = ActorUpdate(strategy, reference, cfg, all_reduce_sum, critic)
        rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
        if actor.estimator.scope == "group":
            advs = one_group_advantages(rewards, [len(ep.response_ids)] * 2, cfg.algorithm)
        else:
            advs = [None, None]
        batch = [_sample(ep, prompt, reward=float(rw), adv=a, sample_index=i) for i, (rw, a) in enumerate(zip(rewards, advs))]
        if garbage:
            for s in batch:
                s.behaviour_logprobs = s.behaviour_logprobs.masked_fill(obs, -40.0)
                if s.advantages is not None:
                    s.advantages = s.advantages.masked_fill(obs, 1e3)
        out = actor.train_step(batch)
        assert all(torch.isfinite(torch.tensor(v)) for v in out.values()), out
        assert out["train_tokens"] == 2 * float(sum(ep.loss_mask))
        if reference is not None:
            assert "kl" in out and math.isfinite(out["kl"])
        if critic is not None:
            assert out["value_loss"] > 0
        results.append((out["loss"], out["grad_norm"]) + ((out["value_loss"],) if critic is not None else ()))
    assert results[0][1] > 0
    assert results[1] == pytest.approx(results[0], abs=1e-6)


def test_concurrent_episodes_share_engine_calls_per_turn_and_keep_their_own_tokens(episode):
    """TurnBatcher: four episodes whose turns end together (at the token limit) decode each turn in one
    engine call, and every episode's ids are those it has when run alone (per-request seeds)."""
    from streamrft.envs.episode import TurnBatcher

    _, prompt, tok, engine = episode
    calls = []

    class Counting:
        def generate(self, requests, mm_inputs=None):
            calls.append(len(requests))
            return engine.generate(requests)

    def env():
        return load_environment("scripted", observations=["1", "2"], role="user")()

    async def batched():
        batcher = TurnBatcher(Counting(), window_s=5.0)  # a long window: only "everyone is waiting" flushes
        for _ in range(4):
            batcher.enter()

        async def one(j):
            try:
                return await run_episode(env(), batcher, ObservationRenderer(tok), prompt, f"b{j}", (1, 0, 0, j),
                                         max_turns=3, max_tokens=60, max_new_tokens=2)
            finally:
                batcher.leave()
        return await asyncio.gather(*(one(j) for j in range(4)))

    together = asyncio.run(batched())
    alone = [asyncio.run(run_episode(env(), engine, ObservationRenderer(tok), prompt, f"a{j}", (1, 0, 0, j),
                                     max_turns=3, max_tokens=60, max_new_tokens=2)) for j in range(4)]
    assert calls == [4, 4, 4]
    assert [e.response_ids for e in together] == [e.response_ids for e in alone]
    assert len({tuple(e.response_ids) for e in together}) > 1  # the seeds differ per sample


def test_an_episode_is_cut_at_the_models_positions_and_an_engine_failure_is_not_an_environment_error(episode):
    from streamrft.envs.episode import EngineTurnError

    _, prompt, tok, engine = episode
    env = load_environment("scripted", observations=["1"] * 10, role="user")()
    ep = asyncio.run(run_episode(env, engine, ObservationRenderer(tok), prompt, "c", SEEDS, max_turns=10,
                                 max_tokens=100, max_new_tokens=6, context_limit=len(prompt) + 15))
    assert ep.finish_reason == "length" and len(prompt) + len(ep.response_ids) <= len(prompt) + 15
    assert ep.turns >= 2  # cut by the positions, not by max_turns or max_tokens

    class Broken:
        async def generate_all(self, requests):
            raise RuntimeError("device lost")

    with pytest.raises(EngineTurnError, match=r"model turn 0 of e \(\d+ context tokens\): RuntimeError: device lost"):
        asyncio.run(run_episode(load_environment("scripted")(), Broken(), ObservationRenderer(tok), prompt, "e", SEEDS,
                                max_turns=2, max_tokens=20, max_new_tokens=6))


def test_an_environment_step_that_never_returns_ends_in_an_error_naming_the_call(episode):
    from streamrft.envs.episode import EnvTimeoutError

    _, prompt, tok, engine = episode

    class Hangs(CalcTool):
        async def step(self, action):
            await asyncio.sleep(3600)

    with pytest.raises(EnvTimeoutError, match=r"^Hangs.step \(turn 0\) did not return within 0.2s \(rollout.stage_timeout_s\)$"):
        asyncio.run(run_episode(Hangs(), engine, ObservationRenderer(tok), prompt, "h", SEEDS, max_turns=2,
                                max_tokens=20, max_new_tokens=3, call_timeout_s=0.2))
