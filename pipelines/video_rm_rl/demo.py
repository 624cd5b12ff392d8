"""Video reward-model RL, end to end on CPU: a tiny vision RM learns synthetic video preferences, then a tiny
Qwen2-VL policy is trained against it by the `streamrft train` runtime (reward ``type: model``).

    python -m pipelines.video_rm_rl.demo [--out runs/video_rm_rl] [key=value ...]   (overrides of config.yaml)

Steps (each skipped when its output exists, except RL, which starts afresh): prepare.py (videos, rows, warmed-up policy, RM backbone);
`train-rm rm.yaml` (the RM, reading each pair's mp4); then GRPO with ``reward.sources = [video_rm,
colour_correct (weight 0)]`` through ``build_run`` + ``train_loop``, the code path of `streamrft train`.

Reported: the RM's pairwise accuracy and ``rm_true_colour_first`` (share of its held-out videos on which it
scores the true colour above the other three); then, on the held-out eval rows (videos the RM and the policy
never trained on), before and after RL:
- ``heldout_rm_score``: the driver's own held-out evaluation (greedy responses scored by the sources; with
  colour_correct at weight 0 this is the RM's mean score);
- ``colour_correct``: greedy exact match against the true colour (``task.colour_correct``), the rule metric
  the RM's preferences encode, measured on the policy module itself;
- ``colour_correct_sampled``: the same over SAMPLES samples per video at the RL temperature (fixed seeds).
The last line is machine-readable:
    video-rm-rl: rm_pairwise_accuracy=.. rm_true_colour_first=.. rm_score_before=.. rm_score_after=.. colour_correct_before=.. colour_correct_after=.. colour_correct_sampled_before=.. colour_correct_sampled_after=.. steps=N ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = "runs/video_rm_rl"
SAMPLES = 8  # per held-out video for colour_correct_sampled (the RL rollout's n_samples_per_prompt)


def greedy_colour_correct(module, processor, rows: list[dict], codec, path: str, samples: int = 0,
                          temperature: float = 1.0) -> float:
    """Mean colour_correct of greedy (top_k=1) responses to ``rows``, videos decoded as the runtime does;
    with ``samples`` > 0, of that many samples per row at ``temperature`` instead (fixed seeds, the same
    before and after RL). Greedy answers depend on the square's colour only, so the greedy number moves in
    steps of one colour's share; the sampled one is the rule metric's expectation under the policy."""
    from pipelines.video_rm_rl.task import colour_correct
    from pipelines.visual_count.common import generate
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.hf import HFEngine

    tok = processor.tokenizer
    how = EngineConfig(temperature=temperature, max_new_tokens=2) if samples else EngineConfig(top_k=1, max_new_tokens=2)
    engine = HFEngine(module, how, [tok.eos_token_id], tok.pad_token_id, torch.device("cpu"))
    inputs = [codec.inputs(r["prompt"], codec.refs(SimpleNamespace(row=i, extra=r), path), f"{path} row {i}")
              for i, r in enumerate(rows)]
    outs, index = generate(engine, inputs, max(1, samples), 0)
    return sum(colour_correct(tok.decode(s.response_ids, skip_special_tokens=True), rows[i]["reference"])
               for s, i in zip(outs, index)) / len(outs)


def rm_true_colour_first(rm_dir: str, pairs_path: str) -> float:
    """Share of the videos of ``pairs_path`` on which the RM scores the true colour above every other colour
    and above the empty answer: what the policy needs from it (pairwise accuracy alone hid an RM that scored
    r, g and b the same; an RM that had never seen the empty answer scored it near the true colour, and RL
    found it)."""
    from pipelines.video_rm_rl.task import COLOURS
    from streamrft.rm.data import read_preference_pairs
    from streamrft.rm.model import ScalarRewardModel

    rm = ScalarRewardModel.from_pretrained(rm_dir)
    videos = {p.media[0].path: p for p in read_preference_pairs(pairs_path, rm.media) if not p.tie}
    answers = [*COLOURS, ""]
    hits = 0
    for p in videos.values():
        scores = rm.score([p.prompt] * len(answers), answers, media=[p.media] * len(answers))
        hits += answers[max(range(len(answers)), key=scores.__getitem__)] == p.chosen
    return hits / len(videos)


def rl_config(out: str, overrides: list[str]):
    """config.yaml with its runs/video_rm_rl paths moved under ``out``."""
    from streamrft.config import load_config

    cfg = load_config(str(HERE / "config.yaml"), [
        f"output_dir={out}/rl", f"model.path={out}/sft", f"data.train_path={out}/train.jsonl",
        f"data.eval_path={out}/eval.jsonl", *overrides])
    for src in cfg.reward.sources:
        if src.type == "model":
            src.model_path = f"{out}/rm"
    return cfg


def run_demo(out: str = DEFAULT_OUT, overrides: list[str] = (), rm_overrides: list[str] = (),
             prepare_kwargs: dict | None = None) -> dict:
    started = time.perf_counter()
    from pipelines.video_rm_rl.prepare import prepare
    from streamrft.rm.cli import evaluate_rm
    from streamrft.rm.config import load_rm_config

    prepare(out, **(prepare_kwargs or {}))
    prepared = time.perf_counter()
    rm_cfg = load_rm_config(HERE / "rm.yaml", [f"output_dir={out}/rm", f"model.path={out}/rm_base",
                                               f"data.train_path={out}/rm_train.jsonl",
                                               f"data.eval_path={out}/rm_eval.jsonl", *rm_overrides])
    if not (Path(rm_cfg.output_dir) / "rm.json").is_file():
        from streamrft.rm.train import train_srm

        train_srm(rm_cfg)
    rm_acc = evaluate_rm(rm_cfg.output_dir, rm_cfg.data.eval_path)["pairwise_accuracy"]
    rm_first = rm_true_colour_first(rm_cfg.output_dir, rm_cfg.data.eval_path)
    rm_done = time.perf_counter()

    from streamrft.compose import build_run
    from streamrft.config import validate_config
    from streamrft.models.media_inputs import MediaCodec
    from streamrft.runtime.distributed import destroy_distributed, init_distributed
    from streamrft.runtime.driver import train_loop

    cfg = rl_config(out, ["checkpoint.resume=never", *overrides])
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # the RL part trains afresh each time
    rows = [json.loads(line) for line in Path(cfg.data.eval_path).read_text().splitlines()]
    rows = rows[:cfg.data.eval_size] if cfg.data.eval_size else rows
    dist = init_distributed(timeout_s=cfg.rollout.stage_timeout_s)
    try:
        validate_config(cfg, dist.world_size)
        run = build_run(cfg, dist)
        processor = run.strategy.processor
        codec = MediaCodec.from_config(processor, cfg.data)
        def measure():
            return (greedy_colour_correct(run.engine.module, processor, rows, codec, cfg.data.eval_path),
                    greedy_colour_correct(run.engine.module, processor, rows, codec, cfg.data.eval_path,
                                          SAMPLES, cfg.engine.temperature))

        before, sampled_before = measure()
        summary = asyncio.run(train_loop(run))
        after, sampled_after = measure()
    finally:
        destroy_distributed()
    result = {"rm_pairwise_accuracy": rm_acc, "rm_true_colour_first": rm_first, "rm_score_before": summary["heldout_reward_mean_before"],
              "rm_score_after": summary["heldout_reward_mean_after"], "colour_correct_before": before,
              "colour_correct_after": after, "colour_correct_sampled_before": sampled_before,
              "colour_correct_sampled_after": sampled_after, "steps": summary["steps"], "n_eval": len(rows),
              "seconds": time.perf_counter() - started, "prepare_seconds": prepared - started,
              "rm_seconds": rm_done - prepared}
    print("video-rm-rl: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()),
          flush=True)
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=DEFAULT_OUT)
    args, overrides = ap.parse_known_args(argv)
    run_demo(args.out, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
