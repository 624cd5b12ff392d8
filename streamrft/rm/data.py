"""Preference and judgment datasets (jsonl or parquet), checked row by row.

Pairwise rows (SRM): ``{"prompt": str, "chosen": str, "rejected": str, "margin": float?, "tie": bool?}``.
Judgment rows (GRM): ``{"prompt": str, "responses": [str, ...] (1 or 2), "judgment": str}``.
With media fields set (RM config ``data.image_field`` / ``video_field`` / ``audio_field``, recorded in a
trained RM's rm.json) each row also carries its prompt's media by path; ``read_*`` turn them into
``protocols.MediaRef``s (absolute path + sha256) with :class:`streamrft.models.media_inputs.MediaCodec`, so
a missing field or file fails here naming file, row and field, before any model is loaded.

A row missing a required field raises ``DataError("FILE: row I: missing field 'F' ...")`` with I the
0-based row index (for jsonl, line I+1 when there are no blank lines).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from pathlib import Path

from streamrft.data import DataError, read_rows


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0  # used by the bradley_terry loss
    tie: bool = False  # the two responses are equally good (see streamrft.rm.losses)
    media: list = field(default_factory=list)  # the prompt's media (protocols.MediaRef), [] for text rows


@dataclass
class JudgmentRow:
    prompt: str
    responses: list[str]  # 1 (pointwise score) or 2 (A/B comparison)
    judgment: str  # the target verdict text, e.g. "[[A]]" or "[[1]]"
    media: list = field(default_factory=list)  # the prompt's media (protocols.MediaRef), [] for text rows


def _field(path, i: int, row: dict, name: str, kinds: tuple[type, ...], what: str):
    if name not in row or row[name] is None:
        raise DataError(f"{path}: row {i}: missing field {name!r} (each row needs {what})")
    value = row[name]
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise DataError(f"{path}: row {i}: field {name!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                        f"got {type(value).__name__}")
    return value


def media_reader(media: dict | None):
    """``(row_index, row) -> [MediaRef]`` for the media settings ``media`` (streamrft.rm.config.media_fields),
    or None when no media field is set (text rows)."""
    if not media or not (media.get("image_field") or media.get("video_field") or media.get("audio_field")):
        return None
    from streamrft.models.media_inputs import MediaCodec

    codec = MediaCodec(None, media.get("image_field") or "", media.get("video_field") or "",
                       media.get("audio_field") or "")
    return lambda path, i, row: codec.refs(SimpleNamespace(row=i, extra=row), str(path))


def read_preference_pairs(path: str | Path, media: dict | None = None) -> list[PreferencePair]:
    what = "prompt, chosen, rejected"
    refs = media_reader(media)
    pairs = []
    for i, row in enumerate(read_rows(path)):
        prompt, chosen, rejected = (_field(path, i, row, k, (str,), what) for k in ("prompt", "chosen", "rejected"))
        margin = float(_field(path, i, row, "margin", (int, float), what)) if row.get("margin") is not None else 0.0
        tie = bool(_field(path, i, row, "tie", (bool,), what)) if row.get("tie") is not None else False
        pairs.append(PreferencePair(prompt, chosen, rejected, margin, tie, refs(path, i, row) if refs else []))
    if not pairs:
        raise DataError(f"{path}: no rows; give at least one {{prompt, chosen, rejected}} row")
    return pairs


def read_judgments(path: str | Path, media: dict | None = None) -> list[JudgmentRow]:
    what = "prompt, responses, judgment"
    refs = media_reader(media)
    out = []
    for i, row in enumerate(read_rows(path)):
        prompt = _field(path, i, row, "prompt", (str,), what)
        responses = _field(path, i, row, "responses", (list,), what)
        judgment = _field(path, i, row, "judgment", (str,), what)
        if len(responses) not in (1, 2) or not all(isinstance(r, str) for r in responses):
            raise DataError(f"{path}: row {i}: field 'responses' must be a list of 1 or 2 strings")
        out.append(JudgmentRow(prompt, list(responses), judgment, refs(path, i, row) if refs else []))
    if not out:
        raise DataError(f"{path}: no rows; give at least one {{prompt, responses, judgment}} row")
    return out


def split_holdout(rows: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded shuffle, the last ``ceil(eval_fraction * n)`` rows held out."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_eval = max(1, int(round(eval_fraction * len(rows))))
    if n_eval >= len(rows):
        raise DataError(f"{len(rows)} rows are too few to hold out {eval_fraction:.0%}; give data.eval_path")
    return rows[:-n_eval], rows[-n_eval:]
