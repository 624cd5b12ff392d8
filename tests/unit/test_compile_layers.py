"""train.compile_layers (streamrft/learner/compiling.py): the FSDP2 learner with its decoder layers compiled by
Inductor (its C++ backend here) gives the eager learner's loss, grad norm and updated weights; one graph
serves every layer and every microbatch length; generation with a KV cache stays eager; a failed compile
falls back once, loudly; gradient checkpointing, LoRA, packing and a vision-language model compose with it;
DeepSpeed refuses the key.

Compiling costs tens of seconds on a shared 2-core machine, so one compiled learner (module fixture) serves
the equality, graph-count and generation checks.
"""

import math

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from streamrft.config import load_config, validate_config
from streamrft.config.base import ConfigError
from streamrft.config.model import ModelConfig
from streamrft.config.train import TrainConfig
from streamrft.learner import compiling
from streamrft.learner.fsdp2 import FSDP2Strategy, decoder_layers
from streamrft.learner.microbatch import SequenceSample, make_microbatches

T = 0.9


@pytest.fixture(scope="module", autouse=True)
def one_compile_thread():
    """Inductor compiles its C++ kernels in a pool of worker processes as wide as the machine; on the 2 cores
    of CI, starting that pool costs more than it saves (measured 107 s -> 65 s for the fixture's compile)."""
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        yield


def _strategy(dist, model_dir, compile_layers, **model):
    torch.manual_seed(0)  # LoRA's A matrices are drawn at random: the same draw for the eager and the compiled one
    mcfg = ModelConfig(path=model_dir, dtype="float32", attn_implementation="sdpa", **model)
    # compile_head off: on a GPU the LM head's kernels are compiled too (train.compile_head, CUDA only) and would
    # add their graphs to the layer graph this file counts
    tcfg = TrainConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.05, compile_layers=compile_layers, compile_head=False)
    return FSDP2Strategy(mcfg, tcfg, dist, total_steps=10)


def _microbatches():
    """Three microbatches of two rows each, 9, 7 and 12 tokens long (a dimension first seen as 1 would be
    specialised by PyTorch, see learner/compiling.py)."""
    return make_microbatches(_samples(3, [(3, 4), (2, 5), (6, 3), (4, 8), (5, 6), (2, 3)]), token_budget=24)


def _samples(seed, lengths):
    """(prompt, response) lengths -> samples with random tokens and advantages."""
    g = torch.Generator().manual_seed(seed)
    return [SequenceSample(torch.randint(3, 30, (p,), generator=g).tolist(),
                           torch.randint(3, 30, (r,), generator=g).tolist(),
                           {"adv": torch.randn(r, generator=g)}) for p, r in lengths]


def _loss_fn(n_tokens):
    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / n_tokens, {}
    return loss_fn


def _train_step(strat, mbs):
    n_tokens = float(sum(mb["response_mask"].sum() for mb in mbs))
    losses = [strat.forward_backward(mb, _loss_fn(n_tokens), T)["loss"] for mb in mbs]
    out = strat.step()
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
               for k, v in strat.module.state_dict().items()}
    return losses, out["grad_norm"], weights


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def eager_step(dist, model_dir):
    return _train_step(_strategy(dist, model_dir, False), _microbatches())


@pytest.fixture(scope="module")
def compiled(dist, model_dir):
    """(strategy, its step's results, graphs compiled by that step, AOTAutograd compiles it ran)."""
    strat = _strategy(dist, model_dir, True)
    before, aot_before = _graphs(), counters["aot_autograd"]["total"]
    result = _train_step(strat, _microbatches())
    return strat, result, _graphs() - before, counters["aot_autograd"]["total"] - aot_before


def _assert_same_step(got, want):
    """Float32 on CPU: Inductor fuses RMSNorm / rotary / SiLU and reorders their float32 sums, a ~1e-7
    relative change per op; through two layers and the head that stays below 1e-5 of the loss and grad
    norm. The weights: AdamW's first step is lr * g / (|g| + eps), so an element whose |g| is near eps
    turns 1e-7 of gradient noise into up to lr = 1e-2 of update; 1e-5 absolute is 1e-3 of the step size
    (test_learner_fsdp2 compares the eager learner to plain HF at the same tolerance)."""
    losses, norm, weights = got
    want_losses, want_norm, want_weights = want
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-7)
    assert norm == pytest.approx(want_norm, rel=1e-5)
    assert set(weights) == set(want_weights)
    for k, v in weights.items():
        torch.testing.assert_close(v, want_weights[k], atol=1e-5, rtol=0, msg=lambda m: k + m)


