"""train.head_kernel=fused: the analytic LM-head backward (streamrft/learner/fused_head.py) against plain
float64 autograd on the full logits, computed independently here (softmax over the allowed columns only,
instead of filling banned ids), and against the checkpoint kernel through a real learner step."""

import math

import pytest
import torch
import torch.nn.functional as F

from streamrft.learner import fused_head
from streamrft.learner.compiling import CompiledOrEager
from streamrft.learner.fused_head import fused_logp_entropy
from streamrft.learner.logprobs import logprobs_from_hidden

T = 0.7
N, H, V = 9, 12, 40
BANNED = [3, 17, 39]


def _inputs(dtype=torch.float32, bias=True, n=N, seed=0, banned_targets=False):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, H, generator=g) * 0.8).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_() if bias else None
    allowed = [v for v in range(V) if v not in BANNED]
    target = torch.tensor(allowed)[torch.randint(0, len(allowed), (n,), generator=g)]
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return h, w, b, target, g_logp, g_ent


def _reference(h, w, b, target, banned, with_entropy=True):
    """float64 log-probs / entropy from the full logits, the softmax taken over the allowed columns."""
    z = F.linear(h.double(), w.double(), None if b is None else b.double()) / T
    allowed = [v for v in range(V) if v not in (banned or [])]
    column = {v: i for i, v in enumerate(allowed)}
    logp_NA = torch.log_softmax(z[:, allowed], dim=-1)
    logp = logp_NA.gather(-1, torch.tensor([column[int(t)] for t in target]).unsqueeze(-1)).squeeze(-1)
    ent = -(logp_NA.exp() * logp_NA).sum(-1) if with_entropy else None
    return logp, ent


def _grads(params):
    return [None if p is None else p.grad for p in params]


def _run_fused(h, w, b, target, g_logp, g_ent, chunk, banned=BANNED, with_entropy=True):
    banned_t = torch.tensor(banned) if banned else None
    logp, ent = fused_logp_entropy(h, w, b, target, 1.0 / T, with_entropy, chunk, banned_t)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), _grads((h, w, b))


def _run_reference(h, w, b, target, g_logp, g_ent, banned=BANNED, with_entropy=True):
    logp, ent = _reference(h, w, b, target, banned, with_entropy)
    loss = (logp * g_logp.double()).sum() + ((ent * g_ent.double()).sum() if with_entropy else 0.0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), _grads((h, w, b))


def _fresh(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, N + 5])
@pytest.mark.parametrize("banned", [BANNED, None])
def test_values_and_gradients_match_float64_autograd(bias, chunk, banned):
    h, w, b, target, g_logp, g_ent = _inputs(bias=bias)
    got = _run_fused(h, w, b, target, g_logp, g_ent, chunk, banned)
    h2, w2, b2 = _fresh(h, w, b)
    want = _run_reference(h2, w2, b2, target, g_logp, g_ent, banned)
    # float32 against float64: logits ~ O(3), V = 40 terms; 1e-5 is ~100 float32 ulps of the largest value
    for name, x, y in zip(("logp", "entropy", "dh", "dW", "db"), got[:2] + tuple(got[2]), want[:2] + tuple(want[2])):
        if y is None:
            assert x is None, name
            continue
        torch.testing.assert_close(x.double(), y.double(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    assert got[2][0].abs().sum() > 0 and got[2][1].abs().sum() > 0
    if banned:  # a constant fill gets no gradient: the head's rows (and bias) of banned ids stay exactly 0
        assert torch.equal(got[2][1][banned], torch.zeros(len(banned), H))
        if bias:
            assert torch.equal(got[2][2][banned], torch.zeros(len(banned)))


def test_without_entropy_and_with_only_one_output_used():
    h, w, b, target, g_logp, g_ent = _inputs()
    logp, ent, grads = _run_fused(h, w, b, target, g_logp, g_ent, 4, with_entropy=False)
    assert ent is None
    h2, w2, b2 = _fresh(h, w, b)
    _, _, want = _run_reference(h2, w2, b2, target, g_logp, g_ent, with_entropy=False)
    for x, y in zip(grads, want):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-5, rtol=1e-5)
    # entropy requested but only the entropy feeds the loss: logp's gradient is None inside the Function
    h3, w3, b3 = _fresh(h, w, b)
    _, ent3 = fused_logp_entropy(h3, w3, b3, target, 1.0 / T, True, 4, torch.tensor(BANNED))
    (ent3 * g_ent).sum().backward()
    h4, w4, b4 = _fresh(h, w, b)
    _, want_ent = _reference(h4, w4, b4, target, BANNED)
    (want_ent * g_ent.double()).sum().backward()
    for x, y in zip((h3.grad, w3.grad, b3.grad), (h4.grad, w4.grad, b4.grad)):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-5, rtol=1e-5)


