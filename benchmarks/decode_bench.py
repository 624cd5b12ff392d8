"""The embedded engine's rollout alone, per decode-kernel choice, against the roofline floor (one GPU).

For each size: a random-init Qwen2.5-shaped model in bf16, B prompts of Lp tokens, N new tokens (EOS
ignored). For each ``engine.decode_kernels`` (torch, triton) it times, in the same process:

* ``prefill_s``: StaticDecoder setup (weight concatenation, cache) + prefill + the first token;
* ``decode_s``: the N-1 decode steps as CUDA-graph replays, one sync at the end (``ms/step``);
* ``generate_s``: a whole ``engine.generate_all`` call (host checks every ``sync_every`` steps included);

and prints the floor (gpu_flops.rollout_floor_s at the copy bandwidth and matmul rate measured here), the
fraction of it reached, and the ratio of each choice to the torch ops. ``--profile`` adds the kernel time
table of a few eager decode steps (torch.profiler) for the Triton choice.

    python benchmarks/decode_bench.py [--sizes 0.5b,1.5b] [--batch 512] [--prompt 256] [--new 512] [--groups 1,8]
                                      [--profile]

``--groups``: samples per prompt (8: a GRPO group, whose rows share one prompt entry in the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_flops import measure_ceilings, rollout_floor_s, shape_of  # noqa: E402
from gpu_grpo import SHAPES  # noqa: E402

from streamrft.config.engine import EngineConfig  # noqa: E402
from streamrft.engines.base import GenerationRequest  # noqa: E402
from streamrft.engines.hf import HFEngine  # noqa: E402
from streamrft.engines.hf_fast import StaticDecoder, decode_kernels  # noqa: E402


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def build(size: str, vocab: int, device: torch.device = torch.device("cuda")):
    """A random-init model of ``size`` (SHAPES, or "tiny": a CPU smoke test's) in bf16 (float32 on a CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, **(TINY if size == "tiny" else SHAPES[size]))
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    return model


def sync_time(fn, device: torch.device = torch.device("cuda")) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure(model, kernels: str, prompts: list[list[int]], n_new: int, profile: bool) -> dict:
    dev = torch.device("cuda")
    ops = decode_kernels(kernels, dev)
    seeds = list(range(len(prompts)))

    def decoder(n):
        return StaticDecoder(model, prompts, seeds, n, 0, [], 1.0, 0.0, 0, 1.0, dev, ops)

    with torch.no_grad():
        warm = decoder(8)  # kernel compilation and cuBLAS heuristics stay out of the timings
        warm.prefill()
        warm.capture()
        warm.run_steps(7)
        del warm
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        box = {}
        prefill_s = sync_time(lambda: box.setdefault("dec", decoder(n_new)).prefill())
        dec = box["dec"]
        capture_s = sync_time(dec.capture)
        decode_s = sync_time(lambda: dec.run_steps(n_new - 1))
        peak = torch.cuda.max_memory_allocated() / 2**30
        table = ""
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            dec.step_1.fill_(1)
            dec.pos_B.copy_(dec.last_prompt_pos_B + 1)
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    dec._decode_step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        del dec, box
        torch.cuda.empty_cache()
    cfg = EngineConfig(max_new_tokens=n_new, static_cache=True, cuda_graphs=True, ignore_eos=True,
                       max_batch_size=len(prompts), decode_kernels=kernels)
    engine = HFEngine(model, cfg, eos_token_ids=[1], pad_token_id=0, device=dev)
    reqs = [GenerationRequest(f"r{i}", p, seed=i) for i, p in enumerate(prompts)]
    generate_s = sync_time(lambda: asyncio.run(engine.generate_all(reqs)))
    return dict(kernels=kernels, prefill_s=prefill_s, capture_s=capture_s, decode_s=decode_s,
                ms_per_step=1000 * decode_s / (n_new - 1), generate_s=generate_s, peak_gib=peak, profile=table)


@contextlib.contextmanager
def attention_settings(spec: str):
    """Inside, the Triton decode attention launches with ``spec`` (BLOCK_N/WARPS/STAGES; "default": as shipped)."""
    from streamrft.engines import triton_decode as tri

    if spec == "default":
        yield
        return
    try:
        block_n, warps, stages = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--attention {spec!r}: use default or BLOCK_N/WARPS/STAGES")
    shipped = tri.decode_attention
    tri.decode_attention = functools.partial(shipped, block_n=block_n, num_warps=warps, num_stages=stages)
    try:
        yield
    finally:
        tri.decode_attention = shipped


def tune(sizes: list[str], batch: int, prompt_len: int, ctx: int, vocab: int, groups: list[int] = (1,),
         rounds: int = 1) -> None:
    """Kernel launch settings, each alone (triton.testing.do_bench, ms): attention at context ``ctx`` (per entry
    of ``groups``: that many rows share each prompt's cache entry, as a GRPO group's samples do), race sampling
    over (batch, vocab) bf16 logits. The first row of each table is the default."""
    import math

    from triton.testing import do_bench

    from streamrft.engines import triton_decode as tri

    dev = torch.device("cuda")
    for size, g in [(size, g) for size in sizes for g in groups]:
        sh = SHAPES[size]
        n_h, n_kv = sh["num_attention_heads"], sh["num_key_value_heads"]
        d = sh["hidden_size"] // n_h
        # batch / g prompts of ``prompt_len`` slots, then ``ctx - prompt_len`` generated slots per row
        pk = torch.randn(batch // g, n_kv, prompt_len, d, device=dev, dtype=torch.bfloat16)
        pv = torch.randn_like(pk)
        gk = torch.randn(batch, n_kv, ctx - prompt_len + 64, d, device=dev, dtype=torch.bfloat16)
        gv = torch.randn_like(gk)
        qkv = torch.randn(batch, (n_h + 2 * n_kv) * d, device=dev, dtype=torch.bfloat16)
        start = torch.zeros(batch, dtype=torch.int64, device=dev)
        prompt_row = torch.arange(batch, device=dev) // g
        step = torch.tensor([ctx - prompt_len], device=dev)
        pos = torch.full((batch,), ctx, device=dev)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        kv_bytes = 2 * batch * n_kv * ctx * d * 2  # as if every row read its own prompt slots (the floor's count)
        settings = list(dict.fromkeys([tri.attention_launch(d), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2),
                                       (32, 4, 2), (64, 2, 2), (64, 2, 3), (64, 2, 4), (32, 2, 2), (32, 2, 3),
                                       (128, 2, 2), (128, 4, 3), (256, 8, 2)]))
        times: dict[tuple, list[float]] = {k: [] for k in settings}
        for r in range(rounds):  # the settings interleaved, each round in a fresh order: clock drift spreads evenly
            for bn, warps, stages in random.Random(r).sample(settings, len(settings)):
                times[(bn, warps, stages)].append(do_bench(lambda: tri.decode_attention(
                    qkv, pk, pv, gk, gv, prompt_row, start, step, pos, inv_freq, 1.0, 1 / math.sqrt(d), n_h, n_kv, bn,
                    warps, stages)))
        for (bn, warps, stages), ms_all in times.items():
            ms = statistics.median(ms_all)
            print(f"tune attention {size} groups={g} ctx={ctx} block_n={bn} warps={warps} stages={stages}: "
                  f"{1000 * ms:.1f} us (median of {rounds}; {', '.join(f'{1000 * t:.1f}' for t in ms_all)}) "
                  f"= {kv_bytes / ms / 1e9:.2f} TB/s of KV read", flush=True)
        del pk, pv, gk, gv
    logits = torch.randn(batch, vocab, device=dev, dtype=torch.bfloat16)
    seeds = torch.arange(batch, device=dev)
    step = torch.tensor([3], device=dev)
    for target, block, warps in [(4096, 1024, 4), (512, 1024, 4), (2048, 1024, 4), (8192, 1024, 4),
                                 (4096, 2048, 8), (8192, 512, 4), (16384, 512, 2)]:
        ms = do_bench(lambda: tri.race_sample(logits, 1.0, seeds, step, block, target, warps))
        print(f"tune race_sample target_programs={target} block={block} warps={warps}: {1000 * ms:.1f} us "
              f"= {logits.numel() * 2 / ms / 1e9:.2f} TB/s of logits read", flush=True)


def longtail_rollouts(size: str, batch: int, prompt_len: int, group: int, vocab: int, cap: int,
                      device: torch.device, kernels: str) -> list[str]:
    """The engine alone on the long-tailed lengths (benchmarks/longtail.py: log-normal, median cap/8, capped at
    ``cap``; one step's per-sample seeds), three ways in one process: every row decoded to the longest length
    (what the engine did before finished rows were known on the device), finished rows skipped by the kernels,
    and skipped plus compaction (hf_fast.should_compact); with the Triton kernels also that last one with each row's
    context walked by one program (no split: triton_decode.attention_splits). Returns the table's lines."""
    from longtail import LongTail

    from streamrft.engines import hf_fast

    shape = LongTail(median=max(1, cap // 8), cap=cap)
    lengths = shape.step_lengths(0, 1, batch // group, group)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch // group)]
    model = build(size, vocab, device)
    cfg = EngineConfig(max_new_tokens=cap, static_cache=True, cuda_graphs=device.type == "cuda", ignore_eos=True,
                       max_batch_size=batch, decode_kernels=kernels)

    def generate(limits: list[int], compact: bool, max_splits: int | None = None) -> float:
        engine = HFEngine(model, cfg, eos_token_ids=[1], pad_token_id=0, device=device)
        reqs = [GenerationRequest(f"r{i}", prompts[i // group], seed=i, max_new_tokens=n)
                for i, n in enumerate(limits)]
        fraction, splits = hf_fast.COMPACT_FRACTION, tri.MAX_SPLITS if tri else None
        hf_fast.COMPACT_FRACTION = fraction if compact else 0.0
        if tri and max_splits is not None:
            tri.MAX_SPLITS = max_splits
        try:
            seconds = sync_time(lambda: asyncio.run(engine.generate_all(reqs)), device)
        finally:
            hf_fast.COMPACT_FRACTION = fraction
            if tri:
                tri.MAX_SPLITS = splits
        return seconds

    # the split-context attention's (triton_decode.attention_splits) own row: the same chunks, one program per
    # row and kv head (MAX_SPLITS = 1), as before v19
    tri = None
    if kernels == "triton":
        from streamrft.engines import triton_decode as tri
    # kernel compilation (the merge kernel per compacted batch size's bucket too), cuBLAS heuristics and captures
    # stay out of the timings
    generate(lengths, True)
    rows = [("every row to the longest", [max(lengths)] * batch, False, None),
            ("finished rows skipped", lengths, False, None),
            ("skipped + compaction", lengths, True, None)]
    if tri:
        generate(lengths, True, 1)
        rows.append(("compaction, unsplit attn", lengths, True, 1))
    lines = [f"{size} longtail: B={batch} groups of {group}, prompt {prompt_len}, lengths median {shape.median} cap "
             f"{cap}: mean {statistics.mean(lengths):.0f}, longest {max(lengths)}, {sum(lengths)} tokens; {kernels}",
             f"{'variant':26} {'generate_s':>10} {'kept tok/s':>10} {'vs first':>8}"]
    base = None
    for label, limits, compact, max_splits in rows:
        seconds = generate(limits, compact, max_splits)
        base = base or seconds
        lines.append(f"{label:26} {seconds:10.3f} {sum(lengths) / seconds:10.0f} {base / seconds:7.2f}x")
        print(lines[-1], flush=True)
    return lines


def admission_rollouts(size: str, batch: int, prompt_len: int, group: int, vocab: int, cap: int,
                       device: torch.device, kernels: str, steps: int = 2) -> list[str]:
    """The async placement's admission pattern on the long-tailed lengths: ``batch // group`` groups in flight at
    most, one ``generate()`` call per group, the next group's call made when a group ends (as the Generator does
    when a credit comes back), ``steps`` steps' worth of groups. Two ways in one process: one chunk per call
    (the colocated engine's rule) and the calls waiting behind a chunk merged into the next (an engine with its
    own weights: engines/call_merge.py). Returns the table's lines."""
    from longtail import LongTail

    shape = LongTail(median=max(1, cap // 8), cap=cap)
    n_groups = steps * (batch // group)
    lengths = [n for step in range(steps) for n in shape.step_lengths(0, step, batch // group, group)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n_groups)]
    model = build(size, vocab, device)
    cfg = EngineConfig(max_new_tokens=cap, static_cache=True, cuda_graphs=device.type == "cuda", ignore_eos=True,
                       max_batch_size=batch, decode_kernels=kernels)

    async def admit_all(engine: HFEngine) -> None:
        pending = list(range(n_groups))

        async def run_group(g: int) -> None:
            await engine.generate_all([GenerationRequest(f"g{g}-{j}", prompts[g], seed=g * group + j,
                                                         max_new_tokens=lengths[g * group + j])
                                       for j in range(group)])
            if pending:
                await run_group(pending.pop(0))

        first, pending = pending[: batch // group], pending[batch // group:]
        await asyncio.gather(*(run_group(g) for g in first))

    def generate(merged: bool) -> float:
        engine = HFEngine(model, cfg, eos_token_ids=[1], pad_token_id=0, device=device, own_weights=merged)
        return sync_time(lambda: asyncio.run(admit_all(engine)), device)

    generate(True)  # kernel compilation, cuBLAS heuristics and captures stay out of the timings
    lines = [f"{size} admissions: B={batch} in flight, groups of {group}, {n_groups} groups, prompt {prompt_len}, "
             f"lengths median {shape.median} cap {cap}: {sum(lengths)} tokens; {kernels}",
             f"{'variant':26} {'generate_s':>10} {'kept tok/s':>10} {'vs first':>8}"]
    base = None
    for label, merged in (("one chunk per call", False), ("waiting calls merged", True)):
        seconds = generate(merged)
        base = base or seconds
        lines.append(f"{label:26} {seconds:10.3f} {sum(lengths) / seconds:10.0f} {base / seconds:7.2f}x")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--kernels", default=None,
                    help="engine.decode_kernels choices, comma-separated (default torch,triton; the longtail and "
                         "admissions workloads: triton, their first entry only)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--groups", default="1",
                    help="samples per prompt, comma-separated (8 = a GRPO group: its rows share one prompt entry)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time kernel launch settings first (per --groups entry)")
    ap.add_argument("--tune-only", action="store_true", help="stop after --tune")
    ap.add_argument("--tune-rounds", type=int, default=1, help="--tune: time every attention setting this many times")
    ap.add_argument("--attention", default="default",
                    help="the Triton decode attention's launch settings to decode with, comma-separated: default or "
                         "BLOCK_N/WARPS/STAGES (e.g. default,32/2/2): one row each")
    ap.add_argument("--workload", choices=("fixed", "longtail", "admissions"), default="fixed",
                    help="longtail: the engine on long-tailed lengths (median --new/8, capped at --new), every row "
                         "to the longest vs finished rows skipped vs skipped + compaction (first --groups entry, "
                         "first --kernels entry); admissions: the async placement's one call per group on those "
                         "lengths, one chunk per call vs waiting calls merged; --sizes tiny runs either on a CPU")
    a = ap.parse_args()
    # the long-tailed table compares ways of running one kernel choice, so it takes the fast one by default
    a.kernels = a.kernels or ("torch,triton" if a.workload == "fixed" else "triton")
    if a.workload != "fixed":
        table = longtail_rollouts if a.workload == "longtail" else admission_rollouts
        lines = []
        for size in a.sizes.split(","):
            dev = torch.device("cpu" if size == "tiny" else "cuda")
            lines += table(size, a.batch, a.prompt, int(a.groups.split(",")[0]), a.vocab, a.new, dev,
                           a.kernels.split(",")[0] if dev.type == "cuda" else "torch")
        print(f"\n==== {a.workload.upper()} TABLE ====")
        print("\n".join(lines))
        return
    if a.tune:
        tune(a.sizes.split(","), a.batch, a.prompt, a.prompt + a.new // 2, a.vocab, [int(g) for g in a.groups.split(",")],
             a.tune_rounds)
        if a.tune_only:
            return
    ceil = measure_ceilings(torch.device("cuda"))
    bw, rate = ceil["copy_bytes_per_s"], ceil["bf16_flops_per_s"]
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s; "
          f"B={a.batch} prompt={a.prompt} new={a.new}", flush=True)
    rng = random.Random(0)
    distinct = [[rng.randrange(3, 1000) for _ in range(a.prompt)] for _ in range(a.batch)]
    lines = []
    for size in a.sizes.split(","):
        model = build(size, a.vocab)
        pf, dec_floor = rollout_floor_s(shape_of(model.config), a.batch, a.prompt, a.new, bw, rate)
        lines.append(f"{size}: floor {pf + dec_floor:.3f} s (prefill {pf:.3f} + decode {dec_floor:.3f}), "
                     f"decode floor {1000 * dec_floor / (a.new - 1):.2f} ms/step")
        lines.append(f"{'size':5} {'group':>5} {'kernels':7} {'prefill_s':>9} {'capture_s':>9} {'decode_s':>8} "
                     f"{'ms/step':>7} {'generate_s':>10} {'peak_GiB':>8} {'decode%':>7} {'rollout%':>8} {'vs base':>8}")
        base = None  # the first group size's first kernels
        for group in [int(g) for g in a.groups.split(",")]:
            # a.batch rows, ``group`` consecutive rows per distinct prompt (the floor counts every row's
            # prompt slots, so a shared prompt can read fewer bytes than it)
            prompts = [distinct[i // group] for i in range(a.batch)]
            variants = [(k, att) for k in a.kernels.split(",")
                        for att in (a.attention.split(",") if k == "triton" else ["default"])]
            for kernels, att in variants:
                with attention_settings(att):
                    r = measure(model, kernels, prompts, a.new, a.profile and kernels == "triton")
                base = base or r
                label = kernels if att == "default" else f"{kernels}:{att}"
                lines.append(f"{size:5} {group:5} {label:7} {r['prefill_s']:9.3f} {r['capture_s']:9.3f} "
                             f"{r['decode_s']:8.3f} {r['ms_per_step']:7.2f} {r['generate_s']:10.3f} "
                             f"{r['peak_gib']:8.1f} {100 * dec_floor / r['decode_s']:7.1f} "
                             f"{100 * (pf + dec_floor) / r['generate_s']:8.1f} {base['generate_s'] / r['generate_s']:7.2f}x")
                print(lines[-1], flush=True)
                if r["profile"]:
                    print(r["profile"], flush=True)
        del model
        torch.cuda.empty_cache()
    print("\n==== DECODE TABLE ====")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
