"""Image, video and audio fields of dataset rows: decoding, resampling, and references that cross processes.

A row field holds media in one of these spellings:

- image: a file path (str), raw bytes, a base64 data URI (``"data:image/png;base64,..."``), or a dict
  ``{"path": ...}`` / ``{"bytes": ...}`` (the Hugging Face datasets image struct);
- video: a list of frame images (any image spelling above), or a video file (mp4, webm, ...) decoded with
  PyAV (the ``video`` extra), sampled at ``data.video_fps`` and capped at ``data.max_video_frames``;
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


VIDEO_EXTRA_HINT = "pip install 'streamrft[video]' (PyAV)"


def have_video_decoder() -> bool:
    """Whether PyAV (the ``video`` extra) is importable: video files need it, frame lists do not."""
    import importlib.util

    return importlib.util.find_spec("av") is not None


VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")


def split_videos(value: object) -> list[object]:
    """A row's video field as one value per video: a video file path (str) is one video, a flat list of frame
    images is one video, a list of those (frame lists, or paths ending in a VIDEO_SUFFIXES suffix) is several
    videos in placeholder order."""
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (list, tuple)) or (isinstance(v, str) and v.lower().endswith(VIDEO_SUFFIXES)) for v in value):
        return list(value)
    return [value]


def sample_frame_times(times_s: list[float], fps: float) -> list[int]:
    """Indices of the frames kept when a video is sampled at ``fps`` frames per second: for each tick
    t_k = t_0 + k / fps (k = 0, 1, ...) up to the last frame's time, the first frame with time >= t_k
    (a frame that two ticks select is kept once). ``fps <= 0`` keeps every frame.

    Timestamps, not indices: a 30 fps clip and a 25 fps clip of the same scene sampled at 2 fps keep the
    frames nearest the same instants."""
    if fps <= 0 or not times_s:
        return list(range(len(times_s)))
    kept: list[int] = []
    t0, step = times_s[0], 1.0 / fps
    k, i = 0, 0
    eps = 1e-9  # float timestamps (pts * time_base) of exact ticks must not slip past them
    while i < len(times_s):
        tick = t0 + k * step
        while i < len(times_s) and times_s[i] < tick - eps:
            i += 1
        if i == len(times_s):
            break
        if not kept or kept[-1] != i:
            kept.append(i)
        k += 1
    return kept


def decode_video_file(data: bytes, name: str, loc: str, max_frames: int = 0, fps: float = 0.0) -> list[Image.Image]:
    """RGB frames of an encoded video (mp4, webm, mkv ... anything FFmpeg reads) with PyAV, sampled at ``fps``
    (``sample_frame_times``) then cut to ``max_frames`` evenly spaced frames (0 = no cap).

    A file that does not decode, or decodes to fewer frames than its stream declares (a truncated
    download), is a MediaError naming ``loc``: no silent partial video."""
    try:
        import av  # type: ignore[import-not-found]
    except ImportError:
        raise MediaError(f"{loc}: decoding the video file {name!r} needs PyAV, which is not installed; "
                         f"{VIDEO_EXTRA_HINT}, or give the video as a list of frame images") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError(f"{loc}: {name!r} has no video stream; give a video file or a list of frames")
            stream = container.streams.video[0]
            declared = int(stream.frames or 0)  # 0 when the container does not say (e.g. webm)
            decoded = [(float(f.time or 0.0), f) for f in container.decode(stream)]
            if declared and len(decoded) < declared:
                raise MediaError(f"{loc}: {name!r} is truncated: its stream declares {declared} frames but only "
                                 f"{len(decoded)} decode; re-download or re-encode it")
            if not decoded:
                raise MediaError(f"{loc}: {name!r} decodes to no frames (truncated or empty video); "
                                 "re-encode it or drop the row")
            keep = sample_frame_times([t for t, _ in decoded], fps)
            frames = [decoded[i][1].to_image().convert("RGB") for i in keep]
    except MediaError:
        raise
    except Exception as exc:  # PyAV's own hierarchy (av.error.InvalidDataError ...) and EOF errors
        raise MediaError(f"{loc}: cannot decode {name!r} as a video ({type(exc).__name__}: {exc}); "
                         "re-encode it (e.g. H.264 mp4) or drop the row") from None
    return _subsample(frames, max_frames)


def _subsample(frames: list[Image.Image], max_frames: int) -> list[Image.Image]:
    if max_frames <= 0 or len(frames) <= max_frames:
        return frames
    idx = np.linspace(0, len(frames) - 1, max_frames).round().astype(int)
    return [frames[i] for i in idx]


def decode_video(value: object, loc: str, max_frames: int = 0, fps: float = 0.0) -> list[Image.Image]:
    """Frames (RGB PIL images) of a video given as a list of frame images or a video file path.

    ``max_frames > 0`` keeps that many frames evenly spaced; ``fps > 0`` first samples a video file at that
    rate (a frame list has no timestamps: its frames are the samples). All frames must share one size.
    """
    if isinstance(value, str):
        frames = decode_video_file(_read_file(value, "video", loc), value, loc, max_frames, fps)
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
