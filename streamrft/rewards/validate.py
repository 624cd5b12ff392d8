"""validate_reward: raise ConfigError for a reward section that cannot run. Only raises; imports nothing heavy
and opens nothing (custom modules are imported when the scorer is built, not here)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from streamrft.config.base import ConfigError
from streamrft.rewards.rules import RULES
from streamrft.rewards.sources import SOURCE_BUILDERS, check_protocol

_SPEC_RE = re.compile(r"^(?P<target>[^:]+\.py|[A-Za-z_][\w.]*):(?P<fn>[A-Za-z_]\w*)$")
_ADDRESS_RE = re.compile(r"^(tcp://[^:/]+:\d+|https?://[^/:]+(:\d+)?(/.*)?)$")


def validate_reward(cfg) -> None:
    """``cfg`` is the root Config. Empty ``reward.sources`` is allowed only for pure on-policy
    distillation (teacher.type set and teacher.mode=pure), where no task reward is used."""
    r = cfg.reward
    if r.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s={r.timeout_s} must be > 0")
    if r.max_concurrency < 1:
        raise ConfigError(f"reward.max_concurrency={r.max_concurrency} must be >= 1")
    if r.retries < 0:
        raise ConfigError(f"reward.retries={r.retries} must be >= 0 (0 = no retry)")
    if not 0.0 <= r.max_failed_fraction <= 1.0:  # also rejects NaN
        raise ConfigError(
            f"reward.max_failed_fraction={r.max_failed_fraction} must be in [0, 1] (the fraction of a step's samples a "
            "reward source may fail before the run stops; 1.0 = never stop)"
        )
    if not r.sources:
        if cfg.teacher.type != "none" and cfg.teacher.mode == "pure":
            return
        raise ConfigError(
            "reward.sources is empty; add at least one source, e.g. "
            "reward.sources: [{name: correct, type: rule, fn: gsm8k}] (only pure distillation, "
            "teacher.mode=pure, runs without one)"
        )
    seen: set[str] = set()
    for i, src in enumerate(r.sources):
        where = f"reward.sources[{i}] ({src.name!r})"
        if not src.name or not src.name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise ConfigError(
                f"reward.sources[{i}].name={src.name!r} must be a non-empty name of letters, digits, _ - ."
            )
        if src.name in seen:
            raise ConfigError(f"{where}: name is used twice; component names must be unique (rename one)")
        seen.add(src.name)
        _validate_weights(src, where)
        _validate_by_type(src, where)


def _validate_weights(src, where: str) -> None:
    if not math.isfinite(src.weight):
        raise ConfigError(f"{where}.weight={src.weight} must be a finite number")
    for label, w in src.label_weights.items():
        if not math.isfinite(w):
            raise ConfigError(f"{where}.label_weights[{label!r}]={w} must be a finite number")
        if src.labels and label not in src.labels:
            raise ConfigError(
                f"{where}.label_weights names label {label!r}, which is not in its labels {src.labels}; "
                "add it to labels or remove the weight"
            )


def validate_reward_paths(cfg) -> None:
    """File checks, run with validate_config(check_paths=True): model sources must be trained RMs, given as a
    directory or as a hub id in the local Hugging Face cache (resolved as model.path is: streamrft.models.hub)."""
    from streamrft.models.hub import resolve_model_dir

    for i, src in enumerate(cfg.reward.sources):
        if src.type != "model":
            continue
        key = f"reward.sources[{i}] ({src.name!r}).model_path"
        model_dir = src.model_path
        if not Path(model_dir).is_dir():  # a hub id in the local cache (a directory is checked for rm.json below)
            try:
                model_dir = resolve_model_dir(src.model_path, key)
            except ValueError as exc:
                raise ConfigError(f"{exc}; it must be a reward model written by `streamrft train-rm CONFIG`") from None
        if not (Path(model_dir) / "rm.json").is_file():
            raise ConfigError(
                f"{key}={src.model_path!r} is not a trained reward model (no rm.json"
                f"{'' if model_dir == src.model_path else f' in {model_dir}'}); train one with `streamrft train-rm CONFIG`"
            )
        _check_rm_media(cfg, key, Path(model_dir) / "rm.json")


def _check_rm_media(cfg, key: str, meta_path: Path) -> None:
    """A media RM (trained with data.image_field / video_field / audio_field) scores the prompt's media: the
    policy's data must give prompts the same kind of media (images or videos for a vision RM, audio for an
    audio RM), else every sample would fail at its first score."""
    import json

    media = json.loads(meta_path.read_text()).get("media") or {}
    if not any(media.get(k) for k in ("image_field", "video_field", "audio_field")):
        return  # a text RM scores prompt + response, with or without media
    d = cfg.data
    parts = _message_media_kinds(cfg)  # message prompts carry their media as content parts, with no data.*_field
    if (media.get("image_field") or media.get("video_field")) and not (
            d.image_field or d.video_field or parts & {"image", "video"}):
        raise ConfigError(f"{key}: the reward model reads each prompt's image/video (trained with "
                          f"data.image_field={media.get('image_field')!r}, data.video_field={media.get('video_field')!r}) "
                          "but this run's data has neither; set data.image_field or data.video_field")
    if media.get("audio_field") and not (d.audio_field or "audio" in parts):
        raise ConfigError(f"{key}: the reward model reads each prompt's audio (trained with data.audio_field="
                          f"{media['audio_field']!r}) but this run's data has none; set data.audio_field")


def _message_media_kinds(cfg) -> set[str]:
    """The media kinds ("image", "video", "audio") of row 0's prompt when it is a list of messages with media
    content parts; empty for text prompts or a row that cannot be read here (the data checks report that)."""
    from streamrft.data.chat import MEDIA_PART_KINDS, is_messages
    from streamrft.data.formats import field_mapping, get_field, written_roles
    from streamrft.data.rows import first_row, needs_datasets_library

    d = cfg.data
    if not d.train_path or needs_datasets_library(d.train_path):
        return set()
    row = first_row(d.train_path)
    if row is None:
        return set()
    try:
        _, fields = field_mapping(d.format, row, d.prompt_field, d.reference_field, d.label_field,
                                  written_roles(getattr(cfg, "_written", None)))
    except ValueError:
        return set()
    prompt = get_field(row, fields["prompt"], None)
    if not is_messages(prompt):
        return set()
    return {p["type"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") in MEDIA_PART_KINDS}


def _validate_by_type(src, where: str) -> None:
    if src.type not in SOURCE_BUILDERS:
        raise ConfigError(
            f"{where}.type={src.type!r} is not available yet; choose one of {sorted(SOURCE_BUILDERS)}"
        )
    if src.type == "model":
        if not src.model_path:
            raise ConfigError(f"{where}.model_path is empty; set it to a directory written by `streamrft train-rm` "
                              "(or its hub id in the local Hugging Face cache)")
    if src.type == "rule" and src.fn not in RULES:
        raise ConfigError(f"{where}.fn={src.fn!r} is not a rule; valid rules: {', '.join(sorted(RULES))}")
    if src.type == "custom":
        match = _SPEC_RE.match(src.fn)
        if not match:
            raise ConfigError(
                f"{where}.fn={src.fn!r} is not 'module:function' or 'path/to/file.py:function'"
            )
        target = match.group("target")
        if target.endswith(".py") and not Path(target).is_file():
            raise ConfigError(f"{where}.fn={src.fn!r}: file {target} does not exist (relative to {Path.cwd()})")
    if src.type == "remote":
        if not src.address:
            raise ConfigError(f"{where}.address is empty; a remote source needs tcp://host:port or http://host:port")
        if not _ADDRESS_RE.match(src.address):
            raise ConfigError(
                f"{where}.address={src.address!r} must be tcp://host:port (ZeroMQ) or http://host[:port][/path]"
            )
        check_protocol(src)  # protocol=openrlhf needs an http address