def test_compiled_layers_give_the_eager_step_with_one_graph_for_every_layer_and_length(compiled, eager_step):
    strat, result, graphs, aot_compiles = compiled
    mbs = _microbatches()
    shapes = [tuple(mb["input_ids"].shape) for mb in mbs]
    assert shapes == [(2, 9), (2, 7), (2, 12)]  # lengths differ
    assert all(compiling.is_compiled_layer(layer) for layer in decoder_layers(strat.module))
    # one forward graph (its backward is compiled with it, not counted): not one per layer, not one per length;
    # 0 would mean the flag compiled nothing
    assert graphs == 1
    # traced once: with floats symbolic, Dynamo would trace the layer, fail to turn its SDPA scale and dropout
    # into tensors, and trace it all again (two AOT compiles for one graph; learner/compiling.py _CompileScope)
    assert aot_compiles == 1
    assert torch._dynamo.config.specialize_float is False  # torch's default, set only while the layer compiled
    assert not compiling.layer_compiler(False).failed
    losses, norm, _ = result
    assert all(math.isfinite(x) and x != 0 for x in losses) and norm > 0.05  # the clip is exercised
    _assert_same_step(result, eager_step)


def test_generation_with_a_kv_cache_runs_the_layers_eagerly(compiled, model_dir):
    strat, _, _, _ = compiled
    ids = torch.tensor([[5, 9, 11, 4, 7]])
    before = _graphs()
    strat.unshard_for_rollout()
    try:
        with torch.no_grad():
            got = strat.module(input_ids=ids, use_cache=True).logits  # a DynamicCache: the hf engine's prefill
    finally:
        strat.reshard_after_rollout()
    assert _graphs() == before, "a forward with a KV cache was compiled"
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain.load_state_dict(compiled[1][2])  # the compiled learner's updated weights
    with torch.no_grad():
        torch.testing.assert_close(got.cpu(), plain(input_ids=ids).logits, atol=1e-5, rtol=0)


def _aot_eager_layers(monkeypatch) -> compiling.CompiledOrEager:
    """A layer compiler with the aot_eager backend, on an emptied Dynamo cache: Dynamo keys its cache by code object
    (the one ``_layer_forward``) and guards classes by id, so an entry left by an earlier compile in this process
    could serve these calls (CI's single process once counted no new graph here)."""
    return _layers_compiled_with(monkeypatch, "aot_eager")


def _layers_compiled_with(monkeypatch, backend) -> compiling.CompiledOrEager:
    torch._dynamo.reset()
    compiler = compiling.new_layer_compiler(backend=backend)
    monkeypatch.setitem(compiling._LAYER_COMPILERS, (False, 1.0), compiler)
    return compiler


