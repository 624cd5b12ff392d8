"""Models by hub id: a tiny model laid out as the Hugging Face cache lays it out resolves and loads by id
with HF_HUB_OFFLINE=1; an id that is not cached is a config error that says how to get it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.config import ConfigError, load_config
from streamrft.config.validate import validate_model
from streamrft.models.hub import resolve_model_dir

REPO = Path(__file__).resolve().parents[2]
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """HF_HOME with hub/models--tiny-org--arith-chat/{snapshots/REV/..., refs/main} (what `hf download` writes)."""
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--tiny-org--arith-chat"
    src = tmp_path_factory.mktemp("src")
    build_tiny_qwen2(str(src), build_char_tokenizer(str(src), "0123456789+= ", chat=True), hidden_size=16,
                     num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    # The cache keeps file contents in blobs/ and symlinks them from the snapshot; both shapes load.
    blobs, snapshot = repo / "blobs", repo / "snapshots" / REV
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return home


def test_a_cached_hub_id_resolves_to_its_snapshot(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve_model_dir("tiny-org/arith-chat", "model.path") == str(
        hf_home / "hub" / "models--tiny-org--arith-chat" / "snapshots" / REV)
    cfg = load_config(None, ["model.path=tiny-org/arith-chat", "model.critic_path=tiny-org/arith-chat",
                             "algorithm.advantage_estimator=gae"])
    validate_model(cfg)  # the check before start accepts cached ids for every model key


def test_an_id_that_is_not_cached_says_how_to_get_it(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cfg = load_config(None, ["model.path=tiny-org/arith-chat", "model.reference_path=tiny-org/missing",
                             "algorithm.kl_coef=0.1"])
    with pytest.raises(ConfigError) as err:
        validate_model(cfg)
    assert str(err.value) == (
        f"model.reference_path=tiny-org/missing is not a directory and not in the Hugging Face cache at "
        f"{hf_home / 'hub'}; download it with `hf download tiny-org/missing` (huggingface-cli download "
        "tiny-org/missing before huggingface_hub 1.0) on a machine with network, or set HF_HOME to the cache that has it")
    with pytest.raises(ValueError, match=r"model.path=/no/such/dir: no config.json there \(the directory does not exist"):
        resolve_model_dir("/no/such/dir", "model.path")


def test_loads_by_id_offline_in_a_fresh_process(hf_home):
    """HF_HOME and HF_HUB_OFFLINE=1 set before start, as a user does: transformers itself, the framework's
    policy loader and the learner's loader all load the cached model by id, to the same weights."""
    code = """
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from streamrft.config.model import ModelConfig
from streamrft.learner.fsdp2 import load_pretrained
from streamrft.models.tiny import load_policy
direct = AutoModelForCausalLM.from_pretrained("tiny-org/arith-chat")
model, tok = load_policy("tiny-org/arith-chat")
learner = load_pretrained("tiny-org/arith-chat", ModelConfig(path="tiny-org/arith-chat"), torch.float32)
same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in
           zip(direct.state_dict().values(), model.state_dict().values(), learner.state_dict().values()))
ids = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True)["input_ids"]
print(json.dumps({"same": same, "n": len(direct.state_dict()), "ids": ids,
                  "template": AutoTokenizer.from_pretrained("tiny-org/arith-chat").chat_template is not None}))
"""
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] and out["n"] > 0 and out["template"]
    # <|user|> 1 + 2 = <eos> <|assistant|>: the chat tokens came along from the cache
    assert len(out["ids"]) == 7 and out["ids"][5] == 1


def test_the_gsm8k_instruct_config_validates_with_its_hub_id_cached_and_message_prompts(hf_home, tmp_path):
    """pipelines/gsm8k/config.yaml as shipped (model.path: Qwen/Qwen2.5-1.5B-Instruct, chat template auto) with the
    id in the cache (a tiny stand-in with a chat template under that name) and prompts preprocessed with
    --messages: `--dry-run` accepts it offline, and a message row renders exactly as apply_chat_template does."""
    from transformers import AutoTokenizer

    from streamrft.data.chat import prompt_ids

    home = tmp_path / "hf_home"
    shutil.copytree(hf_home, home, symlinks=True)
    (home / "hub" / "models--tiny-org--arith-chat").rename(home / "hub" / "models--Qwen--Qwen2.5-1.5B-Instruct")
    data = tmp_path / "train.jsonl"
    pre = subprocess.run([sys.executable, str(REPO / "pipelines" / "gsm8k" / "preprocess.py"),
                          str(REPO / "tests" / "fixtures" / "gsm8k_test_sample.jsonl"), str(data), "--limit", "4",
                          "--messages"], capture_output=True, text=True, timeout=60)
    assert pre.returncode == 0, pre.stderr
    row = json.loads(data.read_text().splitlines()[0])
    assert row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(REPO / "pipelines" / "gsm8k" / "config.yaml"),
                           "--dry-run", f"data.train_path={data}", f"data.eval_path={data}",
                           f"output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0 and "is valid" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(str(next((home / "hub" / "models--Qwen--Qwen2.5-1.5B-Instruct" / "snapshots")
                                                 .iterdir())))
    _, ids = prompt_ids(tok, row["prompt"], "auto")
    assert ids == tok.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
