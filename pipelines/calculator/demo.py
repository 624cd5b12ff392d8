"""`make demo-calculator`: warm up the tiny model on tool traces, run GRPO over calculator episodes, report.

    python pipelines/calculator/demo.py [CONFIG] [key=value ...] [--n-eval N]

Held-out accuracy is measured with tools, before and after RL, by greedy episodes through the run's own
environment (``env.name`` / ``env.kwargs``; pipelines/calculator/evaluate.py). The last line is machine-readable:
    calculator: heldout_accuracy_before=0.xx heldout_accuracy_after=0.yy tool_call_rate_before=0.xx
    tool_call_rate_after=0.yy steps=N seconds=S
(one line); ``seconds`` covers everything from the start, preparation and both evaluations included.

Like `make demo`, it starts fresh every time: it removes its RL output_dir (runs/calculator/rl) before
training; the prepared model and data (runs/calculator/sft, *.jsonl) are reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(HERE.parents[1]))

from pipelines.calculator.evaluate import heldout_with_tools  # noqa: E402
from pipelines.calculator.prepare import prepare  # noqa: E402
from streamrft.data import read_rows  # noqa: E402
from streamrft.config import ConfigError, load_config  # noqa: E402


def prepare_from_config(cfg) -> dict:
    """Prepare what the config needs: the output folder is the parent of ``model.path`` (runs/calculator/sft ->
    runs/calculator); the warm-up follows the config's ``warmup`` section and seed."""
    out_dir = Path(cfg.model.path).parent
    if Path(cfg.model.path).name != "sft":
        raise ConfigError(f"model.path={cfg.model.path} must end in /sft for prepare.py (the warmed-up model)")
    if Path(cfg.data.train_path).resolve() != (out_dir / "train.jsonl").resolve():
        raise ConfigError(f"data.train_path={cfg.data.train_path} must be {out_dir / 'train.jsonl'} (beside model.path)")
    return prepare(str(out_dir), cfg.seed, cfg.warmup.steps, lr=cfg.warmup.lr, batch_size=cfg.warmup.batch_size)


def clear_output_dir(cfg) -> None:
    """Remove the demo's previous RL run; refuse when output_dir holds the prepared model or data."""
    out = Path(cfg.output_dir).resolve()
    if not out.exists():
        return
    for key, value in (("model.path", cfg.model.path), ("data.train_path", cfg.data.train_path)):
        if value and (Path(value).resolve() == out or out in Path(value).resolve().parents):
            raise SystemExit(f"calculator: output_dir={cfg.output_dir} holds {key}={value}; the demo removes its "
                             "output_dir before training, so point output_dir at a folder of its own")
    shutil.rmtree(out)
    print(f"calculator: removed the previous run in {cfg.output_dir} (the demo starts fresh)", flush=True)


def evaluate(model, tokenizer, cfg, rows: list[dict]) -> dict[str, float]:
    from streamrft.envs.base import load_environment

    make_env = load_environment(cfg.env.name, **cfg.env.kwargs)
    return heldout_with_tools(model, tokenizer, rows, make_env, max_turns=cfg.env.max_turns,
                              max_tokens=cfg.env.max_tokens, max_new_tokens=cfg.engine.max_new_tokens)


def run_demo(config: str, overrides: list[str], n_eval: int = 200) -> dict:
    """Prepare, evaluate, train, evaluate; returns ``{"before", "after", "steps", "seconds", "summary"}``
    (before/after: heldout_with_tools's dicts)."""
    import torch

    from streamrft.checkpoint.export import load_policy_from_checkpoint
    from streamrft.compose import train
    from streamrft.models.tiny import load_policy

    started = time.perf_counter()
    cfg = load_config(config, overrides)
    if not cfg.env.name:
        raise ConfigError("env.name is empty: the calculator demo needs the tool environment (env.name: tools)")
    paths = prepare_from_config(cfg)
    rows = read_rows(paths["eval_path"])[:n_eval]
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(cfg.model.path)
    before = evaluate(model, tokenizer, cfg, rows)
    print(f"calculator: held-out before RL: {json.dumps(before)}", flush=True)
    del model
    clear_output_dir(cfg)
    summary = train(cfg)
    model, tokenizer, _ = load_policy_from_checkpoint(cfg.output_dir)
    after = evaluate(model, tokenizer, cfg, rows)
    print(f"calculator: held-out after RL: {json.dumps(after)}", flush=True)
    return {"before": before, "after": after, "steps": summary["steps"], "summary": summary,
            "seconds": time.perf_counter() - started}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(HERE / "config.yaml"))
    parser.add_argument("--n-eval", type=int, default=200, help="held-out episodes before and after (default 200)")
    args, overrides = parser.parse_known_args(argv)
    if args.config and "=" in args.config:  # a key=value override, not a config file
        overrides.insert(0, args.config)
        args.config = str(HERE / "config.yaml")
    result = run_demo(args.config, overrides, args.n_eval)
    before, after = result["before"], result["after"]
    print(
        f"calculator: heldout_accuracy_before={before['accuracy']:.2f} heldout_accuracy_after={after['accuracy']:.2f} "
        f"tool_call_rate_before={before['tool_call_rate']:.2f} tool_call_rate_after={after['tool_call_rate']:.2f} "
        f"steps={result['steps']} seconds={result['seconds']:.0f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
