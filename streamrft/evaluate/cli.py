"""``streamrft eval CONFIG [k=v ...] | --model DIR --data FILE [--n N --k K --format F ...]``.

Flags override the config's values (and any key=value overrides). Prints the summary as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

# flag -> EvalConfig field
_FLAGS = {"model": "model_path", "data": "data_path", "n": "n", "k": "k", "format": "format",
          "temperature": "temperature", "max_new_tokens": "max_new_tokens", "output": "output_path",
          "limit": "limit", "seed": "seed"}


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrft eval", description="pass@1, pass@k and maj@k of a policy.")
    parser.add_argument("config", nargs="?", help="eval config YAML (streamrft/evaluate/config.py)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. n=8")
    parser.add_argument("--model", help="policy directory (model_path)")
    parser.add_argument("--data", help="benchmark file (data_path)")
    parser.add_argument("--n", type=int, help="samples per problem")
    parser.add_argument("--k", type=int, help="k of pass@k and maj@k")
    parser.add_argument("--format", help="arith | gsm8k | math | choice")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--output", help="per-problem results jsonl (output_path)")
    parser.add_argument("--limit", type=int, help="first N problems only")
    parser.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    from streamrft.config import ConfigError
    from streamrft.data import DataError
    from streamrft.evaluate.config import load_eval_config, validate_eval_config

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config:  # no config file, only overrides
        config, overrides = None, [config, *overrides]
    overrides += [f"{field}={getattr(args, flag)}" for flag, field in _FLAGS.items() if getattr(args, flag) is not None]
    try:
        cfg = load_eval_config(config, overrides)
        validate_eval_config(cfg)
        from streamrft.evaluate.run import evaluate

        summary = evaluate(cfg)
    except (ConfigError, DataError) as exc:
        print(f"streamrft eval: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(eval_main(sys.argv[1:]))
