"""torch.compile with an eager fallback, and the regional compile of decoder layers (``train.compile_layers``).

``CompiledOrEager(fn, key, what)`` (used by ``train.compile_head``'s LM-head kernels and by the layers below) runs
``torch.compile(fn)``; when compiling fails (no working C++ compiler for Inductor's CPU backend, no Triton), it
warns once, naming the config key, and runs ``fn`` eagerly from then on: the same values, only slower. A compile
error surfaces at the first call of a new graph, before any of its kernels ran (the backward graph is compiled
together with the forward: ``_CompileScope``), so rerunning the call eagerly computes it exactly once.

Regional compilation (``compile_decoder_layers``): every decoder layer's ``forward`` becomes a call of ONE
compiled function ``_layer_forward(layer, ...)``. The layers run the same code and Dynamo treats a module's
parameters as graph inputs, so all layers share one graph (the guards are on the layer's class and the
attributes its forward reads, not on which layer it is). Why the instance ``forward`` and not
``torch.compile(layer)``: the module, its class and its parameter names stay as they are (an
``OptimizedModule`` wrapper would add ``_orig_mod.`` to every checkpoint and engine weight name), and
``nn.Module.__call__`` still runs the hooks outside the compiled region, so FSDP2's all-gather and
reshard hooks stay eager. ``_layer_forward`` looks up ``type(layer).forward`` at call time, which is Hugging
Face's gradient-checkpointing wrapper of the class the layer has then (``FSDP<Layer>`` after
``fully_shard``): with ``model.gradient_checkpointing`` Dynamo traces ``torch.utils.checkpoint`` into the
graph and AOTAutograd recomputes the layer in the compiled backward (the same memory saving).

Shapes: only the rows and tokens are symbolic (``_mark_batch_dims``: the hidden states' first two dimensions
and the same dimensions of the mask, positions and rotary tables, found by the decoder layer's own argument
names), marked before every call, so microbatches of any size reuse the first graph. Everything else (hidden
size, head dimension, heads) stays a constant: ``dynamic=True`` made those symbolic too, and the symbolic-shape
reasoning over them (sympy, in Dynamo's trace and again when a cached graph's guards are checked) was most of
a compile, cold and warm (benchmarks/layer_compile.py: ``batch`` against ``specialised``). PyTorch still
specialises a dimension first seen as 1 (one row, e.g. packing), so a later microbatch of several rows compiles
once more. Gradient mode is part of the guards: no-grad log-prob passes get their own (forward-only) graph.

Calls with a KV cache (the colocated hf engine generating with the learner's own modules) run eagerly: a
cache's ``update(..., layer_idx)`` would guard on each layer's index (one graph per layer) and graph-break.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from typing import Callable

import torch

from streamrft.learner.compile_warmup import wait_for_warmup

FALLBACK_ERRORS = (torch._dynamo.exc.TorchDynamoException, ImportError)  # a compiler that cannot run here


class _CompileScope:
    """Settings for exactly the compiles that a ``CompiledOrEager`` call triggers.

    Dynamo and AOTAutograd read these only while compiling, so they are set in Dynamo's compile start callback
    and restored in its end callback, and only when the compile was started inside one of our calls: never
    while kernels run, never for other code's compiles, and no per-call config patch (~50 µs each, which 24
    layers × every microbatch would pay).

    - Backward compiled with the forward (``force_non_lazy_backward_lowering``): AOTAutograd otherwise may
      only log a failed backward compile ("suppressing in case backwards not needed") and fail again inside
      ``loss.backward()``, outside the fallback, so the run would stop instead of running eagerly.
    - Floats as constants (``specialize_float``, for compilers built with ``specialize_floats``): under
      ``dynamic=True`` Dynamo makes every float it reads a graph input, including a decoder layer's
      ``scaling`` and ``attention_dropout``; those feed SDPA, which needs Python numbers, so after tracing the
      whole layer and its joint forward-backward graph Dynamo gives up and traces everything again with them
      specialised (a "restart": benchmarks/layer_compile.py measured the warm first step 0.60x without it).
      The floats are per-model constants (the same in every layer), so their guards cost no extra graph.
    - The compiler's own AOTAutograd settings (``CompiledOrEager(functorch_settings=...)``): the layers'
      ``activation_memory_budget`` (train.activation_memory_budget).
    """

    active: "CompiledOrEager | None" = None  # the compiler whose call is running
    saved: dict | None = None  # the settings before the compile this scope changed
    finished = 0  # Dynamo compiles ended since the callbacks were first installed (compiles_finished)
    seconds = 0.0  # their wall time, start to end callback (compile_seconds)
    each: list[tuple[str, float]] = []  # (the compiler's key or "other", seconds) of each, in order (compile_log)
    _started_at = 0.0
    _started_key = "other"

    @classmethod
    def install(cls) -> None:
        """Register the callbacks unless they are (checked at every call: ``torch._dynamo.reset()`` clears them)."""
        handler = getattr(torch._dynamo, "callback_handler", None)
        if handler is None or cls._start in handler.start_callbacks:  # an older torch: torch's own settings
            return
        handler.register_start_callback(cls._start)
        handler.register_end_callback(cls._end)

    @classmethod
    def _start(cls, _args) -> None:
        cls._started_at = time.perf_counter()
        cls._started_key = cls.active.key if cls.active is not None else "other"
        if cls.active is None or cls.saved is not None:
            return
        import torch._functorch.config as functorch_config

        settings = {"force_non_lazy_backward_lowering": True, **cls.active.functorch_settings}
        cls.saved = {"specialize_float": torch._dynamo.config.specialize_float,
                     "functorch": {name: getattr(functorch_config, name) for name in settings}}
        for name, value in settings.items():
            setattr(functorch_config, name, value)
        if cls.active.specialize_floats:
            torch._dynamo.config.specialize_float = True

    @classmethod
    def _end(cls, _args) -> None:
        cls.finished += 1
        took = time.perf_counter() - cls._started_at
        cls.seconds += took
        cls.each.append((cls._started_key, took))
        if cls.saved is None:
            return
        import torch._functorch.config as functorch_config

        torch._dynamo.config.specialize_float = cls.saved["specialize_float"]
        for name, value in cls.saved["functorch"].items():
            setattr(functorch_config, name, value)
        cls.saved = None


def compiles_finished() -> int:
    """How many Dynamo compiles (any, ours or not) have ended in this process since the first call of a
    ``CompiledOrEager``: 0 in a run that compiles nothing. A compile leaves long-lived objects behind (graphs,
    guards, symbolic expressions), which the run's garbage-collection policy freezes (``Pipeline.step_trained``)."""
    return _CompileScope.finished


