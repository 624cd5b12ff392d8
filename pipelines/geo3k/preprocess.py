"""Geo3K-format rows (image, question, answer) -> StreamRFT prompt rows with an image field.

    python pipelines/geo3k/preprocess.py /path/to/geo3k/train.parquet data/geo3k/train.jsonl

Input: jsonl or parquet rows with ``images`` (list; datasets image structs, paths or bytes) or ``image``,
``problem`` or ``question``, and ``answer``. Output rows: ``prompt`` (the Qwen2-VL chat prompt with one
image block, asking for a ``\\boxed{}`` answer), ``reference`` (the answer), ``label`` "geo3k", and
``image``: a path to the image written next to the output (media crosses processes by reference).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from streamrft.data.media import decode_image, where

INSTRUCTION = " Think step by step, then give the final answer as \\boxed{answer}."
TEMPLATE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}{instruction}<|im_end|>\n"
            "<|im_start|>assistant\n")


def _rows(path: Path):
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
    else:
        with path.open() as f:
            yield from (json.loads(line) for line in f if line.strip())


def convert(src: Path, dst: Path) -> int:
    image_dir = dst.parent / (dst.stem + "_images")
    image_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    with dst.open("w") as out:
        for i, row in enumerate(_rows(src)):
            images = row.get("images") or ([row["image"]] if row.get("image") is not None else [])
            if len(images) != 1:
                raise ValueError(f"{where(str(src), i, 'images')}: expected exactly one image, got {len(images)}")
            question = (row.get("problem") or row.get("question") or "").replace("<image>", "").strip()
            if not question or row.get("answer") in (None, ""):
                raise ValueError(f"{src} row {i}: needs 'problem' (or 'question') and 'answer'")
            image_path = image_dir / f"{i}.png"
            decode_image(images[0], where(str(src), i, "images")).save(image_path)
            prompt = TEMPLATE.format(question=question, instruction=INSTRUCTION)
            out.write(json.dumps({"prompt": prompt, "reference": str(row["answer"]), "label": "geo3k",
                                  "image": str(image_path.resolve())}) + "\n")
            n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python pipelines/geo3k/preprocess.py SRC(.jsonl|.parquet) DST.jsonl")
    print(f"wrote {convert(Path(sys.argv[1]), Path(sys.argv[2]))} rows to {sys.argv[2]}")
