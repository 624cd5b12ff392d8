"""How many rows a static-cache chunk may decode at once in the device memory the engine has.

A static-cache chunk (hf_fast.StaticDecoder) allocates its whole KV cache up front: one entry per distinct
prompt, and for every row a generated cache as long as the chunk's largest ``max_new_tokens``. With long
responses that is most of the chunk's memory (0.5B, 512 rows of up to 4,096 new tokens: 24 GiB), and it
can exceed what the engine may use: the async placement's engine process is capped at
``rollout.engine_memory_fraction`` of the GPU, and on a 80 GB card 0.3 of it (23.75 GiB) ran out at the
first chunk. So before each chunk the engine takes only as many rows as fit in the memory free then (the
other rows go to the next chunk, and a warning says so once); one row that cannot fit is an error naming
the sizes. The arithmetic here is pure; ``free_device_bytes`` is the one function that asks the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# kept free beside the estimate: the allocator's rounding, cuBLAS workspaces, the graph pool's slack
MARGIN_BYTES = 512 << 20
# a chunk compacts once at most this fraction of its rows still decode (hf_fast.COMPACT_FRACTION): the
# smaller decoder's generated cache is gathered while the old one still exists
COMPACTION_COPY = 0.25
STEP_FIXED_BYTES = 256 << 20  # one decode step's activations and sampler partials


def step_bytes(vocab: int, rows: int) -> int:
    """Generous bytes for one decode step's temporaries: float32 logits four times over (the top-k/top-p
    processing copies them), plus a fixed share for the activations and the sampler's partials."""
    return rows * 16 * vocab + STEP_FIXED_BYTES


@dataclass(frozen=True)
class DecoderShape:
    """What a chunk's memory depends on (hf_fast.decoder_shape reads it from the model)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    hidden: int
    intermediate: int

    def kv_bytes(self, tokens: int) -> int:
        """Keys and values of ``tokens`` cache slots in every layer."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes * tokens


def row_bytes(shape: DecoderShape, n_new: int) -> int:
    """One row's share of a chunk beside its step temporaries: its generated cache (plus the copy a
    compaction may make of it), and its tokens and log-probs (int64 + float32 per step)."""
    generated = shape.kv_bytes(max(1, n_new - 1))
    return int(generated * (1 + COMPACTION_COPY)) + 12 * n_new


def prefill_bytes(shape: DecoderShape, entries: int, longest: int) -> int:
    """The prefill forward's largest temporaries: one layer's activations over every prompt entry's tokens
    (the MLP's gate, up and their product; the residual, norm, attention output and query)."""
    return entries * longest * (3 * shape.intermediate + 4 * shape.hidden) * shape.dtype_bytes


def _chunk_bytes(shape: DecoderShape, rows: int, entries: int, longest: int, n_new: int) -> int:
    # the prefill's temporaries are freed before the first decode step's are made
    transient = max(step_bytes(shape.vocab, rows), prefill_bytes(shape, entries, longest) + STEP_FIXED_BYTES)
    return shape.kv_bytes(longest) * entries + rows * row_bytes(shape, n_new) + transient


def chunk_bytes(shape: DecoderShape, prompts: list[list[int]], n_new: int) -> int:
    """Device bytes a chunk of these prompts' rows decoding ``n_new`` tokens allocates (an upper bound): one
    cache entry per distinct prompt, each as long as the longest, and every row's own share."""
    return _chunk_bytes(shape, len(prompts), len({tuple(p) for p in prompts}), max(map(len, prompts)), n_new)


def rows_that_fit(shape: DecoderShape, prompts: list[list[int]], n_new: int, free_bytes: int) -> int:
    """How many of ``prompts`` (a prefix, in order) a chunk decoding ``n_new`` tokens can take within
    ``free_bytes`` (less the margin); 0 when not even one row fits. One pass: a chunk's bytes only grow
    with its prefix, and each prompt is hashed once."""
    budget = free_bytes - MARGIN_BYTES
    entries: set[tuple[int, ...]] = set()
    longest = 0
    for rows, prompt in enumerate(prompts, start=1):
        entries.add(tuple(prompt))
        longest = max(longest, len(prompt))
        if _chunk_bytes(shape, rows, len(entries), longest, n_new) > budget:
            return rows - 1
    return len(prompts)


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes this process may still allocate on ``device``: the device's free memory plus the allocator's
    cached blocks, within the process's memory fraction where one is set; None off CUDA (no bound known)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index  # the fraction needs one
    free, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    available = free + torch.cuda.memory_reserved(index) - allocated
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    if fraction < 1.0:
        available = min(available, int(fraction * total) - allocated)
    return max(0, available)
