"""`streamrft chat MODEL_DIR` driven through stdin in a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO

# one busy process at a time (pytest's, or one subprocess it waits on): `make test` runs it in the unit group
# (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.one_process]


def greedy(model_dir, prompts, max_new_tokens):
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.base import GenerationRequest
    from streamrft.engines.hf import HFEngine
    from streamrft.models.tiny import load_policy

    model, tok = load_policy(model_dir)
    engine = HFEngine(model.eval(), EngineConfig(top_k=1, max_new_tokens=max_new_tokens), [tok.eos_token_id],
                      tok.pad_token_id, "cpu")
    reqs = [GenerationRequest(str(i), tok(p)["input_ids"], seed=i) for i, p in enumerate(prompts)]
    return [tok.decode(s.response_ids, skip_special_tokens=True) for s in asyncio.run(engine.generate_all(reqs))]


def test_chat_prints_the_greedy_completion_of_each_stdin_line_and_exits_on_eof(arith_dir):
    prompts = ["12+7=", "40+40=", "3+5="]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "streamrft.chat", str(arith_dir / "sft"), "--max-new-tokens", "5"],
                          input="".join(p + "\n" for p in prompts), capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == greedy(str(arith_dir / "sft"), prompts, 5)


def test_chat_on_a_directory_without_a_model_fails_with_the_reason(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "streamrft.chat", str(tmp_path)], input="", capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 2
    assert "has no config.json" in proc.stderr
