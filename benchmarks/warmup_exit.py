"""How long the first train step's wait for the compile warm-up child lasts, against waiting for the child's exit.

The learner's first compile waits for the child (``CompileWarmup.wait``). It now takes the child's result as soon as
the child writes it. Before, it waited for the child's process to exit, which also covers the child's shutdown:
Inductor's compile workers and, on a GPU, the CUDA context. This starts a real child on a tiny Qwen2 (CPU,
Inductor's C++ backend, a cold compile cache), waits as the learner does, then waits for the exit, and prints both
times and their ratio, for each number of compile threads asked for.

    .venv/bin/python benchmarks/warmup_exit.py --threads 1,2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamrft.config import load_config, validate_config  # noqa: E402
from streamrft.learner import compile_warmup  # noqa: E402
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2  # noqa: E402


def one_wait(root: Path, model_dir: str) -> tuple[float, float]:
    """(seconds from the child's compiling marker to the learner's wait returning, further seconds to its exit)."""
    root.mkdir(parents=True)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(root / "run"), "compile_cache_dir": str(root / "cache"),  # a cold cache each time
        "model": {"path": model_dir, "dtype": "bfloat16", "attn_implementation": "sdpa"},
        "engine": {"max_new_tokens": 6}, "rollout": {"n_samples_per_prompt": 2, "prompts_per_step": 2},
        "reward": {"sources": [{"name": "correct", "type": "rule", "fn": "gsm8k"}]},
        "train": {"compile_layers": True, "compile_head": False, "compile_warmup": True, "micro_batch_tokens": 64}}))
    cfg = load_config(path)
    validate_config(cfg, 1, check_paths=False)
    warm = compile_warmup.start_compile_warmup(cfg, "cpu")
    try:
        deadline = time.monotonic() + 300
        while not warm.compiling_path.exists():
            if time.monotonic() > deadline or warm.proc.poll() is not None:
                raise RuntimeError(f"the warm-up child did not start compiling; its log: {warm.log_path}")
            time.sleep(0.01)
        t0 = time.monotonic()
        result = warm.wait()
        waited = time.monotonic() - t0
        if result["status"] != "ok":
            raise RuntimeError(f"the warm-up child ended {result['status']}: {result.get('reason')}")
        warm.proc.wait(timeout=300)
        return waited, time.monotonic() - t0 - waited
    finally:
        compile_warmup.stop_compile_warmup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="TORCHINDUCTOR_COMPILE_THREADS values, comma-separated")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        tok = build_char_tokenizer(model_dir, "0123456789+-=abcdefghijklmnopq")
        build_tiny_qwen2(model_dir, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
        print(f"{'threads':>7} {'wait for the result s':>22} {'+ the exit s':>12} {'wait for the exit s':>20} "
              f"{'ratio':>6}")
        for i, threads in enumerate(a.threads.split(",")):
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = threads
            waited, exit_s = one_wait(Path(tmp) / f"run{i}", model_dir)
            print(f"{threads:>7} {waited:22.2f} {exit_s:12.2f} {waited + exit_s:20.2f} "
                  f"{(waited + exit_s) / waited:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
