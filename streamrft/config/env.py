"""``env:``: multi-turn rollouts against an environment (issue 18; docs/agents.md).

``env.name`` empty keeps today's single-turn rollouts. Set, every sample is an episode: model turn,
``env.step``, observation rendered with the chat template, ... up to ``env.max_turns`` model turns and
``env.max_tokens`` tokens on the response side (model and observation tokens together).
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamrft.config.base import ConfigError, Section


class EnvConfig(Section):
    name: str = ""  # "" = single-turn; a registered environment (scripted, echo, tools, ...) or module:Class / file.py:Class
    max_turns: int = 4  # model turns per episode at most (the episode ends earlier when the environment says done)
    max_tokens: int = 1024  # token budget of an episode's whole response side (model + observation tokens)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)  # keyword arguments of the environment class
    address: str = ""  # a remote environment service (streamrft serve-env, tcp://host:port); "" = in process
    timeout_s: float = 30.0  # env.address only: per request to the service (reset, step, close)
    retries: int = 3  # env.address only: retries of a request without a reply in time (same episode and turn)


def validate_env(cfg, check_paths: bool = True) -> None:
    """Settings of ``env`` that cannot run, checked before any model is loaded: the environment is resolved
    (name or module:Class imported, kwargs matched against its signature, one instance built) but no episode
    is started."""
    e = cfg.env
    if not e.name:
        defaults = EnvConfig()
        for key in ("max_turns", "max_tokens", "address", "timeout_s", "retries"):  # each would do nothing
            if getattr(e, key) != getattr(defaults, key):
                raise ConfigError(f"env.{key}={getattr(e, key)!r} is set but env.name is empty (single-turn "
                                  "rollouts); set env.name to an environment or remove env.{key}".replace("{key}", key))
        if e.kwargs:
            raise ConfigError("env.kwargs is set but env.name is empty (single-turn rollouts); set env.name or remove env.kwargs")
        return
    if e.max_turns < 1:
        raise ConfigError(f"env.max_turns={e.max_turns} must be >= 1 (model turns per episode)")
    if e.max_tokens < 1:
        raise ConfigError(f"env.max_tokens={e.max_tokens} must be >= 1 (the episode's response-side token budget)")
    if e.max_tokens < cfg.engine.max_new_tokens:
        raise ConfigError(f"env.max_tokens={e.max_tokens} is below engine.max_new_tokens={cfg.engine.max_new_tokens}: "
                          "one model turn alone could pass the episode's budget; raise env.max_tokens or lower "
                          "engine.max_new_tokens")
    if cfg.data.image_field or cfg.data.video_field or cfg.data.audio_field:
        raise ConfigError("env.name with media prompts (data.image_field / video_field / audio_field) is not "
                          "supported yet: episodes render text observations after text prompts")
    if cfg.engine.type != "hf":
        raise ConfigError(f"env.name={e.name!r} needs engine.type=hf (token-in/token-out turns); engine.type="
                          f"{cfg.engine.type!r} is not supported for multi-turn rollouts yet")
    if cfg.data.chat_template == "none":
        raise ConfigError(f"env.name={e.name!r} renders observations with the chat template, but "
                          "data.chat_template=none; set data.chat_template=auto (the tokenizer's) or to a Jinja file")
    if not e.address:
        for key, default in (("timeout_s", 30.0), ("retries", 3)):
            if getattr(e, key) != default:
                raise ConfigError(f"env.{key}={getattr(e, key)!r} is set but env.address is empty (an in-process "
                                  f"environment); env.{key} applies to requests to a serve-env service only")
    if e.address:
        if not e.address.startswith(("tcp://", "ipc://", "http://")):
            raise ConfigError(f"env.address={e.address!r} must be tcp://host:port, ipc://path or http://host:port "
                              "(a streamrft serve-env service), or empty for an in-process environment")
        if not e.timeout_s > 0 or e.retries < 0:
            raise ConfigError(f"env.timeout_s={e.timeout_s} must be > 0 and env.retries={e.retries} >= 0")
        if check_paths and cfg.model.path:
            _check_renderer(cfg, ("user",))  # the service's roles are not known here; user at least
        return  # the service resolves the name; nothing to import here
    from streamrft.envs.base import EnvSpecError, load_environment

    try:
        # one instance is built (not reset): a constructor that refuses its kwargs fails here, not mid-run;
        # constructors must be cheap and hold no resources (those belong in reset), see docs/agents.md
        env = load_environment(e.name, **e.kwargs)()
    except EnvSpecError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # the module's own code failed while importing, or the class refused its kwargs
        raise ConfigError(f"env.name={e.name!r}: {type(exc).__name__}: {exc}") from None
    if check_paths and cfg.model.path:
        # the roles the environment answers with (an optional ``observation_roles`` attribute; user by default)
        _check_renderer(cfg, tuple(getattr(env, "observation_roles", None) or ("user",)))


def _check_renderer(cfg, roles: tuple[str, ...]) -> None:
    """The chat template can render an observation message of each of ``roles`` token-in/token-out: told
    now, from the tokenizer files alone, not after the model is loaded."""
    from streamrft.envs.render import ObservationRenderer
    from streamrft.models.hub import resolve_model_dir

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model.path, "model.path"))
    except (ValueError, OSError):  # a bad model path is reported by validate_model with its own message
        return
    try:
        renderer = ObservationRenderer(tokenizer, cfg.data.chat_template)
        for role in roles:
            renderer.check(role)
    except ValueError as exc:
        raise ConfigError(f"env.name={cfg.env.name!r}, model.path={cfg.model.path}: {exc}") from None