def test_only_rows_and_tokens_are_symbolic_in_the_layer_graph(monkeypatch, model_dir):
    """The graph's inputs have symbolic rows and tokens and constant features (hidden size, head dimension):
    symbolic features (torch.compile's dynamic=True) made most of a compile sympy work. Microbatches of other
    rows and lengths, one whose token count equals the hidden size among them, reuse the one graph."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append([n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    _layers_compiled_with(monkeypatch, record)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = decoder_layers(model)
    compiling.compile_decoder_layers(layers)
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    for rows, tokens in ((2, 7), (3, 5), (2, hidden), (4, 9)):
        x = torch.randn(rows, tokens, hidden, generator=g)
        position_ids = torch.arange(tokens).expand(rows, tokens)
        rope = model.model.rotary_emb(x, position_ids)
        kwargs = dict(position_embeddings=rope, position_ids=position_ids, use_cache=False)
        got, want = layers[1](x, **kwargs), compiling._layer_forward(layers[1], x, **kwargs)
        torch.testing.assert_close(got, want)
    assert len(graphs) == 1, f"{len(graphs)} graphs"
    symbolic = {str(d) for value in graphs[0] if isinstance(value, torch.Tensor)
                for d in value.shape if isinstance(d, torch.SymInt)}
    assert len(symbolic) == 2, symbolic  # rows and tokens, nothing else
    # the hidden states (rows, tokens, hidden) and rotary tables (rows, tokens, head dim); parameters are 1-D, 2-D
    three_d = [v for v in graphs[0] if isinstance(v, torch.Tensor) and v.dim() == 3]
    assert len(three_d) == 3 and {v.shape[2] for v in three_d} == {hidden, hidden // model.config.num_attention_heads}
    assert all([isinstance(d, torch.SymInt) for d in v.shape] == [True, True, False] for v in three_d)


@pytest.mark.slow
def test_gradient_checkpointing_lora_and_packed_masks_compose_with_compiled_layers(monkeypatch, dist, model_dir):
    """HF's checkpoint wrapper inside the compiled forward (Dynamo traces torch.utils.checkpoint, AOTAutograd
    recomputes in the compiled backward under FSDP2's eager hooks), peft's LoRA linears and packed rows'
    4-D block-diagonal masks: the compiled step equals the eager one. Compiled with the aot_eager backend
    (Dynamo + AOTAutograd, eager kernels): what these settings change is the traced graph, and Inductor's
    C++ kernels for such a graph are covered by the fixture's test; a second Inductor compile would cost
    another minute of CI."""
    from streamrft.learner.packing import make_packed_microbatches

    compiler = _aot_eager_layers(monkeypatch)
    mbs = make_packed_microbatches(_samples(5, [(3, 4), (2, 5), (6, 3), (4, 8), (5, 6)]), token_budget=20)
    assert [tuple(mb["attention_mask"].shape) for mb in mbs] == [(1, 1, 16, 16), (1, 1, 18, 18), (1, 1, 12, 12)]
    assert [len(mb["sample_index"]) for mb in mbs] == [2, 2, 1]  # block-diagonal: two samples in a row
    model = dict(gradient_checkpointing=True, lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "gate_proj"])
    want = _train_step(_strategy(dist, model_dir, False, **model), mbs)
    before = _graphs()
    strat = _strategy(dist, model_dir, True, **model)
    got = _train_step(strat, mbs)
    assert _graphs() - before == 1 and not compiler.failed
    assert any(".lora_B." in k and not torch.equal(v, torch.zeros_like(v)) for k, v in got[2].items())
    _assert_same_step(got, want)


def test_a_view_and_a_detached_tensor_as_hidden_states_share_one_graph(monkeypatch, model_dir):
    """Gradient checkpointing around the layer's __call__ (transformers 5.17) calls the compiled layer with the
    model's hidden states (here a view) and again in the backward with a detached tensor (not a view): Dynamo
    guards a view's base, so without compiling._dispatch's copy the second call compiled a second graph."""
    compiler = _aot_eager_layers(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = decoder_layers(model)
    compiling.compile_decoder_layers(layers)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 7 * model.config.hidden_size, generator=g, requires_grad=True)
    view = base.view(2, 7, model.config.hidden_size)
    assert view._base is base
    position_ids = torch.arange(7).expand(2, 7)
    rope = model.model.rotary_emb(view, position_ids)
    before = _graphs()
    out_view = layers[0](view, position_embeddings=rope, position_ids=position_ids, use_cache=False)
    detached = view.detach().requires_grad_(True)
    out_detached = layers[0](detached, position_embeddings=rope, position_ids=position_ids, use_cache=False)
    assert _graphs() - before == 1 and not compiler.failed
    first = out_view[0] if isinstance(out_view, tuple) else out_view
    second = out_detached[0] if isinstance(out_detached, tuple) else out_detached
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    first.sum().backward()
    assert base.grad is not None and base.grad.abs().sum() > 0  # the copy keeps the gradient path to the base


@pytest.mark.slow
def test_a_vision_language_model_compiles_only_its_language_layers(monkeypatch, dist, tmp_path):
    """Qwen2-VL: the language decoder layers take the M-RoPE cos/sin as inputs and run compiled (aot_eager, as
    above), the vision blocks stay eager FSDP units; the gradients of a media microbatch equal the eager ones."""
    from tests.unit.test_vl_fsdp_units import _media_microbatch
    from streamrft.learner.fsdp2 import media_encoder_units
    from streamrft.models.vl import build_tiny_qwen2_vl

    compiler = _aot_eager_layers(monkeypatch)
    path = build_tiny_qwen2_vl(str(tmp_path), "0123456789abc ", num_layers=2, vision_depth=2)
    mb = _media_microbatch(path)
    grads, losses = [], []
    for compile_layers in (False, True):
        torch.manual_seed(0)
        tcfg = TrainConfig(lr=1e-2, compile_layers=compile_layers, compile_head=False)  # graphs: layers only
        strat = FSDP2Strategy(ModelConfig(path=path), tcfg, dist, 2)
        before = _graphs()
        losses.append(strat.forward_backward(mb, lambda mb, lp, ent: (-(lp * mb["adv"]).sum(), {}), 1.0)["loss"])
        strat.release_gathered_weights()
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                      for n, p in strat.module.named_parameters() if p.grad is not None})
    assert [compiling.is_compiled_layer(m) for m in decoder_layers(strat.module)] == [True, True]
    assert not any(compiling.is_compiled_layer(m) for m in media_encoder_units(strat.module))
    assert _graphs() - before == 1 and not compiler.failed
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert set(grads[1]) == set(grads[0]) and any(n.startswith("model.visual.") for n in grads[0])
    for n, g in grads[1].items():
        torch.testing.assert_close(g, grads[0][n], atol=1e-6, rtol=1e-5, msg=lambda m: n + m)


def test_a_failed_layer_compile_warns_once_and_runs_eagerly(monkeypatch, model_dir):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise torch._dynamo.exc.BackendCompilerFailed(broken, RuntimeError("no C++ compiler here"), None)

    compiler = compiling.CompiledOrEager(compiling._layer_forward, "train.compile_layers", "running the decoder layers")
    compiler.compiled = broken
    monkeypatch.setitem(compiling._LAYER_COMPILERS, (False, 1.0), compiler)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 11, 4, 7], [3, 3, 8, 20, 1]])
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits  # no KV cache: the compiled path is taken
        compiling.compile_decoder_layers(decoder_layers(model))
        with pytest.warns(UserWarning, match=r"train.compile_layers: torch.compile failed \(BackendCompilerFailed"):
            got = model(input_ids=ids, use_cache=False).logits
        again = model(input_ids=ids, use_cache=False).logits  # no second attempt, no second warning
    assert len(calls) == 1 and compiler.failed
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(again, want, atol=0, rtol=0)


def test_a_backward_that_fails_to_compile_falls_back_at_the_forward_not_inside_backward(monkeypatch, model_dir):
    """AOTAutograd may put off compiling a graph's backward (and only log its failure) until loss.backward(),
    which runs outside the fallback; the compiles our calls start compile it with the forward, so the failure
    is the forward call's, which warns and runs eagerly: the same loss and gradients as an eager model."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fails(gm, example_inputs):
        raise RuntimeError("this backward cannot be compiled here")

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=fails)
    torch._dynamo.reset()
    compiler = compiling.CompiledOrEager(compiling._layer_forward, "train.compile_layers", "running the decoder layers",
                                         specialize_floats=True, dynamic=True, backend=backend)
    monkeypatch.setitem(compiling._LAYER_COMPILERS, (False, 1.0), compiler)
    ids = torch.tensor([[5, 9, 11, 4, 7], [3, 3, 8, 20, 1]])
    eager, compiled = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for _ in range(2))
    compiling.compile_decoder_layers(decoder_layers(compiled))
    eager(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    with pytest.warns(UserWarning, match="train.compile_layers: torch.compile failed"):
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()  # eager graph: nothing left to compile
    assert compiler.failed
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=lambda m: name + m)


