"""The ``streamrft eval`` config: a typed section (unknown keys fail), YAML + dotted overrides or flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from streamrft.config.base import ConfigError, Section


class EvalConfig(Section):
    model_path: str = ""  # policy: a Hugging Face causal LM directory or a hub id in the local HF cache
    data_path: str = ""  # benchmark rows (jsonl/parquet) with prompt_key and reference_key fields (dotted paths allowed)
    format: Literal["arith", "gsm8k", "math", "choice"] = "gsm8k"  # answer extraction (streamrft.evaluate.answers)
    prompt_key: str = "prompt"  # row field holding the prompt text
    reference_key: str = "reference"  # row field holding the reference answer
    prompt_template: str = "{prompt}"  # text given to the model; {prompt} is the row's prompt (text prompts only)
    chat_template: str = "auto"  # message-list prompts: auto = the tokenizer's template | none = refuse | PATH = Jinja file
    system_prompt: str = ""  # prepended to message-list prompts as a system message
    n: int = 4  # samples per problem
    k: int = 4  # the k of pass@k and maj@k (1 <= k <= n)
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    max_new_tokens: int = 256  # response length cap
    max_batch_size: int = 256  # sequences decoded together
    limit: int = 0  # evaluate the first `limit` problems only; 0 = all
    seed: int = 0  # sampling seed (sample j of problem i uses seed * 1_000_003 + i * n + j)
    output_path: str = "runs/eval/results.jsonl"  # per-problem results; the summary goes to <output>.summary.json


def load_eval_config(path: str | Path | None, overrides: list[str] | None = None) -> EvalConfig:
    from streamrft.config import load_typed_config

    return load_typed_config(path, overrides, EvalConfig, "eval config")


def validate_eval_config(cfg: EvalConfig) -> None:
    """Raise ConfigError for settings that cannot run. Only raises."""
    from streamrft.models.hub import resolve_model_dir

    try:
        resolve_model_dir(cfg.model_path, "model_path")  # a directory or a hub id in the local HF cache
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from streamrft.data.rows import is_datasets_source

    if not cfg.data_path or not (Path(cfg.data_path).is_file() or is_datasets_source(cfg.data_path)):
        raise ConfigError(f"data_path={cfg.data_path!r} does not exist; give the benchmark file")
    if cfg.n < 1:
        raise ConfigError(f"n={cfg.n} must be >= 1 (samples per problem)")
    if not 1 <= cfg.k <= cfg.n:
        raise ConfigError(f"k={cfg.k} must be in [1, n={cfg.n}]; raise n or lower k")
    if cfg.temperature <= 0:
        raise ConfigError(f"temperature={cfg.temperature} must be > 0 (use n=1 with a low temperature for near-greedy)")
    from streamrft.data.chat import check_chat_setting

    try:
        check_chat_setting(cfg.chat_template)
    except ValueError as exc:
        raise ConfigError(str(exc).replace("data.chat_template", "chat_template")) from None
    if cfg.system_prompt and cfg.chat_template == "none":
        raise ConfigError("system_prompt is set but chat_template=none; set chat_template=auto or clear system_prompt")
    if "{prompt}" not in cfg.prompt_template:
        raise ConfigError(f"prompt_template={cfg.prompt_template!r} must contain {{prompt}}")
    if cfg.limit < 0:
        raise ConfigError(f"limit={cfg.limit} must be >= 0 (0 = all problems)")
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")


def max_positions(model_path: str) -> int | None:
    """The model's max_position_embeddings from its config.json (a VL model's text_config), read without
    loading the model; None when the config does not say."""
    from streamrft.models.hub import resolve_model_dir

    try:
        config = json.loads((Path(resolve_model_dir(model_path, "model_path")) / "config.json").read_text())
    except (OSError, ValueError) as exc:  # ValueError: resolve_model_dir's or json's
        raise ConfigError(f"model_path={model_path!r}: config.json cannot be read: {exc}") from None
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompt_lengths(cfg: EvalConfig, prompt_lengths: list[int]) -> None:
    """Every prompt plus max_new_tokens must fit the model's positions (checked on the tokenized
    prompts, before the model is loaded): a ConfigError naming the longest row and both numbers."""
    limit = max_positions(cfg.model_path)
    if limit is None or not prompt_lengths:
        return
    if cfg.max_new_tokens >= limit:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt: the model in "
                          f"{cfg.model_path} has max_position_embeddings={limit} (prompt + response tokens); "
                          f"lower max_new_tokens (--max-new-tokens) below {limit} minus the longest prompt")
    row = max(range(len(prompt_lengths)), key=prompt_lengths.__getitem__)
    longest = prompt_lengths[row]
    if longest + cfg.max_new_tokens > limit:
        raise ConfigError(
            f"{cfg.data_path}: row {row}'s prompt is {longest} tokens; with max_new_tokens={cfg.max_new_tokens} that "
            f"is {longest + cfg.max_new_tokens} positions, more than the model's max_position_embeddings={limit} "
            f"({cfg.model_path}/config.json); set max_new_tokens (--max-new-tokens) to at most {limit - longest}"
            + (" or shorten that prompt" if limit - longest < 1 else "")
        )