def compile_seconds() -> float:
    """Wall seconds those compiles took (Dynamo's trace, AOTAutograd, Inductor or its cache): the driver logs
    each step's share as ``compile_seconds`` (a first step's compile; later, a recompile for a new shape)."""
    return _CompileScope.seconds


def compile_log() -> list[tuple[str, float]]:
    """Each of those compiles in order: the key of the ``CompiledOrEager`` whose call started it
    (``train.compile_layers``, ``train.compile_head``; "other" for any other) and its wall seconds. The
    compile warm-up's child reports it, so a GPU run shows which graph its cold compile waits on."""
    return list(_CompileScope.each)


_PRELOAD: threading.Thread | None = None  # the compiler's import, started by preload_compiler
PRELOAD_TIMEOUT_S = 300.0  # an import that takes longer is stuck (an import-lock cycle between threads): fail loudly


def preload_compiler() -> None:
    """Import Inductor's compiler (``torch._inductor.compile_fx`` and what it pulls in: lowering, kernel templates,
    code caches) in a background thread. The first compile otherwise imports it inside the first train step
    (2.4 of a warm first step's 6 s on this CPU, more where imports are slow); started once the learner is
    built, the import overlaps the engine's set-up and the first rollout. A compile waits for it
    (``_wait_for_preload``) instead of importing the same modules beside it."""
    global _PRELOAD
    if _PRELOAD is None:
        _PRELOAD = threading.Thread(target=_import_compiler, name="streamrft-preload-compiler", daemon=True)
        _PRELOAD.start()


def _import_compiler() -> None:
    try:
        import torch._inductor.compile_fx  # noqa: F401
    except Exception:  # noqa: BLE001 - the compile imports it again in the caller's thread and fails or falls back there
        pass


