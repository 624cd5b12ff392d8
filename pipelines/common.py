"""What the demo pipelines share: writing their jsonl rows (with the media files a multimodal row points at),
the prompt inputs of media examples, and the supervised warm-up of a tiny multimodal policy on its answers.

Reading rows back is ``streamrft.data.read_rows``: the runtime's own reader, whose errors name the file, row,
line and byte offset, so a pipeline reads its data exactly as ``streamrft train`` will.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> str:
    """Write ``rows`` to ``path``, one JSON object a line (creating its folder); returns the path as a string."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_media_split(out_dir: str | Path, name: str, examples: Iterable[tuple[Any, str]], prompt: str,
                      field: str, folder: str, suffix: str, save: Callable[[Any, Path], None]) -> str:
    """Each (media, answer) example saved by ``save(media, file)`` as ``out_dir/folder/name/<i:05d>{suffix}``,
    and a row ``{"prompt", "reference": answer, field: the file's absolute path}`` per example written to
    ``out_dir/name.jsonl``; returns the jsonl path. Absolute paths keep the rows valid from any working
    directory."""
    media_dir = Path(out_dir) / folder / name
    media_dir.mkdir(parents=True, exist_ok=True)

    def rows():
        for i, (media, answer) in enumerate(examples):
            file = media_dir / f"{i:05d}{suffix}"
            save(media, file)
            yield {"prompt": prompt, "reference": answer, field: str(file.resolve())}

    return write_jsonl(Path(out_dir) / f"{name}.jsonl", rows())


def media_prompt_inputs(processor, prompt: str, media_key: str, examples: Sequence[tuple[Any, str]]) -> list[dict]:
    """The model inputs of ``prompt`` with each example's media (``media_key``: "images", "audios", "videos")."""
    from streamrft.models.multimodal import build_model_inputs

    return [build_model_inputs(processor, prompt, {media_key: [media]}) for media, _ in examples]


def answer_warmup(model, processor, steps: int, make_batch: Callable[[int], tuple[list[dict], list[str]]],
                  lr: float, params=None):
    """``steps`` AdamW steps of the mean negative log-likelihood of each answer and its EOS given its prompt;
    ``make_batch(step)`` gives (prompt inputs, answers) of that step. ``params``: what learns (default all).
    Returns the last step's loss (a tensor; NaN when ``steps`` is 0)."""
    import torch

    from streamrft.models.multimodal import collate_prompts, response_logprobs_batch

    tok = processor.tokenizer
    opt = torch.optim.AdamW(model.parameters() if params is None else params, lr=lr)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        inputs, answers = make_batch(step)
        batch = collate_prompts(inputs, tok.pad_token_id)
        targets = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
        logp_BT, mask_BT = response_logprobs_batch(model, batch, targets)
        loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss
