"""The Triton decode kernels against their torch references (decode_ops), on CUDA or, without a GPU,
under Triton's interpreter: test_triton_interpreted.py runs this file in a subprocess with
TRITON_INTERPRET=1 (Triton reads it when it is first imported, which transformers or torch may do long
before this module, so it cannot be set from here)."""

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: test_triton_interpreted.py runs this file under TRITON_INTERPRET=1",
                allow_module_level=True)

from streamrft.engines import decode_ops as ref  # noqa: E402
from streamrft.engines import triton_decode as tri  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    res = torch.randn(5, 40, generator=g).to(DEV, dtype)
    delta = torch.randn(5, 40, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DEV, dtype)
    for d in (None, delta):
        r_ref, h_ref = ref.add_rmsnorm(res, d, w, 1e-6)
        r_tri, h_tri = tri.add_rmsnorm(res, d, w, 1e-6)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        exact = 0 if dtype == torch.float32 else 8e-3  # bf16: one unit in the last place (interpreter rounding)
        torch.testing.assert_close(r_tri, r_ref, atol=exact, rtol=exact)
        torch.testing.assert_close(h_tri.float(), h_ref.float(), atol=tol, rtol=tol)


def test_silu_mul_matches_the_reference():
    gu = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    # two bf16 roundings (silu, then the product): within two units in the last place
    torch.testing.assert_close(tri.silu_mul(gu).float(), ref.silu_mul(gu).float(), atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype,n_heads,n_kv,d", [(torch.float32, 6, 2, 16), (torch.float32, 14, 2, 64),
                                                   (torch.bfloat16, 14, 2, 64), (torch.bfloat16, 12, 2, 128)])
def test_decode_attention_matches_the_reference(dtype, n_heads, n_kv, d):
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's interpreter computes tl.dot on bfloat16 wrongly; bf16 is checked on a GPU")
    g = torch.Generator().manual_seed(2)
    # rows 1 and 2 share prompt entry 1 (a GRPO group); 70 prompt slots and 66 generated ones both cross a
    # 64-slot block boundary; the last entry's prompt is one token long
    B, U, Lp, G, step = 4, 3, 70, 80, 67
    prompt_row = torch.tensor([0, 1, 1, 2], device=DEV)
    start = torch.tensor([0, 5, 5, 69], device=DEV)
    qkv = torch.randn(B, (n_heads + 2 * n_kv) * d, generator=g).to(DEV, dtype)
    caches0 = [torch.randn(n, n_kv, s, d, generator=g).to(DEV, dtype) for n, s in ((U, Lp), (U, Lp), (B, G), (B, G))]
    pos = torch.tensor([136, 131, 131, 67], device=DEV)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(DEV)
    step_1 = torch.tensor([step], device=DEV)
    args = (prompt_row, start, step_1, pos, inv_freq, 1.0, 1 / math.sqrt(d), n_heads, n_kv)
    outs, caches = [], []
    for impl in (ref, tri):
        cache = [c.clone() for c in caches0]
        outs.append(impl.decode_attention(qkv, *cache, *args).float())
        caches.append(cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    # every block size the launch table uses (attention_launch: 32 for head_dim <= 64, 64 above), whatever the default
    for block_n in (32, 64):
        other = tri.decode_attention(qkv, *[c.clone() for c in caches0], *args, block_n=block_n).float()
        torch.testing.assert_close(other, outs[0], atol=tol, rtol=tol)
    # the token's k (rotated) and v land in generated slot step - 1 of every row; nothing else is written
    torch.testing.assert_close(caches[1][2].float(), caches[0][2].float(), atol=tol, rtol=tol)
    assert torch.equal(caches[1][3], caches[0][3])
    assert not torch.equal(caches[1][3][:, :, step - 1], caches0[3][:, :, step - 1])
    for i in (0, 1):
        assert torch.equal(caches[1][i], caches0[i])  # the shared prompt entries are read, never written
    # prompt slots before start and generated slots past step - 1 must not matter: poison them
    pk, pv, gk, gv = (c.clone() for c in caches0)
    for u, s in ((0, 0), (1, 5), (2, 69)):
        pk[u, :, :s] = 1e4
    gk[:, :, step:] = 1e4
    poisoned = tri.decode_attention(qkv, pk, pv, gk, gv, *args).float()
    torch.testing.assert_close(poisoned, outs[1], atol=tol, rtol=tol)


def test_decode_attention_skips_finished_rows():
    """A row whose token count is reached (step >= need_B) reads no cache: poisoned with NaN, its output is still
    finite, and the running rows' outputs are the reference's."""
    g = torch.Generator().manual_seed(4)
    n_heads, n_kv, d, B, Lp, G, step = 6, 2, 16, 4, 20, 30, 25
    prompt_row = torch.tensor([0, 1, 1, 2], device=DEV)
    start = torch.tensor([0, 3, 3, 7], device=DEV)
    qkv = torch.randn(B, (n_heads + 2 * n_kv) * d, generator=g).to(DEV)
    pk, pv = (torch.randn(3, n_kv, Lp, d, generator=g).to(DEV) for _ in range(2))
    gk, gv = (torch.randn(B, n_kv, G, d, generator=g).to(DEV) for _ in range(2))
    pos = torch.tensor([44, 41, 41, 37], device=DEV)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(DEV)
    args = (prompt_row, start, torch.tensor([step], device=DEV), pos, inv_freq, 1.0, 1 / math.sqrt(d), n_heads, n_kv)
    expected = ref.decode_attention(qkv, pk.clone(), pv.clone(), gk.clone(), gv.clone(), *args)
    # row 3 (alone on prompt entry 2) needs 25 tokens: finished at step 25; row 0 needs 26 (running)
    need = torch.tensor([26, 40, 40, step], device=DEV)
    pk[2], pv[2], gk[3], gv[3] = (torch.full_like(t, float("nan")) for t in (pk[2], pv[2], gk[3], gv[3]))
    out = tri.decode_attention(qkv, pk, pv, gk.clone(), gv.clone(), *args, need_B=need)
    torch.testing.assert_close(out[:3], expected[:3], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[3]).all()


def test_race_sample_kernel_skips_finished_rows():
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(3, 3000, generator=g)).to(DEV)
    seeds, s = torch.tensor([1, 2, 3], device=DEV), torch.tensor([7], device=DEV)
    t_ref, lp_ref = ref.race_sample(logits, 0.7, seeds, s)
    tokens, logp = tri.race_sample(logits, 0.7, seeds, s, need_B=torch.tensor([8, 7, 100], device=DEV))
    assert tokens[[0, 2]].tolist() == t_ref[[0, 2]].tolist()
    torch.testing.assert_close(logp[[0, 2]], lp_ref[[0, 2]], atol=1e-5, rtol=1e-5)
    assert (int(tokens[1]), float(logp[1])) == (0, 0.0)  # finished (step 7 of 7 needed): not drawn


