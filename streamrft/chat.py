"""``streamrft chat MODEL_DIR``: a quick interactive check of an exported model.

Reads one prompt per line from stdin and prints the model's completion of it on one line (newlines in
the completion are shown as ``\\n``); exits on EOF. ``--temperature 0`` (the default) decodes greedily,
a positive temperature samples (seeded by ``--seed`` and the line number). ``>`` prompts are printed
only when stdin is a terminal.

``--chat-template auto`` (the default): when the model's tokenizer has a chat template, each line is sent
as one user message rendered with it (``--system-prompt`` prepended as a system message), as training
renders message prompts (streamrft.data.chat); without a template, and with ``none``, the line is the raw
prompt text. ``--chat-template PATH`` renders with that Jinja file.
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
    parser.add_argument("--chat-template", default="auto",
                        help="auto (the tokenizer's template, if it has one) | none (raw text) | PATH (a Jinja file)")
    parser.add_argument("--system-prompt", default="", help="a system message before each line (with a template)")
    args = parser.parse_args(argv)
    if args.temperature < 0 or args.max_new_tokens < 1:
        print(f"streamrft chat: error: --temperature={args.temperature} must be >= 0 and "
              f"--max-new-tokens={args.max_new_tokens} >= 1", file=sys.stderr)
        return 2
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.base import GenerationRequest
    from streamrft.engines.hf import HFEngine
    from streamrft.data.chat import check_chat_setting, prompt_ids
    from streamrft.data.errors import DataError
    from streamrft.models.tiny import load_policy

    try:
        check_chat_setting(args.chat_template)
        model, tokenizer = load_policy(args.model_dir)
    except ValueError as exc:
        print(f"streamrft chat: error: {exc}".replace("data.chat_template", "--chat-template"), file=sys.stderr)
        return 2
    as_messages = args.chat_template != "none" and (args.chat_template != "auto" or bool(tokenizer.chat_template))
    if args.system_prompt and not as_messages:
        print("streamrft chat: error: --system-prompt needs a chat template (the model's tokenizer has none and "
              "--chat-template is not a file)", file=sys.stderr)
        return 2
    model.eval()
    greedy = args.temperature == 0
    cfg = EngineConfig(temperature=1.0 if greedy else args.temperature, top_k=1 if greedy else 0,
                       max_new_tokens=args.max_new_tokens, max_batch_size=1)
    engine = HFEngine(model, cfg, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    interactive = sys.stdin.isatty()
    for i, line in enumerate(_lines(interactive)):
        prompt = line.rstrip("\n")
        if as_messages:
            try:
                _, ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}], args.chat_template,
                                    args.system_prompt, f"stdin line {i + 1}")
            except DataError as exc:
                print(f"streamrft chat: error: {exc}", file=sys.stderr)
                return 2
        else:
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
