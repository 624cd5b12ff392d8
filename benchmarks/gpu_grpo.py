"""GRPO on one GPU, StreamRFT vs TRL's GRPOTrainer (HF generation), same workload; prints one table.

Workload (per size): 64 prompts × 8 samples, prompts of 256 tokens, responses forced to 512 tokens (EOS
suppressed: ``engine.ignore_eos`` here, ``min_new_tokens`` in TRL), bf16 compute, random-init Qwen2.5
shapes (0.5B, 1.5B) with a local character tokenizer (the vocab size sets the cost, not the text), a
pseudo-random reward (benchmarks/gpu_reward.py). Each system runs in its own subprocess (clean memory
peak, clean process group); steady-state numbers are medians over the steps after the first, and for
StreamRFT before the last (which also writes the final checkpoint): run --steps 4 or more.
StreamRFT keeps its optimizer state on the GPU between phases (train.offload_between_phases=false).

``--workload longtail``: response lengths log-normal per sample (median 512, sigma 1, capped at 4096; each
drawn from the sample's seed, the same lengths at every step in both systems, EOS at the last position in
both: benchmarks/longtail.py), instead of the fixed 512.

    python benchmarks/gpu_grpo.py --out DIR [--sizes 0.5b,1.5b] [--steps 3] [--systems streamrft,async,trl,eager]

``async`` is StreamRFT with rollout.placement=async on the same one GPU: an engine process decodes the next
step (staleness <= 1) while the learner trains this one.
    python benchmarks/gpu_grpo.py --tiny --out /tmp/x      # CPU dry run: tiny shapes, few tokens
    python benchmarks/gpu_grpo.py --tiny --workload longtail --systems streamrft,async --steps 2 --out /tmp/y

results.json also holds, per StreamRFT step, the compile seconds (``compile_times``) and the caching allocator's
cudaMalloc / cudaFree / retry counts of each train step (``train_alloc``); ``GPU_GRPO_PROFILE_TRAIN=2,5`` adds a
torch.profiler kernel table of those train steps (``train_profiles``; the profiler slows them).
"""

from __future__ import annotations

import time

