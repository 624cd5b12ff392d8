"""Acceptance (issue 19 item 2): media reward models trained by `streamrft train-rm` on synthetic preferences
(pipelines/vision_srm): a vision SRM and an audio SRM reach >= 85% held-out pairwise accuracy, an image GRM
beats chance (50%) by >= 15 points; the vision SRM served by a real `serve-reward --fn model:DIR` process
scores items whose media travel by reference exactly as in process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from protocols import RewardItem, RewardRequest, encode
from streamrft.rm.cli import train_rm_main
from streamrft.rm.data import read_preference_pairs
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipelines.vision_srm.prepare import prepare  # noqa: E402

pytestmark = pytest.mark.slow
CONFIGS = ROOT / "pipelines" / "vision_srm"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision_srm")
    prepare(str(out))
    return out


def _train(config: str, out: Path, capsys, *overrides: str) -> dict:
    """`streamrft train-rm pipelines/vision_srm/CONFIG` with its runs/vision_srm paths pointed at ``out``."""
    base = {"grm.yaml": "judge", "audio.yaml": "audio", "config.yaml": "image"}[config]
    backbone = {"image": "vl", "audio": "al", "judge": "vl_judge"}[base]
    args = [str(CONFIGS / config), f"output_dir={out / Path(config).stem}", *overrides,
            f"data.train_path={out / f'{base}_train.jsonl'}", f"data.eval_path={out / f'{base}_eval.jsonl'}",
            f"model.path={out / backbone}"]
    assert train_rm_main(args) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("summary: ")][-1]
    return json.loads(line.removeprefix("summary: "))


def test_vision_srm_reaches_85_percent_and_is_served_by_reference(prepared, capsys):
    from streamrft.rm.reward import ModelReward

    summary = _train("config.yaml", prepared, capsys)
    print(f"vision SRM: {summary}")
    assert summary["eval_pairwise_accuracy"] >= 0.85
    rm_dir = prepared / "config"  # eval-rm on media rows: tests/unit/test_rm_media.py

    pairs = read_preference_pairs(prepared / "image_eval.jsonl", {"image_field": "image"})[:8]
    items = [RewardItem(sample_id=f"s{i}", prompt=p.prompt, response=r, media=list(p.media))
             for i, p in enumerate(pairs) for r in (p.chosen, p.rejected)]
    request = encode(RewardRequest(request_id="r", items=items))
    pixels = sum(os.path.getsize(p.media[0].path) for p in pairs)  # each image once
    assert b"\x89PNG" not in request and len(request) < 400 * len(items) < 2 * pixels  # refs on the wire, never pixels
    expected = asyncio.run(ModelReward(str(rm_dir), device="cpu").score(items))
    assert sum(expected[2 * i] > expected[2 * i + 1] for i in range(len(pairs))) >= 6  # it ranks pairs right
    served, served_http = _serve_and_score(rm_dir, items)
    assert served == pytest.approx(expected, abs=1e-5)
    assert served_http == pytest.approx(expected, abs=1e-5)  # the HTTP JSON body's "media" refs likewise


def _serve_and_score(rm_dir: Path, items: list[RewardItem]) -> tuple[list[float], list[float]]:
    """Start `serve-reward --fn model:DIR` (ZeroMQ and HTTP on 127.0.0.1); score ``items`` through
    RemoteRewardClient and through an HTTP JSON body with "media" refs."""
    import urllib.request

    from streamrft.rewards.remote import RemoteRewardClient

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.rewards.service", "--fn", f"model:{rm_dir}",
                             "--bind", "tcp://127.0.0.1:0", "--http", f"127.0.0.1:{port}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("serve-reward: ready"):
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(60) and proc.poll() is None, f"serve-reward did not start: {lines}"
        address = next(m.group(1) for ln in lines if (m := re.match(r"serve-reward: listening on (tcp://\S+)", ln)))

        async def go():
            client = RemoteRewardClient(address, timeout_s=60.0)
            try:
                return await client.score(items)
            finally:
                await client.close()

        body = {"queries": [it.prompt + it.response for it in items], "prompts": [it.prompt for it in items],
                "media": [[msgspec.to_builtins(ref) for ref in it.media] for it in items]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            http_rewards = json.loads(resp.read())["rewards"]
        return asyncio.run(go()), http_rewards
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=5)
        proc.stdout.close()


def test_audio_srm_reaches_85_percent(prepared, capsys):
    summary = _train("audio.yaml", prepared, capsys)
    print(f"audio SRM: {summary}")
    assert summary["eval_pairwise_accuracy"] >= 0.85


def test_image_grm_beats_chance_by_15_points(prepared, capsys):
    # the held-out judgments are balanced: 1/2 "[[1]]", 1/2 "[[0]]" in expectation (seeded: count them)
    rows = [json.loads(ln) for ln in (prepared / "judge_eval.jsonl").read_text().splitlines()]
    majority = max(sum(r["judgment"] == "[[1]]" for r in rows), sum(r["judgment"] == "[[0]]" for r in rows)) / len(rows)
    summary = _train("grm.yaml", prepared, capsys)
    print(f"image GRM: {summary} (majority verdict {majority:.3f})")
    assert summary["eval_verdict_accuracy"] >= max(0.5, majority) + 0.15
