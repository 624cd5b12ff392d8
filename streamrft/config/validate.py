"""Cross-section checks. Each ``validate_*`` only raises ConfigError naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

from streamrft.config.base import ConfigError


def validate_rollout(cfg, world_size: int) -> None:
    r = cfg.rollout
    if r.n_samples_per_prompt < 1:
        raise ConfigError(f"rollout.n_samples_per_prompt={r.n_samples_per_prompt} must be >= 1")
    if r.prompts_per_step < 1:
        raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be >= 1")
    if r.prompts_per_step % world_size != 0:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by world_size={world_size}; "
            f"set rollout.prompts_per_step to a multiple of {world_size}"
        )
    if r.channel_capacity < r.n_samples_per_prompt:
        raise ConfigError(
            f"rollout.channel_capacity={r.channel_capacity} is smaller than one prompt group "
            f"(rollout.n_samples_per_prompt={r.n_samples_per_prompt}); raise rollout.channel_capacity"
        )
    if r.stage_timeout_s <= 0:
        raise ConfigError(f"rollout.stage_timeout_s={r.stage_timeout_s} must be > 0")
    if r.channel_transport not in ("inproc", "ipc", "tcp"):
        raise ConfigError(f"rollout.channel_transport={r.channel_transport!r}: choose inproc, ipc or tcp")
    from streamrft.config.rollout import validate_rollout_runtime

    validate_rollout_runtime(cfg, world_size)


def validate_sampling(e) -> None:
    """Sampling settings no engine can run (every engine calls this on its EngineConfig)."""
    if e.temperature <= 0:
        raise ConfigError(f"engine.temperature={e.temperature} must be > 0; use engine.top_k=1 for greedy")
    if not 0.0 < e.top_p <= 1.0:
        raise ConfigError(f"engine.top_p={e.top_p} must be in (0, 1]")
    if e.top_k < 0:
        raise ConfigError(f"engine.top_k={e.top_k} must be >= 0 (0 = off)")
    if e.max_new_tokens < 1:
        raise ConfigError(f"engine.max_new_tokens={e.max_new_tokens} must be >= 1")
    if e.max_batch_size < 1:
        raise ConfigError(f"engine.max_batch_size={e.max_batch_size} must be >= 1")
    if e.first_token_temperature < 0:
        raise ConfigError(f"engine.first_token_temperature={e.first_token_temperature} must be >= 0 (0 = off)")


def validate_engine(cfg) -> None:
    validate_sampling(cfg.engine)


def validate_train(cfg) -> None:
    t = cfg.train
    if t.max_steps < 0:
        raise ConfigError(f"train.max_steps={t.max_steps} must be >= 0")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be > 0")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        raise ConfigError(f"train.adam_betas={t.adam_betas} must be two numbers in [0, 1)")
    if t.micro_batch_tokens < 1:
        raise ConfigError(f"train.micro_batch_tokens={t.micro_batch_tokens} must be >= 1")
    if t.mini_batches_per_step < 1 or t.ppo_epochs < 1:
        raise ConfigError("train.mini_batches_per_step and train.ppo_epochs must be >= 1")
    if cfg.rollout.prompts_per_step % t.mini_batches_per_step != 0:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is not divisible by "
            f"train.mini_batches_per_step={t.mini_batches_per_step}"
        )


def validate_model(cfg) -> None:
    if not cfg.model.path:
        raise ConfigError("model.path is empty; set it to a Hugging Face model directory")
    p = Path(cfg.model.path)
    if not (p / "config.json").exists():
        raise ConfigError(
            f"model.path={cfg.model.path}: no config.json there; point model.path at a Hugging Face "
            "model directory (for the demo, `streamrft demo` builds one)"
        )


def validate_data(cfg) -> None:
    if not cfg.data.train_path:
        raise ConfigError("data.train_path is empty; set it to a jsonl or parquet file of prompts")
    for key in ("train_path", "eval_path"):
        value = getattr(cfg.data, key)
        if value and not Path(value).exists():
            raise ConfigError(f"data.{key}={value} does not exist")


def validate_all(cfg, world_size: int, check_paths: bool = True) -> None:
    """Settings first (they need nothing on disk), then files (model, data, reward models)."""
    from streamrft.algorithms.validate import validate_algorithm
    from streamrft.config.checkpoint import validate_checkpoint
    from streamrft.learner.lora import validate_lora
    from streamrft.rewards.validate import validate_reward, validate_reward_paths

    validate_rollout(cfg, world_size)
    validate_engine(cfg)
    validate_checkpoint(cfg)
    validate_train(cfg)
    try:
        validate_lora(cfg.model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.model.critic_path and cfg.algorithm.advantage_estimator != "gae":
        raise ConfigError(
            f"model.critic_path={cfg.model.critic_path} is set but algorithm.advantage_estimator="
            f"{cfg.algorithm.advantage_estimator} does not use a critic; set advantage_estimator=gae or clear critic_path"
        )
    if cfg.train.critic_lr <= 0:
        raise ConfigError(f"train.critic_lr={cfg.train.critic_lr} must be > 0")
    validate_algorithm(cfg)
    validate_reward(cfg)
    if check_paths:
        validate_model(cfg)
        validate_data(cfg)
        validate_reward_paths(cfg)
