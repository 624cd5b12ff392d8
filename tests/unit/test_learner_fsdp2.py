"""FSDP2Strategy at world size 1, in process, against an unwrapped copy of the same model."""

import math
import msgspec
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.learner.microbatch import SequenceSample, make_microbatches
from streamrft.learner.reference import FrozenReference

T = 0.9


def configs(path, **train):
    """(ModelConfig, TrainConfig); namespaces with the same fields if the config tree cannot import."""
    t = dict(lr=1e-2, lr_schedule="constant", warmup_steps=0, min_lr_ratio=0.0, weight_decay=0.01,
             adam_betas=[0.9, 0.999], adam_eps=1e-8, grad_clip=0.05, strategy="fsdp2")
    t.update(train)
    m = dict(path=path, dtype="float32", attn_implementation="sdpa", gradient_checkpointing=False,
             freeze_prefix=[], reference_path="")
    try:
        from streamrft.config.model import ModelConfig
        from streamrft.config.train import TrainConfig
        return ModelConfig(**m), TrainConfig(**t)
    except TypeError:  # config tree broken in this checkout
        return types.SimpleNamespace(**m), types.SimpleNamespace(**t)


def _microbatches():
    g = torch.Generator().manual_seed(3)
    samples = [SequenceSample(torch.randint(3, 30, (p,), generator=g).tolist(),
                              torch.randint(3, 30, (r,), generator=g).tolist(),
                              {"adv": torch.randn(r, generator=g)}) for p, r in [(3, 5), (6, 2), (2, 7), (4, 4)]]
    mbs = make_microbatches(samples, token_budget=20)
    assert len(mbs) > 1
    return mbs


def _loss_fn(n_tokens):
    def loss_fn(mb, logp_BL, entropy_BL):
        loss = -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / n_tokens
        return loss, {"tokens": mb["response_mask"].sum()}
    return loss_fn


def _direct_logp(model, mb):
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                   position_ids=mb["position_ids"]).logits.float() / T
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(logp.shape[0], 1), logp], 1) * mb["response_mask"]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_forward_backward_and_step_match_an_unwrapped_model_and_report_its_grad_norm(dist, model_dir):
    mcfg, tcfg = configs(model_dir)
    strat = FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {k: _full(v).clone() for k, v in strat.module.state_dict().items()}
    mbs = _microbatches()
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))
    losses = [strat.forward_backward(mb, _loss_fn(n_tokens), T)["loss"] for mb in mbs]

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ref_loss = 0.0
    for mb in mbs:
        loss = -(_direct_logp(ref, mb) * mb["adv"]).sum() / n_tokens
        loss.backward()
        ref_loss += float(loss.detach())
    ref_grads = dict(ref.named_parameters())
    strat.release_gathered_weights()  # at world size 1 the weights stay gathered until the step (no .grad on them)
    for name, p in strat.module.named_parameters():
        torch.testing.assert_close(_full(p.grad), ref_grads[name].grad, atol=1e-7, rtol=1e-5)
    out = strat.step()
    want_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters() if p.grad is not None))
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()

    assert sum(losses) == pytest.approx(ref_loss, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(want_norm, rel=1e-5) and want_norm > 0.05, "clipping is exercised"
    assert out["lr"] == pytest.approx(1e-2)
    after = {k: _full(v) for k, v in strat.module.state_dict().items()}
    ref_sd = ref.state_dict()
    assert set(after) == set(ref_sd)
    for k, v in after.items():
        assert not torch.equal(v, before[k]), f"{k} did not change"
        # Adam's first step is lr * g / (|g| + eps): elements with |g| ~ eps amplify 1e-7 grad noise, so
        # the update is compared at 1e-3 of its size (lr = 1e-2); the gradients above are compared at 1e-7
        torch.testing.assert_close(v, ref_sd[k], atol=1e-5, rtol=0, msg=lambda m: k + m)

    # the weights for the engine are the same tensors, in HF names, bucketed
    buckets = list(strat.full_state_for_engine(bucket_bytes=4096))
    assert len(buckets) > 1
    names = [n for b in buckets for n, _ in b]
    assert names == list(after)
    for b in buckets:
        for n, t in b:
            torch.testing.assert_close(t, after[n], atol=0, rtol=0)

    # compute_logprobs agrees with the unwrapped updated model
    logp, ent = strat.compute_logprobs(mbs[0], T, with_entropy=True)
    torch.testing.assert_close(logp, _direct_logp(ref, mbs[0]).detach(), atol=1e-5, rtol=0)
    assert ent is not None and (ent[mbs[0]["response_mask"] > 0] > 0).all()


def test_rollout_unshard_allows_plain_forwards_and_training_resumes_after_reshard(dist, model_dir):
    mcfg, tcfg = configs(model_dir)
    strat = FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)
    mb = _microbatches()[0]
    want, _ = strat.compute_logprobs(mb, T)
    strat.unshard_for_rollout()
    with torch.no_grad():
        for _ in range(3):
            logits = strat.module(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    assert logits.shape[-1] == strat.module.config.vocab_size
    with pytest.raises(RuntimeError, match="reshard_after_rollout"):
        strat.compute_logprobs(mb, T)
    strat.reshard_after_rollout()
    got, _ = strat.compute_logprobs(mb, T)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    strat.forward_backward(mb, _loss_fn(10.0), T)
    assert strat.step()["grad_norm"] > 0


def test_save_then_load_restores_weights_optimizer_and_schedule(dist, model_dir, tmp_path):
    mcfg, tcfg = configs(model_dir, lr_schedule="cosine", warmup_steps=2)
    a = FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)
    mbs = _microbatches()
    a.forward_backward(mbs[0], _loss_fn(10.0), T)
    a.step()
    a.save(str(tmp_path / "ckpt"))
    b = FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)
    b.load(str(tmp_path / "ckpt"))
    for step in range(2):  # identical next steps, including Adam moments and the LR schedule
        outs = []
        for s in (a, b):
            s.forward_backward(mbs[1], _loss_fn(10.0), T)
            outs.append(s.step())
        assert outs[0] == outs[1]
    for (k, va), vb in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        torch.testing.assert_close(_full(va), _full(vb), atol=0, rtol=0, msg=k)
    with pytest.raises(ValueError, match="does not exist"):
        b.load(str(tmp_path / "missing"))