def test_no_rows_gives_empty_outputs_and_zero_gradients():
    h, w, b, target, *_ = _inputs(n=0)
    logp, ent = fused_logp_entropy(h, w, b, target, 1.0 / T, True, 8, torch.tensor(BANNED))
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()  # the gradients below come from the Function alone
    assert h.grad.shape == (0, H) and torch.equal(w.grad, torch.zeros(V, H)) and torch.equal(b.grad, torch.zeros(V))


def test_a_banned_target_is_minus_huge_and_sends_no_gradient_to_banned_rows():
    h, w, b, target, g_logp, g_ent = _inputs()
    target = target.clone()
    target[2] = BANNED[1]
    logp, ent = fused_logp_entropy(h, w, b, target, 1.0 / T, True, 4, torch.tensor(BANNED))
    (logp[torch.arange(N) != 2] * g_logp[torch.arange(N) != 2]).sum().backward(retain_graph=True)
    assert logp[2] < -1e30  # the fill value minus the row's logsumexp, as the checkpoint kernel gives
    w.grad = None
    (logp * g_logp + ent * g_ent).sum().backward()
    assert torch.equal(w.grad[BANNED], torch.zeros(len(BANNED), H)) and torch.isfinite(w.grad).all()
    assert torch.isfinite(h.grad).all()


class _TiedLM(torch.nn.Module):
    """An embedding and a bias-free head that share one weight (tie_word_embeddings)."""

    def __init__(self, w):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.embed.weight = torch.nn.Parameter(w.detach().clone())
        self.head = torch.nn.Linear(H, V, bias=False)
        self.head.weight = self.embed.weight

    def hidden(self, ids):
        return torch.tanh(self.embed(ids))


def test_tied_embeddings_accumulate_head_and_embedding_gradients():
    _, w, _, target, g_logp, g_ent = _inputs(bias=False)
    ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(5))
    fused, ref = _TiedLM(w), _TiedLM(w)
    logp, ent = fused_logp_entropy(fused.hidden(ids), fused.head.weight, None, target, 1.0 / T, True, 2,
                                   torch.tensor(BANNED))
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    want_logp, want_ent = _reference(ref.hidden(ids), ref.head.weight, None, target, BANNED)
    ((want_logp * g_logp.double()).sum() + (want_ent * g_ent.double()).sum()).backward()
    torch.testing.assert_close(fused.embed.weight.grad, ref.embed.weight.grad, atol=1e-5, rtol=1e-5)
    # the embedding's own share is in there: the rows of the looked-up ids differ from the head-only grad
    head_only = _TiedLM(w)
    lp, en = fused_logp_entropy(head_only.hidden(ids).detach(), head_only.head.weight, None, target, 1.0 / T, True,
                                2, torch.tensor(BANNED))
    ((lp * g_logp).sum() + (en * g_ent).sum()).backward()
    assert not torch.allclose(head_only.embed.weight.grad[ids], fused.embed.weight.grad[ids], atol=1e-4)


