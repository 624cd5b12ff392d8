"""The static-cache decode path (engine.static_cache) against a full Hugging Face forward, on CPU."""

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from streamrft.engines.decode_ops import race_sample, race_uniform, row_keys


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


def test_samples_of_one_prompt_share_its_cache_and_decode_as_if_alone(monkeypatch):
    """A GRPO group's rows read one prompt cache entry (prefill runs the distinct prompts only), and each row
    gets the tokens and log-probs it gets when it is decoded alone in its chunk."""
    from streamrft.engines import hf_fast

    seen, original_init = [], hf_fast.StaticDecoder.__init__
    monkeypatch.setattr(hf_fast.StaticDecoder, "__init__", lambda self, *a, **k: (original_init(self, *a, **k),
                                                                                   seen.append(self))[0])
    model = _model()
    cfg = EngineConfig(max_new_tokens=6, static_cache=True, sync_every=2, ignore_eos=True, temperature=0.9)
    engine = HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))
    group = [GenerationRequest(f"g{i}", [5, 6, 7, 8, 9], seed=20 + i) for i in range(3)]
    other = GenerationRequest("b", [3, 4], seed=12)
    together = asyncio.run(engine.generate_all([group[0], other, group[1], group[2]]))
    (dec,) = seen
    assert (dec.B, dec.U) == (4, 2) and dec.prompt_row_B.tolist() == [0, 1, 0, 0]
    assert tuple(dec.prompt_k[0].shape) == (2, 2, 5, 8) and tuple(dec.gen_k[0].shape) == (4, 2, 5, 8)
    alone = [asyncio.run(engine.generate_all([r]))[0] for r in (group[0], other, group[1], group[2])]
    for a, t in zip(alone, together):
        assert t.response_ids == a.response_ids
        assert t.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert len({tuple(s.response_ids) for s in together[::2]}) > 1  # own seeds: the group's samples differ


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


def test_race_uniforms_depend_only_on_seed_step_and_token():
    seeds = torch.tensor([1, 2, 3, 1 << 40], dtype=torch.int64)
    u0 = race_uniform(row_keys(seeds, torch.tensor([0])), 50)
    assert torch.equal(u0[[0, 3]], race_uniform(row_keys(seeds[[0, 3]], torch.tensor([0])), 50))
    assert not torch.equal(u0, race_uniform(row_keys(seeds, torch.tensor([1])), 50))
    assert not torch.equal(u0[0], u0[1])
    assert bool(((u0 >= 0) & (u0 <= 1)).all())
    u = race_uniform(row_keys(torch.arange(400, dtype=torch.int64), torch.tensor([7])), 500).double()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002


def test_race_sample_draws_from_the_softmax():
    """Frequencies over 40000 seeds against softmax(z / T): a chi-square test, df = 4."""
    z = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    T, n = 0.8, 40000
    tokens, logp = race_sample(z.expand(n, -1), 1 / T, torch.arange(n, dtype=torch.int64), torch.tensor([3]))
    p = torch.softmax(z / T, -1).double()
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[4] == 0  # a -inf entry is never drawn
    live = p > 0
    chi2 = (((counts - n * p) ** 2)[live] / (n * p)[live]).sum().item()
    assert chi2 < 18.5  # chi-square(4) 0.999 quantile
    torch.testing.assert_close(logp, torch.log(p.float())[tokens])


def test_race_sample_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 100, generator=g)
    seeds = torch.arange(6, dtype=torch.int64) * 977
    full, _ = race_sample(z, 1.0, seeds, torch.tensor([5]))
    part, _ = race_sample(z[[4, 1]], 1.0, seeds[[4, 1]], torch.tensor([5]))
    assert part.tolist() == full[[4, 1]].tolist()


