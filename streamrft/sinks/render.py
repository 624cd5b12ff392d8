"""``streamrft trajectories render PATH --out page.html``: samples as one self-contained HTML page.

Each response token is a box shaded by its entropy (white = certain, orange = uncertain); tokens
above the high-entropy threshold are outlined in red. Hovering a token shows its id and entropy.
The page has inline CSS only and no external resource, so it opens offline and can be attached.

Multi-turn episodes (records with a ``loss_mask``): observation spans (mask 0, never trained) are drawn
in blue-grey with a label naming their chat role (tool / user), not shaded by entropy; the header line
gives the number of turns and the per-turn rewards.

Token strings. Records carry token ids and the decoded ``response``, not per-token strings. The
boxes use, in this order: a ``response_tokens`` field on the record if the protocol grows one; the
``token_texts`` callable passed in (e.g. a tokenizer's ``convert_ids_to_tokens``); the characters
of ``response`` when there are exactly as many as ids (character-level tokenizers, like the toy
task's); otherwise the ids themselves (``#1234``), with the decoded response shown beneath.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from protocols import TrajectoryRecord
from streamrft.sinks.analyze import DEFAULT_HIGH_ENTROPY
from streamrft.sinks.reader import read_trajectories

TokenTexts = Callable[[list[int]], list[str]]

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 16px; background: #f6f7f9;
       color: #1d232b; }
h1 { font-size: 20px; margin: 0 0 8px; }
.legend { margin-bottom: 12px; font-size: 13px; }
.legend span.tok { margin-right: 4px; }
.sample { background: #fff; border: 1px solid #d5d9e0; border-radius: 6px; padding: 10px 12px; margin-bottom: 12px; }
.meta { font-size: 12px; color: #4a5563; margin-bottom: 6px; }
.meta b { color: #1d232b; }
.pos { color: #127a2e; font-weight: bold; } .neg { color: #b3261e; font-weight: bold; }
.status-filtered, .status-failed { background: #fde8e6; border-radius: 3px; padding: 0 4px; }
.prompt { font-family: Menlo, Consolas, monospace; font-size: 12px; background: #eef1f5; padding: 6px;
          white-space: pre-wrap; border-radius: 4px; margin-bottom: 6px; }
.response { font-family: Menlo, Consolas, monospace; font-size: 13px; line-height: 1.9; white-space: pre-wrap; }
.tok { border: 1px solid #e2e5ea; border-radius: 3px; padding: 0 1px; margin: 0 1px 0 0; }
.tok.hi { border: 2px solid #d0021b; font-weight: bold; }
.decoded { font-size: 12px; color: #4a5563; white-space: pre-wrap; margin-top: 4px; }
.obs { background: #dde6f3; border: 1px dashed #7a8db0; border-radius: 4px; padding: 1px 2px; margin: 0 2px; }
.obs .role { font-size: 10px; color: #35507a; font-weight: bold; margin-right: 3px; }
.obs .tok { background: #dde6f3; border-color: #c3cfe3; color: #35507a; }
"""


def token_strings(record: TrajectoryRecord, token_texts: TokenTexts | None = None) -> tuple[list[str], bool]:
    """The text of each response token and whether it is real text (False: ids as placeholders)."""
    ids = list(record.response_ids)
    from_record = getattr(record, "response_tokens", None)
    if from_record and len(from_record) == len(ids):
        return list(from_record), True
    if token_texts is not None:
        texts = token_texts(ids)
        if len(texts) == len(ids):
            return list(texts), True
    if len(record.response) == len(ids):
        return list(record.response), True
    return [f"#{i}" for i in ids], False


def _entropy_colour(entropy: float, threshold: float) -> str:
    # Linear from white (0 nats) to saturated orange at twice the threshold.
    t = max(0.0, min(1.0, entropy / (2 * threshold)))
    green = int(255 - t * (255 - 140))
    blue = int(255 - t * 255)
    return f"rgb(255,{green},{blue})"


def _render_token(text: str, token_id: int, entropy: float | None, threshold: float) -> str:
    shown = html.escape(text.replace("\n", "\u21b5\n"))
    if entropy is None:
        return f'<span class="tok" title="id {token_id}">{shown}</span>'
    cls = "tok hi" if entropy > threshold else "tok"
    colour = _entropy_colour(entropy, threshold)
    return f'<span class="{cls}" style="background:{colour}" title="id {token_id}, H={entropy:.3f}">{shown}</span>'