def _wait_for_preload() -> None:
    if _PRELOAD is not None and _PRELOAD.is_alive():
        _PRELOAD.join(PRELOAD_TIMEOUT_S)
        if _PRELOAD.is_alive():
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            raise RuntimeError(f"compile: importing torch._inductor in the background did not finish within "
                               f"{PRELOAD_TIMEOUT_S:g} s (stage: the first train step's compile, rank {rank})")


class CompiledOrEager:
    """``fn`` under ``torch.compile(fn, **compile_kwargs)`` (compiled lazily, at the first call); if compiling
    fails, one warning naming ``key`` and ``fn`` eagerly from then on (see the module docstring).
    ``specialize_floats``: the compiles its calls trigger treat Python floats as constants; ``functorch_settings``:
    ``torch._functorch.config`` values for those compiles only (``_CompileScope``)."""

    def __init__(self, fn: Callable, key: str, what: str, specialize_floats: bool = False,
                 functorch_settings: dict | None = None, **compile_kwargs):
        self.fn, self.key, self.what = fn, key, what
        self.specialize_floats = specialize_floats
        self.functorch_settings = dict(functorch_settings or {})
        self.compile_kwargs = compile_kwargs
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                if self.compiled is None:
                    _wait_for_preload()
                    wait_for_warmup()  # the compile warm-up's child fills the caches this compile reads
                    self.compiled = torch.compile(self.fn, **self.compile_kwargs)
                _CompileScope.install()
                outer, _CompileScope.active = _CompileScope.active, self
                try:
                    return self.compiled(*args, **kwargs)
                finally:
                    _CompileScope.active = outer
            except FALLBACK_ERRORS as exc:
                self.failed = True
                warnings.warn(f"{self.key}: torch.compile failed ({type(exc).__name__}: {exc}); {self.what} "
                              f"eagerly from now on (set {self.key}=false to skip compiling)")
        return self.fn(*args, **kwargs)


def _layer_forward(layer: torch.nn.Module, *args, **kwargs):
    """The layer's class forward (HF's checkpointing wrapper included), looked up at call time."""
    return type(layer).forward(layer, *args, **kwargs)


# (deterministic, activation_memory_budget) -> the one compiled layer forward
_LAYER_COMPILERS: dict[tuple[bool, float], CompiledOrEager] = {}

# "batch": only rows and tokens are symbolic (module docstring); "all": every dimension of every input
# (torch.compile's dynamic=True, as before): benchmarks/layer_compile.py's baseline, set before the first compile
SYMBOLIC_SHAPES = "batch"

# The decoder layer's tensor arguments (Hugging Face's names, the same for every causal LM here) and which of
# their dimensions are rows or tokens, counted from the end: hidden states and rotary tables (..., rows, tokens,
# features; Qwen2-VL's rotary tables lead with its 3 position sections), positions (..., rows, tokens), the
# positions of a cache (tokens), a 4-D mask (rows, 1, query tokens, key tokens), a 2-D one (rows, tokens).
_BATCH_DIMS_FROM_END = {"hidden_states": (2, 3), "position_embeddings": (2, 3), "position_ids": (1, 2),
                        "cache_position": (1,), "attention_mask": {2: (1, 2), 4: (1, 2, 4)}}


def layer_compiler(deterministic: bool, activation_memory_budget: float = 1.0) -> CompiledOrEager:
    """The compiled layer forward shared by every decoder layer of the process. ``deterministic``
    (train.deterministic): Inductor's deterministic mode, which skips on-device benchmarking of kernel
    configurations that change results (reduction orders), so a run and its resume compile the same kernels.
    ``activation_memory_budget`` (train.activation_memory_budget): below 1, AOTAutograd's partitioner keeps at
    most that fraction of the activations the layer graph would save for backward (0: only its inputs, as
    gradient checkpointing) and recomputes the rest in the compiled backward, choosing what is cheapest to
    recompute by FLOPs (elementwise ops and norms before matmuls): selective recompute without marking ops."""
    key = (deterministic, float(activation_memory_budget))
    if key not in _LAYER_COMPILERS:
        options = {**({"deterministic": True} if deterministic else {}), **shape_stable_inductor_options()}
        settings = {"activation_memory_budget": key[1]} if key[1] < 1.0 else {}
        _LAYER_COMPILERS[key] = new_layer_compiler(options=options, functorch_settings=settings)
    return _LAYER_COMPILERS[key]