def test_frozen_reference_matches_the_unwrapped_model_and_has_no_trainable_params(dist, model_dir):
    mcfg, _ = configs(model_dir)
    ref = FrozenReference(model_dir, mcfg, dist)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mb = _microbatches()[0]
    torch.testing.assert_close(ref.compute_logprobs(mb, T), _direct_logp(plain, mb).detach(), atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in ref.module.parameters()) and not ref.module.training


def test_missing_model_path_and_bad_freeze_prefix_are_clear_value_errors(dist, model_dir, tmp_path):
    mcfg, tcfg = configs(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model.path=.*nope"):
        FSDP2Strategy(mcfg, tcfg, dist, total_steps=1)
    mcfg, tcfg = configs(model_dir)
    mcfg.freeze_prefix = ["vision_tower."]
    with pytest.raises(ValueError, match="freeze_prefix entry 'vision_tower.'"):
        FSDP2Strategy(mcfg, tcfg, dist, total_steps=1)


def test_gradient_checkpointing_gives_the_same_grads_and_frozen_prefixes_stay_fixed(dist, model_dir):
    mbs = _microbatches()
    grads = []
    for ckpt in (False, True):
        mcfg, tcfg = configs(model_dir)
        mcfg.gradient_checkpointing = ckpt
        mcfg.freeze_prefix = ["model.layers.0."]
        strat = FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)
        frozen = {n: _full(p).clone() for n, p in strat.module.named_parameters() if n.startswith("model.layers.0.")}
        assert frozen and not any(p.requires_grad for n, p in strat.module.named_parameters() if n in frozen)
        for mb in mbs:
            strat.forward_backward(mb, _loss_fn(20.0), T)
        strat.release_gathered_weights()
        grads.append({n: _full(p.grad).clone() for n, p in strat.module.named_parameters() if p.grad is not None})
        strat.step()
        for n, p in strat.module.named_parameters():
            if n in frozen:
                assert torch.equal(_full(p), frozen[n]), n
    assert grads[0].keys() == grads[1].keys() and not any(k.startswith("model.layers.0.") for k in grads[0])
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-7, rtol=1e-5)


