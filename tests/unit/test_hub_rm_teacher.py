"""Reward models and teachers by hub id: a trained RM and a policy laid out as the Hugging Face cache lays them
out are used by id (``reward.sources[].model_path``, ``serve-reward --fn model:ID``, ``serve-teacher --model``)
with HF_HUB_OFFLINE=1, giving what the same local directories give; an id that is not cached, or a cached
model that is no reward model, is an error naming the key."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from protocols import RewardItem, TeacherReply, TeacherRequest, decode, encode
from streamrft.config.base import ConfigError
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.rewards.validate import validate_reward_paths

REPO = Path(__file__).resolve().parents[2]
REV = "fedcba9876543210fedcba9876543210fedcba98"


def _cache(home: Path, repo_id: str, src: Path) -> Path:
    """hub/models--ORG--NAME/{blobs, snapshots/REV -> blobs, refs/main}, as `hf download` writes it."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / REV
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, blobs / f"b{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"b{i}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return snapshot


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> SimpleNamespace:
    """A tiny policy and a scalar RM on it, each as a local directory and cached under an id."""
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
    from streamrft.rm.model import ScalarRewardModel

    root = tmp_path_factory.mktemp("hub_models")
    policy, rm = root / "policy", root / "rm"
    build_tiny_qwen2(str(policy), build_char_tokenizer(str(policy), "0123456789+= "), hidden_size=16, num_layers=1,
                     num_heads=2, num_kv_heads=1, intermediate_size=32)
    ScalarRewardModel.from_backbone(str(policy)).save_pretrained(rm)
    home = root / "hf_home"
    return SimpleNamespace(home=home, policy=policy, rm=rm, policy_snapshot=_cache(home, "tiny-org/policy", policy),
                           rm_snapshot=_cache(home, "tiny-org/rm", rm))


@pytest.fixture
def offline(models, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(models.home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return models


def _cfg(model_path: str) -> SimpleNamespace:
    return SimpleNamespace(reward=RewardConfig(sources=[RewardSourceConfig(name="rm", type="model",
                                                                           model_path=model_path)]))


def test_a_reward_model_source_by_cached_id_validates_and_errors_name_the_key(offline):
    validate_reward_paths(_cfg("tiny-org/rm"))
    validate_reward_paths(_cfg(str(offline.rm)))
    with pytest.raises(ConfigError) as err:
        validate_reward_paths(_cfg("tiny-org/policy"))  # cached, but a plain LM: no rm.json
    assert str(err.value) == (f"reward.sources[0] ('rm').model_path='tiny-org/policy' is not a trained reward model "
                              f"(no rm.json in {offline.policy_snapshot}); train one with `streamrft train-rm CONFIG`")
    with pytest.raises(ConfigError) as err:
        validate_reward_paths(_cfg("tiny-org/missing"))
    assert str(err.value).startswith(
        f"reward.sources[0] ('rm').model_path=tiny-org/missing is not a directory and not in the Hugging Face cache "
        f"at {offline.home / 'hub'}; download it with `hf download tiny-org/missing`")
    assert str(err.value).endswith("; it must be a reward model written by `streamrft train-rm CONFIG`")


def test_a_reward_model_by_id_scores_as_its_directory_does(offline):
    from streamrft.rewards.sources import resolve_reward_function
    from streamrft.rm.reward import ModelReward

    items = [RewardItem(sample_id=str(i), prompt=p, response=r) for i, (p, r) in
             enumerate([("1+2=", "3"), ("4+4=", "9"), ("12+30=", "42")])]
    by_dir = asyncio.run(ModelReward(str(offline.rm), device="cpu").score(items))
    by_id = resolve_reward_function("model:tiny-org/rm")  # serve-reward --fn model:tiny-org/rm
    assert by_id.name == f"model:{offline.rm_snapshot}"
    assert asyncio.run(by_id.score(items)) == by_dir
    assert len(set(by_dir)) == 3  # real, distinct scores
    with pytest.raises(ValueError, match=r"tiny-org/nope is not a directory and not in the Hugging Face cache"):
        resolve_reward_function("model:tiny-org/nope")


@pytest.mark.slow  # a real serve-teacher process (torch import, model load): ~5 s idle, much more on a loaded box
def test_serve_teacher_by_cached_id_answers_as_the_directory_does(offline):
    import torch

    from streamrft.models.tiny import load_policy
    from streamrft.teacher.scoring import sequence_logprobs

    ids, prompt_lens = [[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1]
    model, _ = load_policy(str(offline.policy))
    with torch.no_grad():
        expected = sequence_logprobs(model.eval(), ids, prompt_lens)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "serve-teacher", "--model", "tiny-org/policy",
                             "--bind", "tcp://127.0.0.1:0"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        address = None
        for line in proc.stdout:  # "listening on ..." then "ready"; EOF if it died
            if "listening on" in line:
                address = line.rsplit(" ", 1)[-1].strip()
            if "ready" in line:
                break
        assert address, "serve-teacher did not start"
        sock.connect(address)
        sock.send(encode(TeacherRequest(request_id="t1", token_ids=ids, prompt_lens=prompt_lens)))
        assert sock.poll(30_000), "no teacher reply within 30 s"
        reply = decode(sock.recv(), TeacherReply)
    finally:
        sock.close()
        ctx.term()
        proc.terminate()
        proc.wait(15)
    assert reply.error == ""
    assert [len(x) for x in reply.logprobs] == [3, 2]
    for got, want in zip(reply.logprobs, expected):
        assert got == pytest.approx([float(v) for v in want], abs=1e-5)


def test_serve_teacher_with_an_id_that_is_not_cached_exits_2_naming_it(offline, capsys):
    from streamrft.teacher.service import serve_teacher_main

    assert serve_teacher_main(["--model", "tiny-org/absent"]) == 2
    assert ("--model=tiny-org/absent is not a directory and not in the Hugging Face cache at "
            f"{offline.home / 'hub'}") in capsys.readouterr().err
