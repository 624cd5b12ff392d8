"""Synthetic audio QA for CPU: one pure tone; "high or low? a or b" -> "a" (high) | "b" (low).

A tone is a numpy sine of 0.5 s at 16 kHz (10 ms fades), its frequency drawn from 200-600 Hz (low) or
900-1600 Hz (high), each with probability 1/2. The answer is in the clip's spectrum: the log-mel bins
the tone falls in. Reward 1.0 when the response text is exactly the right letter.

Why not the earlier two-tone task ("which of two tones is higher?"): its answer is in the order of the
tones, not in their spectrum, and the tiny model does not learn it even from labels: 200 supervised steps
(batch 16, lr 3e-3) left held-out accuracy at 0.49-0.51 with hidden size 32 or 64 and with sinusoidal
encoder positions, so RL on it stayed at chance (0.49). The one-tone task is learnt from labels in ~25
steps; see prepare.py for how the warm-up leaves that skill to RL.
"""

from __future__ import annotations

import numpy as np

from pipelines.common import write_media_split

ALPHABET = "ab ?highorlw"
PROMPT = "high or low? a or b"
RATE = 16000
LOW, HIGH = (200.0, 600.0), (900.0, 1600.0)


def tone(freq: float, seconds: float = 0.5, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    ramp = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)  # 10 ms fade in/out: no clicks
    return (0.5 * ramp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def make_examples(n: int, seed: int) -> list[tuple[np.ndarray, str]]:
    """``n`` (waveform, answer) pairs; answer "a" for a high tone, "b" for a low one."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        high = bool(rng.random() < 0.5)
        out.append((tone(rng.uniform(*(HIGH if high else LOW))), "a" if high else "b"))
    return out


def reward(response: str, reference: str) -> float:
    """The reward source of config.yaml (type: custom): 1.0 for exactly the right letter."""
    return 1.0 if response.strip() == reference else 0.0


def write_split(out_dir: str, name: str, n: int, seed: int) -> str:
    """Write ``n`` examples as wav files under out_dir/audio/<name>/ and rows
    {"prompt", "reference", "audio": <wav path>} to out_dir/<name>.jsonl; returns the jsonl path."""
    import soundfile as sf

    return write_media_split(out_dir, name, make_examples(n, seed), PROMPT, field="audio", folder="audio",
                             suffix=".wav", save=lambda wave, file: sf.write(file, wave, RATE, subtype="FLOAT"))