def test_a_padding_microbatch_backpropagates_a_zero_through_every_weight(dist, model_dir):
    """A rank whose samples all failed trains padding microbatches (no response token) so that its
    forwards match the other ranks'; their loss must still have a graph over every weight (backward
    runs, sharded gradient collectives match), and contribute exactly zero."""
    from streamrft.learner.microbatch import padding_microbatch

    strategy = FSDP2Strategy(*configs(model_dir), dist, total_steps=1)
    mb = padding_microbatch(["adv"])

    def loss_fn(mb, logp_BL, entropy_BL):
        return (logp_BL * mb["response_mask"]).sum() + (entropy_BL * mb["response_mask"]).sum(), {}

    out = strategy.forward_backward(mb, loss_fn, temperature=1.0, with_entropy=True)
    assert out["loss"] == 0.0
    strategy.release_gathered_weights()
    grads = [p.grad for p in strategy.module.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert all(float(g.full_tensor().abs().sum() if hasattr(g, "full_tensor") else g.abs().sum()) == 0.0 for g in grads)


def test_stats_on_device_are_the_float_stats_as_detached_tensors(dist, model_dir):
    """The actor reads a step's stats once (stats_on_device=True: no host sync per microbatch); they must be
    the numbers the float path returns, detached, and the gradients the same."""
    mbs = _microbatches()
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))

    def run(on_device: bool):
        torch.manual_seed(0)
        strat = FSDP2Strategy(*configs(model_dir), dist, total_steps=1)
        stats = [strat.forward_backward(mb, _loss_fn(n_tokens), T, stats_on_device=on_device) for mb in mbs]
        strat.release_gathered_weights()
        grads = {n: _full(p.grad).clone() for n, p in strat.module.named_parameters() if p.grad is not None}
        return stats, grads

    floats, grads_f = run(False)
    tensors, grads_t = run(True)
    assert all(isinstance(v, float) for s in floats for v in s.values())
    for f, t in zip(floats, tensors):
        assert f.keys() == t.keys()
        for k in f:
            assert isinstance(t[k], torch.Tensor) and t[k].dim() == 0 and not t[k].requires_grad
            assert float(t[k]) == f[k]
    assert grads_f.keys() == grads_t.keys() and all(torch.equal(grads_f[k], grads_t[k]) for k in grads_f)


def test_frozen_lora_base_is_stored_in_the_compute_dtype_and_trains_bitwise_like_a_float32_copy(dist, model_dir,
                                                                                               monkeypatch):
    """bf16 compute with LoRA: the frozen base is stored in bf16 (half the memory of a float32 copy), the adapters
    in float32; the loss, the adapters' gradients and their values after AdamW are bitwise those of a run that
    keeps the frozen base in float32 (the mixed-precision cast gives the forward the same bf16 values)."""
    import msgspec

    import streamrft.learner.fsdp2 as fsdp2

    mbs = _microbatches()
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))

    def run():
        mcfg, tcfg = configs(model_dir)
        mcfg = msgspec.structs.replace(mcfg, dtype="bfloat16", lora_rank=4, lora_alpha=8.0,
                                       lora_target_modules=["q_proj", "down_proj"])
        torch.manual_seed(0)
        strat = FSDP2Strategy(mcfg, tcfg, dist, total_steps=1)
        losses = [strat.forward_backward(mb, _loss_fn(n_tokens), T)["loss"] for mb in mbs]
        strat.release_gathered_weights()
        params = dict(strat.module.named_parameters())
        grads = {n: _full(p.grad).clone() for n, p in params.items() if p.grad is not None}
        strat.step()
        dtypes = {n: p.dtype for n, p in params.items()}
        adapters = {n: _full(p).detach().clone() for n, p in params.items() if p.requires_grad}
        return losses, grads, adapters, dtypes

    losses, grads, adapters, dtypes = run()
    assert adapters and all(".lora_" in n for n in adapters)
    assert {dtypes[n] for n in adapters} == {torch.float32}
    assert {d for n, d in dtypes.items() if n not in adapters} == {torch.bfloat16}
    monkeypatch.setattr(fsdp2, "store_frozen_in", lambda model, dtype: None)
    want_losses, want_grads, want_adapters, want_dtypes = run()
    assert {d for n, d in want_dtypes.items() if n not in adapters} == {torch.float32}
    assert losses == want_losses
    assert grads.keys() == want_grads.keys() == adapters.keys()
    assert all(torch.equal(grads[n], want_grads[n]) for n in grads)
    assert all(torch.equal(adapters[n], want_adapters[n]) for n in adapters)