def test_the_layer_graph_compiles_without_inductors_size_checked_norm_fusion():
    """A run's short last microbatch recompiled the layer graph on the GPU (benchmarks/NOTES.md v24): Inductor's
    strict check for fusing a norm's backward became a guard on rows x tokens. The layer compiler turns the
    check off where this torch has it, with the run's other options kept, and the options are real Inductor
    settings (config.patch refuses an unknown key)."""
    import torch._inductor.config as inductor_config

    has_mode = hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode")
    for deterministic in (False, True):
        options = compiling.layer_compiler(deterministic).compile_kwargs["options"]
        assert options.get("triton.mix_order_reduction_non_strict_mode") is (True if has_mode else None)
        assert options.get("deterministic") is (True if deterministic else None)
        with inductor_config.patch(options):
            assert inductor_config.triton.mix_order_reduction_non_strict_mode is True or not has_mode
    assert not inductor_config.triton.mix_order_reduction_non_strict_mode or not has_mode  # only while compiling


def test_compile_seconds_add_each_compiles_wall_time_and_nothing_for_a_cached_call():
    """The driver logs each step's compile_seconds from these totals (streamrft/runtime/driver.py)."""
    import time

    def slow_backend(gm, example_inputs):
        time.sleep(0.3)
        return gm.forward

    double = compiling.CompiledOrEager(lambda x: x * 2 + 1, "test.compile", "doubling", backend=slow_backend)
    compiles, seconds = compiling.compiles_finished(), compiling.compile_seconds()
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 3.0))
    assert compiling.compiles_finished() == compiles + 1
    took = compiling.compile_seconds() - seconds
    assert 0.3 <= took < 30
    key, each = compiling.compile_log()[-1]
    assert key == "test.compile" and each == pytest.approx(took)  # named by its compiler's key
    assert torch.equal(double(torch.zeros(3)), torch.ones(3))  # the same shape: the cached graph
    assert compiling.compiles_finished() == compiles + 1 and compiling.compile_seconds() - seconds == took
    assert len(compiling.compile_log()) == compiles + 1


