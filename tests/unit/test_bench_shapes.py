"""benchmarks/gpu_grpo.py's shapes: the 7B entry is Qwen2.5-7B's published config (7,615,616,512 parameters,
untied LM head); the 7B workload is the reduced one; --tiny --sizes 7b takes the tiny shape through the 7B paths."""

import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_grpo import SHAPES, drop_checkpoints, micro_batch_tokens, tiny_size, workload  # noqa: E402


def test_7b_shape_has_the_published_parameter_count():
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES["7b"]))
    n = sum(p.numel() for p in model.parameters())
    # Qwen2.5-7B: 7.61B parameters (28 layers, q/k/v biases, untied 152064 x 3584 embedding and head)
    assert n == 7_615_616_512
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_7b_workload_and_tiny_mapping():
    wl = workload(False, "fixed", "7b")
    assert (wl["prompts"], wl["samples"], wl["prompt_len"], wl["new"], wl["vocab"]) == (16, 8, 256, 256, 152064)
    assert micro_batch_tokens(wl, wl["micro_batch"]) == 16 * 512
    assert wl["final_save"] is False and workload(False, "fixed", "0.5b")["final_save"] is True
    assert tiny_size("7b") == "tiny7b" and tiny_size("0.5b") == "tiny"
    assert SHAPES["tiny7b"]["tie_word_embeddings"] is False
    assert workload(True, "fixed", "tiny7b")["final_save"] is False


def test_a_finished_runs_checkpoints_are_dropped_and_nothing_else(tmp_path):
    """The call's later runs need the GPU machine's disk (benchmarks/NOTES.md v24): after each run the parent removes
    its checkpoints, and keeps its log, its compile warm-up folder and the shared compile cache."""
    run = tmp_path / "run_1.5b_streamrft"
    for f in ("checkpoints/step_00000003/meta.json", "checkpoints/step_00000003/__0_0.distcp",
              "compile_warmup/vm-1.log", "metrics.jsonl"):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x")
    (tmp_path / "compile_cache" / "fxgraph").mkdir(parents=True)
    drop_checkpoints(run)
    assert not (run / "checkpoints").exists()
    assert (run / "compile_warmup" / "vm-1.log").exists() and (run / "metrics.jsonl").exists()
    assert (tmp_path / "compile_cache" / "fxgraph").is_dir()
    drop_checkpoints(tmp_path / "run_0.5b_trl")  # a run that saved nothing: no error
