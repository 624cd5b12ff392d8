"""The rollout's per-sample pipeline tail on the CPU: gpu_grpo.py's StreamRFT worker on the tiny model with
64 prompts x 8 samples and 4 new tokens (generation is ~0.1 s of a rollout; the rest is each sample crossing
generator -> reward -> advantage -> learner feed). Prints the rollout seconds of every step and the median
over steps 2..N-1; ``--profile DIR`` also writes a cProfile of one steady rollout (step 3), sorted by
cumulative and by own time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tail_bench.py --out /tmp/tail [--steps 6] [--profile /tmp/tail]

``--tail-only``: the engine returns every sample at once (random tokens of ``--new`` length, drawn when the
generate call starts, handed out row by row as the static-cache engine does) and the train step does nothing, so
a rollout is the per-sample pipeline alone at the GPU workload's shape (``--new 512 --prompt-len 256``) without
the CPU decoding it (~100 s a rollout here) or training on it.

``--code DIR``: import ``streamrft`` and ``protocols`` from DIR (a ``git worktree`` of an older commit) with this
harness; ``--compare N --code DIR`` alternates DIR's code (the baseline) and this tree's.

``--baseline``: the behaviour before v15: channels send every item in a message of its own
(``ChannelSender.coalesce = False``) and the reward stage scores one sample per call (``batch_limit = 1``). ``--compare N``: N pairs of runs, baseline and current alternating, each in its own
process; prints both medians and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_grpo  # noqa: E402  (it puts this tree first on sys.path; it imports streamrft only when it runs)

if "--code" in sys.argv:  # before anything imports streamrft: the code under test comes from that tree
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", default="", help="folder for the cProfile of step 3's rollout")
    ap.add_argument("--baseline", action="store_true", help="one message per item on every channel")
    ap.add_argument("--compare", type=int, default=0, help="N alternating pairs of baseline and current runs")
    ap.add_argument("--new", type=int, default=4, help="response tokens per sample (the GPU workload's: 512)")
    ap.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per sample (the GPU workload's: 256)")
    ap.add_argument("--tail-only", action="store_true", help="an instant engine and an empty train step")
    ap.add_argument("--code", default="", help="import streamrft from this tree (--compare: the baseline's)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.compare:
        return compare(a.compare, out, a)
    if a.baseline:
        from streamrft.runtime.channels import ChannelSender
        from streamrft.runtime.scoring import RewardScorerStage

        ChannelSender.coalesce = False
        RewardScorerStage.batch_limit = 1
    if a.tail_only:
        instant_engine_and_empty_train_step()
    wl = gpu_grpo.workload(True)
    wl.update(prompts=64, samples=8, new=a.new, prompt_len=a.prompt_len, micro_batch=64)
    gpu_grpo.build_model("tiny", wl, out, "cpu")
    if a.profile:  # gpu_grpo's timeline profiles the third rollout's event loop into the run folder
        os.environ["GPU_GRPO_PROFILE_ROLLOUT"] = "3"
    res = gpu_grpo.run_streamrft("tiny", wl, out, a.steps, fast=True)
    if "error" in res:
        raise SystemExit(res["error"])
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        for key in ("cumulative", "tottime"):
            shutil.copy(out / "run_tiny_streamrft" / f"rollout3_profile_{key}.txt", Path(a.profile) / f"profile_{key}.txt")
    # Every rollout's event-loop CPU seconds (the timeline's rollout_loop_cpu_s: the main thread's thread_time while
    # waiting for the batch): the engine's forwards run in worker threads (asyncio.to_thread), so this is the
    # per-sample tail's own work, far less noisy on a shared machine than the wall time.
    cpu = res["rollout_loop_cpu_s"]
    print(json.dumps({"rollout_s_median": res["rollout_s"], "step_s": res["step_s"],
                      "rollouts": [round(t, 3) for t in res["rollout_times"]],
                      # steps 2..N: the first builds the decoder; the profiled one (3rd) is left out
                      "loop_cpu_s_median": statistics.median(c for i, c in enumerate(cpu[1:], 1) if not (a.profile and i == 2)),
                      "loop_cpu_s": [round(c, 3) for c in cpu],
                      "gc2_s": full_collections_per_rollout(res["timeline"])}))


def full_collections_per_rollout(timeline: list) -> list[float]:
    """Seconds of full (generation-2) collections inside each rollout, from the timeline: each one walks every
    tracked object not frozen, so objects made after Pipeline.launch froze the heap (a compile's graphs, guards and
    sympy expressions) make them slow."""
    rollouts = [(start, start + seconds) for kind, _, start, seconds in timeline if kind == "rollout"]
    collections = [(start, seconds) for kind, label, start, seconds in timeline if kind == "gc" and label == "gen2"]
    return [round(sum(s for t, s in collections if a <= t <= b), 3) for a, b in rollouts]


def instant_engine_and_empty_train_step() -> None:
    """--tail-only: HFEngine.generate yields every request's sample as soon as it is called, and the actor's
    train step returns at once: what is left of a rollout is the per-sample pipeline."""
    import asyncio

    import torch

    from streamrft.engines.base import GeneratedSample
    from streamrft.engines.hf import HFEngine
    from streamrft.learner.actor import ActorUpdate

    async def generate(self, requests, mm_inputs=None):
        n = self.cfg.max_new_tokens
        g = torch.Generator().manual_seed(requests[0].seed)
        tokens_BN = torch.randint(3, 29, (len(requests), n), generator=g)
        logp_BN = -torch.rand((len(requests), n), generator=g)
        await asyncio.sleep(0)
        for i, r in enumerate(requests):
            yield GeneratedSample(request_id=r.request_id, response_ids=tokens_BN[i].tolist(),
                                  logprobs=logp_BN[i].tolist(), finish_reason="length",
                                  policy_version=self.policy_version, token_versions=[self.policy_version] * n)

    HFEngine.generate = generate
    ActorUpdate.train_step = lambda self, batch: {"loss": 0.0}


def compare(pairs: int, out: Path, a) -> None:
    """Alternate baseline and current runs (each a fresh process) and print the medians and ratios."""
    import subprocess

    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    for i in range(pairs):
        for kind in ("baseline", "current"):
            cmd = [sys.executable, __file__, "--out", str(out / f"{kind}{i}"), "--steps", str(a.steps),
                   "--new", str(a.new), "--prompt-len", str(a.prompt_len)] + (["--tail-only"] if a.tail_only else [])
            if kind == "baseline":
                cmd += ["--code", a.code] if a.code else ["--baseline"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode:
                raise SystemExit(f"{kind} run {i} failed:\n{done.stderr[-3000:]}")
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(kind, i, runs[kind][-1], flush=True)
    med = {kind: {key: statistics.median(r[key] for r in rs) for key in ("loop_cpu_s_median", "rollout_s_median")}
           for kind, rs in runs.items()}
    print(json.dumps({"medians": med, "ratio_current_over_baseline": {
        key: round(med["current"][key] / med["baseline"][key], 3) for key in med["current"]}}))


if __name__ == "__main__":
    main()