_T_MAIN = time.time()  # the worker's first line: process start = this - the parent's launch time

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = {  # published Qwen2.5 config values
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    # Qwen2.5-7B (config.json of Qwen/Qwen2.5-7B): 7.62e9 parameters, untied LM head, vocab 152064
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
    # --tiny --sizes 7b: the tiny shape through every 7B-only path (untied head, bf16 build, no final save)
    "tiny7b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, tie_word_embeddings=False),
}
BIG = ("7b", "tiny7b")  # built directly in bf16 on the device (7B in fp32 on the host would be 30 GB)
# LoRA of the 7B runs, the same in StreamRFT (model.lora_*) and TRL (peft LoraConfig): every linear of the blocks
LORA = dict(r=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
# systems that are StreamRFT with fixed overrides (besides streamrft/async/eager): LoRA, and full fine-tuning with
# the AdamW state in host memory (train.optimizer_offload) and recomputed activations
SYSTEM_OVERRIDES = {
    "lora": [f"model.lora_rank={LORA['r']}", f"model.lora_alpha={LORA['alpha']}",
             f"model.lora_target_modules=[{','.join(LORA['targets'])}]"],
    "fullft": ["train.optimizer_offload=true", "model.gradient_checkpointing=true"],
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# async on one GPU: the engine process's share of the device memory (weights, concatenated weights, static KV
# cache, graphs: ~32 GiB at 1.5B); the learner takes the rest minus a margin. Both use expandable segments.
ASYNC_ENGINE_SHARE = 0.3


def workload(tiny: bool, kind: str = "fixed", size: str = "") -> dict:
    if tiny:
        wl = dict(prompts=4, samples=2, prompt_len=8, new=6, vocab=512, micro_batch=4)
    elif size == "7b":
        # 7B: 1/4 of the sequences and half the response of the small shapes (16 x 8, prompt 256, new 256 = 64k
        # tokens a step, ~2.9 PFLOP of training: ~5 s at 600 TFLOP/s) so one system's build + 3 steps fit in
        # ~4 minutes; micro-batch 16 x 512 tokens (~45 GiB of bf16 activations without recompute, LoRA)
        wl = dict(prompts=16, samples=8, prompt_len=256, new=256, vocab=152064, micro_batch=16)
    else:
        # async on one GPU: the learner process has ~0.65 of the memory, so its micro-batch is half the colocated one
        wl = dict(prompts=64, samples=8, prompt_len=256, new=512, vocab=151936, micro_batch=32, async_micro_batch=16)
    wl["kind"] = kind
    # 7B: no final checkpoint (full fine-tuning's fp32 weights + AdamW state are ~85 GiB: more than the disk)
    wl["final_save"] = size not in BIG
    if kind == "longtail":
        from longtail import LongTail

        shape = LongTail(median=4, cap=16) if tiny else LongTail(median=512, cap=4096)
        # the engine and TRL may decode up to the cap; the token budget per micro-batch stays that of
        # micro_batch sequences of median length (but holds at least one sequence of the cap)
        wl.update(shape=shape, new=shape.cap, median=shape.median)
    return wl


def response_tokens(wl: dict, steps: int) -> float:
    """Response tokens per step: fixed, or the mean over the run's steps of the long-tailed lengths."""
    if wl["kind"] != "longtail":
        return wl["prompts"] * wl["samples"] * wl["new"]
    return statistics.mean(sum(step_lengths(wl, s)) for s in range(steps))


def steady_steps(n_steps: int) -> list[int]:
    """The 0-based steps whose median is a run's steady step: not the first (warm-up) and not the last (it also
    writes the final checkpoint), where there are enough."""
    return list(range(1, n_steps - 1)) if n_steps >= 3 else (list(range(1, n_steps)) or list(range(n_steps)))


def engine_only_lengths(wl: dict) -> list[int] | None:
    """Each row's new tokens in the engine-only generate call (request seeds 0 .. B-1); None: every row wl["new"]."""
    if wl["kind"] != "longtail":
        return None
    return [wl["shape"].length(i) for i in range(wl["prompts"] * wl["samples"])]


def step_lengths(wl: dict, step: int) -> list[int] | None:
    """Each row's new tokens in the GRPO rollout of a 0-based step (the same in every system); None: fixed."""
    if wl["kind"] != "longtail":
        return None
    from streamrft.config import Config

    return wl["shape"].step_lengths(Config().seed, step, wl["prompts"], wl["samples"])


def micro_batch_tokens(wl: dict, micro_batch: int) -> int:
    if wl["kind"] != "longtail":
        return micro_batch * (wl["prompt_len"] + wl["new"])
    return max(micro_batch * (wl["prompt_len"] + wl["median"]), wl["prompt_len"] + wl["new"])


def learner_overrides(wl: dict, placement: str = "colocated") -> list[str]:
    """The learner's settings of the benchmark (also benchmarks/learner_profile.py's, which trains alone)."""
    mb = wl["async_micro_batch" if placement == "async" and "async_micro_batch" in wl else "micro_batch"]
    return [
        "model.dtype=bfloat16", "train.lr=1e-6",
        f"train.micro_batch_tokens={micro_batch_tokens(wl, mb)}",
        "algorithm.advantage_estimator=group_norm", "algorithm.policy_loss=ppo_clip", "algorithm.kl_coef=0.0",
        # one GPU with room for both phases: keep the optimizer state on the device (TRL does not offload either)
        *(["train.offload_between_phases=false"] if placement == "colocated" else []),
    ]


def write_reward_config(path: Path) -> None:
    """The run's config file: the pseudo-random reward source (the rest are key=value overrides)."""
    path.write_text("reward:\n  sources:\n    - name: rand\n      type: custom\n"
                    f"      fn: {ROOT / 'benchmarks' / 'gpu_reward.py'}:random_reward\n")


# ---------------------------------------------------------------- model + data ----------------------
def build_model(size: str, wl: dict, out: Path, device: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrft.models.tiny import build_char_tokenizer

    path = out / f"model_{size}"
    tok = build_char_tokenizer(str(path), ALPHABET)
    cfg = Qwen2Config(**{**dict(vocab_size=wl["vocab"], tie_word_embeddings=True), **SHAPES[size]}, rope_theta=1e6,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    # 7B: random init directly in bf16 on the device (15 GB) instead of fp32 (30 GB) then a cast
    dtype = torch.bfloat16 if size in BIG else torch.float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(torch.bfloat16).save_pretrained(str(path))
    del model
    rng = random.Random(0)
    n_rows = wl["prompts"] * 8
    with (out / f"data_{size}.jsonl").open("w") as f:
        for _ in range(n_rows):
            text = "".join(rng.choice(ALPHABET) for _ in range(wl["prompt_len"]))
            f.write(json.dumps({"prompt": text, "reference": ""}) + "\n")
    return path


# ---------------------------------------------------------------- StreamRFT worker ------------------
def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(files for _, _, files in os.walk(folder))


def drop_checkpoints(run_dir: Path) -> None:
    """Remove a finished run's checkpoints (its result already holds what their saves cost). Why: the GPU machine's
    disk is shared by the call's runs, and a 1.5B checkpoint with AdamW state is ~20 GiB: three of them left a
    later run of the same warm machine without space at its save (benchmarks/NOTES.md v24)."""
    from streamrft.checkpoint.layout import checkpoints_root

    shutil.rmtree(checkpoints_root(run_dir), ignore_errors=True)


def run_streamrft(size: str, wl: dict, out: Path, steps: int, fast: bool, placement: str = "colocated",
                  tag: str = "", overrides: list[str] | None = None, variant: str = "") -> dict:
    # as `streamrft train` (cli.py): the config, then the compile warm-up's child, then torch and the rest
    from bench_firststep import LAUNCH_ENV, Stamps, breakdown
    from streamrft.bytecode import imported_packages_from_source
    from streamrft.config import load_config, validate_config
    from streamrft.learner import compile_warmup

    cuda = compile_warmup.probe_device_type() == "cuda"

    def sync():
        if cuda and "torch" in sys.modules:
            sys.modules["torch"].cuda.synchronize()

    stamps = Stamps(sync)
    if os.environ.get(LAUNCH_ENV):
        stamps.mark("launch", float(os.environ[LAUNCH_ENV]))
    stamps.mark("main", _T_MAIN)
    tag = tag or (("streamrft" if placement == "colocated" else "async") if fast else "eager")
    run_dir = out / f"run_{size}_{tag}"
    if run_dir.exists():  # a run dir left by an earlier call would be resumed (checkpoint.resume=auto)
        shutil.rmtree(run_dir)
    cache_dir = out / "compile_cache"  # shared by every StreamRFT run of the call: the first is cold
    cache = "warm" if _has_files(cache_dir) else "cold"
    overrides_all = [
        f"output_dir={run_dir}", f"model.path={out / f'model_{size}'}",
        f"data.train_path={out / f'data_{size}.jsonl'}", "data.eval_path=",
        f"engine.max_new_tokens={wl['new']}", "engine.ignore_eos=true", "engine.temperature=1.0",
        f"engine.max_batch_size={wl['prompts'] * wl['samples']}",
        f"engine.static_cache={'true' if fast else 'false'}",
        f"engine.cuda_graphs={'true' if fast and cuda else 'false'}",
        f"rollout.prompts_per_step={wl['prompts']}", f"rollout.n_samples_per_prompt={wl['samples']}",
        f"train.max_steps={steps}", *learner_overrides(wl, placement),
        f"rollout.placement={placement}",
        # async, one GPU overlapped: the engine process decodes while the learner trains (staleness <= 1),
        # holding at most this share of the GPU's memory (its weights, KV cache and graphs)
        *(["rollout.max_staleness=1", f"rollout.engine_memory_fraction={ASYNC_ENGINE_SHARE if cuda else 0.0}"]
          if placement == "async" else []),
        # Inductor and Triton caches kept across the call's runs (compile_cache_dir): --repeat-streamrft's warm runs
        f"compile_cache_dir={cache_dir}",
        *(overrides or []),  # --variants: this variant's overrides
        *os.environ.get("STREAMRFT_BENCH_EXTRA", "").split(),  # extra key=value overrides for an experiment
    ]
    cfg_path = out / f"cfg_{size}_{tag}.yaml"
    write_reward_config(cfg_path)
    cfg = load_config(cfg_path, overrides_all)
    stamps.mark("config_loaded")
    warmup = compile_warmup.start_compile_warmup(cfg)  # train.compile_warmup (learner/compile_warmup.py)
    kernels = compile_warmup.active_kernel_warmup()  # engine.kernel_warmup (engines/kernel_warmup.py)
    stamps.mark("warmup_started")
    import asyncio

    import torch

    import streamrft.compose as compose
    import streamrft.engines as engines
    import streamrft.engines.hf_fast as hf_fast
    from step_timeline import Timeline
    from streamrft.engines.base import GenerationRequest
    from streamrft.runtime.distributed import init_distributed
    from streamrft.runtime.driver import _shutdown, train_loop

    stamps.mark("imports_done")
    if cuda and placement == "async":
        # one GPU, two processes: the learner keeps to its share so the engine process's allocations fit too
        torch.cuda.set_per_process_memory_fraction(1.0 - ASYNC_ENGINE_SHARE - 0.05)
    dist = init_distributed()
    stamps.mark("dist_ready")
    validate_config(cfg, dist.world_size)
    stamps.mark("validated")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # the first step's parts (benchmarks/bench_firststep.py): model load, engine build, and per chunk the static
    # decoder's set-up (concatenated weights + KV cache), prefill and CUDA-graph capture (+ Triton compile)
    stamps.wrap(compose, "build_learner", "build_learner")
    stamps.wrap(engines, "build_engine", "build_engine")
    stamps.wrap(compose, "build_run", "build_run")
    stamps.wrap(hf_fast.StaticDecoder, "__init__", "decoder_init")
    stamps.wrap(hf_fast.StaticDecoder, "prefill", "prefill")
    stamps.wrap(hf_fast.StaticDecoder, "capture", "capture")
    if cuda:  # who hands cached device memory back, and what it costs
        stamps.wrap(torch.cuda, "empty_cache", "empty_cache", sync=False)
    run = compose.build_run(cfg, dist)
    final_save = wl.get("final_save", True)
    if not final_save:  # 7B: a full checkpoint (fp32 + Adam, ~85 GiB) would not fit the GPU machine's disk
        run.checkpointer.step_done = lambda step, policy_version, defer_complete=False: None
    if wl["kind"] == "longtail":
        from longtail import LONGTAIL_ENV, force_lengths

        eos_id = run.strategy.tokenizer.eos_token_id
        if placement == "async":  # the engines are processes of their own: each runs longtail.py's worker
            os.environ[LONGTAIL_ENV] = json.dumps({"shape": dataclasses.asdict(wl["shape"]), "eos_id": eos_id})
            os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])
            run.pipeline.worker_module = "longtail"
        else:
            force_lengths(run.engine, wl["shape"], eos_id)
    stamps.wrap(run.pipeline, "take", "rollout")  # waiting for the step's batch
    train_diag = watch_train_steps(run.actor, cuda, run_dir)
    stamps.wrap(run.actor, "train_step", "train")
    # one clock for rollouts, train steps, garbage collections and the checkpoint stager's host memory work
    timeline = Timeline()
    timeline.watch_gc()
    timeline.watch_host_staging()
    timeline.wrap(run.pipeline, "take", "rollout")
    timeline.wrap(run.actor, "train_step", "train")
    # GPU_GRPO_PROFILE_ROLLOUT=k: a cProfile of the k-th rollout's event loop (rollout<k>_profile_*.txt in the run dir)
    timeline.watch_rollout_parts(run.pipeline, int(os.environ.get("GPU_GRPO_PROFILE_ROLLOUT", "0")), run_dir)
    if cuda:
        timeline.watch_learner_gpu(run.strategy, run.actor)
        timeline.watch_gpu_clocks()
    if os.environ.get("GPU_GRPO_WATCH_OPTIMIZER"):  # the optimizer step's parts and a stack sampler inside it
        timeline.watch_optimizer_step(run.strategy)
    times = stamps.calls

    async def main():
        try:
            summary.update(await train_loop(run))
            if cuda:  # the GRPO steps' peak; the engine-only call below has a workload of its own (no shared
                # prompts: 512 prompt entries and their prefill at once), measured apart (engine_only_peak_gib)
                summary["steps_peak"] = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
                torch.cuda.reset_peak_memory_stats()
            if placement == "async":  # the rollout engine lives in its own process: no engine-only timing here
                return float("nan")
            # the engine alone, after training (weights unsharded for rollout): one full generate call
            rng = random.Random(1)
            reqs = [GenerationRequest(f"b{i}", [rng.randrange(3, 29) for _ in range(wl["prompt_len"])], seed=i)
                    for i in range(wl["prompts"] * wl["samples"])]
            sync()
            t0 = time.perf_counter()
            got = await run.engine.generate_all(reqs)
            sync()
            engine_s = time.perf_counter() - t0
            want = engine_only_lengths(wl) or [wl["new"]] * len(reqs)
            assert [len(g.response_ids) for g in got] == want
            return engine_s
        finally:
            await _shutdown(run)

    summary: dict = {}
    try:
        engine_s = asyncio.run(main())
    finally:
        timeline.stop()
        compile_warmup.stop_compile_warmup()
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    # steady state: not the first step (warm-up) and not the last (it also writes the final checkpoint)
    steady = [rows[i] for i in steady_steps(len(rows))]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    # rollout/train: the engine-only generate call after training is not a rollout (its decoder calls come last)
    n_roll = len(times["rollout"])
    steady_t = lambda key: statistics.median(times[key][1:] or times[key])  # noqa: E731
    tokens = response_tokens(wl, steps)
    from torch._dynamo.utils import counters

    from streamrft.learner.compiling import compile_log

    return {
        "system": tag, "size": size, "steps": len(rows), "variant": variant, "overrides": list(overrides or []),
        "trainable_params": run.trainable_params,  # LoRA: the adapters only
        "step_s": med("step_seconds"), "rollout_s": steady_t("rollout"), "train_s": steady_t("train"),
        "rollout_tok_s": tokens / steady_t("rollout"), "trained_tok_s": med("trained_tokens_per_s"),
        # the learner's own count from the tokens it trained (steps.jsonl): the long-tailed workload's MFU
        "train_flops": med("train_flops"),
        "phase_switch_s": med("phase/rollout_to_train_seconds") + med("phase/train_to_rollout_seconds"),
        "r2t_s": med("phase/rollout_to_train_seconds"), "t2r_s": med("phase/train_to_rollout_seconds"),
        "weight_sync_s": med("phase/weight_push_seconds"), "offload_s": med("phase/offload_seconds"),
        "reload_s": med("phase/reload_seconds"), "engine_only_s": engine_s,
        "steady_steps": steady_steps(len(rows)),  # the 0-based steps of step_s (the long-tailed FLOPs' lengths)
        # over the GRPO steps (before v22 this included the engine-only call, whose 512 distinct prompts' prefill
        # and cache made the 1.5B peak: benchmarks/NOTES.md v22)
        "peak_gib": summary["steps_peak"][0] / 2**30 if cuda else 0.0,
        # what the caching allocator held at most (allocated + cached pools): the device memory really taken
        "peak_reserved_gib": summary["steps_peak"][1] / 2**30 if cuda else 0.0,
        "engine_only_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda and placement != "async" else 0.0,
        "step_times": [r.get("step_seconds") for r in rows], "rollout_times": times["rollout"][:n_roll],
        "train_times": times["train"], "both_busy": summary.get("async_both_busy_fraction", 0.0),
        # per step, what checkpointing blocked the step (checkpoint.async_save: the host copy only; the last
        # step's write finishes in the background and the run waits for it at the end)
        "checkpoint_times": [r.get("checkpoint_seconds") for r in rows], "final_save": final_save,
        # per step, torch.compile's wall time inside it (a later step's share is a recompile)
        "compile_times": [r.get("compile_seconds") for r in rows],
        # per train step, the caching allocator's cudaMalloc/cudaFree calls and retries (a retry frees every cached
        # block and synchronizes), and the kernel tables of the steps named in GPU_GRPO_PROFILE_TRAIN
        "train_alloc": train_diag["alloc"], "train_profiles": train_diag["profiles"],
        # those steps' CUDA runtime calls per thread (a lock held by another thread slows the launches), and the run's
        # timeline: rollouts, train steps, garbage collections, the checkpoint stager's slabs and page-locking calls
        "train_traces": train_diag["traces"], "timeline": timeline.to_json(),
        "learner_gpu": timeline.learner, "gpu_clocks": timeline.clocks, "rollout_loop_cpu_s": timeline.loop_cpu,
        "optimizer_parts": timeline.optimizer_parts, "optimizer_stacks": timeline.stack_summary(),
        # cold: compile_cache_dir was empty when this run started; the Inductor FX-graph cache's hits/misses
        "cache": cache, "inductor_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")},
        # this process's compiles in order (the learner's graphs by setting key, and their seconds): against the
        # warm-up child's compile_log, which graph the child's Inductor cache did not serve (NOTES v22)
        "compile_log": [[key, round(s, 3)] for key, s in compile_log()],
        # the compile warm-up's child (None: train.compile_warmup off): its result (status, its compiles and their
        # seconds, its wall time from its start) and how long the first train step's compile waited for it
        "compile_warmup": warmup and {**(warmup.result or {}), "waited_s": round(warmup.waited_s, 3)},
        # the engine's kernel warm-up child (None: engine.kernel_warmup off): its result, collected at the learner's
        # first compile (after the first rollout) or when the run ended
        "kernel_warmup": kernels and kernels.result,
        "first_step": breakdown(stamps.marks, stamps.calls, rows[0] if rows else {}),
        # the packages this interpreter compiled from source at import (no .pyc): every process's imports pay it
        "imports_from_source": imported_packages_from_source(),
        "stamps": stamps.to_json(),
    }


