"""The RM training config (``streamrft train-rm CONFIG [k=v ...]``): its own typed tree, unknown keys fail.

Loaded like the RL config: YAML/TOML, then dotted overrides (``streamrft.config.apply_overrides``),
then ``msgspec.convert`` into :class:`RMTrainConfig`; ``validate_rm_config`` only raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from streamrft.config.base import ConfigError, Section


class RMModelConfig(Section):
    path: str = ""  # backbone: a Hugging Face causal LM directory (SRM) / the judge's initial LM (GRM)
    layer: int = -1  # SRM: hidden-state layer that is pooled (0 = embeddings, -1 = last)
    pooling: Literal["last", "attention"] = "last"  # SRM: last non-pad token, or learned attention pooling
    num_heads: int = 1  # SRM: linear reward heads; the reward is their mean, the loss their mean loss


class RMDataConfig(Section):
    train_path: str = ""  # jsonl/parquet: prompt, chosen, rejected[, margin, tie] (SRM); prompt, responses, judgment (GRM)
    eval_path: str = ""  # held-out rows of the same shape; "" = hold out eval_fraction of train_path
    eval_fraction: float = 0.1  # share of train rows held out when eval_path is ""
    # media of each row, by path (as the RL data keys; a Qwen2-VL / Qwen2-Audio model.path reads them with the prompt)
    image_field: str = ""  # row field with image(s): path, bytes, base64 data URI or list of them; "" = none
    video_field: str = ""  # row field with a video: list of frame images or a video file (PyAV); "" = none
    audio_field: str = ""  # row field with audio clip(s): wav/flac path(s); "" = none
    max_video_frames: int = 16  # videos keep this many evenly spaced frames; 0 = all
    video_fps: float = 0.0  # video files are sampled at this many frames per second first; 0 = every frame


class RMTrainSection(Section):
    steps: int = 500  # optimizer steps
    batch_size: int = 32  # pairs (SRM) or judgment rows (GRM) per step
    lr: float = 1e-3  # AdamW peak learning rate
    lr_schedule: Literal["constant", "cosine"] = "constant"  # SRM: constant, or cosine decay to 0 over train.steps
    weight_decay: float = 0.0  # SRM: AdamW weight decay
    loss: Literal["bradley_terry", "log_exp", "hps"] = "bradley_terry"  # SRM pair loss (streamrft.rm.losses)
    temperature: float = 1.0  # hps loss temperature (> 0)
    grad_clip: float = 1.0  # SRM: max global grad norm; 0 = off
    lm_coef: float = 0.0  # SRM: weight of an auxiliary next-token loss on the chosen responses (text: tied-embedding backbones)
    log_every: int = 50  # steps between log lines / train.jsonl records


class GRMConfig(Section):
    template: str = "Q:{prompt} A:{a} B:{b} V:"  # judge prompt for two responses ({prompt}, {a}, {b})
    single_template: str = "Q:{prompt} A:{a} V:"  # judge prompt for one response (pointwise scores)
    max_new_tokens: int = 8  # verdict length cap when judging


class RMTrainConfig(Section):
    kind: Literal["srm", "grm"] = "srm"  # scalar reward model or generative judge
    seed: int = 0  # data order and head init
    output_dir: str = "runs/rm"  # the trained RM directory (ScalarRewardModel / GenerativeJudge .from_pretrained)
    model: RMModelConfig = msgspec.field(default_factory=RMModelConfig)
    data: RMDataConfig = msgspec.field(default_factory=RMDataConfig)
    train: RMTrainSection = msgspec.field(default_factory=RMTrainSection)
    grm: GRMConfig = msgspec.field(default_factory=GRMConfig)


def media_fields(data) -> dict:
    """The media settings of an RM data section (or of a saved RM's rm.json "media" entry): what ``rm.json``
    records so that eval-rm, ``type: model`` rewards and serve-reward read rows and items the same way."""
    keys = ("image_field", "video_field", "audio_field", "max_video_frames", "video_fps")
    return {k: (data.get(k) if isinstance(data, dict) else getattr(data, k)) for k in keys}


def check_media_backbone(model_dir: str, data) -> None:
    """ConfigError when the media fields do not fit the backbone: images/videos need a Qwen2-VL model,
    audio a Qwen2-Audio model, and a multimodal backbone needs its media field (reads config.json only)."""
    from transformers import AutoConfig

    model_type = getattr(AutoConfig.from_pretrained(model_dir), "model_type", "")
    visual = [f"data.{k}={getattr(data, k)!r}" for k in ("image_field", "video_field") if getattr(data, k)]
    audio = [f"data.audio_field={data.audio_field!r}"] if data.audio_field else []
    if visual and model_type != "qwen2_vl":
        raise ConfigError(f"{', '.join(visual)} needs a vision-language backbone (Qwen2-VL), but model.path="
                          f"{model_dir} is a {model_type!r} model; set model.path to a Qwen2-VL directory or clear the field")
    if audio and model_type != "qwen2_audio":
        raise ConfigError(f"{audio[0]} needs an audio-language backbone (Qwen2-Audio), but model.path={model_dir} "
                          f"is a {model_type!r} model; set model.path to a Qwen2-Audio directory or clear the field")
    if model_type in ("qwen2_vl", "qwen2_audio") and not (visual or audio):
        need = "data.image_field or data.video_field" if model_type == "qwen2_vl" else "data.audio_field"
        raise ConfigError(f"model.path={model_dir} is a {model_type} model but no media field is set; set {need} "
                          "(the row field that holds each prompt's media)")


def check_tied_lm_head(model_dir: str, lm_coef: float) -> None:
    """ConfigError when ``train.lm_coef > 0`` but a text backbone's LM head is not tied to its input embedding:
    a text SRM keeps no LM head of its own, so the auxiliary loss reads logits through the embedding
    (ScalarRewardModel.lm_logits); checked on config.json, before any weights load."""
    from transformers import AutoConfig

    if not getattr(AutoConfig.from_pretrained(model_dir), "tie_word_embeddings", False):
        raise ConfigError(f"train.lm_coef={lm_coef} needs a backbone whose LM head is tied to its input embedding, "
                          f"but model.path={model_dir} has tie_word_embeddings=false; set train.lm_coef=0")


def load_rm_config(path: str | Path | None, overrides: list[str] | None = None) -> RMTrainConfig:
    """Read YAML/TOML, apply dotted overrides, type-check every key (unknown keys fail)."""
    from streamrft.config import load_typed_config

    return load_typed_config(path, overrides, RMTrainConfig, "rm config")


def validate_rm_config(cfg: RMTrainConfig, check_paths: bool = True) -> None:
    """Raise ConfigError for settings that cannot run. Only raises."""
    t = cfg.train
    if t.steps < 0 or t.batch_size < 1 or t.lr <= 0:
        raise ConfigError(f"train.steps={t.steps} (>= 0), train.batch_size={t.batch_size} (>= 1), "
                          f"train.lr={t.lr} (> 0): fix the one out of range")
    if t.lm_coef < 0:
        raise ConfigError(f"train.lm_coef={t.lm_coef} must be >= 0 (0 = no auxiliary LM loss)")
    if t.temperature <= 0:
        raise ConfigError(f"train.temperature={t.temperature} must be > 0")
    for key, value in (("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip),
                       ("train.log_every", t.log_every)):
        if value < 0:  # a negative decay grows the weights; a negative clip or log period is no setting
            raise ConfigError(f"{key}={value} must be >= 0 (0 = off)")
    if cfg.kind == "grm":
        # The judge trains with the supervised warm-up loop (plain AdamW, constant lr): SRM-only keys must
        # keep their defaults rather than be silently ignored.
        defaults = RMTrainConfig()
        for key in ("model.layer", "model.pooling", "model.num_heads", "train.loss", "train.temperature",
                    "train.lr_schedule", "train.weight_decay", "train.grad_clip", "train.lm_coef"):
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            if value != getattr(getattr(defaults, section), name):
                raise ConfigError(f"{key}={value!r} applies to scalar RMs only (kind=srm); remove it for kind=grm")
    if cfg.model.num_heads < 1:
        raise ConfigError(f"model.num_heads={cfg.model.num_heads} must be >= 1")
    if not 0.0 < cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction} must be in (0, 1)")
    if not cfg.model.path:
        raise ConfigError("model.path is empty; set it to a Hugging Face causal LM directory")
    if not cfg.data.train_path:
        raise ConfigError("data.train_path is empty; set it to a jsonl/parquet file of training rows")
    for key in ("{prompt}", "{a}", "{b}"):
        if key not in cfg.grm.template:
            raise ConfigError(f"grm.template={cfg.grm.template!r} lacks {key}")
    d = cfg.data
    if d.max_video_frames < 0 or d.video_fps < 0:
        raise ConfigError(f"data.max_video_frames={d.max_video_frames} and data.video_fps={d.video_fps} must be >= 0")
    if check_paths:
        from streamrft.models.hub import resolve_model_dir

        try:
            model_dir = resolve_model_dir(cfg.model.path, "model.path")  # a directory or a cached hub id
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_media_backbone(model_dir, d)
        if t.lm_coef > 0 and not any(getattr(d, k) for k in ("image_field", "video_field", "audio_field")):
            check_tied_lm_head(model_dir, t.lm_coef)  # a media RM keeps its backbone's own LM head
        for key, value in (("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)):
            if value and not Path(value).is_file():
                raise ConfigError(f"{key}={value} does not exist (relative to {Path.cwd()})")
