"""Synthetic audio QA for CPU: two tones one after the other; "which is higher? a or b" -> "a" | "b".

Tones are numpy sines (0.25 s each, 16 kHz, a 0.05 s gap), frequencies drawn from 200-1600 Hz at least
a factor 1.5 apart. Multiple choice: reward 1.0 when the response text is exactly the right letter.
"""

from __future__ import annotations

import numpy as np

ALPHABET = "ab ?whichsigerto"
PROMPT = "which is higher? a or b"
RATE = 16000


def tone_pair(f1: float, f2: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(0.25 * rate)) / rate
    ramp = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01)  # 10 ms fade in/out: no clicks
    a, b = (0.5 * ramp * np.sin(2 * np.pi * f * t) for f in (f1, f2))
    return np.concatenate([a, np.zeros(int(0.05 * rate)), b]).astype(np.float32)


def make_examples(n: int, seed: int) -> list[tuple[np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        f1, f2 = rng.uniform(200, 1600, size=2)
        if max(f1, f2) / min(f1, f2) < 1.5:
            continue
        out.append((tone_pair(f1, f2), "a" if f1 > f2 else "b"))
    return out


def reward(response_text: str, answer: str) -> float:
    return 1.0 if response_text.strip() == answer else 0.0
