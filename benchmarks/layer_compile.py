"""The first train step with ``train.compile_layers``, cold (empty compile cache) and warm (a second process on the
first one's cache), in three variants of ``learner/compiling.py``:

- ``symbolic``: every input dimension symbolic (torch.compile's ``dynamic=True``) and Python floats symbolic too
  (torch's default under it);
- ``specialised``: the same with floats specialised while the layer compiles (``_CompileScope``);
- ``batch``: floats specialised, and only the rows and tokens symbolic (``SYMBOLIC_SHAPES = "batch"``, what
  StreamRFT does).

Each measurement is a fresh worker process (``--worker``): an FSDP2 learner (world size 1) on the model, one
train step over three microbatches of different lengths; it reports the step's seconds, the AOTAutograd
compiles it ran (2 for one graph = Dynamo traced the layer twice) and the first loss (the two variants must
agree). Usage::

    python benchmarks/layer_compile.py --out /tmp/lc            # tiny Qwen2 built under --out, CPU
    python benchmarks/layer_compile.py --out /tmp/lc --model DIR  # any Hugging Face causal LM directory

Prints one row per (variant, cache) and the specialised/symbolic and batch/specialised ratios; writes
``result.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# variant -> (floats specialised while compiling, compiling.SYMBOLIC_SHAPES)
VARIANTS = {"symbolic": (False, "all"), "specialised": (True, "all"), "batch": (True, "batch")}
COMPARED = (("specialised", "symbolic"), ("batch", "specialised"))  # (variant, its baseline) ratios


def _microbatches(vocab: int):
    """Three microbatches of two rows, 9, 7 and 12 tokens (no dimension of size 1, which Dynamo would specialise)."""
    import torch

    from streamrft.learner.microbatch import SequenceSample, make_microbatches

    g = torch.Generator().manual_seed(3)
    lengths = [(3, 4), (2, 5), (6, 3), (4, 8), (5, 6), (2, 3)]
    samples = [SequenceSample(torch.randint(3, vocab, (p,), generator=g).tolist(),
                              torch.randint(3, vocab, (r,), generator=g).tolist(),
                              {"adv": torch.randn(r, generator=g)}) for p, r in lengths]
    return make_microbatches(samples, token_budget=24)


def worker(model: str, variant: str, result: Path) -> None:
    import torch
    from torch._dynamo.utils import counters

    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.learner import compiling
    from streamrft.learner.fsdp2 import FSDP2Strategy
    from streamrft.runtime.distributed import destroy_distributed, init_distributed

    specialise_floats, compiling.SYMBOLIC_SHAPES = VARIANTS[variant]
    compiling.layer_compiler(False).specialize_floats = specialise_floats
    dist = init_distributed(timeout_s=60)
    strat = FSDP2Strategy(ModelConfig(path=model, dtype="float32", attn_implementation="sdpa"),
                          TrainConfig(lr=1e-2, compile_layers=True), dist, total_steps=10)
    mbs = _microbatches(strat.module.config.vocab_size)
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))

    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / n_tokens, {}

    started = time.perf_counter()
    losses = [strat.forward_backward(mb, loss_fn, 1.0)["loss"] for mb in mbs]
    strat.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    result.write_text(json.dumps({"first_step_s": seconds, "aot_compiles": counters["aot_autograd"]["total"],
                                  "loss0": losses[0]}))
    destroy_distributed()


def _tiny_model(out: Path) -> str:
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    d = out / "model"
    if not (d / "config.json").exists():
        tok = build_char_tokenizer(str(d), "0123456789+-=abcdefghijklmnopq")
        build_tiny_qwen2(str(d), tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
    return str(d)


def ratios(rows: list[dict], variant: str = "specialised", baseline: str = "symbolic") -> dict[str, float]:
    """variant / baseline first-step seconds, cold and warm (pure: rows as ``main`` collects them)."""
    by = {(r["variant"], r["cache"]): r for r in rows if "first_step_s" in r}
    out = {}
    for cache in ("cold", "warm"):
        a, b = by.get((variant, cache)), by.get((baseline, cache))
        if a and b:
            out[cache] = a["first_step_s"] / b["first_step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the tiny model, the compile caches and result.json")
    parser.add_argument("--model", default="", help="a Hugging Face causal LM directory (default: a tiny Qwen2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one worker may take")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.worker, Path(args.result))

    from bench_variants import worker_result

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or _tiny_model(out)
    rows = []
    for variant in VARIANTS:
        cache = out / f"cache-{variant}"
        if cache.exists():
            import shutil

            shutil.rmtree(cache)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
                   PYTHONPATH=str(ROOT))
        for state in ("cold", "warm"):
            cmd = [sys.executable, __file__, "--out", str(out), "--model", model, "--worker", variant,
                   "--result", str(out / "worker.json")]
            row = {"variant": variant, "cache": state, **worker_result(cmd, out / "worker.json", args.timeout, env)}
            rows.append(row)
            shown = row.get("error") or f"{row['first_step_s']:.2f} s, {row['aot_compiles']} AOT compiles, " \
                                         f"loss0 {row['loss0']!r}"
            print(f"{variant:12s} {state}: {shown}", flush=True)
    summary = {"rows": rows, **{f"ratio_{a}_over_{b}": ratios(rows, a, b) for a, b in COMPARED}}
    (out / "result.json").write_text(json.dumps(summary, indent=1))
    for a, b in COMPARED:
        print(f"first step, {a} / {b}:", ", ".join(f"{k} {v:.2f}x" for k, v in summary[f"ratio_{a}_over_{b}"].items()))


if __name__ == "__main__":
    main()