def test_race_sample_kernel_draws_the_reference_tokens():
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(4, 3000, generator=g)).to(DEV)
    logits[1, 100:] = float("-inf")  # a top-k style mask: only the first 100 entries may be drawn
    seeds = torch.tensor([1, 2, 3, 1 << 45], device=DEV)
    for step in range(3):
        s = torch.tensor([step], device=DEV)
        t_ref, lp_ref = ref.race_sample(logits, 0.7, seeds, s)
        # as launched, and with one split per row of 128-wide blocks (each lane then sees ~24 entries: the
        # running maximum and sum move within a lane, not only across lanes and splits)
        for block, programs in ((1024, 4096), (128, 4)):
            t_tri, lp_tri = tri.race_sample(logits, 0.7, seeds, s, block=block, target_programs=programs)
            assert torch.equal(t_tri, t_ref)
            torch.testing.assert_close(lp_tri, lp_ref, atol=1e-5, rtol=1e-5)
            assert int(t_tri[1]) < 100


def _tiny_model_and_requests():
    """A tiny random Qwen2 on the test device and three requests: two prompt lengths, and two samples of one
    prompt (a GRPO group: one prompt cache entry)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrft.engines.base import GenerationRequest

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval().to(DEV)
    return model, [GenerationRequest("a", [5, 6, 7, 8, 9], seed=11), GenerationRequest("b", [3, 4], seed=12),
                   GenerationRequest("a2", [5, 6, 7, 8, 9], seed=13)]


def test_static_decoder_with_triton_kernels_matches_the_torch_ops_and_a_full_forward():
    """The whole decode step on the kernels: same tokens as the torch ops, log-probs of a full forward."""
    import asyncio

    from streamrft.config.engine import EngineConfig
    from streamrft.engines.hf import HFEngine

    model, reqs = _tiny_model_and_requests()
    assert tri.attention_launch(16)[0] < 40 - 1
    runs = {}
    for kernels in ("torch", "triton"):
        # 40 new tokens: the generated part of the cache crosses one of the attention's 32-slot blocks (head_dim 16)
        ecfg = EngineConfig(max_new_tokens=40, static_cache=True, ignore_eos=True, decode_kernels=kernels,
                            temperature=0.9)
        engine = HFEngine(model, ecfg, eos_token_ids=[0], pad_token_id=0, device=DEV)
        runs[kernels] = asyncio.run(engine.generate_all(reqs))
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    for req, s in zip(reqs, runs["triton"]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([req.prompt_ids + s.response_ids], device=DEV)).logits[0]
        logp = torch.log_softmax(logits.float() / 0.9, -1)
        n = len(req.prompt_ids)
        ref_lp = [logp[n - 1 + j, t].item() for j, t in enumerate(s.response_ids)]
        assert s.logprobs == pytest.approx(ref_lp, abs=1e-4)


def test_static_decoder_with_rows_that_finish_early_matches_the_torch_ops(monkeypatch):
    """Rows that end early (their own max_new_tokens, or a stop token) are skipped by the Triton kernels for the
    rest of the chunk, and the chunk compacts to its running rows (hf_fast.should_compact, thresholds lowered
    for three rows); every sample is the torch ops' (which compute every row at every step). The attention splits
    each row's context as on a GPU of 4 multiprocessors (2 splits for 3 rows, 4 once compacted to 1)."""
    import asyncio
    from dataclasses import replace

    from streamrft.config.engine import EngineConfig
    from streamrft.engines import hf_fast
    from streamrft.engines.hf import HFEngine

    model, reqs = _tiny_model_and_requests()
    reqs = [replace(reqs[0], max_new_tokens=12), reqs[1], replace(reqs[2], max_new_tokens=30)]
    runs, sizes, compacted, splits_seen = {}, [], hf_fast.StaticDecoder.compacted, set()
    for kernels in ("torch", "triton"):
        if kernels == "triton":
            monkeypatch.setattr(hf_fast, "COMPACT_MIN_ROWS", 2)
            monkeypatch.setattr(hf_fast, "COMPACT_FRACTION", 0.7)
            monkeypatch.setattr(hf_fast, "COMPACT_MIN_STEPS", 1)
            monkeypatch.setattr(tri, "multiprocessors", lambda device: 4)
            choose = tri.attention_splits
            monkeypatch.setattr(tri, "attention_splits", lambda *a: splits_seen.add(choose(*a)) or choose(*a))
            monkeypatch.setattr(hf_fast.StaticDecoder, "compacted",
                                lambda self, keep: (sizes.append((self.B, len(keep))), compacted(self, keep))[1])
        # stop id 32: on CPU the second row samples it as its 21st token (the others never do); the first and
        # third rows end at their own limits (12, 30), so the chunk runs 3, 2, then 1 row (host checks: every 4 steps)
        ecfg = EngineConfig(max_new_tokens=40, static_cache=True, decode_kernels=kernels, temperature=0.9,
                            sync_every=4)
        engine = HFEngine(model, ecfg, eos_token_ids=[32], pad_token_id=0, device=DEV)
        runs[kernels] = asyncio.run(engine.generate_all(reqs))
    reasons = [s.finish_reason for s in runs["triton"]]
    assert "length" in reasons and sizes and sizes[0][0] == 3
    if not CUDA:  # the stop id was picked from this CPU run's samples: a GPU's logits may round to other samples
        assert reasons == ["length", "stop", "length"] and [len(s.response_ids) for s in runs["triton"]] == [12, 21, 30]
        assert sizes == [(3, 2), (2, 1)]
    assert 2 in splits_seen and max(splits_seen) >= 2
    for a, b in zip(runs["torch"], runs["triton"]):
        assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_graph_replays_the_eager_steps_and_empties_the_cache_only_when_short(monkeypatch):
    """The decode step captured once (hf_fast.capture_graph, without torch.cuda.graph's cache-emptying prelude)
    and replayed gives the eager steps' tokens and log-probs, also when later calls capture into the engine's
    graph pool again (hf_fast.DecodeGraphPool); the allocator's cache is emptied before the capture only when
    the device's free memory is below the step's headroom."""
    import asyncio
    import warnings

    from streamrft.config.engine import EngineConfig
    from streamrft.engines.hf import HFEngine

    model, reqs = _tiny_model_and_requests()
    emptied = []
    real_empty = torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (emptied.append(1), real_empty())[1])

    def run(graphs, calls=1):
        ecfg = EngineConfig(max_new_tokens=40, static_cache=True, ignore_eos=True, decode_kernels="triton",
                            temperature=0.9, cuda_graphs=graphs)
        engine = HFEngine(model, ecfg, eos_token_ids=[0], pad_token_id=0, device=DEV)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [[(s.response_ids, s.logprobs) for s in asyncio.run(engine.generate_all(reqs))]
                    for _ in range(calls)]
        # a failed capture only warns and decodes eagerly (same tokens): it must not happen here
        assert not [w for w in caught if "capture failed" in str(w.message)]
        for out in outs[1:]:  # later calls capture into the engine's pool again, after the first graph ended
            same(out, outs[0])
        return outs[0]

    def same(a, b):
        assert [ids for ids, _ in a] == [ids for ids, _ in b]
        for (_, lp_a), (_, lp_b) in zip(a, b):
            assert lp_a == pytest.approx(lp_b, abs=1e-5)

    eager = run(False)
    emptied.clear()
    same(run(True, calls=3), eager)
    assert emptied == []  # an idle GPU has far more free memory than the headroom
    _, total = torch.cuda.mem_get_info()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, total))
    same(run(True), eager)
    assert emptied  # short of memory: the cache went back to the driver before the capture


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_compacted_chunks_capture_their_own_graph_and_decode_as_the_eager_steps(monkeypatch):
    """With CUDA graphs, each compaction captures a graph of the running rows into the engine's pool; the samples
    are the eager, uncompacted ones."""
    import asyncio
    from dataclasses import replace

    from streamrft.config.engine import EngineConfig
    from streamrft.engines import hf_fast
    from streamrft.engines.hf import HFEngine

    model, reqs = _tiny_model_and_requests()
    reqs = [replace(reqs[0], max_new_tokens=9), reqs[1], replace(reqs[2], max_new_tokens=25)]

    def run(graphs):
        ecfg = EngineConfig(max_new_tokens=60, static_cache=True, ignore_eos=True, decode_kernels="triton",
                            temperature=0.9, cuda_graphs=graphs, sync_every=4)
        engine = HFEngine(model, ecfg, eos_token_ids=[0], pad_token_id=0, device=DEV)
        return [(s.response_ids, s.logprobs) for s in asyncio.run(engine.generate_all(reqs))]

    eager = run(False)
    captured, capture = [], hf_fast.StaticDecoder.capture
    monkeypatch.setattr(hf_fast.StaticDecoder, "capture", lambda self, pool=None: (captured.append(self.B),
                                                                                   capture(self, pool))[1])
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_ROWS", 2)
    monkeypatch.setattr(hf_fast, "COMPACT_FRACTION", 0.7)
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_STEPS", 1)
    graphed = run(True)
    assert captured[0] == 3 and len(captured) >= 2 and captured[1] < 3
    for (ids_e, lp_e), (ids_g, lp_g) in zip(eager, graphed):
        assert ids_g == ids_e
        assert lp_g == pytest.approx(lp_e, abs=1e-4)


