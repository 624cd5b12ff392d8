"""`streamrft export`: a trained checkpoint becomes a HF model directory with the trained policy's log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrft.checkpoint import latest_checkpoint
from streamrft.checkpoint.export import export_main
from streamrft.config import load_config
from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.runtime.distributed import destroy_distributed, init_distributed
from tests.integration.conftest import REPO, arith_overrides

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def hf_logp(model, mb) -> torch.Tensor:
    """log p(token_t | tokens_<t) of a plain HF forward, aligned like the learner's (B, L) log-probs."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                   position_ids=mb["position_ids"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(logp.shape[0], 1), logp], 1) * mb["response_mask"]


@pytest.mark.parametrize("lora", [[], ["model.lora_rank=4", "model.lora_alpha=8"]], ids=["full", "lora_merged"])
def test_exported_model_loads_with_transformers_and_matches_the_trained_policy(arith_dir, tmp_path, capsys, lora):
    from streamrft.compose import train

    out, exported = tmp_path / "run", tmp_path / "hf"
    cfg = load_config(CONFIG, arith_overrides(arith_dir, out, "train.max_steps=2", "algorithm.kl_coef=0.05",
                                              "train.lr=1e-2", "data.eval_size=8", *lora))
    train(cfg)
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step_00000002"
    assert export_main([str(out), "--out", str(exported)]) == 0  # an output_dir resolves to its latest
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}

    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    samples = [SequenceSample(tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(r, add_special_tokens=False), {})
               for p, r in [("12+7=", "19"), ("3-5=", "-2"), ("40+41=", "81")]]
    (mb,) = make_microbatches(samples, token_budget=256)

    dist = init_distributed(timeout_s=60)
    try:
        policy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=cfg.train.max_steps)
        sft_logp, _ = policy.compute_logprobs(mb, 1.0)
        policy.load(str(ckpt))
        trained_logp, _ = policy.compute_logprobs(mb, 1.0)
    finally:
        destroy_distributed()
    with torch.no_grad():
        got = hf_logp(model, mb)
    assert (trained_logp - sft_logp).abs().max() > 1e-4  # training moved the policy: the check has teeth
    # LoRA: the export folds W + (alpha/r) B A into plain weights; float32 rounding differs slightly.
    torch.testing.assert_close(got, trained_logp * mb["response_mask"], atol=1e-5 if lora else 1e-6, rtol=0)


def test_export_of_a_folder_without_checkpoints_fails_with_a_clear_message(tmp_path, capsys):
    assert export_main([str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert "is neither a checkpoint folder" in capsys.readouterr().err
