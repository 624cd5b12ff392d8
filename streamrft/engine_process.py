"""An engine process of the async placement (``rollout.placement=async``), and its composition root.

    python -m streamrft.engine_process SPEC.json

Learner rank 0 starts ``rollout.engine_ranks`` of these (streamrft/runtime/async_placement.py). Each one holds its
own copy of the policy (an ``hf`` engine over a private module). This module builds what the process runs on: the
policy copy on its device, the engine, the prompt dataset, the reward scorer and the teacher client. The
learner-side composition root is streamrft/compose.py. ``streamrft.runtime.engine_worker.serve`` wires these parts
into the rollout stages; the runtime keeps no model code of its own (../ARCHITECTURE's dependency direction).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import msgspec

from streamrft.parent_death import die_with_parent
from streamrft.runtime.engine_worker import EngineParts, exit_now, serve


def build_engine_parts(cfg, spec: dict) -> EngineParts:
    """The process's device (``rollout.engine_memory_fraction`` of it, set before anything is loaded there), its
    policy copy and engine, the dataset, the reward scorer and the teacher client."""
    import torch
    from transformers import AutoTokenizer

    from streamrft.data import PromptDataset
    from streamrft.engines import build_engine  # looked up when called: benchmarks/longtail.py wraps it
    from streamrft.learner.fsdp2 import _DTYPES, load_pretrained
    from streamrft.models.hub import resolve_model_dir
    from streamrft.rewards.scorer import build_reward_scorer
    from streamrft.teacher.client import build_teacher_client

    device = torch.device(spec["device"])
    fraction = cfg.rollout.engine_memory_fraction
    if fraction:
        if device.type != "cuda":
            raise ValueError(f"rollout.engine_memory_fraction={fraction} needs a CUDA device; the engine process runs "
                             f"on {device}: set it to 0")
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model.path, "model.path"))
    dtype = _DTYPES[cfg.model.dtype] if device.type == "cuda" else torch.float32
    module = load_pretrained(cfg.model.path, cfg.model, dtype)
    module.to(device).eval()
    engine = build_engine(cfg.engine, module, tokenizer, device, model_path=cfg.model.path, own_weights=True)
    d = cfg.data
    dataset = PromptDataset.from_config(d.train_path, d, written_keys=getattr(cfg, "_written", None))
    return EngineParts(engine=engine, tokenizer=tokenizer, dataset=dataset, scorer=build_reward_scorer(cfg.reward),
                       teacher=build_teacher_client(cfg.teacher, cfg.reward.timeout_s, cfg.reward.retries))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from streamrft.cli import enable_crash_stacks

    enable_crash_stacks()
    die_with_parent()
    spec = json.loads(Path(argv[0]).read_text())
    from streamrft.config import Config

    cfg = msgspec.convert(spec["config"], Config)
    logging.basicConfig(level=logging.WARNING, format=f"engine rank {spec['engine_rank']}: %(message)s")
    try:
        asyncio.run(serve(cfg, spec, build_engine_parts))
    except Exception as exc:  # one line naming the engine rank; the learner sees the exit code
        print(f"streamrft: engine rank {spec['engine_rank']}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        exit_now(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