def test_auto_compiles_the_layers_for_fsdp2_on_a_gpu_only(tmp_path):
    """The default (auto) is on where the H200 measured it (fsdp2 on CUDA: benchmarks/NOTES.md v7) and off on CPU
    and for DeepSpeed; true and false are what they say; a deepspeed config with the default is valid."""
    from streamrft.config.train import compile_layers_enabled

    auto = TrainConfig()
    assert auto.compile_layers == "auto"
    assert compile_layers_enabled(auto, "cuda") and not compile_layers_enabled(auto, "cpu")
    assert not compile_layers_enabled(TrainConfig(strategy="deepspeed"), "cuda")
    assert compile_layers_enabled(TrainConfig(compile_layers=True), "cpu")
    assert not compile_layers_enabled(TrainConfig(compile_layers=False), "cuda")
    (tmp_path / "c.yaml").write_text("reward:\n  sources:\n    - {name: c, type: rule, fn: gsm8k}\n")
    validate_config(load_config(tmp_path / "c.yaml", ["train.strategy=deepspeed"]), 1, check_paths=False)
    for value, want in (("true", True), ("false", False), ("auto", "auto")):
        assert load_config(tmp_path / "c.yaml", [f"train.compile_layers={value}"]).train.compile_layers == want
    with pytest.raises(ConfigError, match="compile_layers"):
        load_config(tmp_path / "c.yaml", ["train.compile_layers=sometimes"])


def _saved_bytes_and_grads(layer, x, **kwargs):
    """Bytes the layer's forward saves for backward (every tensor autograd keeps, counted as it is saved),
    the output, and the input's and parameters' gradients."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = layer(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    (out * out).sum().backward()
    return sum(saved), out.detach(), [x.grad] + [p.grad.clone() for p in layer.parameters()]


def test_an_activation_memory_budget_saves_fewer_activations_and_gives_the_same_gradients(monkeypatch, model_dir):
    """train.activation_memory_budget: the layer graph compiled at budget 0 saves less for backward than at 1
    (the partitioner recomputes in backward what it no longer keeps), with the same output and gradients.
    AOTAutograd's own partitioner with eager kernels (aot_eager_decomp_partition): the budget is a
    partitioner setting, the same one Inductor's compile uses."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layer = decoder_layers(model)[0]
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 9, model.config.hidden_size, generator=g)
    position_ids = torch.arange(9).expand(2, 9)
    rope = model.model.rotary_emb(x0, position_ids)
    kwargs = dict(position_embeddings=rope, position_ids=position_ids, use_cache=False)
    results = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        settings = {"activation_memory_budget": budget} if budget < 1 else {}
        compiler = compiling.new_layer_compiler(backend="aot_eager_decomp_partition", functorch_settings=settings)
        monkeypatch.setitem(compiling._LAYER_COMPILERS, (False, 1.0), compiler)
        compiling.compile_decoder_layers([layer])
        layer.zero_grad(set_to_none=True)
        results[budget] = _saved_bytes_and_grads(layer, x0.clone().requires_grad_(True), **kwargs)
        assert not compiler.failed
    import torch._functorch.config as functorch_config
    assert functorch_config.activation_memory_budget == 1.0  # set for the compile only
    full, none = results[1.0], results[0.0]
    hidden_bytes = x0.numel() * x0.element_size()
    assert none[0] < full[0] and full[0] >= 4 * hidden_bytes, (none[0], full[0])
    torch.testing.assert_close(none[1], full[1], atol=0, rtol=0)
    for got, want in zip(none[2], full[2]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
