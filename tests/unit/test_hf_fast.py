"""The static-cache decode path (engine.static_cache) against a full Hugging Face forward, on CPU."""

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.engines.hf_fast import counter_uniform, sample_from_uniform


def _model(vocab=40):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _requests():
    return [GenerationRequest("a", [5, 6, 7, 8, 9], seed=11), GenerationRequest("b", [3, 4], seed=12),
            GenerationRequest("c", [7, 1, 2], seed=13, max_new_tokens=3)]


def test_static_path_logprobs_match_a_full_forward_of_each_row_alone():
    model = _model()
    cfg = EngineConfig(max_new_tokens=6, static_cache=True, sync_every=2, ignore_eos=True)
    engine = HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))
    samples = asyncio.run(engine.generate_all(_requests()))
    assert [len(s.response_ids) for s in samples] == [6, 6, 3]
    assert all(s.finish_reason == "length" for s in samples)
    for req, s in zip(_requests(), samples):
        ids = torch.tensor([req.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp_LV = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        n = len(req.prompt_ids)
        ref = [logp_LV[n - 1 + j, tok].item() for j, tok in enumerate(s.response_ids)]
        assert s.logprobs == pytest.approx(ref, abs=1e-4)


def test_static_path_stops_at_a_stop_token_unless_ignore_eos():
    model = _model()
    with torch.no_grad():  # make token 9 certain after any context: zero hidden states, a head bias for 9
        model.model.norm.weight.zero_()
    model.lm_head = torch.nn.Linear(32, 40, bias=True)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.fill_(-30.0)
        model.lm_head.bias[9] = 30.0
    cfg = EngineConfig(max_new_tokens=5, static_cache=True, sync_every=3)
    engine = HFEngine(model, cfg, eos_token_ids=[9], pad_token_id=0, device=torch.device("cpu"))
    out = asyncio.run(engine.generate_all(_requests()[:2]))
    assert [(s.response_ids, s.finish_reason) for s in out] == [([9], "stop"), ([9], "stop")]
    cfg2 = EngineConfig(max_new_tokens=5, static_cache=True, ignore_eos=True)
    engine2 = HFEngine(model, cfg2, eos_token_ids=[9], pad_token_id=0, device=torch.device("cpu"))
    out2 = asyncio.run(engine2.generate_all(_requests()[:1]))
    assert out2[0].response_ids == [9] * 5 and out2[0].finish_reason == "length"


def test_counter_uniform_depends_only_on_seed_and_step():
    seeds = torch.tensor([1, 2, 3, 1 << 40], dtype=torch.int64)
    u0 = counter_uniform(seeds, torch.tensor([0]))
    assert torch.equal(u0[[0, 3]], counter_uniform(seeds[[0, 3]], torch.tensor([0])))
    assert not torch.equal(u0, counter_uniform(seeds, torch.tensor([1])))
    assert bool(((u0 >= 0) & (u0 < 1)).all())
    u = counter_uniform(torch.arange(20000, dtype=torch.int64), torch.tensor([7]))
    assert abs(u.mean().item() - 0.5) < 0.01


def test_sample_from_uniform_inverts_the_cdf_and_skips_zero_mass_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.0, 0.25, 0.25], [0.5, 0.0, 0.25, 0.25]]))
    tokens, logp = sample_from_uniform(logits, torch.tensor([0.6, 0.999999], dtype=torch.float64))
    assert tokens.tolist() == [2, 3]
    assert logp.tolist() == pytest.approx([torch.log(torch.tensor(0.25)).item()] * 2)


def test_cuda_graphs_without_static_cache_is_a_config_error():
    with pytest.raises(ValueError, match="engine.cuda_graphs=true needs engine.static_cache=true"):
        HFEngine(_model(), EngineConfig(cuda_graphs=True), eos_token_ids=[0], pad_token_id=0,
                 device=torch.device("cpu"))
