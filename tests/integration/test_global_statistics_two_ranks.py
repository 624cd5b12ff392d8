"""Issue 16 item 12 across real ranks: the float64 two-pass statistics (global whitening, REINFORCE++,
running reward normalisation, the reported reward std) make two all-reduces each; with torchrun and
gloo two ranks give the first step of one rank (same global batch, same seed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO, arith_overrides
from tests.integration.test_train_e2e import env_one_thread
from tests.ports import free_port

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def first_step(out):
    return json.loads((out / "steps.jsonl").read_text().splitlines()[0])


def test_two_ranks_match_one_rank_with_reinforce_pp_whitening_and_running_norm(arith_dir, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["algorithm.advantage_estimator=reinforce++", "algorithm.reward_running_norm=true",
             "rollout.n_samples_per_prompt=4", "algorithm.offpolicy_mask=token"]
    # the one-rank run beside the two-rank one: independent runs, and it would leave a core idle while it runs alone
    log = tmp_path / "one.log"  # a file, not a pipe: nobody reads a pipe while the two-rank run is going
    with log.open("w") as f:
        single = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG),
                                   *arith_overrides(arith_dir, one, *extra)],
                                  env=env_one_thread(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        env = dict(env_one_thread(), NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
        proc = subprocess.run([str(REPO / "launch" / "colocate.sh"), str(CONFIG), *arith_overrides(arith_dir, two, *extra)],
                              env=env, timeout=300, cwd=REPO, capture_output=True, text=True)
        single.wait(timeout=300)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait(10)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert single.returncode == 0, log.read_text()[-3000:]
    a, b = first_step(one), first_step(two)
    assert b["train_sequences"] == a["train_sequences"]
    assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-9)
    assert b["reward_std"] == pytest.approx(a["reward_std"], abs=1e-9)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6)
    assert b["behaviour_proximal_kl"] == pytest.approx(a["behaviour_proximal_kl"], abs=1e-6)