def shape_stable_inductor_options() -> dict:
    """Inductor settings that keep the layer graph's kernel choices free of guards on the microbatch's size.

    Why: with rows and tokens symbolic, Inductor's Triton scheduler fuses a norm's backward (the weight gradient
    summed over tokens, the input gradient over features: a "mix-order" reduction) only when it judges the
    microbatch large enough (rows x tokens x hidden >= 5 Mi elements, at least 4096 tokens and twice as many
    tokens as features), and that judgement becomes a guard of the cached graph. A run's last, short microbatch (at 1.5B
    and 8192 tokens: 51 of 10 rows, then one of 2) failed it and recompiled the layer graph inside the first
    step, 4.8 s that the compile warm-up could not have spent for it (benchmarks/NOTES.md v24; on the H100:
    ``1536*s1*s0 >= 5242880``). The non-strict mode fuses whenever the fusion is legal: the same kernels for
    every full microbatch, a fused one for the short one (which the check judged slower there, on a microbatch
    that is a small share of the step), and one graph for all sizes. Only set where this torch has it."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


def new_layer_compiler(functorch_settings: dict | None = None, **compile_kwargs) -> CompiledOrEager:
    """A compiler of ``_layer_forward`` with this module's settings, ``functorch_settings`` (AOTAutograd's, for
    its compiles) and ``compile_kwargs`` (options, backend)."""
    # "all": every input dimension symbolic from the first call; "batch": none (dynamic=None) but the ones that
    # _dispatch marks, and Dynamo's automatic dynamic shapes for an unmarked one that changes
    return CompiledOrEager(_layer_forward, "train.compile_layers", "running the decoder layers",
                           specialize_floats=True, functorch_settings=functorch_settings,
                           dynamic=True if SYMBOLIC_SHAPES == "all" else None, **compile_kwargs)


def _has_kv_cache(kwargs: dict) -> bool:
    return any(kwargs.get(k) is not None for k in ("cache", "past_key_values", "layer_past"))


def _dispatch(compiler: CompiledOrEager, layer: torch.nn.Module, *args, **kwargs):
    if _has_kv_cache(kwargs):
        return _layer_forward(layer, *args, **kwargs)  # generation: eager (module docstring)
    if args and isinstance(args[0], torch.Tensor) and args[0]._base is not None:
        # A view as the hidden states makes Dynamo guard on its base. Where gradient checkpointing wraps the
        # layer's __call__ (transformers 5.17; 5.24 traces it inside the forward), the backward runs the layer
        # again with a detached input, which has no base: a second graph, compiled at the first backward.
        # A copy that is not a view (one (tokens, hidden) tensor per such call) keeps one graph.
        args = (args[0].clone(), *args[1:])
    if SYMBOLIC_SHAPES == "batch":
        _mark_batch_dims(args, kwargs)
    return compiler(layer, *args, **kwargs)


def _mark_batch_dims(args: tuple, kwargs: dict) -> None:
    """Mark the row and token dimensions of the layer's inputs symbolic (``maybe_``: a dimension the graph
    needs constant, such as one row, is specialised instead of failing the compile). By argument name, not by
    size: a feature dimension that happens to equal the token count stays a constant."""
    named = dict(kwargs)
    if args:
        named["hidden_states"] = args[0]
    for name, dims in _BATCH_DIMS_FROM_END.items():
        value = named.get(name)
        for tensor in (value if isinstance(value, (tuple, list)) else (value,)):
            if not isinstance(tensor, torch.Tensor):
                continue
            for k in (dims.get(tensor.dim(), ()) if isinstance(dims, dict) else dims):
                if tensor.dim() >= k:
                    torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - k)


def compile_decoder_layers(layers: list[torch.nn.Module], deterministic: bool = False,
                           activation_memory_budget: float = 1.0) -> None:
    """Route each layer's forward through the shared compiled function (in place; see the module docstring)."""
    compiler = layer_compiler(deterministic, activation_memory_budget)
    for layer in layers:
        layer.forward = functools.partial(_dispatch, compiler, layer)


def is_compiled_layer(layer: torch.nn.Module) -> bool:
    """Whether ``compile_decoder_layers`` routed this layer's forward (whatever its compiler's state)."""
    fwd = layer.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _dispatch
