"""Synthetic videos for CPU: an 8x8 square of one of four colours slides across a 16x16 black frame for 2
frames (2 pixels a frame, a random way); the answer is the square's colour: "r" (red), "g" (green),
"b" (blue) or "w" (white). Pure colours, one channel each or all three: with yellow (red + green) instead
of white the tiny RM confused red, green and yellow.

Prompt "colour?" after the video block; target "<colour><eos>". The rule metric ``colour_correct`` is 1.0
when the response's text is exactly the colour, else 0.0: it is what the reward model's preferences encode
(chosen = the true colour, rejected = another colour), so a policy that raises the RM's score should raise
it too. (Motion direction was tried first: the tiny models learn it neither supervised nor by RL within
minutes of CPU, so the demo asks what they can see.)

Videos are written as lossless mp4 files (H.264 RGB, qp 0; PyAV): the runtime decodes real video files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

ALPHABET = "rgbwcolu? "
PROMPT = "colour?"
COLOURS = {"r": (255, 0, 0), "g": (0, 255, 0), "b": (0, 0, 255), "w": (255, 255, 255)}
SIZE, SQUARE, STEP, FRAMES = 16, 8, 2, 2  # 2 frames: one temporal patch; 4 doubled every stage's CPU time
_WAYS = ((0, -1), (0, 1), (-1, 0), (1, 0))  # (rows, cols) per step: left, right, up, down


def make_frames(colour: str, rng: random.Random) -> list[np.ndarray]:
    """FRAMES uint8 (SIZE, SIZE, 3) frames: the ``colour`` square sliding STEP pixels a frame one way,
    from a random start that keeps it inside the frame."""
    dy, dx = rng.choice(_WAYS)
    travel = STEP * (FRAMES - 1)
    lo_y, hi_y = max(0, -dy * travel), SIZE - SQUARE - max(0, dy * travel)
    lo_x, hi_x = max(0, -dx * travel), SIZE - SQUARE - max(0, dx * travel)
    y0, x0 = rng.randint(lo_y, hi_y), rng.randint(lo_x, hi_x)
    frames = []
    for t in range(FRAMES):
        f = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
        y, x = y0 + dy * STEP * t, x0 + dx * STEP * t
        f[y:y + SQUARE, x:x + SQUARE] = COLOURS[colour]
        frames.append(f)
    return frames


def make_examples(n: int, seed: int) -> list[tuple[list[np.ndarray], str]]:
    rng = random.Random(seed)
    return [(make_frames(c, rng), c) for c in (rng.choice(list(COLOURS)) for _ in range(n))]


def malformed(rng: random.Random) -> str:
    """A response that is no single colour letter: two letters, or one non-colour character."""
    if rng.random() < 0.5:
        return rng.choice(list(COLOURS)) + rng.choice(ALPHABET.strip())
    return rng.choice([c for c in ALPHABET if c not in COLOURS])


def colour_correct(response_text: str, answer: str) -> float:
    return 1.0 if response_text.strip() == answer else 0.0


def reward(response: str, reference: str) -> float:
    """The rule metric as a reward function (``type: custom``, fn pipelines/video_rm_rl/task.py:reward)."""
    return colour_correct(response, reference)


def write_mp4(frames: list[np.ndarray], path: Path, fps: int = 4) -> None:
    """Lossless mp4 (libx264rgb, qp 0): the decoded frames equal ``frames`` exactly."""
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264rgb", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "rgb24"
        stream.options = {"qp": "0", "preset": "ultrafast"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_split(out_dir: str, name: str, n: int, seed: int, pairs: bool = False) -> str:
    """``n`` examples as mp4 files under out_dir/videos/<name>/ and rows in out_dir/<name>.jsonl; returns its path.

    RL rows: {"prompt", "reference", "video"}. ``pairs``: preference rows for the RM
    {"prompt", "chosen", "rejected", "video"}, one per other colour, the empty response and one malformed
    response (5 per video). The empty response (the policy stops at once) is what RL found when the RM had
    never seen it: it scored 5.3 on red videos (true colour 7.4, wrong colours -6), so the policy answered
    nothing everywhere (colour_correct 0.57 -> 0.29). With one random rejected colour per video the RM
    ranked the pairs it saw (86 %) but picked the true colour of only 57 % of the videos, and the policy learned to say the colour it scored highest
    everywhere; without malformed rejections, RL raised the RM score (3.3 -> 6.1) while colour_correct
    fell (0.52 -> 0.29), responses the RM never saw being one way to score high."""
    video_dir = Path(out_dir) / "videos" / name
    video_dir.mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / f"{name}.jsonl"
    rng = random.Random(seed + 1)
    with path.open("w") as f:
        for i, (frames, colour) in enumerate(make_examples(n, seed)):
            file = video_dir / f"{i:05d}.mp4"
            write_mp4(frames, file)
            row = {"prompt": PROMPT, "video": str(file.resolve())}
            if not pairs:
                f.write(json.dumps({**row, "reference": colour}) + "\n")
                continue
            rejected = [c for c in COLOURS if c != colour] + ["", malformed(rng)]
            for other in rejected:
                f.write(json.dumps({**row, "chosen": colour, "rejected": other}) + "\n")
            rng.shuffle(rejected)
            for a, b in zip(rejected, rejected[1:]):  # a chain of ties: every wrong answer equally wrong
                f.write(json.dumps({**row, "chosen": a, "rejected": b, "tie": True}) + "\n")
    return str(path)
