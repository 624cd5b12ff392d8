"""Synthetic visual counting for CPU: a 32x32 image with 1-4 white squares; the answer is the count.

Prompt "how many?" after the image block; target "<digit><eos>". Reward 1.0 when the response's text
(before EOS) is exactly the count, else 0.0.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from pipelines.common import write_media_split

ALPHABET = "0123456789 ?howmany"
PROMPT = "how many?"
SIZE, CELL = 32, 8  # a 4x4 grid of 8-pixel cells; each square fills a cell minus a 1-pixel border


def make_image(count: int, rng: random.Random) -> Image.Image:
    img = Image.new("RGB", (SIZE, SIZE), "black")
    draw = ImageDraw.Draw(img)
    for cell in rng.sample(range(16), count):
        x, y = (cell % 4) * CELL, (cell // 4) * CELL
        draw.rectangle([x + 1, y + 1, x + CELL - 2, y + CELL - 2], fill="white")
    return img


def make_examples(n: int, seed: int) -> list[tuple[Image.Image, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        count = rng.randint(1, 4)
        out.append((make_image(count, rng), str(count)))
    return out


def reward(response_text: str, answer: str) -> float:
    return 1.0 if response_text.strip() == answer else 0.0


def write_split(out_dir: str, name: str, n: int, seed: int) -> str:
    """Write ``n`` examples as PNG files under out_dir/images/<name>/ and rows
    {"prompt", "reference", "image": <png path>} to out_dir/<name>.jsonl; returns the jsonl path."""
    return write_media_split(out_dir, name, make_examples(n, seed), PROMPT, field="image", folder="images",
                             suffix=".png", save=lambda img, file: img.save(file))