def _both_kernels(h, w, b, target, g_logp, g_ent, banned):
    """``logprobs_from_hidden`` with the fused and with the checkpoint kernel on one sequence whose row t-1 is h's
    row predicting target t (position 0 predicts nothing: one extra zero row), in h's dtype, backward of
    g_logp . logp + g_ent . H: {kernel: (logp, entropy, dhidden, dW, db)}."""
    ids = torch.zeros(1, N + 1, dtype=torch.long)
    ids[0, 1:] = target
    mask = torch.ones(1, N + 1)
    hidden = torch.cat([h.detach(), torch.zeros(1, H, dtype=h.dtype)]).unsqueeze(0).requires_grad_()
    head = torch.nn.Linear(H, V).to(h.dtype)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    out = {}
    for kernel in ("fused", "checkpoint"):
        hidden.grad, head.weight.grad, head.bias.grad = None, None, None
        lp, en = logprobs_from_hidden(hidden, head, ids, mask, T, True, chunk_size=4, banned_ids=banned,
                                      head_kernel=kernel)
        (lp[0, 1:] * g_logp + en[0, 1:] * g_ent).sum().backward()
        out[kernel] = (lp.detach(), en.detach(), hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    return out


def test_bf16_matches_float64_within_bf16_rounding_and_the_checkpoint_kernel_closely():
    h, w, b, target, g_logp, g_ent = _inputs(dtype=torch.bfloat16)
    logp, ent, grads = _run_fused(h, w, b, target, g_logp, g_ent, 4)
    h2, w2, b2 = _fresh(h, w, b)  # the same bf16 values, so only the computation's rounding differs
    want_logp, want_ent, want = _run_reference(h2, w2, b2, target, g_logp, g_ent)
    # the head's output z is rounded to bf16 before the float32 softmax: 8 significant bits, a relative
    # error <= u = 2^-8 per logit. logp = z_y - lse moves by <= 2 u max|z|; H moves by
    # |sum_v p_v (log p_v + H) dz_v| <= 2 H u max|z| (sum_v p_v |log p_v + H| <= 2 H)
    u = 2.0 ** -8
    zmax = float((F.linear(h2.detach().double(), w2.detach().double(), b2.detach().double()) / T).abs().max())
    torch.testing.assert_close(logp.double(), want_logp, atol=2 * u * zmax, rtol=0)
    torch.testing.assert_close(ent.double(), want_ent, atol=2 * u * zmax * float(want_ent.max()), rtol=0)
    # gradients come out in bf16 (dz is rounded to bf16 before the matmuls, as autograd's cast does):
    # within 2 bf16 ulps (2^-6 relative) of the largest reference element
    for x, y in zip(grads, want):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x.double(), y.double(), atol=2.0 ** -6 * float(y.abs().max()), rtol=0)
    # against the checkpoint kernel in bf16 (the same bf16 head output): float32 rounding apart from the
    # values, one bf16 rounding of dz apart in the gradients
    out = _both_kernels(h, w, b, target, g_logp, g_ent, BANNED)
    for x, y in zip(out["fused"], out["checkpoint"]):
        torch.testing.assert_close(x.float(), y.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out["fused"][0], out["checkpoint"][0], atol=1e-5, rtol=0)


def test_logprobs_from_hidden_fused_equals_checkpoint_with_packed_positions():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 11, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    ids = torch.randint(0, V, (2, 11), generator=g)
    mask = (torch.rand(2, 11, generator=g) > 0.3).float()
    pos = torch.tensor([list(range(6)) + list(range(5)), list(range(11))])
    out = {}
    for kernel in ("fused", "checkpoint"):
        hidden.grad, head.weight.grad = None, None
        lp, en = logprobs_from_hidden(hidden, head, ids, mask, T, True, chunk_size=3, position_ids_BL=pos,
                                      head_kernel=kernel)
        (lp * mask * 0.3 + en * 0.1).sum().backward()
        out[kernel] = (lp.detach(), en.detach(), hidden.grad.clone(), head.weight.grad.clone())
    assert out["fused"][0][0, 6] == 0  # a packed sequence start has no prediction
    for x, y in zip(out["fused"], out["checkpoint"]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"train.head_kernel='fast' must be one of: fused, checkpoint"):
        logprobs_from_hidden(hidden, head, ids, mask, T, True, head_kernel="fast")


