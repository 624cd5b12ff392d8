"""Synthetic media preferences for CPU reward-model demos and tests.

Vision: a 32x32 image whose dominant colour (most of its pixels, plus noise and a block of another colour)
is one of COLOURS; prompt "colour?"; the preferred response names the dominant colour, the rejected one
another colour. Audio: a 0.5 s pure tone of one of NOTES (pitch classes a few octaves apart, so they fall
in different mel bins of the tiny 16-bin feature extractor); prompt "note?"; the preferred response names
the tone's pitch class. Judgments (GRM): the two responses in random order, verdict ``[[A]]`` or ``[[B]]``
for the one that names the colour.

Rows carry their media by path (``image`` / ``audio`` fields), as the RM config's ``data.image_field`` /
``data.audio_field`` expect.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from pipelines.common import write_jsonl

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 50, 220), "yellow": (230, 220, 40)}
# pitch class -> frequency (Hz): C4, G5, E6, B6; a few octaves apart, so each tone has mel bins of its own
NOTES = {"c": 261.63, "g": 783.99, "e": 1318.51, "b": 1975.53}
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCQV01?[]: "
IMAGE_PROMPT, AUDIO_PROMPT = "colour?", "note?"
RATE = 16000
SIZE = 32


def colour_image(colour: str, rng: random.Random) -> np.ndarray:
    """uint8 (SIZE, SIZE, 3): ``colour`` with per-pixel noise, and a random block (< 1/4 of the area) of
    another colour, so the answer is the dominant colour, not any colour present."""
    base = np.array(COLOURS[colour], dtype=np.float64)
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 25, (SIZE, SIZE, 3))
    img = base + noise
    other = np.array(COLOURS[rng.choice([c for c in COLOURS if c != colour])], dtype=np.float64)
    h, w = rng.randrange(4, SIZE // 2 + 1), rng.randrange(4, SIZE // 2 + 1)
    y, x = rng.randrange(SIZE - h + 1), rng.randrange(SIZE - w + 1)
    img[y:y + h, x:x + w] = other
    return np.clip(img, 0, 255).astype(np.uint8)


def tone(freq: float, rng: random.Random, seconds: float = 0.5) -> np.ndarray:
    """float32 mono at RATE: a sine at ``freq`` (±1 %), random amplitude and phase, 10 ms fades, light noise."""
    t = np.arange(int(seconds * RATE)) / RATE
    ramp = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)
    f = freq * rng.uniform(0.99, 1.01)
    wave = rng.uniform(0.2, 0.6) * ramp * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
    wave += np.random.default_rng(rng.randrange(2**32)).normal(0, 0.01, wave.shape)
    return wave.astype(np.float32)


def _write_image(arr: np.ndarray, path: Path) -> None:
    from PIL import Image

    Image.fromarray(arr).save(path)


def _write_audio(wave: np.ndarray, path: Path) -> None:
    import soundfile as sf

    sf.write(str(path), wave, RATE)


def write_media_pairs(out_dir: str | Path, name: str, n: int, seed: int, kind: str = "image") -> str:
    """``n`` preference rows ``{"prompt", "chosen", "rejected", "<kind>": path}`` in OUT/<name>.jsonl, the
    media files under OUT/<kind>s/<name>/; ``kind`` "image" (dominant colour) or "audio" (pitch class)."""
    out = Path(out_dir)
    media_dir = out / f"{kind}s" / name
    media_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS if kind == "image" else NOTES)
    rows = []
    for i in range(n):
        answer = rng.choice(names)
        if kind == "image":
            path = media_dir / f"{i}.png"
            _write_image(colour_image(answer, rng), path)
            prompt = IMAGE_PROMPT
        else:
            path = media_dir / f"{i}.wav"
            _write_audio(tone(NOTES[answer], rng), path)
            prompt = AUDIO_PROMPT
        rejected = rng.choice([c for c in names if c != answer])
        rows.append({"prompt": prompt, "chosen": answer, "rejected": rejected, kind: str(path.resolve())})
    return write_jsonl(out / f"{name}.jsonl", rows)


def write_image_judgments(out_dir: str | Path, name: str, n: int, seed: int, pointwise: bool = False) -> str:
    """``n`` GRM rows ``{"prompt", "responses": [a, b], "judgment": "[[A]]" | "[[B]]", "image": path}``: the
    right colour in a random slot; ``pointwise``: ``"responses": [name]``, ``"judgment": "[[1]]"`` when the
    name is the dominant colour else ``"[[0]]"`` (each with probability 1/2)."""
    out = Path(out_dir)
    media_dir = out / "images" / f"judge_{name}"
    media_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        answer = rng.choice(list(COLOURS))
        wrong = rng.choice([c for c in COLOURS if c != answer])
        path = media_dir / f"{i}.png"
        _write_image(colour_image(answer, rng), path)
        first = rng.random() < 0.5
        if pointwise:
            rows.append({"prompt": IMAGE_PROMPT, "responses": [answer if first else wrong],
                         "judgment": "[[1]]" if first else "[[0]]", "image": str(path.resolve())})
            continue
        rows.append({"prompt": IMAGE_PROMPT, "responses": [answer, wrong] if first else [wrong, answer],
                     "judgment": "[[A]]" if first else "[[B]]", "image": str(path.resolve())})
    return write_jsonl(out / f"{name}.jsonl", rows)
