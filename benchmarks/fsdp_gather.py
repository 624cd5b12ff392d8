"""What ``train.reshard_after_forward`` changes in a train step: FSDP2's weight gathers and the step's time.

One process, a one-rank group, the project's FSDP2 learner (``FSDP2Strategy``) on a small Qwen2 built here, a
step of ``--microbatches`` microbatches (forward, backward, then the optimizer step). For each setting, one
step counts the units FSDP2 gathers (``gathers_in_one_step``), then
``--steps`` steps are timed, the two settings interleaved step by step so that a slow spell of the machine
hits both. ``true`` (reshard after every forward, gather again for backward) is the baseline the ratios are
against. On a GPU the gathers are cast-and-copy kernels whose launches cost host time per microbatch; on a CPU
they are the same host work plus the copies.

    python benchmarks/fsdp_gather.py [--layers 8] [--hidden 256] [--microbatches 16] [--steps 8]
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


def step(strat, mbs) -> float:
    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"].to(logp_BL.device) * mb["response_mask"].to(logp_BL.device)).mean(), {}

    sync = torch.cuda.synchronize if strat.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for mb in mbs:
        strat.forward_backward(mb, loss_fn, 1.0, stats_on_device=True)
    strat.step()
    sync()
    return time.perf_counter() - t0


def gathers_in_one_step(strat, mbs) -> int:
    """Units gathered during one step: FSDP2 parameter groups whose ``unshard`` did gather (not the no-op of
    an already gathered group). At world size 1 FSDP2 skips the collective and copies (casts) each weight
    into the gathered buffer, so its ``FSDP::all_gather`` profiler range never appears: counted at the call."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    count = [0]
    original = FSDPParamGroup.unshard

    def counting(group, *args, **kwargs):
        before = group._all_gather_result
        original(group, *args, **kwargs)
        count[0] += before is None and group._all_gather_result is not None
    FSDPParamGroup.unshard = counting
    try:
        step(strat, mbs)
    finally:
        FSDPParamGroup.unshard = original
    return count[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per setting, after one warm-up step")
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
            learners = {"true": build(d, True, dist), "false": build(d, False, dist)}
            gathers = {name: gathers_in_one_step(s, mbs) for name, s in learners.items()}  # also the warm-up
            times: dict[str, list[float]] = {name: [] for name in learners}
            for _ in range(a.steps):
                for name, strat in learners.items():
                    times[name].append(step(strat, mbs))
    finally:
        destroy_distributed()
    base = statistics.median(times["true"])
    print(f"{a.layers} layers, hidden {a.hidden}, {a.microbatches} microbatches of {a.rows}x{a.tokens} tokens, "
          f"{dist.device.type}; {a.steps} steps per setting, interleaved")
    print(f"{'reshard_after_forward':22} {'gathers/step':>12} {'step_s (median)':>16} {'vs true':>8}")
    for name in learners:
        med = statistics.median(times[name])
        print(f"{name:22} {gathers[name]:12d} {med:16.4f} {base / med:7.2f}x")


if __name__ == "__main__":
    main()