def watch_train_steps(actor, cuda: bool, run_dir: Path) -> dict:
    """Per ``actor.train_step`` call: allocator counter deltas; under ``GPU_GRPO_PROFILE_TRAIN=2,4`` (1-based
    train steps) a torch.profiler kernel table of those steps, to compare a slow step with a steady one, and
    their Chrome traces (run_dir/trace_train{N}.json.gz) with the CUDA runtime calls totalled per thread."""
    import torch
    from step_timeline import trace_summary

    wanted = {int(x) for x in os.environ.get("GPU_GRPO_PROFILE_TRAIN", "").split(",") if x.strip()}
    diag: dict = {"alloc": [], "profiles": {}, "traces": {}}
    fn = actor.train_step
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")

    @functools.wraps(fn)
    def watched(*a, **k):
        n = len(diag["alloc"]) + 1
        before = torch.cuda.memory_stats() if cuda else {}
        if cuda and n in wanted:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = fn(*a, **k)
                torch.cuda.synchronize()
            diag["profiles"][str(n)] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                                 max_name_column_width=70)
            trace = run_dir / f"trace_train{n}.json.gz"
            prof.export_chrome_trace(str(trace))
            diag["traces"][str(n)] = trace_summary(trace)
        else:
            out = fn(*a, **k)
        after = torch.cuda.memory_stats() if cuda else {}
        diag["alloc"].append({key: after.get(key, 0) - before.get(key, 0) for key in keys})
        return out

    actor.train_step = watched
    return diag


