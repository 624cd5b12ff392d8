"""Progress: a tqdm bar on a TTY, plain lines otherwise."""

from __future__ import annotations

import io

from streamrft.metrics.progress import Progress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_tty_progress_prints_one_plain_line_every_k_updates_with_live_fields():
    out = io.StringIO()
    progress = Progress(total=10, desc="train", stream=out, log_every=3, log_every_s=1e9)
    for step in range(7):
        progress.update(1, reward=step / 10, tokens_per_s=1000.0)
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # after updates 3 and 6, and the final one on close
    assert lines[0].startswith("train: 3/10") and "reward=0.2" in lines[0] and "tokens_per_s=1000" in lines[0]
    assert lines[-1].startswith("train: 7/10") and "reward=0.6" in lines[-1]
    assert "\r" not in out.getvalue()


def test_without_a_tty_a_line_is_also_printed_when_enough_seconds_passed():
    out = io.StringIO()
    progress = Progress(total=5, desc="gen", stream=out, log_every=1000, log_every_s=0.0)
    progress.update(1, reward=1.0)
    assert out.getvalue().startswith("gen: 1/5")
    progress.close()


def test_on_a_tty_progress_draws_a_tqdm_bar_with_the_live_fields_in_the_postfix():
    out = FakeTty()
    with Progress(total=4, desc="train", stream=out) as progress:
        assert progress.uses_bar
        progress.update(2, reward=0.5)
    text = out.getvalue()
    assert "train" in text and "2/4" in text and "reward=0.5" in text
