"""``streamrft chat MODEL_DIR``: a quick interactive check of an exported model.

Reads one prompt per line from stdin and prints the model's completion of it on one line (newlines in
the completion are shown as ``\\n``); exits on EOF. ``--temperature 0`` (the default) decodes greedily,
a positive temperature samples (seeded by ``--seed`` and the line number). ``>`` prompts are printed
only when stdin is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def chat_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrft chat", description="Complete prompts read from stdin.")
    parser.add_argument("model_dir", help="a Hugging Face causal LM directory")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion length cap")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    args = parser.parse_args(argv)
    if args.temperature < 0 or args.max_new_tokens < 1:
        print(f"streamrft chat: error: --temperature={args.temperature} must be >= 0 and "
              f"--max-new-tokens={args.max_new_tokens} >= 1", file=sys.stderr)
        return 2
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.base import GenerationRequest
    from streamrft.engines.hf import HFEngine
    from streamrft.models.tiny import load_policy

    try:
        model, tokenizer = load_policy(args.model_dir)
    except ValueError as exc:
        print(f"streamrft chat: error: {exc}", file=sys.stderr)
        return 2
    model.eval()
    greedy = args.temperature == 0
    cfg = EngineConfig(temperature=1.0 if greedy else args.temperature, top_k=1 if greedy else 0,
                       max_new_tokens=args.max_new_tokens, max_batch_size=1)
    engine = HFEngine(model, cfg, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    interactive = sys.stdin.isatty()
    for i, line in enumerate(_lines(interactive)):
        prompt = line.rstrip("\n")
        ids = tokenizer(prompt)["input_ids"]
        if not ids:
            print("", flush=True)
            continue
        (sample,) = asyncio.run(engine.generate_all([GenerationRequest(str(i), ids, seed=args.seed * 1_000_003 + i)]))
        text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        print(text.replace("\n", "\\n"), flush=True)
    return 0


def _lines(interactive: bool):
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


if __name__ == "__main__":
    sys.exit(chat_main(sys.argv[1:]))
