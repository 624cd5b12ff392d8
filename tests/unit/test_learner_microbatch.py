"""Token-budget microbatching: layout, budget, order and per-token field alignment."""

import pytest
import torch

from streamrft.learner.microbatch import SequenceSample, make_microbatches, pack_indices, padding_microbatch


def _samples(lengths):
    out = []
    for i, (p, r) in enumerate(lengths):
        prompt = [10 + i] * p
        response = list(range(100 + i * 10, 100 + i * 10 + r))
        out.append(SequenceSample(prompt, response, {"adv": torch.arange(r, dtype=torch.float32) + i * 100}))
    return out


def test_each_sequence_appears_once_with_prompt_then_response_and_fields_aligned_to_token_positions():
    samples = _samples([(3, 2), (1, 5), (4, 4), (2, 1), (6, 3)])
    mbs = make_microbatches(samples, token_budget=20)
    seen = []
    for mb in mbs:
        B, L = mb["input_ids"].shape
        assert mb["input_ids"].dtype == torch.int64 and mb["response_mask"].dtype == torch.float32
        for b in range(B):
            i = int(mb["sample_index"][b])
            seen.append(i)
            s = samples[i]
            p, r = len(s.prompt_ids), len(s.response_ids)
            assert mb["input_ids"][b, :p].tolist() == s.prompt_ids
            assert mb["input_ids"][b, p:p + r].tolist() == s.response_ids
            assert mb["input_ids"][b, p + r:].eq(0).all()
            assert mb["attention_mask"][b].tolist() == [1] * (p + r) + [0] * (L - p - r)
            assert mb["position_ids"][b, :p + r].tolist() == list(range(p + r))
            assert mb["response_mask"][b].tolist() == [0.0] * p + [1.0] * r + [0.0] * (L - p - r)
            assert mb["adv"][b, p:p + r].tolist() == s.tensors["adv"].tolist()
            assert mb["adv"][b].abs().sum() == s.tensors["adv"].abs().sum()
    assert sorted(seen) == list(range(len(samples)))


def test_microbatches_respect_the_token_budget_unless_one_sequence_alone_exceeds_it():
    samples = _samples([(2, 2), (3, 3), (10, 20), (1, 1), (4, 4), (2, 3)])
    mbs = make_microbatches(samples, token_budget=12)
    for mb in mbs:
        B, L = mb["input_ids"].shape
        assert B * L <= 12 or B == 1
    big = [mb for mb in mbs if mb["input_ids"].shape[1] == 30]
    assert len(big) == 1 and big[0]["input_ids"].shape[0] == 1


def test_packing_is_first_fit_decreasing_and_deterministically_ordered():
    # lengths 5,5,4,3,2 under budget 10: FFD puts [0,1] (2*5), [2,3] (2*4), [4] -> ordered by first index
    assert pack_indices([5, 5, 4, 3, 2], 10) == [[0, 1], [2, 3], [4]]
    # order within bins ascending, bins by smallest index
    assert pack_indices([1, 6, 1, 6], 12) == [[0, 2], [1, 3]]
    assert pack_indices([3, 3, 3], 9) == [[0, 1, 2]]


def test_mismatched_field_length_is_a_value_error_naming_the_sample_and_field():
    bad = [SequenceSample([1], [2, 3], {"adv": torch.zeros(3)})]
    with pytest.raises(ValueError, match="sample 0 field 'adv'"):
        make_microbatches(bad, 8)
    with pytest.raises(ValueError, match="token_budget=0"):
        make_microbatches(_samples([(1, 1)]), 0)


def test_padding_microbatch_has_no_response_tokens():
    mb = padding_microbatch(["adv"])
    assert mb["input_ids"].shape == (1, 2) and mb["response_mask"].sum() == 0 and mb["adv"].shape == (1, 2)
    assert mb["sample_index"].tolist() == [-1]


def test_right_pad_puts_each_sequence_first_and_pads_after_it():
    from streamrft.learner.microbatch import right_pad

    ids_BL, mask_BL = right_pad([[5, 6, 7], [8], [9, 10]], pad_id=2)
    assert ids_BL.tolist() == [[5, 6, 7], [8, 2, 2], [9, 10, 2]] and ids_BL.dtype == torch.long
    assert mask_BL.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]] and mask_BL.dtype == torch.long
