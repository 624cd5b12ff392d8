"""GSM8K (jsonl or parquet rows of {question, answer}) -> StreamRFT dataset jsonl rows.

Each output row is ``{"prompt", "reference", "label": "gsm8k"}``: the prompt asks for the final
answer after ``####`` (what the gsm8k rule reads first), and the reference is the number after the
``####`` of the GSM8K solution, commas kept (the rule strips them). With ``--messages`` the prompt is a
one-message conversation ``[{"role": "user", "content": ...}]`` (TRL's conversational format), which
training renders with the model's chat template (``data.chat_template: auto``): what an Instruct model
was tuned on.

    python pipelines/gsm8k/preprocess.py /path/to/gsm8k/train.jsonl data/gsm8k_train.jsonl [--limit N] [--messages]

GSM8K is MIT-licensed (Copyright (c) 2021 OpenAI); keep its LICENSE beside derived files you share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

PROMPT_TEMPLATE = (
    "{question}\n"
    "Solve the problem step by step. On the last line, write the final answer as a number after '#### ', "
    "for example: #### 42"
)
LABEL = "gsm8k"


def read_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(row number starting at 1, row) for a .jsonl or .parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only for parquet input

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: row {i} is not valid JSON: {exc}") from None
            yield i, row


def convert_row(row: dict, path: Path, row_number: int, messages: bool = False) -> dict:
    """One GSM8K row -> one dataset row; ValueError names the file, row and field when it cannot."""
    for field in ("question", "answer"):
        value = row.get(field) if isinstance(row, dict) else None
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{path}: row {row_number} has no {field!r} text (field {field!r} missing or empty)")
    answer = row["answer"]
    if "####" not in answer:
        raise ValueError(f"{path}: row {row_number} field 'answer' has no '#### <final answer>' line")
    reference = answer.rsplit("####", 1)[1].strip()
    if not reference:
        raise ValueError(f"{path}: row {row_number} field 'answer' has nothing after '####'")
    text = PROMPT_TEMPLATE.format(question=row["question"].strip())
    prompt = [{"role": "user", "content": text}] if messages else text
    return {"prompt": prompt, "reference": reference, "label": LABEL}


def preprocess(src: Path, dst: Path, limit: int = 0, messages: bool = False) -> int:
    """Write the converted rows of ``src`` to ``dst`` (jsonl); returns the number of rows written."""
    if not src.is_file():
        raise ValueError(f"input {src} does not exist")
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    tmp = dst.with_suffix(dst.suffix + ".tmp")  # a failed run leaves no half-written dataset behind
    with tmp.open("w", encoding="utf-8") as out:
        for row_number, row in read_rows(src):
            if limit and n >= limit:
                break
            out.write(json.dumps(convert_row(row, src, row_number, messages), ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(dst)
    return n


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Convert GSM8K jsonl/parquet to StreamRFT dataset jsonl.")
    parser.add_argument("input", type=Path, help="GSM8K train.jsonl / test.jsonl or a .parquet file")
    parser.add_argument("output", type=Path, help="dataset jsonl to write")
    parser.add_argument("--limit", type=int, default=0, help="keep the first N rows; 0 = all")
    parser.add_argument("--messages", action="store_true",
                        help="write each prompt as a chat message list (rendered with the model's chat template)")
    args = parser.parse_args(argv)
    try:
        n = preprocess(args.input, args.output, args.limit, args.messages)
    except ValueError as exc:
        print(f"preprocess: error: {exc}", file=sys.stderr)
        return 2
    print(f"preprocess: wrote {n} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