@pytest.mark.parametrize("splits", [2, 4, 16])
def test_split_context_attention_matches_the_reference(splits):
    """Each (row, kv head)'s context split over ``splits`` programs and merged: the reference's output and cache
    writes, with more splits than some rows have blocks (empty splits), a finished row poisoned with NaN, prompt
    slots before the row's start and generated slots past its step poisoned with 1e4."""
    g = torch.Generator().manual_seed(6)
    n_heads, n_kv, d, B, U, Lp, G, step = 6, 2, 16, 5, 3, 70, 80, 67
    prompt_row = torch.tensor([0, 1, 1, 2, 2], device=DEV)
    start = torch.tensor([0, 5, 5, 69, 69], device=DEV)
    qkv = torch.randn(B, (n_heads + 2 * n_kv) * d, generator=g).to(DEV)
    pk, pv = (torch.randn(U, n_kv, Lp, d, generator=g).to(DEV) for _ in range(2))
    gk, gv = (torch.randn(B, n_kv, G, d, generator=g).to(DEV) for _ in range(2))
    pos = torch.tensor([136, 131, 131, 67, 67], device=DEV)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(DEV)
    args = (prompt_row, start, torch.tensor([step], device=DEV), pos, inv_freq, 1.0, 1 / math.sqrt(d), n_heads, n_kv)
    ref_caches = [t.clone() for t in (pk, pv, gk, gv)]
    expected = ref.decode_attention(qkv, *ref_caches, *args)
    need = torch.tensor([80, 80, 80, 80, step], device=DEV)  # row 4 is finished
    for u, s in ((0, 0), (1, 5), (2, 69)):
        pk[u, :, :s] = 1e4
    gk[:, :, step:] = 1e4
    gk[4, :, : step - 1], gv[4, :, : step - 1] = float("nan"), float("nan")
    for block_n in (16, 32):
        caches = [t.clone() for t in (pk, pv, gk, gv)]
        out = tri.decode_attention(qkv, *caches, *args, block_n=block_n, need_B=need, splits=splits)
        torch.testing.assert_close(out[:4], expected[:4], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(out[4]).all()
        # the token's k and v written once, into slot step - 1 of every row (the first split's job)
        torch.testing.assert_close(caches[2][:4, :, step - 1], ref_caches[2][:4, :, step - 1], atol=1e-5, rtol=1e-5)
        assert torch.equal(caches[3][:, :, step - 1], ref_caches[3][:, :, step - 1])


def test_split_count_follows_the_batch_and_bad_counts_are_refused():
    h200 = 132  # multiprocessors
    assert tri.attention_splits(512, 2, h200) == 1 and tri.attention_splits(132, 2, h200) == 1
    assert tri.attention_splits(127, 2, h200) == 2 and tri.attention_splits(31, 2, h200) == 8
    assert tri.attention_splits(7, 2, h200) == tri.MAX_SPLITS
    qkv = torch.zeros(2, 10 * 16, device=DEV)
    with pytest.raises(ValueError, match="splits=3 must be a power of two"):
        tri.decode_attention(qkv, *([torch.zeros(1, 2, 4, 16, device=DEV)] * 2),
                             *([torch.zeros(2, 2, 4, 16, device=DEV)] * 2), None, None, None, None, None, 1.0, 1.0,
                             6, 2, splits=3)


def test_a_failing_split_kernel_warns_once_and_the_whole_context_kernel_takes_over(monkeypatch):
    g = torch.Generator().manual_seed(8)
    n_heads, n_kv, d, B, Lp, G, step = 4, 2, 16, 2, 8, 12, 5
    qkv = torch.randn(B, (n_heads + 2 * n_kv) * d, generator=g).to(DEV)
    caches = [torch.randn(n, n_kv, s, d, generator=g).to(DEV) for n, s in ((1, Lp), (1, Lp), (B, G), (B, G))]
    args = (torch.tensor([0, 0], device=DEV), torch.tensor([0, 2], device=DEV), torch.tensor([step], device=DEV),
            torch.tensor([12, 10], device=DEV), torch.ones(d // 2, device=DEV), 1.0, 0.25, n_heads, n_kv)
    expected = ref.decode_attention(qkv, *[c.clone() for c in caches], *args)
    TritonError = type("OutOfResources", (RuntimeError,), {"__module__": "triton.runtime.errors"})
    launch, calls = tri._decode_attention, []

    def failing(*a):
        calls.append(a[-1])
        if a[-1] > 1:
            raise TritonError("out of shared memory")
        return launch(*a)

    monkeypatch.setattr(tri, "_decode_attention", failing)
    monkeypatch.setattr(tri, "_SPLITS_FAILED", [])
    with pytest.warns(UserWarning, match=r"split-context kernels failed \(OutOfResources: out of shared memory\)"):
        out = tri.decode_attention(qkv, *[c.clone() for c in caches], *args, splits=4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(tri, "multiprocessors", lambda device: 132)  # auto would split: the failure is remembered
    again = tri.decode_attention(qkv, *[c.clone() for c in caches], *args)
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=1e-5)
    assert calls == [4, 1, 1]
    monkeypatch.setattr(tri, "_decode_attention", lambda *a: (_ for _ in ()).throw(KeyError("not triton's")))
    with pytest.raises(KeyError):
        tri.decode_attention(qkv, *[c.clone() for c in caches], *args, splits=2)


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's part of Triton's cache key that a run can vary (the
    compile-time constants and launch options by value; for the other arguments a tensor's dtype and 16-byte
    alignment, an integer's equality to 1 and divisibility by 16), then launches the kernel."""

    def __init__(self, kernel, name: str, launched: dict, who: list):
        self.kernel, self.name, self.launched, self.who = kernel, name, launched, who

    @staticmethod
    def _kind(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0)
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, int):
            return ("int", value == 1, value % 16 == 0)
        return type(value).__name__

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            key = (self.name, tuple(self._kind(a) for a in args),
                   tuple(sorted((k, v if isinstance(v, (int, str, bool, type(None))) else self._kind(v))
                                for k, v in kwargs.items())))
            self.launched[self.who[0]].add(key)
            return launch(*args, **kwargs)
        return record


def test_the_kernel_warmup_launches_every_kernel_variant_the_engine_launches(monkeypatch, tmp_path):
    """engines/kernel_warmup.py: a one-layer copy of the model (learner/compile_warmup.one_layer_model, from the saved
    model) decoded through warm_decode_kernels launches every kernel with every cache-key variant that the engine
    launches on the full model: a chunk of three rows with a prompt length not divisible by 16 that compacts as rows
    end (attention split 2 at 3 rows, 4 at 1, as on a 4-multiprocessor GPU), then a chunk of one 16-token prompt."""
    import asyncio
    from dataclasses import replace

    from streamrft.config.engine import EngineConfig
    from streamrft.config.model import ModelConfig
    from streamrft.engines import hf_fast, kernel_warmup
    from streamrft.engines.base import GenerationRequest
    from streamrft.engines.hf import HFEngine
    from streamrft.learner.compile_warmup import one_layer_model

    model, reqs = _tiny_model_and_requests()
    model.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_ROWS", 1)
    monkeypatch.setattr(hf_fast, "COMPACT_FRACTION", 0.7)
    monkeypatch.setattr(hf_fast, "COMPACT_MIN_STEPS", 1)
    monkeypatch.setattr(tri, "multiprocessors", lambda device: 4)
    launched, who = {"engine": set(), "warm-up": set()}, ["engine"]
    for name in [n for n in vars(tri) if n.startswith("_") and n.endswith("_kernel")]:
        monkeypatch.setattr(tri, name, _LaunchRecorder(getattr(tri, name), name, launched, who))
    ecfg = EngineConfig(max_new_tokens=20, static_cache=True, decode_kernels="triton", temperature=0.9,
                        max_batch_size=3)
    engine = HFEngine(model, ecfg, eos_token_ids=[7], pad_token_id=0, device=DEV)
    first_chunk = [replace(reqs[0], max_new_tokens=4), replace(reqs[1], max_new_tokens=6), reqs[2]]
    asyncio.run(engine.generate_all(first_chunk))
    asyncio.run(engine.generate_all([GenerationRequest("c", list(range(1, 17)), seed=3)]))
    who[0] = "warm-up"
    copy = one_layer_model(ModelConfig(path=str(tmp_path / "model"), dtype="float32", attn_implementation="sdpa"))
    assert len(copy.model.layers) == 1
    launches = kernel_warmup.warm_decode_kernels(copy.to(DEV).eval(), ecfg, DEV, first=3)
    splits_keys = {dict(k[2]).get("SPLITS") for k in launched["engine"] if k[0] == "_decode_attention_kernel"}
    assert splits_keys == {2, 4}  # the chunk of 3 rows split in 2, compacted to 1 row: in 4
    assert launched["engine"] <= launched["warm-up"], sorted(launched["engine"] - launched["warm-up"])
    assert launches == 2 * len(kernel_warmup.launch_variants(3, 3, 50, 2, 4)) == 4


def test_the_kernel_warmup_batches_cover_every_split_pair_once_the_likeliest_first():
    """launch_variants: one batch per distinct (sampler split, attention split) over 1..largest rows, no two alike,
    the run's likeliest chunk first (Qwen2.5-0.5B's vocabulary and kv heads on an H200's 132 multiprocessors)."""
    from streamrft.engines.kernel_warmup import launch_variants

    def pair(b):
        return tri.race_splits(b, 151936)[0], tri.attention_splits(b, 2, 132)

    sizes = launch_variants(512, 512, 151936, 2, 132)
    assert sizes[0] == 512 and len(set(map(pair, sizes))) == len(sizes)
    assert {pair(b) for b in range(1, 513)} == set(map(pair, sizes))
    assert launch_variants(600, 256, 151936, 2, 132)[0] == 256  # never more rows than a chunk holds
    assert tri.race_splits(512, 151936) == (8, 19456) and tri.race_splits(16, 151936) == (149, 1024)