def test_decode_kernels_choice(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from streamrft.engines import decode_ops
    from streamrft.engines.hf_fast import decode_kernels

    assert decode_kernels("auto", torch.device("cpu")) is decode_ops
    assert decode_kernels("torch", torch.device("cpu")) is decode_ops
    with pytest.raises(ValueError, match="engine.decode_kernels=triton needs"):
        decode_kernels("triton", torch.device("cpu"))


def test_cuda_graphs_without_static_cache_is_a_config_error():
    with pytest.raises(ValueError, match="engine.cuda_graphs=true needs engine.static_cache=true"):
        HFEngine(_model(), EngineConfig(cuda_graphs=True), eos_token_ids=[0], pad_token_id=0,
                 device=torch.device("cpu"))


def test_static_path_rows_stop_in_different_blocks_with_the_tokens_of_an_unstopped_run():
    """Greedy decoding: a row that meets the stop token ends there (kept), with exactly the tokens and
    log-probs that a run without stops produced up to that point, whichever readback block it falls in."""
    model = _model()
    free = EngineConfig(max_new_tokens=9, static_cache=True, sync_every=2, ignore_eos=True, top_k=1)
    full = asyncio.run(HFEngine(model, free, eos_token_ids=[0], pad_token_id=0,
                                device=torch.device("cpu")).generate_all(_requests()))
    stop = full[0].response_ids[4]  # row a meets it at index <= 4: in the third block of two steps
    cfg = EngineConfig(max_new_tokens=9, static_cache=True, sync_every=2, stop_token_ids=[stop], top_k=1)
    out = asyncio.run(HFEngine(model, cfg, eos_token_ids=[], pad_token_id=0,
                               device=torch.device("cpu")).generate_all(_requests()))
    for got, ref, req in zip(out, full, _requests()):
        limit = req.max_new_tokens or 9
        n = ref.response_ids.index(stop) + 1 if stop in ref.response_ids[:limit] else limit
        assert got.response_ids == ref.response_ids[:n]
        assert got.logprobs == pytest.approx(ref.logprobs[:n], abs=1e-6)
        assert got.finish_reason == ("stop" if stop in ref.response_ids[:limit] else "length")


def test_static_path_applies_lora_adapters_injected_in_the_model():
    """model.lora_rank: the colocated engine's module carries peft LoRA layers; the static path must decode
    with W + scaling·B·A, as the module's own forward does."""
    from streamrft.config.model import ModelConfig
    from streamrft.learner.lora import apply_lora

    model = _model()
    apply_lora(model, ModelConfig(lora_rank=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "up_proj",
                                                                               "o_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # B = 0 at init would hide a missing adapter
    cfg = EngineConfig(max_new_tokens=5, static_cache=True, ignore_eos=True)
    engine = HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))
    samples = asyncio.run(engine.generate_all(_requests()))
    for req, s in zip(_requests(), samples):
        with torch.no_grad():
            logp_LV = torch.log_softmax(model(input_ids=torch.tensor([req.prompt_ids + s.response_ids])).logits[0], -1)
        n = len(req.prompt_ids)
        assert s.logprobs == pytest.approx([logp_LV[n - 1 + j, t].item() for j, t in enumerate(s.response_ids)],
                                           abs=1e-4)


def test_triton_failure_under_auto_falls_back_to_the_torch_ops_once_and_loudly():
    """engine.decode_kernels=auto picked Triton, whose compiler fails here: warn, decode with the torch
    ops (same tokens as choosing them), and keep them for later chunks."""
    import types

    from streamrft.engines import decode_ops

    TritonError = type("CompilationError", (Exception,), {"__module__": "triton.compiler.errors"})

    def broken(*args, **kwargs):
        raise TritonError("ptxas not found")

    model = _model()
    reference = asyncio.run(HFEngine(model, EngineConfig(max_new_tokens=4, static_cache=True, decode_kernels="torch"),
                                     eos_token_ids=[0], pad_token_id=0,
                                     device=torch.device("cpu")).generate_all(_requests()))
    engine = HFEngine(model, EngineConfig(max_new_tokens=4, static_cache=True), eos_token_ids=[0], pad_token_id=0,
                      device=torch.device("cpu"))
    engine.decode_ops = types.SimpleNamespace(add_rmsnorm=broken)  # stands for triton_decode
    with pytest.warns(UserWarning, match="engine.decode_kernels=auto: the Triton kernels failed"):
        got = asyncio.run(engine.generate_all(_requests()))
    assert engine.decode_ops is decode_ops
    assert [s.response_ids for s in got] == [s.response_ids for s in reference]


def test_static_path_with_top_k_and_top_p_records_the_processed_distributions_logprob():
    """With top-k / top-p the race runs on process_logits' output: tokens stay inside the kept set and the
    recorded log-prob is log softmax of the processed logits (the distribution actually sampled from)."""
    from streamrft.engines.sampling import process_logits

    model = _model()
    cfg = EngineConfig(max_new_tokens=6, static_cache=True, ignore_eos=True, temperature=0.8, top_k=7, top_p=0.8)
    samples = asyncio.run(HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0,
                                   device=torch.device("cpu")).generate_all(_requests()))
    for req, s in zip(_requests(), samples):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([req.prompt_ids + s.response_ids])).logits[0]
        n = len(req.prompt_ids)
        for j, tok in enumerate(s.response_ids):
            processed = process_logits(logits[n - 1 + j: n + j], 0.8, 7, 0.8)[0]
            assert processed[tok] > float("-inf")  # drawn from the kept set
            assert s.logprobs[j] == pytest.approx(torch.log_softmax(processed, -1)[tok].item(), abs=1e-4)


