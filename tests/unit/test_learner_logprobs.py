"""Chunked log-probs and entropy against a direct full-logits computation."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.learner.logprobs import token_logprobs
from streamrft.learner.microbatch import SequenceSample, make_microbatches


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    lens = [(3, 4), (5, 2), (2, 6)]
    samples = [SequenceSample(torch.randint(1, 32, (p,), generator=g).tolist(),
                              torch.randint(1, 32, (r,), generator=g).tolist(),
                              {"adv": torch.randn(r, generator=g)}) for p, r in lens]
    (mb,) = make_microbatches(samples, token_budget=1000)
    return mb


def _direct(model, mb, T):
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                   position_ids=mb["position_ids"]).logits.float() / T
    logp_BLV = torch.log_softmax(logits, -1)
    B, L = mb["input_ids"].shape
    logp = torch.zeros(B, L)
    ent = torch.zeros(B, L)
    for b in range(B):
        for t in range(1, L):
            if mb["response_mask"][b, t] > 0:
                logp[b, t] = logp_BLV[b, t - 1, mb["input_ids"][b, t]]
                ent[b, t] = -(logp_BLV[b, t - 1].exp() * logp_BLV[b, t - 1]).sum()
    return logp, ent


def test_chunked_logprobs_and_entropy_equal_the_full_logits_computation():
    model, mb, T = _tiny_model(), _batch(), 0.7
    want_logp, want_ent = _direct(model, mb, T)
    for chunk in (1, 3, 1024):
        logp, ent = token_logprobs(model, mb, temperature=T, with_entropy=True, chunk_size=chunk)
        assert logp.shape == mb["input_ids"].shape and logp.dtype == torch.float32
        torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
        assert (logp[mb["response_mask"] == 0] == 0).all()
    _, none = token_logprobs(model, mb, temperature=T, with_entropy=False)
    assert none is None


def test_gradients_through_the_checkpointed_chunks_equal_the_direct_gradients():
    mb, T = _batch(), 1.3
    m1, m2 = _tiny_model(), _tiny_model()
    logp, ent = token_logprobs(m1, mb, T, with_entropy=True, chunk_size=4)
    ((logp * mb["adv"]).sum() + 0.1 * ent.sum()).backward()
    want_logp, want_ent = _direct(m2, mb, T)
    ((want_logp * mb["adv"]).sum() + 0.1 * want_ent.sum()).backward()
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, atol=1e-6, rtol=1e-5, msg=name)
