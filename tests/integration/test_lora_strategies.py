"""LoRA under both sharded strategies (world size 1, gloo): merged full weights reproduce the adapter model."""

import pytest
import torch

from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner.fsdp2 import LOGPROB_METHOD, load_pretrained, shard_model
from streamrft.learner.logprobs import token_logprobs
from streamrft.learner.lora import apply_lora, lora_scaling, merge_lora_named_tensors
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
from streamrft.runtime.distributed import destroy_distributed, init_distributed

T = 0.8


@pytest.fixture()
def setup(tmp_path):
    d = str(tmp_path / "model")
    tok = build_char_tokenizer(d, "0123456789+-=abcdefghijklmnopq")
    build_tiny_qwen2(d, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                     max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    samples = [SequenceSample(torch.randint(3, 30, (3,), generator=g).tolist(),
                              torch.randint(3, 30, (5,), generator=g).tolist(),
                              {"adv": torch.randn(5, generator=g)}) for _ in range(3)]
    (mb,) = make_microbatches(samples, 1000)
    dist = init_distributed(timeout_s=60)
    yield ModelConfig(path=d, lora_rank=4, lora_alpha=8.0), mb, dist
    destroy_distributed()


def _loss_fn(mb, logp_BL, entropy_BL):
    return -(logp_BL * mb["adv"]).sum() / mb["response_mask"].sum(), {}


def _merged_logp(mcfg, named, mb):
    fresh = load_pretrained(mcfg.path, mcfg, torch.float32)
    fresh.load_state_dict(dict(named))
    with torch.no_grad():
        return token_logprobs(fresh, mb, T, False)[0]


@pytest.mark.slow
def test_lora_under_fsdp2_and_deepspeed_zero3_merges_to_the_adapter_models_logprobs(setup):
    pytest.importorskip("deepspeed")
    from streamrft.learner.deepspeed import DeepSpeedStrategy

    mcfg, mb, dist = setup
    # FSDP2: apply_lora before shard_model (the hook in FSDP2Strategy.__init__)
    model = shard_model(apply_lora(load_pretrained(mcfg.path, mcfg, torch.float32), mcfg), dist, torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        logp, _ = getattr(model, LOGPROB_METHOD)(mb, T, False)
        _loss_fn(mb, logp, None)[0].backward()
        opt.step()
        opt.zero_grad()
    full = ((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in model.state_dict().items())
    with torch.no_grad():
        adapter = getattr(model, LOGPROB_METHOD)(mb, T, False)[0]
    merged = _merged_logp(mcfg, merge_lora_named_tensors(full, lora_scaling(mcfg)), mb)
    torch.testing.assert_close(merged, adapter, atol=1e-5, rtol=0)

    strat = DeepSpeedStrategy(mcfg, TrainConfig(strategy="deepspeed", zero_stage=3, lr=0.05), dist, 10)
    assert all(".lora_" in n for n, p in strat.module.named_parameters() if p.requires_grad)
    base = _merged_logp(mcfg, ((n, t) for b in strat.full_state_for_engine(1 << 20) for n, t in b), mb)
    for _ in range(2):
        strat.forward_backward(mb, _loss_fn, T)
        strat.step()
    adapter = strat.compute_logprobs(mb, T)[0]
    merged = _merged_logp(mcfg, ((n, t) for b in strat.full_state_for_engine(1 << 20) for n, t in b), mb)
    torch.testing.assert_close(merged, adapter, atol=1e-5, rtol=0)
    assert (adapter - base).abs().max() > 1e-2, "the adapters trained"