def test_the_host_idle_window_is_open_while_the_decode_loop_waits_and_shut_around_it(monkeypatch):
    """Background host work that holds the CUDA driver (the checkpoint prewarm's page-locking) runs only while
    the static decode loop waits a block behind the GPU: not during prefill, not once the chunk is done."""
    from streamrft.engines import hf_fast

    states, original_prefill = [], hf_fast.StaticDecoder.prefill
    monkeypatch.setattr(hf_fast.StaticDecoder, "prefill",
                        lambda self: (states.append(("prefill", engine.host_idle.is_open())), original_prefill(self))[1])
    cfg = EngineConfig(max_new_tokens=6, static_cache=True, sync_every=2, ignore_eos=True)
    engine = HFEngine(_model(), cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))

    async def run():
        async for sample in engine.generate(_requests()):
            states.append((sample.request_id, engine.host_idle.is_open()))
    asyncio.run(run())
    assert states == [("prefill", False), ("c", True), ("a", True), ("b", True)]
    assert not engine.host_idle.is_open()
    assert engine.host_idle_window is engine.host_idle
    assert engine.with_config(cfg).host_idle is engine.host_idle  # the greedy evaluation engine: the same host
    eager = HFEngine(_model(), EngineConfig(max_new_tokens=6), eos_token_ids=[0], pad_token_id=0,
                     device=torch.device("cpu"))
    assert eager.host_idle_window is None  # its generate never opens the window: nothing may wait for it


def test_a_chunk_compacts_to_its_running_rows_and_decodes_the_same(monkeypatch):
    """Once few rows still decode (long-tailed lengths), the chunk goes on with a decoder of those rows only
    (hf_fast.should_compact): the samples are the ones decoded without compaction, prompt entries shared by a
    group included."""
    from streamrft.engines import hf_fast

    model = _model()
    cfg = EngineConfig(max_new_tokens=30, static_cache=True, sync_every=2, ignore_eos=True, temperature=0.9)
    limits = [3, 30, 5, 8, 24, 2, 30, 4]
    reqs = [GenerationRequest(f"r{i}", [5, 6, 7] if i % 2 else [3, 4, 9, 9], seed=40 + i, max_new_tokens=n)
            for i, n in enumerate(limits)]

    def run():
        engine = HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))
        return [(s.request_id, s.response_ids, s.logprobs, s.finish_reason)
                for s in asyncio.run(engine.generate_all(reqs))]

    plain = run()
    assert [len(ids) for _, ids, _, _ in plain] == limits
    sizes, original = [], hf_fast.StaticDecoder.compacted

    def compacted(self, keep):
        if self.B == 8:  # every per-row tensor is gathered (a new one must join hf_fast._ROW_STATE); no other size is 8
            per_row = {k for k, v in vars(self).items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 8}
            assert per_row == set(hf_fast._ROW_STATE), per_row ^ set(hf_fast._ROW_STATE)
        sizes.append((self.B, len(keep)))
        return original(self, keep)

    monkeypatch.setattr(hf_fast.StaticDecoder, "compacted", compacted)
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_ROWS", 2)
    monkeypatch.setattr(hf_fast, "COMPACT_FRACTION", 0.5)
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_STEPS", 1)
    compacted = run()
    # blocks of 2 steps: once tokens 0-4 are read, the rows of limits 2-5 are done and 4 of 8 run on (8, 24,
    # 30, 30); once the rows of limits 8 and 24 are done, 2 of those 4 (the two of limit 30)
    assert sizes == [(8, 4), (4, 2)]
    assert [(r, ids, reason) for r, ids, _, reason in compacted] == [(r, ids, reason) for r, ids, _, reason in plain]
    for (_, _, lp_c, _), (_, _, lp_p, _) in zip(compacted, plain):
        assert lp_c == pytest.approx(lp_p, abs=1e-5)


def test_should_compact_thresholds():
    from streamrft.engines.hf_fast import should_compact

    assert should_compact(128, 512, 1000) and not should_compact(129, 512, 1000)
    assert not should_compact(2, 15, 1000)  # too few rows to pay for a capture
    assert not should_compact(10, 512, 127)  # too few steps left


def test_a_failed_compaction_warns_once_and_decodes_on_with_every_row(monkeypatch):
    from streamrft.engines import hf_fast

    model = _model()
    cfg = EngineConfig(max_new_tokens=20, static_cache=True, sync_every=2, ignore_eos=True)
    reqs = [GenerationRequest(f"r{i}", [5, 6, 7], seed=i, max_new_tokens=n) for i, n in enumerate([2, 3, 20, 2])]
    engine = HFEngine(model, cfg, eos_token_ids=[0], pad_token_id=0, device=torch.device("cpu"))
    plain = asyncio.run(engine.generate_all(reqs))
    calls = []

    def out_of_memory(self, keep):
        calls.append(len(keep))
        raise torch.OutOfMemoryError("no room for the smaller batch's caches")

    monkeypatch.setattr(hf_fast.StaticDecoder, "compacted", out_of_memory)
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_ROWS", 2)
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_STEPS", 1)
    with pytest.warns(UserWarning, match=r"compacting the chunk's 4 rows to 1 failed \(no room"):
        failed = asyncio.run(engine.generate_all(reqs))
    assert calls == [1]  # not tried again in the chunk
    assert [(s.response_ids, s.logprobs) for s in failed] == [(s.response_ids, s.logprobs) for s in plain]
