"""train.compile_head: the compiled chunked head gives the eager values and gradients (CUDA only; the CPU
always runs eagerly, so there is nothing to compare there), and a failed compile falls back, once, loudly."""

import pytest
import torch

from streamrft.learner.compiling import CompiledOrEager
from streamrft.learner.logprobs import logprobs_from_hidden



@pytest.mark.skipif(not torch.cuda.is_available(), reason="train.compile_head compiles on CUDA only")
def test_compiled_head_matches_eager_values_and_gradients():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    head = torch.nn.Linear(64, 3000, bias=False).to(dev)
    ids = torch.randint(0, 3000, (3, 40), device=dev)
    mask = torch.zeros(3, 40, device=dev)
    mask[:, 10:] = 1
    results = []
    for compile_head in (False, True):
        hidden = torch.randn(3, 40, 64, device=dev, generator=torch.Generator(dev).manual_seed(1), requires_grad=True)
        head.weight.grad = None
        logp, ent = logprobs_from_hidden(hidden, head, ids, mask, 0.7, True, chunk_size=37, compile_head=compile_head)
        (logp.sum() * 0.5 + ent.sum() * 0.2).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad, head.weight.grad.clone()))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=2e-4, rtol=2e-4)


def test_a_failed_compile_warns_once_and_computes_eagerly(monkeypatch):
    import torch._dynamo

    from streamrft.learner import logprobs

    calls = []

    def broken(*args):
        calls.append(1)
        raise torch._dynamo.exc.TorchDynamoException("backend compiler failed: no triton here")

    compiler = CompiledOrEager(logprobs._chunk_logp_entropy, "train.compile_head", "computing the LM-head log-probs")
    compiler.compiled = broken  # as if torch.compile had returned a function that fails to compile at its first call
    monkeypatch.setattr(logprobs, "_COMPILED_CHUNK", compiler)
    fn = logprobs._chunk_function(torch.device("cuda"), compile_head=True)  # a device object; no GPU needed
    h, w, t = torch.randn(5, 8), torch.randn(30, 8), torch.randint(0, 30, (5,))
    with pytest.warns(UserWarning, match="train.compile_head: torch.compile failed"):
        got = fn(h, w, None, t, 1.0, True)
    again = fn(h, w, None, t, 1.0, True)  # no second attempt, no second warning
    ref = logprobs._chunk_logp_entropy(h, w, None, t, 1.0, True)
    assert len(calls) == 1
    for a, b, c in zip(got, again, ref):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)
