"""FSDP2's work per microbatch on one rank: weight gathers (``train.reshard_after_forward``) and gradient
reduces (``last_before_step``), counted, and the train step's time.

One process, a one-rank group, the project's FSDP2 learner (``FSDP2Strategy``) on a small Qwen2 built here, a
step of ``--microbatches`` microbatches (forward, backward, then the optimizer step), in three settings:

- ``each``: reshard after every forward, gather again for backward, reduce in every backward (before v12);
- ``kept``: ``train.reshard_after_forward=false``, the weights gathered once per step, a reduce per backward;
- ``kept+deferred``: also ``last_before_step=False`` for all but the last microbatch, as the actor calls it:
  one reduce per unit per step (the default on one rank).

For each, one step counts the units FSDP2 gathers and reduces, then ``--steps`` steps are timed, the settings
interleaved step by step so that a slow spell of the machine hits all of them; ratios are against ``each``. On
a GPU each gather and reduce is a few kernels per weight launched from Python, host time per microbatch that
the GPU waits for when the microbatch's own work is shorter; on a CPU the same host work plus the copies.

    python benchmarks/fsdp_microbatch.py [--layers 24] [--hidden 64] [--microbatches 16] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def build(model_dir: str, reshard: bool, dist):
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.learner.fsdp2 import FSDP2Strategy

    dtype = "bfloat16" if dist.device.type == "cuda" else "float32"
    return FSDP2Strategy(ModelConfig(path=model_dir, dtype=dtype), TrainConfig(lr=1e-4, reshard_after_forward=reshard,
                                                                               compile_head=False), dist, 100)


def microbatches(n: int, rows: int, tokens: int, vocab: int) -> list[dict]:
    from streamrft.learner.microbatch import SequenceSample, make_microbatches

    g = torch.Generator().manual_seed(0)
    prompt = tokens // 2
    samples = [SequenceSample(torch.randint(3, vocab, (prompt,), generator=g).tolist(),
                              torch.randint(3, vocab, (tokens - prompt,), generator=g).tolist(),
                              {"adv": torch.randn(tokens - prompt, generator=g)}) for _ in range(n * rows)]
    mbs = make_microbatches(samples, token_budget=rows * tokens)
    assert len(mbs) == n, (len(mbs), n)
    return mbs


def step(strat, mbs, defer: bool) -> float:
    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"].to(logp_BL.device) * mb["response_mask"].to(logp_BL.device)).mean(), {}

    sync = torch.cuda.synchronize if strat.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i, mb in enumerate(mbs):
        last = not defer or i == len(mbs) - 1
        strat.forward_backward(mb, loss_fn, 1.0, stats_on_device=True, last_before_step=last)
    strat.step()
    sync()
    return time.perf_counter() - t0


def count_in_one_step(strat, mbs, defer: bool) -> tuple[int, int]:
    """(units gathered, units reduced) in one step: FSDP2 parameter groups whose ``unshard`` did gather (not the
    no-op of an already gathered group; at world size 1 FSDP2 skips the collective and casts each weight into
    the gathered buffer, so its ``FSDP::all_gather`` range never appears) and its ``FSDP::post_backward_reduce``
    ranges."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.profiler import ProfilerActivity, profile

    gathers = [0]
    original = FSDPParamGroup.unshard

    def counting(group, *args, **kwargs):
        before = group._all_gather_result
        original(group, *args, **kwargs)
        gathers[0] += before is None and group._all_gather_result is not None
    FSDPParamGroup.unshard = counting
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(strat, mbs, defer)
    finally:
        FSDPParamGroup.unshard = original
    return gathers[0], sum(1 for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setting, after one warm-up step")
    a = ap.parse_args()

    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
    from streamrft.runtime.distributed import destroy_distributed, init_distributed

    dist = init_distributed(timeout_s=120)
    try:
        with tempfile.TemporaryDirectory() as d:
            tok = build_char_tokenizer(d, "0123456789+-=abcdefghijklmnopqrstuvwxyz")
            build_tiny_qwen2(d, tok, hidden_size=a.hidden, num_layers=a.layers, num_heads=8, num_kv_heads=2,
                             intermediate_size=4 * a.hidden, max_position_embeddings=2 * a.tokens)
            mbs = microbatches(a.microbatches, a.rows, a.tokens, len(tok))
            settings = {"each": (True, False), "kept": (False, False), "kept+deferred": (False, True)}
            learners = {name: build(d, reshard, dist) for name, (reshard, _) in settings.items()}
            counts = {name: count_in_one_step(s, mbs, settings[name][1]) for name, s in learners.items()}  # warm-up
            times: dict[str, list[float]] = {name: [] for name in learners}
            for _ in range(a.steps):
                for name, strat in learners.items():
                    times[name].append(step(strat, mbs, settings[name][1]))
    finally:
        destroy_distributed()
    base = statistics.median(times["each"])
    print(f"{a.layers} layers, hidden {a.hidden}, {a.microbatches} microbatches of {a.rows}x{a.tokens} tokens, "
          f"{dist.device.type}; {a.steps} steps per setting, interleaved")
    print(f"{'setting':15} {'gathers/step':>12} {'reduces/step':>12} {'step_s (median)':>16} {'vs each':>8}")
    for name in learners:
        med = statistics.median(times[name])
        print(f"{name:15} {counts[name][0]:12d} {counts[name][1]:12d} {med:16.4f} {base / med:7.2f}x")


if __name__ == "__main__":
    main()