@pytest.mark.parametrize("g_scale", [0.2, 4.0])
@pytest.mark.parametrize("banned", [BANNED, None], ids=["banned", "no_banned"])
def test_checkpoint_kernel_equals_fused_and_float64_with_large_entropy_gradients(banned, g_scale):
    """At a banned id p = 0 and log p = -3.4e38: autograd through -(exp(log p) * log p) multiplied g_H by
    log p, inf for |g_H| > 1, then by p = 0: nan in every gradient of the row (log-softmax's backward sums
    it). The checkpoint kernel's values and gradients must equal the fused kernel's (and float64's) for any g_H."""
    h, w, b, target, g_logp, g_ent = _inputs()
    out = _both_kernels(h, w, b, target, g_logp, g_ent * g_scale, banned)
    assert all(torch.isfinite(x).all() for x in out["checkpoint"]), "nan/inf in the checkpoint kernel's outputs"
    for name, x, y in zip(("logp", "entropy", "dh", "dW", "db"), out["fused"], out["checkpoint"]):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    h2, w2, b2 = _fresh(h, w, b)
    want = _run_reference(h2, w2, b2, target, g_logp, g_ent * g_scale, banned)
    lp, en, dh, dw, db = out["checkpoint"]
    got = (lp[0, 1:], en[0, 1:], dh[0, :N], dw, db)  # the rows of h (the sequence's position 0 predicts nothing)
    for name, x, y in zip(("logp", "entropy", "dh", "dW", "db"), got, want[:2] + tuple(want[2])):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-5 * max(1.0, g_scale), rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    if banned:  # the banned rows of the head get exactly no gradient
        assert torch.equal(out["checkpoint"][3][banned], torch.zeros(len(banned), H))


def test_a_failed_compile_warns_once_and_runs_eagerly(monkeypatch):
    import torch._dynamo

    calls = []

    def broken(*args):
        calls.append(1)
        raise torch._dynamo.exc.TorchDynamoException("backend compiler failed: no triton here")

    compilers = {name: CompiledOrEager(fn, "train.compile_head", "computing the fused LM head's elementwise part")
                 for name, fn in (("stats", fused_head.chunk_stats), ("grad", fused_head.chunk_grad_logits))}
    for c in compilers.values():
        c.compiled = broken  # as if torch.compile had returned a function that fails to compile at its first call
    monkeypatch.setattr(fused_head, "_ELEMENTWISE", compilers)
    fn = fused_head._elementwise("stats", torch.device("cuda"), compile_head=True)  # a device object; no GPU needed
    h, w, t = torch.randn(5, 8), torch.randn(30, 8), torch.randint(0, 30, (5,))
    with pytest.warns(UserWarning, match="train.compile_head: torch.compile failed"):
        got = fn(h, w, None, t, 1.0, None, True)
    again = fn(h, w, None, t, 1.0, None, True)
    assert fused_head._elementwise("grad", torch.device("cuda"), True) is fused_head.chunk_grad_logits
    ref = fused_head.chunk_stats(h, w, None, t, 1.0, None, True)
    assert len(calls) == 1
    for a, b, c in zip(got, again, ref):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_config_refuses_an_unknown_head_kernel_before_any_model_loads():
    from streamrft.config import ConfigError, load_config
    from streamrft.config.validate import validate_train

    with pytest.raises(ConfigError, match=r"Invalid enum value 'fast' - at `train.head_kernel`"):
        load_config(None, ["train.head_kernel=fast"])
    cfg = load_config(None, ["train.head_kernel=checkpoint"])
    assert cfg.train.head_kernel == "checkpoint"
    cfg.train.head_kernel = "fast"  # a config built in code skips msgspec's type check
    with pytest.raises(ConfigError, match=r"train.head_kernel='fast' must be one of: fused, checkpoint"):
        validate_train(cfg)


