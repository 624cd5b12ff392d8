"""Image, video and audio fields of dataset rows: decoding, resampling, and references that cross processes.

A row field holds media in one of these spellings:

- image: a file path (str), raw bytes, a base64 data URI (``"data:image/png;base64,..."``), or a dict
  ``{"path": ...}`` / ``{"bytes": ...}`` (the Hugging Face datasets image struct);
- video: a list of frame images (any image spelling above), or a video file path decoded with PyAV or
  torchcodec when one of them is importable;
- audio: a wav / flac file path (or bytes) read with soundfile, mixed down to mono and resampled to the
  processor's rate (``resample``: linear interpolation).

Every user error is a ``MediaError`` (a ValueError) that names the file, row and field, e.g.
``"train.jsonl row 3 field 'image': image file 'a.png' does not exist; fix the path or drop the row"``.

Messages that cross a process never carry pixels or samples: they carry ``MediaRef(path, sha256, kind)``;
the receiver reads the file and checks the hash (``read_ref``), so a file changed after admission is an
error, not a silent mismatch. ``encode_images_once`` turns a sample's image refs into the base64 strings of
``protocols.reward.RewardItem.images``, each distinct image exactly once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

MediaKind = Literal["image", "video", "audio"]
MEDIA_KINDS: tuple[str, ...] = ("image", "video", "audio")


class MediaError(ValueError):
    """A media field that cannot be read; the message names file, row and field."""


@dataclass(frozen=True)
class MediaRef:
    """A media file by reference: what a cross-process message carries instead of the decoded media."""

    path: str  # absolute path readable by every process of the run (shared filesystem)
    sha256: str  # hex digest of the file's bytes at admission time
    kind: str  # "image" | "video" | "audio"

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256, "kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict) -> MediaRef:
        return cls(path=str(d["path"]), sha256=str(d["sha256"]), kind=str(d["kind"]))


def where(file: str, row: int, field: str) -> str:
    """The location prefix of every media error: ``"<file> row <row> field '<field>'"``."""
    return f"{file} row {row} field {field!r}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_file(path: str, kind: str, loc: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise MediaError(f"{loc}: {kind} file {path!r} does not exist; fix the path or drop the row")
    return p.read_bytes()


def make_ref(path: str, kind: str, loc: str = "media") -> MediaRef:
    """Hash a file and return its reference (the path made absolute)."""
    if kind not in MEDIA_KINDS:
        raise MediaError(f"{loc}: media kind {kind!r} is not one of {', '.join(MEDIA_KINDS)}")
    data = _read_file(path, kind, loc)
    return MediaRef(path=str(Path(path).resolve()), sha256=sha256_bytes(data), kind=kind)


def read_ref(ref: MediaRef, loc: str = "media") -> bytes:
    """The referenced file's bytes, after checking that its content still has the recorded hash."""
    data = _read_file(ref.path, ref.kind, loc)
    digest = sha256_bytes(data)
    if digest != ref.sha256:
        raise MediaError(f"{loc}: {ref.kind} file {ref.path!r} changed since it was referenced (sha256 "
                         f"{digest[:12]}... != {ref.sha256[:12]}...); do not modify media files during a run")
    return data


# ---------------------------------------------------------------------------------------------- images