def _step_counting_reduces(strat, mbs, n_tokens, defer: bool):
    """Microbatches then the optimizer step; the FSDP2 reduces they ran, the gradients and the new weights."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, mb in enumerate(mbs):
            strat.forward_backward(mb, _loss_fn(n_tokens), T, last_before_step=not defer or i == len(mbs) - 1)
    reduces = sum(1 for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce"))
    strat.release_gathered_weights()
    grads = {n: _full(p.grad).clone() for n, p in strat.module.named_parameters() if p.grad is not None}
    out = strat.step()
    weights = {k: _full(v).clone() for k, v in strat.module.state_dict().items()}
    return reduces, grads, out["grad_norm"], weights


@pytest.mark.parametrize("dtype, reshard", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", True)])
def test_one_rank_defers_the_gradient_reduce_to_the_last_microbatch_with_the_same_sums(dist, model_dir, dtype,
                                                                                       reshard):
    """last_before_step=False on one rank: FSDP2 keeps the gradients in its float32 accumulators and reduces
    once per unit (3 units: 2 layers and the root) instead of once per unit per microbatch; the gradients,
    grad norm and updated weights are the ones of reducing every microbatch (the same float32 additions in the
    same order, bf16 compute included)."""
    mcfg, tcfg = configs(model_dir, reshard_after_forward=reshard)  # auto: kept gathered on one rank
    mcfg = msgspec.structs.replace(mcfg, dtype=dtype)
    mbs = _microbatches()
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))
    results = {}
    for defer in (False, True):
        torch.manual_seed(0)
        results[defer] = _step_counting_reduces(FSDP2Strategy(mcfg, tcfg, dist, total_steps=10), mbs, n_tokens, defer)
    assert len(mbs) > 1 and results[False][0] == 3 * len(mbs) and results[True][0] == 3
    (_, grads_each, norm_each, weights_each), (_, grads_once, norm_once, weights_once) = results[False], results[True]
    assert grads_once.keys() == grads_each.keys() and len(grads_once) > 0
    for name in grads_each:
        torch.testing.assert_close(grads_once[name], grads_each[name], atol=0, rtol=0, msg=lambda m: name + m)
    assert norm_once == norm_each
    for name in weights_each:
        torch.testing.assert_close(weights_once[name], weights_each[name], atol=0, rtol=0, msg=lambda m: name + m)


def test_a_step_after_an_unreduced_microbatch_is_an_error_naming_the_rank(dist, model_dir):
    strat = FSDP2Strategy(*configs(model_dir), dist, total_steps=10)
    mb = _microbatches()[0]
    strat.forward_backward(mb, _loss_fn(10.0), T, last_before_step=False)
    with pytest.raises(RuntimeError, match=r"rank 0: the last forward_backward before the optimizer step passed "
                                           r"last_before_step=False"):
        strat.step()
    strat.forward_backward(mb, _loss_fn(10.0), T)  # the accumulation can still be completed
    assert strat.step()["grad_norm"] > 0


def test_fused_adamw_takes_the_same_steps_as_the_default_up_to_rounding(dist, model_dir):
    mbs = _microbatches()
    start, trained = None, {}
    for fused in (False, True):
        strat = FSDP2Strategy(*configs(model_dir, fused_adamw=fused, grad_clip=0.0), dist, total_steps=10)
        assert strat.optimizer.defaults["fused"] is (True if fused else None)
        start = start or {n: _full(p).detach().clone() for n, p in strat.module.named_parameters()}
        for _ in range(3):
            for mb in mbs:
                strat.forward_backward(mb, _loss_fn(10.0), T, last_before_step=mb is mbs[-1])
            strat.step()
        trained[fused] = {n: _full(p).detach().clone() for n, p in strat.module.named_parameters()}
    # the kernels round differently (a weight whose second moment is tiny amplifies it: 3e-6 seen on CI with one
    # thread); a wrong update (no bias correction, no weight decay on a norm weight of 1) is off by 1e-4 or more
    for name, want in trained[False].items():
        torch.testing.assert_close(trained[True][name], want, atol=2e-5, rtol=0)
    # the three steps moved the weights: the comparison is not of two untrained models
    assert max(float((trained[True][n] - start[n]).abs().max()) for n in start) > 1e-3


def test_head_chunk_tokens_sets_the_lm_heads_chunk_in_both_strategies_with_the_same_numbers(dist, model_dir,
                                                                                             monkeypatch):
    import streamrft.learner.logprobs as logprobs
    from streamrft.config.train import HeadSettings
    from streamrft.learner.deepspeed import _LogprobModel

    chunks = []
    real = logprobs.fused_logp_entropy

    def spy(*args):  # the real kernel, its chunk size written down
        chunks.append(args[6])
        return real(*args)

    monkeypatch.setattr(logprobs, "fused_logp_entropy", spy)
    mbs = _microbatches()
    grads, logps = {}, {}
    for chunk in ("auto", 3):
        strat = FSDP2Strategy(*configs(model_dir, head_chunk_tokens=chunk), dist, total_steps=10)
        chunks.clear()
        for mb in mbs:
            strat.forward_backward(mb, _loss_fn(10.0), T, last_before_step=mb is mbs[-1])
        logps[chunk] = strat.compute_logprobs(mbs[0], T)[0]
        assert chunks == [4096 if chunk == "auto" else 3] * (len(mbs) + 1)  # every microbatch, and the no-grad pass
        strat.release_gathered_weights()  # at world size 1 the sharded parameters hold .grad after this
        grads[chunk] = {n: _full(p.grad).clone() for n, p in strat.module.named_parameters()}
    # chunks of 3 tokens: the head's weight gradient is summed over more chunks, the same up to rounding
    torch.testing.assert_close(logps[3], logps["auto"], atol=1e-6, rtol=0)
    for name, want in grads["auto"].items():
        torch.testing.assert_close(grads[3][name], want, atol=1e-6, rtol=1e-5)
    # DeepSpeed's forward module takes the same setting (its engine wraps this module)
    chunks.clear()
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _LogprobModel(policy, HeadSettings(chunk_tokens=5))(mbs[0], T, False)
    assert chunks == [5]
