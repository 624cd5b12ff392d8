"""Packed microbatches against the unpacked (right-padded) path on a tiny Qwen2, in float32 on CPU."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.learner.logprobs import token_logprobs
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.learner.packing import (balanced_bins, block_causal_mask, make_packed_microbatches,
                                       rows_by_sample, scatter_by_sample)

T = 0.7


def _model(attn="sdpa"):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation=attn)
    return Qwen2ForCausalLM(cfg).float()


def _samples(lens=((3, 4), (5, 2), (2, 6), (0, 5), (4, 4), (1, 3))):
    g = torch.Generator().manual_seed(1)
    return [SequenceSample(torch.randint(1, 32, (p,), generator=g).tolist(),
                           torch.randint(1, 32, (r,), generator=g).tolist(),
                           {"adv": torch.randn(r, generator=g)}) for p, r in lens]


@torch.no_grad()
def _per_sample(mbs, model):
    out = {}
    for mb in mbs:
        logp, ent = token_logprobs(model, mb, T, with_entropy=True)
        mb = dict(mb, logp=logp, ent=ent)
        out.update({i: (v, rows_by_sample(mb, "ent")[i]) for i, v in rows_by_sample(mb, "logp").items()})
    return out


def _loss_and_grads(model, mbs, n_tokens):
    model.zero_grad()
    total = 0.0
    for mb in mbs:
        logp, _ = token_logprobs(model, mb, T, with_entropy=False)
        loss = -(logp * mb["adv"] * mb["response_mask"]).sum() / n_tokens
        loss.backward()
        total += float(loss)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_microbatches_give_the_same_logprobs_entropy_loss_and_gradients_as_unpacked(attn):
    model = _model(attn)
    samples = _samples()
    unpacked = make_microbatches(samples, token_budget=24)
    packed = make_packed_microbatches(samples, token_budget=20)
    assert len(packed) > 1 and any(len(mb["sample_index"]) > 1 for mb in packed)
    a, b = _per_sample(unpacked, model), _per_sample(packed, model)
    assert sorted(a) == sorted(b) == list(range(len(samples)))
    for i in a:
        # the empty-prompt sample has no prediction for its first token in either layout
        torch.testing.assert_close(b[i][0], a[i][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(b[i][1], a[i][1], atol=1e-5, rtol=0)
    assert float(a[3][0][0]) == 0.0 and float(b[3][0][0]) == 0.0
    n_tokens = sum(len(s.response_ids) for s in samples)
    loss_u, grads_u = _loss_and_grads(model, unpacked, n_tokens)
    loss_p, grads_p = _loss_and_grads(model, packed, n_tokens)
    assert loss_p == pytest.approx(loss_u, abs=1e-5) and abs(loss_u) > 1e-3
    for name in grads_u:
        torch.testing.assert_close(grads_p[name], grads_u[name], atol=1e-5, rtol=0, msg=lambda m: name + m)


def test_packed_layout_restarts_positions_and_blocks_attention_across_sequences():
    samples = _samples(((2, 1), (1, 2)))
    (mb,) = make_packed_microbatches(samples, token_budget=100)
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]
    assert mb["response_mask"].tolist() == [[0, 0, 1, 0, 1, 1]]
    assert mb["seq_index"].tolist() == [[0, 0, 0, 1, 1, 1]]
    m = mb["attention_mask"][0, 0].int().tolist()
    assert m[3] == [0, 0, 0, 1, 0, 0]  # the second sequence's first token sees only itself
    assert m[5] == [0, 0, 0, 1, 1, 1]
    pad = block_causal_mask(torch.tensor([0, 0, -1, -1]))[0, 0].int().tolist()
    assert pad == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_balanced_bins_respect_the_budget_and_even_out_token_counts():
    lengths = [9, 8, 7, 6, 5, 4, 3, 2, 2, 1]
    bins = balanced_bins(lengths, token_budget=16)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert len(bins) == 3 and max(loads) <= 16 and max(loads) - min(loads) <= 1, loads
    assert balanced_bins([30, 2, 2], token_budget=10) == [[0], [1, 2]]  # over-long gets its own bin


def test_rows_by_sample_and_scatter_round_trip_in_both_layouts():
    samples = _samples()
    for mbs in (make_microbatches(samples, 24), make_packed_microbatches(samples, 20)):
        rows = [torch.arange(len(s.response_ids), dtype=torch.float32) + 10 * i for i, s in enumerate(samples)]
        got = {}
        for mb in mbs:
            scatter_by_sample(mb, "x", rows)
            got.update(rows_by_sample(mb, "x"))
            got_adv = rows_by_sample(mb, "adv")
            for i, v in got_adv.items():
                torch.testing.assert_close(v, samples[i].tensors["adv"])
        for i, r in enumerate(rows):
            torch.testing.assert_close(got[i], r)


def test_a_seq_index_field_is_rejected_with_its_name():
    s = SequenceSample([1], [2], {"seq_index": torch.zeros(1)})
    with pytest.raises(ValueError, match="'seq_index' clashes"):
        make_packed_microbatches([s], 10)