def _image_bytes(value: object, loc: str) -> tuple[bytes, str]:
    """(encoded bytes, a name for messages) of one image value in any accepted spelling."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return _image_bytes(value["bytes"], loc)
        if value.get("path") is not None:
            return _image_bytes(value["path"], loc)
        raise MediaError(f"{loc}: image dict has neither 'bytes' nor 'path' (keys: {sorted(value)}); "
                         "give {'path': ...} or {'bytes': ...}")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), "<bytes>"
    if isinstance(value, str):
        if value.startswith("data:"):
            head, _, payload = value.partition(",")
            if ";base64" not in head or not payload:
                raise MediaError(f"{loc}: data URI {head[:40]!r} is not base64; use 'data:image/png;base64,...'")
            try:
                return base64.b64decode(payload, validate=True), "<base64>"
            except binascii.Error as exc:
                raise MediaError(f"{loc}: invalid base64 in data URI ({exc})") from None
        return _read_file(value, "image", loc), value
    raise MediaError(f"{loc}: expected an image (path, bytes, base64 data URI or {{'path'|'bytes': ...}}), "
                     f"got {type(value).__name__}")


def decode_image(value: object, loc: str) -> Image.Image:
    """An RGB PIL image from a path, bytes, base64 data URI or datasets image dict."""
    data, name = _image_bytes(value, loc)
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise MediaError(f"{loc}: cannot decode {name!r} as an image ({type(exc).__name__}); "
                         "re-encode it as PNG or JPEG") from None


# ---------------------------------------------------------------------------------------------- video


def _decode_video_file(path: str, loc: str, max_frames: int) -> list[Image.Image]:
    _read_file(path, "video", loc)
    try:
        import av  # type: ignore[import-not-found]
    except ImportError:
        av = None
    if av is not None:
        try:
            with av.open(path) as container:
                frames = [f.to_image().convert("RGB") for f in container.decode(video=0)]
        except Exception as exc:  # PyAV raises its own error hierarchy
            raise MediaError(f"{loc}: cannot decode {path!r} as a video ({type(exc).__name__})") from None
        return _subsample(frames, max_frames)
    try:
        from torchcodec.decoders import VideoDecoder  # type: ignore[import-not-found]
    except ImportError:
        raise MediaError(f"{loc}: decoding the video file {path!r} needs PyAV or torchcodec, and neither is "
                         "installed; pip install av, or give the video as a list of frame image paths") from None
    try:
        frames_NCHW = VideoDecoder(path)[:]
    except Exception as exc:
        raise MediaError(f"{loc}: cannot decode {path!r} as a video ({type(exc).__name__})") from None
    frames = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in frames_NCHW]
    return _subsample(frames, max_frames)


def _subsample(frames: list[Image.Image], max_frames: int) -> list[Image.Image]:
    if max_frames <= 0 or len(frames) <= max_frames:
        return frames
    idx = np.linspace(0, len(frames) - 1, max_frames).round().astype(int)
    return [frames[i] for i in idx]


def decode_video(value: object, loc: str, max_frames: int = 0) -> list[Image.Image]:
    """Frames (RGB PIL images) of a video given as a list of frame images or a video file path.

    ``max_frames > 0`` keeps that many frames evenly spaced. All frames must share one size.
    """
    if isinstance(value, str):
        frames = _decode_video_file(value, loc, max_frames)
    elif isinstance(value, (list, tuple)):
        if not value:
            raise MediaError(f"{loc}: video has no frames; give a non-empty list of frame images")
        frames = _subsample([decode_image(v, f"{loc} frame {i}") for i, v in enumerate(value)], max_frames)
    else:
        raise MediaError(f"{loc}: expected a video (list of frame images or a video file path), "
                         f"got {type(value).__name__}")
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise MediaError(f"{loc}: video frames have different sizes {sorted(sizes)}; resize them to one size")
    return frames


# ---------------------------------------------------------------------------------------------- audio


def resample(wave_N: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Linear-interpolation resampling of a mono waveform: y[j] = x(j * src_rate / dst_rate).

    Output length round(N * dst_rate / src_rate). No anti-alias filter: downsampling folds content above
    dst_rate / 2 (fine for speech-band tasks; pre-filter real recordings that carry such content).
    """
    if src_rate <= 0 or dst_rate <= 0:
        raise ValueError(f"sample rates must be > 0, got src_rate={src_rate}, dst_rate={dst_rate}")
    if src_rate == dst_rate or len(wave_N) == 0:
        return wave_N.astype(np.float32)
    n_out = int(round(len(wave_N) * dst_rate / src_rate))
    t_out = np.arange(n_out, dtype=np.float64) * (src_rate / dst_rate)
    return np.interp(t_out, np.arange(len(wave_N), dtype=np.float64), wave_N.astype(np.float64)).astype(np.float32)


def decode_audio(value: object, target_rate: int, loc: str) -> np.ndarray:
    """Mono float32 waveform at ``target_rate`` from a wav / flac path or bytes (soundfile)."""
    import soundfile as sf

    if isinstance(value, str):
        data, name = _read_file(value, "audio", loc), value
    elif isinstance(value, (bytes, bytearray)):
        data, name = bytes(value), "<bytes>"
    elif isinstance(value, dict) and (value.get("path") or value.get("bytes")):
        return decode_audio(value.get("bytes") or value["path"], target_rate, loc)
    else:
        raise MediaError(f"{loc}: expected audio (wav/flac path or bytes), got {type(value).__name__}")
    try:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise MediaError(f"{loc}: cannot decode {name!r} as audio ({type(exc).__name__}); "
                         "convert it to wav or flac") from None
    return resample(wave.mean(axis=1), int(rate), int(target_rate))


# ---------------------------------------------------------------------------------------------- remote rewards


def encode_images_once(refs: list[MediaRef]) -> list[str]:
    """Base64 strings of a sample's image refs for ``RewardItem.images``: each distinct image (by sha256)
    encoded exactly once, in first-seen order; non-image refs are skipped; content is hash-checked."""
    out: list[str] = []
    seen: set[str] = set()
    for i, ref in enumerate(refs):
        if ref.kind != "image" or ref.sha256 in seen:
            continue
        seen.add(ref.sha256)
        out.append(base64.b64encode(read_ref(ref, f"media ref {i}")).decode("ascii"))
    return out
