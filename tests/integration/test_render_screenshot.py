"""The rendered trajectory page, screenshotted by headless Chromium, shows something."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from PIL import Image

from streamrft.sinks import JsonlSink
from streamrft.sinks.render import render_trajectories
from streamrft.sinks.synthetic import synthetic_records

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_headless_chromium_screenshot_of_the_rendered_page_has_the_window_size_and_is_not_blank(tmp_path):
    sink = JsonlSink(tmp_path / "traj", run_id="r", rank=0)
    for record in synthetic_records(6, response_len=48):
        sink.write(record)
    sink.close()
    page = tmp_path / "page.html"
    assert render_trajectories(tmp_path / "traj", page, max_samples=6) == 6
    png = tmp_path / "shot.png"
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1200,800",
        "--hide-scrollbars", page.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, timeout=60)  # run() kills it on timeout
    assert png.exists(), f"no screenshot; chromium exited {result.returncode}: {result.stderr.decode()[-2000:]}"
    with Image.open(png) as image:
        assert image.size == (1200, 800)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "screenshot is (nearly) a single colour"
    # Entropy shading puts orange-ish token backgrounds on the page: pixels with R high and B low.
    assert any(r > 240 and b < 120 and g > 120 for _, (r, g, b) in colours)
