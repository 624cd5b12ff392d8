"""benchmarks/longtail.py: the long-tailed length of a sample is a pure function of its seed (log-normal,
median and cap as configured), and both enforcements give the same responses shape: HF generate with
ForceLengthProcessor (TRL's path) and the static-cache engine wrapped by force_lengths (StreamRFT's path)
end every row with EOS as its length(seed)-th token, also in the async placement's engine processes."""

import asyncio
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.engines.sampling import sample_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from longtail import ForceLengthProcessor, LongTail, force_lengths  # noqa: E402

EOS = 1
SHAPE = LongTail(median=4, sigma=1.0, cap=12)


def _model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=0)).eval()


def test_lengths_are_log_normal_per_seed_with_the_median_and_the_cap():
    shape = LongTail()  # median 512, sigma 1, cap 4096
    lengths = [shape.length(seed) for seed in range(20000)]
    assert lengths[:50] == [shape.length(seed) for seed in range(50)]  # a pure function of the seed
    assert abs(statistics.median(lengths) - 512) < 0.03 * 512
    capped = sum(n == 4096 for n in lengths) / len(lengths)
    expected = 0.5 * math.erfc(math.log(8) / math.sqrt(2))  # P(z > ln(4096 / 512)) = 0.0188
    assert abs(capped - expected) < 0.004 and max(lengths) == 4096 and min(lengths) >= 1
    assert shape.step_lengths(0, 3, 2, 2) == [shape.length(sample_seed(0, 3, p, j)) for p in (0, 1) for j in (0, 1)]


def test_hf_generate_with_the_processor_ends_each_row_with_eos_at_its_length():
    model = _model()
    lengths = SHAPE.step_lengths(0, 0, 3, 2)
    assert len(set(lengths)) > 1  # the rows differ
    prompts = torch.randint(2, 40, (6, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=SHAPE.cap,
                             logits_processor=[ForceLengthProcessor(lengths, prompts.shape[1], EOS)], pad_token_id=0)
    for row, n in zip(out[:, prompts.shape[1]:].tolist(), lengths):
        assert row[:n][-1] == EOS and EOS not in row[: n - 1], (row, n)


def test_the_wrapped_engine_gives_each_request_its_length_ending_in_eos():
    engine = HFEngine(_model(), EngineConfig(max_new_tokens=SHAPE.cap, static_cache=True, ignore_eos=True),
                      eos_token_ids=[EOS], pad_token_id=0, device=torch.device("cpu"))
    force_lengths(engine, SHAPE, EOS)
    requests = [GenerationRequest(f"r{p}-{j}", [5, 6, 7], seed=sample_seed(0, 0, p, j)) for p in range(3) for j in range(2)]
    out = asyncio.run(engine.generate_all(requests))
    assert [len(s.response_ids) for s in out] == SHAPE.step_lengths(0, 0, 3, 2)  # the same lengths as TRL's rows
    assert all(s.response_ids[-1] == EOS and s.logprobs[-1] == 0.0 and s.finish_reason == "stop" for s in out)


def test_the_async_engine_process_builds_engines_that_decode_the_long_tailed_lengths(monkeypatch):
    """``python -m longtail SPEC`` (gpu_grpo's async engine processes): StreamRFT's engine worker runs with every
    engine that ``streamrft.engines.build_engine`` gives it wrapped by force_lengths."""
    import json

    import longtail
    import streamrft.engines as engines
    from streamrft import engine_process

    monkeypatch.setattr(engines, "build_engine", engines.build_engine)  # restored after the test
    monkeypatch.setenv(longtail.LONGTAIL_ENV, json.dumps({"shape": {"median": 4, "sigma": 1.0, "cap": 12},
                                                          "eos_id": EOS}))
    seen = {}

    def worker_main(argv):  # what an engine process does with the engine it builds: generate
        from streamrft.engines import build_engine

        tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=0)
        engine = build_engine(EngineConfig(max_new_tokens=SHAPE.cap, static_cache=True, ignore_eos=True), _model(),
                              tokenizer, torch.device("cpu"))
        requests = [GenerationRequest(f"r{p}-{j}", [5, 6, 7], seed=sample_seed(0, 0, p, j))
                    for p in range(3) for j in range(2)]
        seen["argv"], seen["out"] = argv, asyncio.run(engine.generate_all(requests))
        return 0

    monkeypatch.setattr(engine_process, "main", worker_main)
    assert longtail.engine_process_main(["spec.json"]) == 0 and seen["argv"] == ["spec.json"]
    assert [len(s.response_ids) for s in seen["out"]] == SHAPE.step_lengths(0, 0, 3, 2)
    assert all(s.response_ids[-1] == EOS for s in seen["out"])
