"""generator.vector builds the message tensors the way torch.tensor would (same values, dtype and rounding)."""

import numpy as np
import torch

from streamrft.runtime.generator import vector


def test_vector_matches_torch_tensor_for_ints_floats_and_empty_lists():
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-2**40, 2**40, (512,), generator=g).tolist()
    floats = (torch.randn(512, generator=g, dtype=torch.float64) * 1e3).tolist()  # doubles: rounding to float32 matters
    for values, np_dtype, torch_dtype in ((ints, np.int64, torch.int64), (floats, np.float32, torch.float32),
                                          ([], np.int64, torch.int64), ([1, 0, 1], np.uint8, torch.uint8)):
        got, want = vector(values, np_dtype), torch.tensor(values, dtype=torch_dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_the_tokenizer_decodes_a_response_tensor_as_it_decodes_the_list(tmp_path):
    from streamrft.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(str(tmp_path / "tok"), "abcdefgh 0123456789")
    ids = tok("abc 12 hg0", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(vector(ids, np.int64), skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True) == "abc 12 hg0"