def test_one_learner_step_fused_equals_checkpoint(dist, tmp_path):
    """FSDP2 (world size 1) on the tiny tied-embedding Qwen2: the same loss and grad norm (float32) with
    train.head_kernel=fused as with checkpoint, and the updated weights agree."""
    from streamrft.learner.fsdp2 import FSDP2Strategy
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
    from tests.unit.test_learner_fsdp2 import _loss_fn, _microbatches, configs

    tok = build_char_tokenizer(str(tmp_path), "0123456789+-=abcdefghijklmnopq")
    model_dir = build_tiny_qwen2(str(tmp_path), tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=64, max_position_embeddings=64)
    mbs = _microbatches()
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))

    def loss_fn(mb, logp_BL, entropy_BL):  # the policy term plus an entropy bonus: both gradients used
        loss, stats = _loss_fn(n_tokens)(mb, logp_BL, entropy_BL)
        return loss - 0.01 * (entropy_BL * mb["response_mask"]).sum() / n_tokens, stats

    results = {}
    for kernel in ("checkpoint", "fused"):
        strat = FSDP2Strategy(*configs(model_dir, head_kernel=kernel), dist, total_steps=1)
        assert strat.module.config.tie_word_embeddings
        loss = sum(strat.forward_backward(mb, loss_fn, 0.9, with_entropy=True)["loss"] for mb in mbs)
        out = strat.step()
        sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
              for k, v in strat.module.state_dict().items()}
        results[kernel] = (loss, out["grad_norm"], sd)
    (l_c, n_c, sd_c), (l_f, n_f, sd_f) = results["checkpoint"], results["fused"]
    assert math.isfinite(l_f) and n_f > 0
    assert l_f == pytest.approx(l_c, abs=1e-5, rel=1e-5)
    assert n_f == pytest.approx(n_c, rel=1e-5)
    for k in sd_c:
        torch.testing.assert_close(sd_f[k], sd_c[k], atol=1e-5, rtol=0, msg=lambda m: k + m)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_compiled_elementwise_part_equals_eager(device):
    """train.compile_head: the compiled spelling of dZ (pointwise, one-hot as column == target) and the
    compiled statistics give the eager values. On CUDA through the Function (values and gradients, run by
    hand on a GPU machine); on CPU through inductor's C++ backend, opt-in (STREAMRFT_CPU_INDUCTOR=1: about
    a minute of compiling)."""
    import os

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("train.compile_head compiles on CUDA only")
    if device == "cpu" and os.environ.get("STREAMRFT_CPU_INDUCTOR") != "1":
        pytest.skip("set STREAMRFT_CPU_INDUCTOR=1 to compile with inductor on the CPU")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(11)
    n, hid, vocab = 300, 64, 3000
    h = torch.randn(n, hid, generator=g).to(dev)
    w = (torch.randn(vocab, hid, generator=g) * 0.2).to(dev)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dev)
    target = torch.randint(0, vocab, (n,), generator=g).to(dev)
    target[5] = 7  # a banned target
    g_logp, g_ent = torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)
    banned = torch.tensor([7, 100, 2999], device=dev)
    if device == "cuda":
        results = []
        for compile_head in (False, True):
            hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
            logp, ent = fused_logp_entropy(hh, ww, bb, target, 1 / T, True, 128, banned, compile_head)
            (logp[torch.arange(n, device=dev) != 5] * g_logp[torch.arange(n, device=dev) != 5]).sum().backward(
                retain_graph=True)
            (ent * g_ent).sum().backward()
            results.append((logp.detach(), ent.detach(), hh.grad, ww.grad, bb.grad))
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager, atol=2e-4, rtol=2e-4)
        return
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[banned] = True
    stats = torch.compile(fused_head.chunk_stats, dynamic=True)
    grad = torch.compile(fused_head.chunk_grad_logits, dynamic=True)
    for rows in (slice(0, 128), slice(128, 300)):  # two shapes: the dynamic-shape graph is reused
        args = (h[rows], w, b, target[rows], 1 / T, mask)
        got, want = stats(*args, True), fused_head.chunk_stats(*args, True)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        _, lse, ent = want
        gargs = (h[rows], w, b, target[rows], lse, ent, g_logp[rows], g_ent[rows], 1 / T, mask)
        torch.testing.assert_close(grad(*gargs), fused_head.chunk_grad_logits(*gargs), atol=1e-6, rtol=1e-5)
        gargs = (h[rows], w, None, target[rows], lse, None, g_logp[rows], None, 1 / T, None)
        torch.testing.assert_close(grad(*gargs), fused_head.chunk_grad_logits(*gargs), atol=1e-6, rtol=1e-5)
