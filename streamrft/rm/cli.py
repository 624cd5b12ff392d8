"""Entry points ``streamrft train-rm`` and ``streamrft eval-rm``.

    streamrft train-rm CONFIG.yaml [key=value ...]          train an SRM or GRM (RM config, streamrft.rm.config)
    streamrft eval-rm CONFIG.yaml [key=value ...]           held-out accuracy of CONFIG's output_dir on its eval split
    streamrft eval-rm --model DIR --data FILE               held-out accuracy of a trained RM on FILE

Media RMs (trained with data.image_field / video_field / audio_field) read the held-out rows' media with
the field names and video sampling recorded in their rm.json, so ``--model DIR --data FILE`` needs no flags.

eval-rm prints one JSON line: for an SRM ``pairwise_accuracy`` over non-tie pairs (reward(chosen) >
reward(rejected)); for a GRM ``verdict_accuracy`` (greedy verdict equals the judgment row's verdict).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def train_rm_main(argv: list[str]) -> int:
    """``streamrft train-rm CONFIG [k=v ...]``; prints the summary JSON; returns the exit status."""
    parser = argparse.ArgumentParser(prog="streamrft train-rm", description="Train a reward model.")
    parser.add_argument("config", help="RM config YAML/TOML (see streamrft/rm/config.py)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    parser.add_argument("--dry-run", action="store_true", help="validate the config and exit")
    args = parser.parse_args(argv)
    from streamrft.config import ConfigError
    from streamrft.data import DataError
    from streamrft.rm.config import load_rm_config, validate_rm_config

    try:
        cfg = load_rm_config(args.config, args.overrides)
        validate_rm_config(cfg)
        if args.dry_run:
            print(f"streamrft train-rm: {args.config} is valid")
            return 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        from streamrft.rm.train import TRAINERS

        summary = TRAINERS[cfg.kind](cfg)
    except (ConfigError, DataError, ValueError) as exc:
        print(f"streamrft train-rm: error: {exc}", file=sys.stderr)
        return 2
    print("summary: " + json.dumps(summary), flush=True)
    return 0


def evaluate_rm(model_dir: str, data_path: str) -> dict:
    """Accuracy of the trained RM in ``model_dir`` on the rows of ``data_path``."""
    from pathlib import Path

    from streamrft.rm.model import RM_META, rm_kind

    kind = rm_kind(model_dir)
    media = json.loads((Path(model_dir) / RM_META).read_text()).get("media")
    if kind == "srm":
        from streamrft.rm.data import read_preference_pairs
        from streamrft.rm.model import ScalarRewardModel
        from streamrft.rm.train import srm_accuracy

        pairs = read_preference_pairs(data_path, media)
        acc = srm_accuracy(ScalarRewardModel.from_pretrained(model_dir), pairs)
        return {"kind": kind, "pairwise_accuracy": acc, "n_pairs": sum(not p.tie for p in pairs), "data": data_path}
    from streamrft.rm.data import read_judgments
    from streamrft.rm.judge import GenerativeJudge, judge_accuracy

    rows = read_judgments(data_path, media)
    acc = judge_accuracy(GenerativeJudge.from_pretrained(model_dir), rows)
    return {"kind": kind, "verdict_accuracy": acc, "n_rows": len(rows), "data": data_path}


def eval_rm_main(argv: list[str]) -> int:
    """``streamrft eval-rm CONFIG [k=v ...] | --model DIR --data FILE``; prints one JSON line."""
    parser = argparse.ArgumentParser(prog="streamrft eval-rm", description="Held-out accuracy of a reward model.")
    parser.add_argument("config", nargs="?", help="RM config: evaluates output_dir on data.eval_path")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the config")
    parser.add_argument("--model", help="trained RM directory (instead of a config)")
    parser.add_argument("--data", help="held-out rows (jsonl/parquet) for --model")
    args = parser.parse_args(argv)
    from streamrft.config import ConfigError
    from streamrft.data import DataError

    try:
        if args.model or args.data:
            if args.config or not (args.model and args.data):
                raise ConfigError("give either CONFIG or both --model DIR and --data FILE")
            model_dir, data_path = args.model, args.data
        else:
            if not args.config:
                raise ConfigError("give CONFIG or --model DIR --data FILE")
            from streamrft.rm.config import load_rm_config

            cfg = load_rm_config(args.config, args.overrides)
            if not cfg.data.eval_path:
                raise ConfigError(f"{args.config}: data.eval_path is empty; eval-rm needs a held-out file "
                                  "(or use --model DIR --data FILE)")
            model_dir, data_path = cfg.output_dir, cfg.data.eval_path
        result = evaluate_rm(model_dir, data_path)
    except (ConfigError, DataError, ValueError) as exc:
        print(f"streamrft eval-rm: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # python -m streamrft.rm.cli CONFIG [k=v ...] is train-rm
    sys.exit(train_rm_main(sys.argv[1:]))
