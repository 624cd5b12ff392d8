"""Row media through the runtime: dataset row -> MediaRefs (what crosses processes) -> model inputs.

The Generator turns a row's media fields (``data.image_field`` / ``video_field`` / ``audio_field``) into
``protocols.pipeline.MediaRef``s (absolute path + sha256; inline bytes / data URIs are spilled once to a
content-addressed file), then decodes them into the processor inputs of the prompt
(``build_model_inputs``). The learner re-decodes the same refs (hash-checked), so pixels never travel
on a wire and both sides see byte-identical media.

Every failure is a ``MediaError`` naming file, row and field, e.g.
``"data/train.jsonl row 3 field 'image': cannot decode '/d/3.png' as an image (UnidentifiedImageError); ..."``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from protocols.pipeline import MediaRef
from streamrft.data.media import (
    MediaError,
    _image_bytes,
    _subsample,
    decode_audio,
    decode_image,
    decode_video_file,
    read_ref,
    sha256_bytes,
    split_videos,
    where,
)
from streamrft.models.multimodal import MEDIA_KEYS, build_model_inputs


def load_processor(path: str):
    """The saved processor of a multimodal model directory (AutoProcessor, with the tiny VL processor
    registered); None for a text-only model (its tokenizer is enough)."""
    from transformers import AutoConfig, AutoProcessor

    model_type = getattr(AutoConfig.from_pretrained(path), "model_type", "")
    if model_type not in ("qwen2_vl", "qwen2_audio"):
        return None  # before importing streamrft.models.vl: a text run never imports it
    from streamrft.models.vl import register_processors

    register_processors()
    return AutoProcessor.from_pretrained(path)


class MediaCodec:
    """``refs(row, file)`` -> list[MediaRef]; ``inputs(prompt, refs, loc)`` -> one prompt's model inputs."""

    def __init__(self, processor, image_field: str = "", video_field: str = "", audio_field: str = "",
                 spill_dir: str | None = None, max_video_frames: int = 0, video_fps: float = 0.0):
        self.processor = processor
        self.fields = {"image": image_field, "video_frame": video_field, "audio": audio_field}
        self.spill_dir = Path(spill_dir or os.path.join(tempfile.gettempdir(), "streamrft-media"))
        # data.max_video_frames / data.video_fps: applied where refs become frames (``inputs``), so the
        # Generator and the learner sample the same frames from the same hash-checked bytes
        self.max_video_frames, self.video_fps = max_video_frames, video_fps

    @classmethod
    def from_config(cls, processor, data_cfg, message_media: bool = False) -> MediaCodec | None:
        """None when no media field is configured and no prompt has media message parts (``message_media``):
        text runs keep their exact code path."""
        if not (data_cfg.image_field or data_cfg.video_field or data_cfg.audio_field or message_media):
            return None
        if processor is None:
            set_fields = [f"data.{k}={v!r}" for k, v in (("image_field", data_cfg.image_field),
                          ("video_field", data_cfg.video_field), ("audio_field", data_cfg.audio_field)) if v]
            what = (f"{', '.join(set_fields)} is set" if set_fields else
                    "the prompts have image / video / audio message parts")
            raise ValueError(f"{what} but model.path is a text-only model; set model.path "
                             "to a vision-language or audio-language model, or drop the media")
        return cls(processor, data_cfg.image_field, data_cfg.video_field, data_cfg.audio_field,
                   max_video_frames=data_cfg.max_video_frames, video_fps=data_cfg.video_fps)

    # ---- row -> refs (admission) ----------------------------------------------------------------------
    def refs(self, row, file) -> list[MediaRef]:
        out: list[MediaRef] = []
        for kind, name in self.fields.items():
            if not name:
                continue
            loc = where(str(file), row.row, name)
            if row.extra.get(name) is None:
                raise MediaError(f"{loc}: the row has no media field {name!r} (fields present: "
                                 f"{sorted(row.extra)}); fix the row or set data.{_config_key(kind)}")
            values = row.extra[name]
            if kind == "video_frame":
                for g, video in enumerate(split_videos(values)):
                    if isinstance(video, str) and not video.startswith("data:"):
                        out.append(self._ref(video, "video", name, loc, g))  # a video file, decoded in ``inputs``
                        continue
                    if not isinstance(video, (list, tuple)) or not video:
                        raise MediaError(f"{loc}: a video must be a video file path or a non-empty list of frame "
                                         f"images, got {type(video).__name__}")
                    out += [self._ref(v, "video_frame", name, loc, g) for v in video]
            else:
                for v in values if isinstance(values, (list, tuple)) else [values]:
                    out.append(self._ref(v, kind, name, loc))
        return out

    def part_refs(self, parts: list[tuple[str, object, str]], field: str) -> list[MediaRef]:
        """Refs of a message-list prompt's media parts (streamrft.data.chat.media_parts), in placeholder order,
        exactly as ``refs`` makes them for the same values in data.image_field / video_field / audio_field."""
        out: list[MediaRef] = []
        n_videos = 0
        for kind, value, loc in parts:
            if kind != "video":
                out.append(self._ref(value, kind, field, loc))
                continue
            if isinstance(value, str) and not value.startswith("data:"):
                out.append(self._ref(value, "video", field, loc, n_videos))
            elif isinstance(value, (list, tuple)) and value:
                out += [self._ref(v, "video_frame", field, loc, n_videos) for v in value]
            else:
                raise MediaError(f"{loc}: a video must be a video file path or a non-empty list of frame images, "
                                 f"got {type(value).__name__}")
            n_videos += 1
        return out

    def prompt(self, row, file, prompt_field: str, chat_template: str = "auto",
               system_prompt: str = "") -> tuple[str, list[MediaRef], dict[str, torch.Tensor]]:
        """(prompt text, media refs, model inputs) of a dataset row: a text prompt with the media of
        data.image_field / video_field / audio_field, or a message list whose content parts carry the media,
        rendered with the processor's chat template (``data.chat_template: auto``) or the configured one.
        The Generator and held-out evaluation both call this."""
        from streamrft.data.chat import is_messages, media_parts, render_prompt
        from streamrft.data.errors import DataError

        loc = f"{file}: row {row.row} field {prompt_field!r}"
        if not is_messages(row.prompt):
            refs = self.refs(row, file)
            return row.prompt, refs, self.inputs(row.prompt, refs, f"{file} row {row.row}")
        set_fields = [f"data.{_config_key(k)}" for k, v in self.fields.items() if v]
        if set_fields:
            raise DataError(f"{loc}: the prompt is a list of messages and {', '.join(set_fields)} is set; give "
                            "message prompts their media as content parts ({'type': 'image', 'image': PATH}, ...) "
                            "and clear the field, or give the prompt as text")
        parts = media_parts(row.prompt, loc)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        text = render_prompt(tokenizer, row.prompt, chat_template, system_prompt, loc,
                             default_template=getattr(self.processor, "chat_template", None) or None)
        refs = self.part_refs(parts, prompt_field)
        return text, refs, self.inputs(text, refs, f"{file} row {row.row}")

    def _ref(self, value, kind: str, field: str, loc: str, group: int = 0) -> MediaRef:
        if isinstance(value, str) and not value.startswith("data:"):
            data = _read(value, kind, loc)
            path = str(Path(value).resolve())
        else:  # bytes, data URI or {"path"|"bytes"}: spill inline bytes to a content-addressed file
            if isinstance(value, dict) and value.get("bytes") is None and value.get("path"):
                return self._ref(value["path"], kind, field, loc, group)
            data, _ = _image_bytes(value, loc)
            path = str(self._spill(data))
        return MediaRef(path=path, sha256=sha256_bytes(data), kind=kind, field=field, group=group)

    def _spill(self, data: bytes) -> Path:
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / sha256_bytes(data)
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(path)
        return path

    # ---- refs -> model inputs (Generator, learner, evaluation) ------------------------------------------
    def inputs(self, prompt: str, refs: list[MediaRef], loc: str) -> dict[str, torch.Tensor]:
        """``build_model_inputs`` of the prompt with its media decoded from ``refs`` (hash-checked);
        ``loc`` says where the prompt came from ("<file> row <n>" or "sample <id>")."""
        images, videos, audios = [], {}, []
        for ref in refs:
            where_ref = (f"{loc} field {ref.field!r}" if ref.field else loc) + f" (media file {ref.path!r})"
            data = read_ref(_as_data_ref(ref), where_ref)
            if ref.kind == "image":
                images.append(decode_image(data, where_ref))
            elif ref.kind == "video_frame":
                videos.setdefault(ref.group, []).append(decode_image(data, where_ref))
            elif ref.kind == "video":
                videos[ref.group] = decode_video_file(data, ref.path, where_ref, self.max_video_frames, self.video_fps)
            elif ref.kind == "audio":
                rate = self.processor.feature_extractor.sampling_rate
                audios.append(decode_audio(data, rate, where_ref))
            else:
                raise MediaError(f"{where_ref}: unknown media kind {ref.kind!r}")
        # frame lists get the same cap as files (a file's frames were capped as decoded: a no-op for them)
        clips = [_subsample(videos[g], self.max_video_frames) for g in sorted(videos)]
        sizes = [sorted({f.size for f in clip}) for clip in clips]
        for g, size in enumerate(sizes):
            if len(size) > 1:
                raise MediaError(f"{loc}: video {g} has frames of different sizes {size}; resize them to one size")
        try:
            return build_model_inputs(self.processor, prompt, {"images": images, "videos": clips, "audios": audios})
        except MediaError:
            raise
        except ValueError as exc:
            raise MediaError(f"{loc}: {exc}") from None


def media_tensors(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-prompt media tensors of ``inputs`` (pixel_values, image_grid_thw, input_features ...)."""
    return {k: inputs[k] for k in MEDIA_KEYS if k in inputs}


def _config_key(kind: str) -> str:
    return {"image": "image_field", "video_frame": "video_field", "audio": "audio_field"}[kind]


def _read(path: str, kind: str, loc: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise MediaError(f"{loc}: {kind} file {path!r} does not exist; fix the path or drop the row")
    return p.read_bytes()


def _as_data_ref(ref: MediaRef):
    """streamrft.data.media.read_ref takes its own MediaRef (kind in image|video|audio)."""
    from streamrft.data.media import MediaRef as DataRef

    return DataRef(path=ref.path, sha256=ref.sha256, kind="video" if ref.kind in ("video", "video_frame") else ref.kind)
