"""The static-cache engine sizes its KV cache from the chunk's requests (longest prompt, and the largest
max_new_tokens asked for), not from engine.max_new_tokens or the model's max_position_embeddings, and
decodes only as many steps as the largest request needs."""

import asyncio

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.config.engine import EngineConfig
from streamrft.engines import hf_fast
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine


def _engine(max_new_tokens: int) -> HFEngine:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=True)).eval()
    cfg = EngineConfig(max_new_tokens=max_new_tokens, static_cache=True, sync_every=2, ignore_eos=True)
    return HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))


def _sizes(monkeypatch) -> list[tuple]:
    """(KV cache shape, decode steps run) of every chunk."""
    seen, original_init, original_run = [], hf_fast.StaticDecoder.__init__, hf_fast.StaticDecoder.run_steps

    def init(self, *a, **k):
        original_init(self, *a, **k)
        self.steps_run = 1  # prefill samples token 0
        seen.append(self)

    def run_steps(self, n):
        self.steps_run += n
        original_run(self, n)

    monkeypatch.setattr(hf_fast.StaticDecoder, "__init__", init)
    monkeypatch.setattr(hf_fast.StaticDecoder, "run_steps", run_steps)
    return seen


def test_kv_cache_holds_the_longest_prompt_plus_the_largest_request(monkeypatch):
    decoders = _sizes(monkeypatch)
    engine = _engine(max_new_tokens=100)  # the engine's ceiling; the model allows 128 positions
    requests = [GenerationRequest("a", [5, 6, 7, 8, 9], seed=1, max_new_tokens=3),
                GenerationRequest("b", [3, 4], seed=2, max_new_tokens=7)]
    out = asyncio.run(engine.generate_all(requests))
    assert [len(s.response_ids) for s in out] == [3, 7]
    (dec,) = decoders
    assert tuple(dec.prompt_k[0].shape) == (2, 2, 5, 8)  # (distinct prompts, kv heads, longest prompt, head_dim)
    assert tuple(dec.gen_k[0].shape) == (2, 2, 7 - 1, 8)  # (B, kv heads, largest request - 1, head_dim)
    assert dec.tokens_BN.shape == (2, 7) and dec.steps_run == 7  # no step past the largest request


def test_requests_without_a_limit_use_engine_max_new_tokens(monkeypatch):
    decoders = _sizes(monkeypatch)
    engine = _engine(max_new_tokens=6)
    asyncio.run(engine.generate_all([GenerationRequest("a", [5, 6, 7], seed=1)]))
    assert tuple(decoders[0].prompt_k[0].shape) == (1, 2, 3, 8)
    assert tuple(decoders[0].gen_k[0].shape) == (1, 2, 6 - 1, 8)