# ---------------------------------------------------------------- TRL worker ------------------------
def run_trl(size: str, wl: dict, out: Path, steps: int, lora: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gpu_reward import random_reward

    cuda = torch.cuda.is_available()
    path = str(out / f"model_{size}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    if cuda:
        model.to("cuda")
        torch.cuda.reset_peak_memory_stats()
    gen_times: list[float] = []
    original = model.generate

    def sync():
        if cuda:
            torch.cuda.synchronize()

    calls = [0]  # generate calls so far = the step whose lengths the next call draws (longtail)

    def timed_generate(*a, **k):
        if wl["kind"] == "longtail":
            from transformers import LogitsProcessorList

            from longtail import ForceLengthProcessor
            from streamrft.config import Config

            ids = k.get("input_ids", a[0] if a else None)
            lengths = wl["shape"].step_lengths(Config().seed, calls[0], ids.shape[0] // wl["samples"], wl["samples"])
            k["logits_processor"] = LogitsProcessorList([ForceLengthProcessor(lengths, ids.shape[1], tok.eos_token_id)])
        calls[0] += 1
        sync()
        t0 = time.perf_counter()
        r = original(*a, **k)
        sync()
        gen_times.append(time.perf_counter() - t0)
        return r

    model.generate = timed_generate
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            step_times.append(time.perf_counter() - self.t0)

    rows = [json.loads(line) for line in (out / f"data_{size}.jsonl").read_text().splitlines()]
    n = wl["prompts"] * wl["samples"]
    args = GRPOConfig(
        output_dir=str(out / f"trl_{size}"), per_device_train_batch_size=wl["micro_batch"],
        gradient_accumulation_steps=n // wl["micro_batch"], num_generations=wl["samples"],
        max_completion_length=wl["new"], temperature=1.0, top_k=0, top_p=1.0, beta=0.0, learning_rate=1e-6,
        bf16=cuda, max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        generation_kwargs={"min_new_tokens": wl["new"]} if wl["kind"] != "longtail" else {}, use_vllm=False,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )

    def reward(completions, **kw):
        return [random_reward(c, "") for c in completions]

    peft_config = None
    if lora:  # the same adapters as StreamRFT's "lora" system (LORA)
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=list(LORA["targets"]),
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
                          callbacks=[Timer()], peft_config=peft_config)
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)  # LoRA: the adapters only
    steady = step_times[1:] or step_times
    gens = gen_times[1:] or gen_times
    tokens = response_tokens(wl, steps)
    step_s, gen_s = statistics.median(steady), statistics.median(gens)
    return {
        "system": "trl-lora" if lora else "trl", "size": size, "steps": len(step_times), "trainable_params": trainable, "step_s": step_s, "rollout_s": gen_s,
        "train_s": step_s - gen_s, "rollout_tok_s": tokens / gen_s, "trained_tok_s": tokens / step_s,
        "phase_switch_s": 0.0, "weight_sync_s": 0.0, "engine_only_s": gen_s,
        # TRL's engine-only time is its steady generate time: the long-tailed floor takes those steps' lengths
        "steady_steps": list(range(1, len(step_times))) or [0],
        "engine_only_steps": list(range(1, len(gen_times))) or [0],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        # what the caching allocator held at most (allocated + cached pools): the device memory really taken
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        "step_times": step_times, "rollout_times": gen_times,
    }


# ---------------------------------------------------------------- table -----------------------------
STREAMRFT_KINDS = ("streamrft", "async", "eager", "lora", "fullft")  # worker kinds run by run_streamrft
TRL_KINDS = ("trl", "trl-lora")


def report(results: dict, ceilings: dict, wls: dict, sizes: list[str]) -> str:
    """The main table (one row per run), the ratios, then the variants and first-step tables."""
    from transformers import AutoConfig

    from bench_firststep import first_step_table
    from bench_variants import variants_table
    from gpu_flops import rollout_floor_s, rollout_flops, shape_of, train_flops

    bw, rate = ceilings.get("copy_bytes_per_s", 4.3e12), ceilings.get("bf16_flops_per_s", 7.9e14)
    lines = [f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s"]
    head = (f"{'size':5} {'system':22} {'step_s':>7} {'roll_s':>7} {'train_s':>7} {'roll_tok/s':>10} {'train_tok/s':>11} "
            f"{'peak_GiB':>8} {'resv_GiB':>8} {'switch_s':>8} {'wsync_s':>7} {'eng_s':>6} {'roofl%':>6} {'lrnMFU%':>7} "
            f"{'stepMFU%':>8}")
    runs = [r for k, r in results.items() if isinstance(r, dict) and "_" in k and not k.startswith("_")
            and k != "ceilings"]
    for size in sizes:
        wl = wls[size]
        B = wl["prompts"] * wl["samples"]
        lines.append(f"{size}: B={B} prompt={wl['prompt_len']} new={wl['new']}"
                     + (f" (longtail: median {wl['median']}, capped at new; the floor and the FLOPs count each row's "
                        "own length: the engine-only call's for roofl%, the steady steps' for stepMFU%)"
                        if wl.get("kind") == "longtail" else ""))
        cfg_path = Path(results.get("_out", ".")) / f"model_{size}"
        try:
            s = shape_of(AutoConfig.from_pretrained(str(cfg_path)))
        except Exception:  # noqa: BLE001 - model not built (earlier failure)
            continue
        args = (s, B, wl["prompt_len"], wl["new"])  # the shape and the workload, for every count below
        engine_lengths = engine_only_lengths(wl)
        pf, dec = rollout_floor_s(*args, bw, rate, engine_lengths)
        tf = train_flops(*args)
        rf = rollout_flops(*args, engine_lengths)
        lines.append(f"{size}: rollout floor {pf + dec:.3f} s (prefill {pf:.3f} + decode {dec:.3f}); "
                     f"train {tf / 1e15:.2f} PFLOP, rollout {rf / 1e15:.2f} PFLOP")
        lines.append(head)
        for key, r in results.items():
            if not key.startswith(f"{size}_") or not isinstance(r, dict):
                continue
            system = key[len(size) + 1:]
            if "error" in r:
                lines.append(f"{size:5} {system:22} FAILED: {r['error'][-300:]}")
                continue
            # long-tailed responses: the FLOPs of the tokens this run trained (every row at the cap would
            # overstate them ~5x); fixed lengths: the formula, as in the earlier tables
            run_tf = (r.get("train_flops") or tf) if wl.get("kind") == "longtail" else tf
            run_rf, floor_s = rf, pf + dec
            if wl.get("kind") == "longtail":  # each row's own length, in the steps the row's times are medians of
                run_rf = statistics.median(rollout_flops(*args, step_lengths(wl, k))
                                           for k in r.get("steady_steps", steady_steps(r["steps"])))
                if r.get("engine_only_steps"):  # TRL: its engine-only time is its steady rollouts'
                    floor_s = statistics.median(sum(rollout_floor_s(*args, bw, rate, step_lengths(wl, k)))
                                                for k in r["engine_only_steps"])
            eng_s = r["engine_only_s"]  # NaN: the async placement's engine is another process (not timed alone)
            timed = eng_s == eng_s and eng_s > 0
            eng_cols = f"{eng_s:6.2f} {100 * floor_s / eng_s:6.1f}" if timed else f"{'-':>6} {'-':>6}"
            lines.append(
                f"{size:5} {system:22} {r['step_s']:7.2f} {r['rollout_s']:7.2f} {r['train_s']:7.2f} "
                f"{r['rollout_tok_s']:10.0f} {r['trained_tok_s']:11.0f} {r['peak_gib']:8.1f} "
                f"{r.get('peak_reserved_gib', 0.0):8.1f} {r['phase_switch_s']:8.3f} {r['weight_sync_s']:7.3f} "
                f"{eng_cols} "
                f"{100 * run_tf / (r['train_s'] * rate):7.1f} {100 * (run_tf + run_rf) / (r['step_s'] * rate):8.1f}")
        first = next((r for k, r in results.items() if k.startswith(f"{size}_streamrft") and "step_s" in r), {})
        a, b, c = first, results.get(f"{size}_trl", {}), results.get(f"{size}_async", {})
        if "step_s" in c and "step_s" in a:
            lines.append(f"{size:5} ratio     async/colocated step throughput {a['step_s'] / c['step_s']:.2f}x"
                         + (f", async/TRL {b['step_s'] / c['step_s']:.2f}x" if "step_s" in b else "")
                         + f"; both busy {c.get('both_busy', 0.0):.2f} of the wall time")
        for mine, theirs in ((a, b), (results.get(f"{size}_lora", {}), results.get(f"{size}_trl-lora", {}))):
            if "step_s" in mine and "step_s" in theirs:
                lines.append(f"{size:5} ratio     {mine['system']}/{theirs['system']}: step throughput "
                             f"{theirs['step_s'] / mine['step_s']:.2f}x, rollout tok/s "
                             f"{mine['rollout_tok_s'] / theirs['rollout_tok_s']:.2f}x, "
                             f"train time {theirs['train_s'] / mine['train_s']:.2f}x faster")
    variant_rows = [r for r in runs if r.get("variant")]
    if variant_rows:
        lines += ["", "memory options (--variants): steady medians; peak = allocated, resv = reserved by the allocator",
                  variants_table(variant_rows)]
    if any(r.get("first_step") for r in runs):
        lines += ["", first_step_table(runs)]
    return "\n".join(lines)


def tiny_size(size: str) -> str:
    """--tiny: the tiny shape, through the 7B-only paths when 7B was asked for."""
    return "tiny7b" if size == "7b" else "tiny"


def main() -> None:
    from bench_firststep import LAUNCH_ENV
    from bench_variants import parse_variants, plan_jobs, worker_result

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--systems", default="streamrft,trl,eager",
                    help="streamrft, async, eager, trl; lora, trl-lora (LoRA of every linear, r=16); fullft (full "
                         "fine-tuning, AdamW state in host memory)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--workload", choices=("fixed", "longtail"), default="fixed")
    ap.add_argument("--variants", default="",
                    help='the streamrft system once per variant: "name:key=value,key=value;name2:..." (name alone: '
                         "no overrides)")
    ap.add_argument("--repeat-streamrft", type=int, default=1,
                    help="run each StreamRFT run N times in a row (the compile caches of the first are kept "
                         "under OUT/compile_cache: cold, then warm first step)")
    ap.add_argument("--report-dir", default="",
                    help="also write results.json and table.txt here after every run (e.g. the GPU call's $OUT: "
                         "a call cut short still returns what finished)")
    ap.add_argument("--worker", default="")
    ap.add_argument("--size", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--variant", default="")
    ap.add_argument("--overrides", default="[]", help="(worker) JSON list of key=value")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        wl = workload(a.tiny, a.workload, a.size)
        tag = a.tag or a.worker
        try:
            if a.worker in TRL_KINDS:
                res = run_trl(a.size, wl, out, a.steps, lora=a.worker == "trl-lora")
            elif a.worker in STREAMRFT_KINDS:
                res = run_streamrft(a.size, wl, out, a.steps if a.worker != "eager" else 2,
                                    fast=a.worker != "eager", placement="async" if a.worker == "async" else "colocated",
                                    tag=tag, variant=a.variant,
                                    overrides=SYSTEM_OVERRIDES.get(a.worker, []) + json.loads(a.overrides))
            else:
                raise ValueError(f"--worker {a.worker!r}: not one of {STREAMRFT_KINDS + TRL_KINDS}")
        except Exception as exc:  # noqa: BLE001 - reported in the table
            import traceback

            res = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}", "system": tag,
                   "size": a.size, "variant": a.variant, "overrides": json.loads(a.overrides)}
            traceback.print_exc()
        (out / f"res_{a.size}_{tag}.json").write_text(json.dumps(res))
        return

    # everything that can be wrong in the flags is checked before any model is built
    variants = parse_variants(a.variants) if a.variants else None
    sizes = list(dict.fromkeys(tiny_size(s) for s in a.sizes.split(","))) if a.tiny else a.sizes.split(",")
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--sizes: {unknown} not in {sorted(set(SHAPES) - {'tiny', 'tiny7b'})}")
    systems = a.systems.split(",")
    bad = [s for s in systems if s not in STREAMRFT_KINDS + TRL_KINDS]
    if bad:
        raise SystemExit(f"--systems: {bad} not in {STREAMRFT_KINDS + TRL_KINDS}")
    if variants and "streamrft" not in systems:
        raise SystemExit("--variants runs the streamrft system: add streamrft to --systems")
    jobs = plan_jobs(sizes, systems, variants, a.repeat_streamrft)
    wls = {size: workload(a.tiny, a.workload, size) for size in sizes}
    shutil.rmtree(out / "compile_cache", ignore_errors=True)  # the call's first StreamRFT run compiles cold

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ceilings = {}
    if device == "cuda":
        ceilings = measure_ceilings_safe()
        print(f"ceilings: {ceilings}", flush=True)
    results: dict = {"_out": str(out), "ceilings": ceilings}
    built: set[str] = set()
    for job in jobs:
        size, system, tag = job["size"], job["kind"], job["tag"]
        if size not in built:
            t0 = time.perf_counter()
            build_model(size, wls[size], out, device)
            if device == "cuda":  # the workers need the whole device: give back what building the model cached
                torch.cuda.empty_cache()
            built.add(size)
            print(f"[{size}] model built in {time.perf_counter() - t0:.1f} s", flush=True)
        cmd = [sys.executable, __file__, "--out", str(out), "--worker", system, "--size", size, "--tag", tag,
               "--variant", job["variant"], "--overrides", json.dumps(job["overrides"]),
               "--steps", str(a.steps), "--workload", a.workload] + (["--tiny"] if a.tiny else [])
        t0 = time.perf_counter()
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True") if system == "async" else os.environ.copy()
        env[LAUNCH_ENV] = repr(time.time())  # the worker's first-step breakdown starts here
        res = worker_result(cmd, out / f"res_{size}_{tag}.json", a.timeout, env)
        drop_checkpoints(out / f"run_{size}_{tag}")
        res.setdefault("system", tag)
        res.setdefault("size", size)
        res.setdefault("variant", job["variant"])
        res.setdefault("overrides", job["overrides"])
        results[f"{size}_{tag}"] = res
        print(f"[{size}] {tag} done in {time.perf_counter() - t0:.1f} s: "
              f"{ {k: v for k, v in res.items() if not isinstance(v, (list, dict))} }", flush=True)
        table = report(results, ceilings, wls, sizes)
        for folder in [out] + ([Path(a.report_dir)] if a.report_dir else []):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.json").write_text(json.dumps(results, indent=1))
            (folder / "table.txt").write_text(table + "\n")
        print(table, flush=True)
    print("\n==== TABLE ====")
    print(table)


def measure_ceilings_safe() -> dict:
    import torch

    from gpu_flops import measure_ceilings

    c = measure_ceilings(torch.device("cuda"))
    torch.cuda.empty_cache()
    return c


if __name__ == "__main__":
    main()