def _render_sample(record: TrajectoryRecord, token_texts: TokenTexts | None, threshold: float) -> str:
    texts, real = token_strings(record, token_texts)
    entropies: list[float | None] = (
        list(record.entropy) if len(record.entropy) == len(texts) else [None] * len(texts)
    )
    mask = list(record.loss_mask) if len(record.loss_mask) == len(texts) else [1] * len(texts)
    roles = list(record.observation_roles)
    parts, span = [], 0
    for j, (t, i, h) in enumerate(zip(texts, record.response_ids, entropies, strict=True)):
        if mask[j]:
            parts.append(_render_token(t, i, h, threshold))
            continue
        if j == 0 or mask[j - 1]:  # an observation span opens: label it with its role
            role = roles[span] if span < len(roles) else "observation"
            parts.append(f'<span class="obs" title="observation ({html.escape(role)}), not trained">'
                         f'<span class="role">{html.escape(role)}</span>')
            span += 1
        parts.append(_render_token(t, i, None, threshold))
        if j == len(texts) - 1 or mask[j + 1]:
            parts.append("</span>")
    tokens = "".join(parts)
    turns = ""
    if record.turn_starts:
        rewards = ", ".join(f"{r:.3g}" for r in record.turn_rewards)
        turns = f" · {len(record.turn_starts)} turns (turn rewards {rewards})"
    sign = "pos" if record.advantage > 0 else "neg" if record.advantage < 0 else ""
    components = ", ".join(f"{html.escape(k)} {v:.3g}" for k, v in record.reward_components.items())
    status = html.escape(record.status + (f": {record.reason}" if record.reason else ""))
    meta = (
        f"<b>{html.escape(record.sample_id)}</b> · step {record.step} · rank {record.rank} · "
        f"version {record.policy_version} · reward <b>{record.reward:.3g}</b>"
        + (f" ({components})" if components else "")
        + f' · advantage <span class="{sign}">{record.advantage:+.3g}</span>'
        + f' · <span class="status-{html.escape(record.status)}">{status}</span>'
        + f" · {len(record.response_ids)} tokens, finish {html.escape(record.finish_reason or 'unknown')}"
        + turns
    )
    decoded = "" if real else f'<div class="decoded">{html.escape(record.response)}</div>'
    return (
        f'<div class="sample"><div class="meta">{meta}</div>'
        f'<div class="prompt">{html.escape(record.prompt)}</div>'
        f'<div class="response">{tokens}</div>{decoded}</div>'
    )


def render_records(
    records: Sequence[TrajectoryRecord],
    title: str,
    token_texts: TokenTexts | None = None,
    high_entropy: float = DEFAULT_HIGH_ENTROPY,
) -> str:
    """The HTML page for ``records`` (already selected) as a string."""
    legend = "".join(
        _render_token(f"H={h:g}", 0, h, high_entropy) for h in (0.0, high_entropy / 2, high_entropy, 2 * high_entropy)
    )
    body = "\n".join(_render_sample(r, token_texts, high_entropy) for r in records)
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f'<div class="legend">{len(records)} samples · token shade = entropy (nats), outlined above '
        f"{high_entropy:g}: {legend}</div>\n{body}\n</body></html>\n"
    )


def render_trajectories(
    path: str | os.PathLike,
    out_html: str | os.PathLike,
    max_samples: int = 50,
    token_texts: TokenTexts | None = None,
    high_entropy: float = DEFAULT_HIGH_ENTROPY,
) -> int:
    """Write the page for the first ``max_samples`` records under ``path``; returns how many it shows."""
    records: list[TrajectoryRecord] = []
    for record in read_trajectories(path):
        if len(records) >= max_samples:
            break
        records.append(record)
    page = render_records(records, f"StreamRFT trajectories: {path}", token_texts, high_entropy)
    Path(out_html).parent.mkdir(parents=True, exist_ok=True)
    Path(out_html).write_text(page, encoding="utf-8")
    return len(records)


def render_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamrft trajectories render", description="Render samples, tokens shaded by entropy, as HTML."
    )
    parser.add_argument("path", help="a .jsonl / .parquet file or a directory written by the trajectory sinks")
    parser.add_argument("--out", required=True, help="the HTML file to write")
    parser.add_argument("--max-samples", type=int, default=50, help="show at most this many samples")
    parser.add_argument("--high-entropy", type=float, default=DEFAULT_HIGH_ENTROPY, help="threshold in nats")
    args = parser.parse_args(argv)
    try:
        shown = render_trajectories(args.path, args.out, args.max_samples, high_entropy=args.high_entropy)
    except (FileNotFoundError, ValueError) as exc:
        print(f"streamrft trajectories render: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({shown} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(render_main())
