"""Chunked log-probs and entropy against a direct full-logits computation."""

import pytest
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


def test_a_right_padded_microbatch_without_its_padding_mask_gives_the_same_logprobs_and_gradients(monkeypatch):
    """On a GPU the text forward drops the 2-D padding mask and the position ids (logprobs.causal_only: causal
    SDPA kernels). Forced here on the CPU: log-probs, entropy and every gradient equal the masked forward's,
    because right padding is never attended to by a real token under the causal mask."""
    import streamrft.learner.logprobs as lp
    from streamrft.learner.critic import ValueModel

    mb, T = _batch(), 0.9
    assert (mb["attention_mask"] == 0).any()  # rows of different lengths: padded
    assert lp.text_mask_and_positions(None, mb["attention_mask"], mb["position_ids"])["attention_mask"] is mb["attention_mask"]

    def run(drop: bool):
        monkeypatch.setattr(lp, "causal_only", lambda mask: drop and mask.dim() == 2)
        model = _tiny_model()
        if drop:  # the mask mapping is handed over: transformers' packed-sequence check (a GPU sync) never runs
            import transformers.masking_utils as masking

            assert lp.no_mask(model) == {"full_attention": None}

            def no_sync_here(*a, **k):
                raise AssertionError("transformers built the mask (its packed-sequence check syncs on a GPU)")
            monkeypatch.setattr(masking, "find_packed_sequence_indices", no_sync_here)
        logp, ent = token_logprobs(model, mb, T, with_entropy=True, chunk_size=4)
        ((logp * mb["adv"]).sum() + 0.1 * ent.sum()).backward()
        critic = ValueModel(_tiny_model(seed=3).model)
        values = critic(mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["response_mask"])
        monkeypatch.undo()
        return logp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()}, values.detach()

    got, want = run(True), run(False)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[3], want[3], atol=1e-6, rtol=0)
    # without the padding mask, padded positions do change: the test would see a mask that mattered
    monkeypatch.setattr(lp, "causal_only", lambda mask: mask.dim() == 2)
    kw = lp.text_mask_and_positions(None, mb["attention_mask"], mb["position_ids"])
    assert kw == {"attention_mask": None, "position_ids": None}


def test_a_model_with_sliding_window_layers_gets_its_masks_built_by_transformers():
    from types import SimpleNamespace

    from streamrft.learner.logprobs import no_mask

    full, mixed = (SimpleNamespace(config=SimpleNamespace(layer_types=t))
                   for t in (["full_attention"] * 3, ["full_attention", "sliding_attention"]))
    assert no_mask(full) == {"full_attention": None}
    assert no_mask(mixed) is None and no_mask(SimpleNamespace(config=SimpleNamespace())) is None


def test_only_a_2d_mask_on_a_gpu_is_dropped():
    from streamrft.learner.logprobs import causal_only

    assert not causal_only(torch.ones(2, 5, dtype=torch.long))  # the CPU keeps its mask
    assert not causal_only(torch.ones(1, 1, 5, 5, dtype=torch.bool))  # a packed (block-diagonal) mask is needed


def test_head_positions_skip_each_rows_and_each_packed_sequences_first_token():
    from streamrft.learner.logprobs import head_positions

    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 1, 1, 0]])
    packed = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])  # row 0 holds two sequences
    assert head_positions(mask).tolist() == [[0, 0, 0, 1, 1], [1, 3, 4, 2, 3]]
    assert head_positions(mask, packed).tolist() == [[0, 0, 1, 1], [1, 4, 2, 3]]


def test_head_positions_given_by_the_caller_give_the_same_logprobs_as_found_here():
    """What a GPU learner does (fsdp2.move_batch computes them from the host copy, no nonzero on the device)."""
    from streamrft.learner.fsdp2 import move_batch
    from streamrft.learner.logprobs import head_positions

    model, mb, T = _tiny_model(), _batch(), 0.9
    given = {**move_batch(mb, torch.device("cpu")), "head_positions": head_positions(mb["response_mask"],
                                                                                     mb["position_ids"])}
    want = token_logprobs(model, mb, T, with_entropy=True)
    got = token_logprobs(model, given, T, with_entropy=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="move_batch adds head_positions for a GPU only")
def test_move_batch_to_a_gpu_brings_the_head_positions_from_the_host():
    from streamrft.learner.fsdp2 import move_batch
    from streamrft.learner.logprobs import head_positions

    mb = _batch()
    moved = move_batch(mb, torch.device("cuda"))
    assert moved["head_positions"].device.type == "cuda"
    assert torch.equal(moved["head_positions"].cpu(), head_positions(mb["response_mask"], mb["position_ids"]))
    assert "head_positions" not in mb  # the host microbatch is not changed
