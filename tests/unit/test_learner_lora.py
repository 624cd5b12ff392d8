"""LoRA through peft: only adapters train, merged weights reproduce the adapter model, prefixes stay frozen."""

import copy
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.learner.fsdp2 import _apply_freeze_prefix
from streamrft.learner.logprobs import token_logprobs
from streamrft.learner.lora import apply_lora, is_adapter_name, merged_state_for_engine
from streamrft.learner.microbatch import SequenceSample, make_microbatches

T = 0.8


def _cfg(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"), freeze=()):
    try:
        from streamrft.config.model import ModelConfig
        return ModelConfig(path="x", lora_rank=rank, lora_alpha=alpha, lora_target_modules=list(targets),
                           freeze_prefix=list(freeze))
    except TypeError:
        return types.SimpleNamespace(lora_rank=rank, lora_alpha=alpha, lora_target_modules=list(targets),
                                     freeze_prefix=list(freeze))


def _base():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).float()


def _mb():
    g = torch.Generator().manual_seed(2)
    samples = [SequenceSample(torch.randint(1, 32, (p,), generator=g).tolist(),
                              torch.randint(1, 32, (r,), generator=g).tolist(),
                              {"adv": torch.randn(r, generator=g)}) for p, r in [(3, 5), (4, 3), (2, 6)]]
    (mb,) = make_microbatches(samples, 1000)
    return mb


def _step(model, opt, mb):
    logp, _ = token_logprobs(model, mb, T, with_entropy=False)
    loss = -(logp * mb["adv"]).sum() / mb["response_mask"].sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_only_adapters_train_and_merged_weights_reproduce_the_adapter_model():
    base = _base()
    model = apply_lora(copy.deepcopy(base), _cfg())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * 3 * 2  # A and B, three targets, two layers
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.0)
    mb = _mb()
    _step(model, opt, mb)
    _step(model, opt, mb)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainable)

    merged = dict(merged_state_for_engine(model, _cfg()))
    assert set(merged) == set(base.state_dict())  # base HF names, nothing else
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(merged)
    with torch.no_grad():
        logp_adapter, _ = token_logprobs(model, mb, T, False)
        logp_merged, _ = token_logprobs(fresh, mb, T, False)
        logp_base, _ = token_logprobs(base, mb, T, False)
    torch.testing.assert_close(logp_merged, logp_adapter, atol=1e-5, rtol=0)
    assert (logp_adapter - logp_base).abs().max() > 1e-3, "the adapters changed the model"
    untargeted = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged[untargeted], base.state_dict()[untargeted])


def test_freeze_prefix_after_lora_freezes_the_adapters_under_it():
    model = apply_lora(_base(), _cfg(freeze=["model.layers.0."]))
    _apply_freeze_prefix(model, ["model.layers.0."])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("model.layers.1.") and is_adapter_name(n) for n in trainable)


def test_lora_rank_zero_is_a_no_op_and_bad_targets_name_the_key():
    model = _base()
    assert apply_lora(model, _cfg(rank=0)) is model
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"model.lora_target_modules entries \['qkv'\] match no Linear"):
        apply_lora(_base(), _cfg(targets=("qkv",)))
    with pytest.raises(ValueError, match="model.lora_alpha=0"):
        apply_lora(_base(), _cfg(alpha=0))
