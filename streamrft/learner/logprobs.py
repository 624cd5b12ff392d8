"""Per-token log-probs and entropy from hidden states, without the full (B, L, V) float32 logits.

For a causal LM with temperature T, the log-prob of token x_t given x_<t is

    logp[b, t] = z[b, t-1, x_t] / T - logsumexp_v(z[b, t-1, v] / T),   z = lm_head(hidden)

and the entropy of the same distribution is H[b, t] = -sum_v p_v log p_v. Only positions with
response_mask[b, t] = 1 need logits: we gather their (t-1) hidden states into an (N, H) matrix and run the
head in chunks of ``chunk_size`` rows, so only a few (chunk_size, V) float32 blocks are alive at a time (forward
and backward). ``train.head_kernel`` picks how the chunks are differentiated: ``fused`` (default) is
``fused_head.FusedHeadLogprob``, an analytic backward that recomputes only the head matmul; ``checkpoint``
runs each chunk of the plain computation below under activation checkpointing (autograd recomputes and walks
the whole chunk graph).
Positions outside the response mask (and t = 0, and the first token of every packed sequence, where
position_ids = 0) hold 0.

Packed microbatches (``packing.py``) carry a 4-D block-diagonal boolean attention_mask (B, 1, L, L);
``attention_kwargs`` hands it to the model in the form its attention implementation takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from streamrft.config.train import HEAD_KERNEL_CHUNKS, HEAD_KERNELS, HeadSettings, compile_head_enabled
from streamrft.learner.compiling import CompiledOrEager
from streamrft.learner.fused_head import fused_logp_entropy

# rows per chunk when the caller gives none: each kernel's own (config/train.py says why these sizes)
DEFAULT_CHUNK = HEAD_KERNEL_CHUNKS


def _chunk_logp_entropy(h_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                        target_N: torch.Tensor, inv_temperature: float, with_entropy: bool,
                        banned_ids: torch.Tensor | None = None):
    z_NV = F.linear(h_NH, weight_VH, bias_V).float() * inv_temperature
    if banned_ids is not None:  # tokens the engine never samples: the same renormalised distribution
        z_NV = z_NV.index_fill(-1, banned_ids, torch.finfo(z_NV.dtype).min)
    logp_NV = torch.log_softmax(z_NV, dim=-1)
    logp_N = logp_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp_N, None
    p_NV = logp_NV.exp()
    plogp_NV = p_NV * logp_NV
    if banned_ids is not None:
        # at banned ids p = 0 and log p = -3.4e38: autograd through p * log p multiplies g_H by log p, inf once
        # |g_H| > 1, then by p = 0, which is nan (and log-softmax's backward spreads it over the row). The where
        # sends every p = 0 entry gradient 0, which is its true gradient p (log p + 1) g_H; values unchanged.
        # Only here: elsewhere log p is a moderate number and the bool block it saves would be wasted memory.
        plogp_NV = torch.where(p_NV > 0, plogp_NV, 0.0)
    entropy_N = -plogp_NV.sum(-1)
    return logp_N, entropy_N


# compiled at its first call; if compiling fails (no working Triton or C compiler here), one warning and eager
# from then on: the same values, only slower (learner/compiling.py)
_COMPILED_CHUNK = CompiledOrEager(_chunk_logp_entropy, "train.compile_head", "computing the LM-head log-probs",
                                  specialize_floats=True, dynamic=True)


def _chunk_function(device: torch.device, compile_head: bool):
    """The chunk computation, under ``torch.compile`` on CUDA when asked (``train.compile_head``).

    Eagerly, one chunk makes about eight float32 passes over its (chunk, V) logits forward and more in
    backward (cast, scale, log-softmax, gather, exp, product, sum); compiled, the softmax statistics,
    gather and entropy fuse into one pass over the head's output, and the backward into one more."""
    if not compile_head_enabled(compile_head, device.type):
        return _chunk_logp_entropy
    return _COMPILED_CHUNK


def head_positions(response_mask_BL: torch.Tensor, position_ids_BL: torch.Tensor | None = None) -> torch.Tensor:
    """(2, N) int64: the (row, position) of every token the LM head predicts: response tokens, except a row's
    first token and, with ``position_ids_BL``, the first token of each packed sequence.

    ``nonzero`` needs its result's size on the host, so on a GPU it waits for all queued work; the learner
    computes this from the microbatch's host tensors instead (``fsdp2.move_batch``, key ``head_positions``)."""
    mask_BL = response_mask_BL.bool().clone()
    mask_BL[:, 0] = False  # no prediction for the first token
    if position_ids_BL is not None:
        mask_BL &= position_ids_BL != 0  # nor for the first token of a packed sequence
    return mask_BL.nonzero().t()


def logprobs_from_hidden(hidden_BLH: torch.Tensor, head: torch.nn.Module, input_ids_BL: torch.Tensor,
                         response_mask_BL: torch.Tensor, temperature: float, with_entropy: bool,
                         chunk_size: int | None = None, position_ids_BL: torch.Tensor | None = None,
                         banned_ids: list[int] | None = None, compile_head: bool = False,
                         head_kernel: str = "fused", positions_2N: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The formula above, given the final hidden states (after the last norm) and the LM head.
    With ``position_ids_BL``, positions where it is 0 (a sequence start) are excluded too. ``banned_ids``
    (media placeholders, which the hf engine never samples) get probability 0: the softmax runs over the
    remaining vocabulary, as the engine's sampling distribution does. ``compile_head``: see
    ``_chunk_function`` (CUDA only; the CPU always runs eagerly). ``head_kernel``: the module docstring;
    ``chunk_size`` None is ``DEFAULT_CHUNK[head_kernel]``. ``positions_2N``: ``head_positions`` of the mask
    and position ids, when the caller has them (computed here otherwise)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0; set rollout.temperature > 0")
    if head_kernel not in HEAD_KERNELS:
        raise ValueError(f"train.head_kernel={head_kernel!r} must be one of: {', '.join(HEAD_KERNELS)}")
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK[head_kernel]
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    B, L = input_ids_BL.shape
    if positions_2N is None:
        positions_2N = head_positions(response_mask_BL, position_ids_BL)
    b_N, t_N = positions_2N[0], positions_2N[1]
    h_NH = hidden_BLH[b_N, t_N - 1]
    target_N = input_ids_BL[b_N, t_N]
    weight, bias = head.weight, getattr(head, "bias", None)  # under FSDP2 the gathered (unsharded) weight
    banned_V = torch.tensor(banned_ids, dtype=torch.long, device=h_NH.device) if banned_ids else None
    if head_kernel == "fused":
        logps, ents = [], []
        if h_NH.shape[0]:
            logp_N, ent_N = fused_logp_entropy(h_NH, weight, bias, target_N, 1.0 / temperature, with_entropy,
                                               chunk_size, banned_V, compile_head)
            logps, ents = [logp_N], [ent_N]
    else:
        logps, ents = _checkpointed_chunks(h_NH, weight, bias, target_N, 1.0 / temperature, with_entropy,
                                           chunk_size, banned_V, compile_head)
    zeros_BL = hidden_BLH.new_zeros(B, L, dtype=torch.float32)
    if not logps and torch.is_grad_enabled() and (hidden_BLH.requires_grad or weight.requires_grad):
        # no response token here (a padding microbatch of a rank with fewer samples): a zero that still
        # depends on every weight, so backward runs and the sharded learner's gradient collectives match
        # the other ranks' (a loss without a graph cannot be backpropagated at all)
        zeros_BL = zeros_BL + 0.0 * (hidden_BLH.float().sum() + weight.float().sum())
    logp_N = torch.cat(logps) if logps else zeros_BL.new_zeros(0)
    logp_BL = zeros_BL.index_put((b_N, t_N), logp_N)
    entropy_BL = None
    if with_entropy:
        ent_N = torch.cat(ents) if ents else zeros_BL.new_zeros(0)
        entropy_BL = zeros_BL.index_put((b_N, t_N), ent_N)
    return logp_BL, entropy_BL


def _checkpointed_chunks(h_NH, weight, bias, target_N, inv_temperature, with_entropy, chunk_size, banned_V,
                         compile_head):
    """train.head_kernel=checkpoint: each chunk of ``_chunk_logp_entropy`` under activation checkpointing
    when grads are on (per-chunk logp and entropy lists)."""
    use_ckpt = torch.is_grad_enabled() and (h_NH.requires_grad or weight.requires_grad)
    chunk_fn = _chunk_function(h_NH.device, compile_head)
    logps, ents = [], []
    for start in range(0, h_NH.shape[0], chunk_size):
        args = (h_NH[start:start + chunk_size], weight, bias, target_N[start:start + chunk_size],
                inv_temperature, with_entropy)
        if banned_V is not None:
            args += (banned_V,)
        if use_ckpt:
            logp_n, ent_n = checkpoint(chunk_fn, *args, use_reentrant=False)
        else:
            logp_n, ent_n = chunk_fn(*args)
        logps.append(logp_n)
        ents.append(ent_n)
    return logps, ents


def token_logprobs(model: torch.nn.Module, mb: dict[str, torch.Tensor], temperature: float,
                   with_entropy: bool, chunk_size: int | None = None, compile_head: bool = False,
                   head_kernel: str = "fused") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_BL, entropy_BL | None) for a Hugging Face causal LM on microbatch ``mb``.

    Runs the decoder (``model.get_decoder()``) for hidden states, then the LM head in chunks of response
    positions. Needs mb["input_ids"], ["attention_mask"], ["position_ids"], ["response_mask"], all (B, L).
    A microbatch with media tensors (pixel_values / image_grid_thw ..., see ``MEDIA_KEYS``) runs the
    multimodal base model instead (``multimodal_hidden``).
    """
    if any(k in mb for k in _MEDIA_KEYS):
        hidden_BLH = multimodal_hidden(model, mb)
        return logprobs_from_hidden(hidden_BLH, model.get_output_embeddings(), mb["input_ids"],
                                    mb["response_mask"], temperature, with_entropy, chunk_size, mb["position_ids"],
                                    media_placeholder_ids(model), compile_head, head_kernel, mb.get("head_positions"))
    hidden_BLH = model.get_decoder()(input_ids=mb["input_ids"], use_cache=False,
                                     **text_mask_and_positions(model, mb["attention_mask"], mb["position_ids"]),
                                     ).last_hidden_state
    if torch.is_grad_enabled():
        hidden_BLH = _touch_audio_tower(model, hidden_BLH)
    return logprobs_from_hidden(hidden_BLH, model.get_output_embeddings(), mb["input_ids"],
                                mb["response_mask"], temperature, with_entropy, chunk_size, mb["position_ids"],
                                compile_head=compile_head, head_kernel=head_kernel,
                                positions_2N=mb.get("head_positions"))


def head_logprobs(model: torch.nn.Module, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool,
                  head: HeadSettings) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` with the learner's resolved head settings (``HeadSettings.of(train_cfg)``): the one
    place a strategy's log-prob forward turns them into the head's arguments."""
    return token_logprobs(model, mb, temperature, with_entropy, head.chunk_tokens,
                          compile_head=head.compile_head, head_kernel=head.kernel)


_MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "input_features")


def _touch_audio_tower(model: torch.nn.Module, hidden_BLH: torch.Tensor) -> torch.Tensor:
    """An audio model's microbatch without clips (a padding microbatch of a rank with fewer samples): add
    0 x the trainable audio tower and projector weights, so they get a (zero) gradient as on the ranks whose
    microbatches had clips. FSDP2 reduce-scatters only the parameters that have a gradient, and these sit in
    the root unit: ranks that disagree on which have one would run mismatched collectives."""
    from streamrft.models.multimodal import model_kind

    if model_kind(model) != "audio":
        return hidden_BLH
    base = model.model
    params = [p for m in (base.audio_tower, base.multi_modal_projector) for p in m.parameters() if p.requires_grad]
    if not params:
        return hidden_BLH
    return hidden_BLH + 0.0 * sum(p.sum() for p in params).to(hidden_BLH.dtype)


def media_placeholder_ids(model: torch.nn.Module) -> list[int]:
    """Image / video / audio placeholder token ids of the model's config: the hf engine never samples them
    (``HFEngine._banned_ids``), so the learner's distribution leaves them out too."""
    config = getattr(model, "config", None)
    return sorted({i for key in ("image_token_id", "video_token_id", "audio_token_id")
                   if isinstance(i := getattr(config, key, None), int)})


def multimodal_hidden(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, L, H) final hidden states of a vision- or audio-language model on a microbatch with media.

    The media tensors of the microbatch's rows are concatenated in row order (as ``collate_prompts``),
    which is the order the model fills placeholders in (row-major over the batch).

    - Qwen2-VL family: ``mm_token_type_ids`` is rebuilt from the placeholder ids (image 1, video 2) and
      positions are the (3, B, L) M-RoPE ids of the model's ``get_rope_index``, so every real token gets the
      position it had in the engine's left-padded prefill + decode. Right-padded rows only (no packing).
    - Qwen2-Audio: the clips' ``input_features`` / ``feature_attention_mask`` go through the audio tower and
      projector into the ``<|AUDIO|>`` positions; positions are the microbatch's 1-D ``position_ids``
      (``cumsum(mask) - 1`` per sample, as in the engine), so packed rows work too: the packed samples'
      placeholders appear in the row in the same order as their clips were concatenated (``sample_index``).
    """
    from streamrft.models.multimodal import model_kind

    kind = model_kind(model)
    if kind == "audio":
        return _audio_hidden(model, mb)
    if kind != "vl":
        raise ValueError(f"{type(model).__name__}: a microbatch with media tensors ({sorted(k for k in mb if k in _MEDIA_KEYS)}) "
                         "needs a vision-language (Qwen2-VL family) or audio-language (Qwen2-Audio) model")
    from streamrft.models.vl import mrope_position_ids

    input_ids_BL = mb["input_ids"]
    config = model.config
    types_BL = torch.zeros_like(input_ids_BL)
    types_BL[input_ids_BL == config.image_token_id] = 1
    types_BL[input_ids_BL == config.video_token_id] = 2
    inputs = {"input_ids": input_ids_BL, "attention_mask": mb["attention_mask"], "mm_token_type_ids": types_BL}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in mb:
            inputs[key] = mb[key]
    position_ids = mrope_position_ids(model, inputs)
    return model.model(**inputs, position_ids=position_ids, use_cache=False).last_hidden_state


def _audio_hidden(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Qwen2-Audio's base model on ids + clips (see ``multimodal_hidden``). A placeholder count that does
    not match the clips' feature lengths is an error here, not a silent misalignment."""
    if "feature_attention_mask" not in mb:
        raise ValueError("a microbatch with input_features has no feature_attention_mask; the audio media tensors "
                         "must come from the processor (streamrft.models.media_inputs.MediaCodec)")
    tower = model.model.audio_tower
    _, n_tokens_A = tower._get_feat_extract_output_lengths(mb["feature_attention_mask"].sum(-1))
    n_placeholders = int((mb["input_ids"] == model.config.audio_token_id).sum())
    if n_placeholders != int(n_tokens_A.sum()):
        raise ValueError(f"the microbatch has {n_placeholders} <|AUDIO|> placeholders but its "
                         f"{mb['input_features'].shape[0]} clips give {int(n_tokens_A.sum())} audio features; "
                         "the media tensors do not belong to these rows")
    return model.model(
        input_ids=mb["input_ids"], input_features=mb["input_features"],
        feature_attention_mask=mb["feature_attention_mask"],
        attention_mask=attention_mask_for(model, mb["attention_mask"]), position_ids=mb["position_ids"],
        use_cache=False,
    ).last_hidden_state


def causal_only(mask: torch.Tensor) -> bool:
    """Whether a text forward may drop a 2-D padding mask: on a GPU. Microbatches are right-padded
    (``microbatch.collate``): under the causal mask a real token attends only to earlier positions, all real,
    so the padding mask changes no output the loss reads (padded positions' own outputs change; their
    response_mask is 0). With a padding mask SDPA leaves its causal flash/cuDNN kernels for masked ones
    (the H200's long-tailed workload, padded in nearly every microbatch, trained 2.1x slower per token than
    the unpadded one), and transformers checks the mask for padding with a host sync. The CPU keeps the mask:
    its SDPA has no faster causal path, and the recorded CPU fixtures keep their bits."""
    return mask.dim() == 2 and mask.device.type == "cuda"


def text_mask_and_positions(model: torch.nn.Module, mask: torch.Tensor, position_ids: torch.Tensor) -> dict:
    """attention_mask and position_ids for a text-only forward: no mask and no positions where ``causal_only``
    (transformers then numbers positions 0..L-1, the same as ours on real tokens, and does not read padded
    position ids as packed-sequence starts); else ``attention_mask_for``'s mask and the microbatch's positions."""
    if causal_only(mask):
        return {"attention_mask": no_mask(model), "position_ids": None}
    return {"attention_mask": attention_mask_for(model, mask), "position_ids": position_ids}


def no_mask(model: torch.nn.Module) -> dict | None:
    """The attention_mask argument of a causal forward with no mask at all. For a model whose layers are all
    full attention, the per-layer-type mapping transformers would build itself ({"full_attention": None}):
    handed over ready, it skips building it, where transformers checks its own position ids for packed
    sequences with ``.all()`` on the GPU, a host sync in every forward (one per microbatch on the H200's
    profiled step) that drains the queue the host had run ahead on. Other models (sliding-window layers):
    None, and transformers builds their masks."""
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    if layer_types and all(t == "full_attention" for t in layer_types):
        return {"full_attention": None}
    return None


def attention_mask_for(model: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor | None:
    """A 2-D padding mask as is; a 4-D boolean packed mask (True = attend) as the model's attention
    implementation takes it: None for flash_attention_2 (transformers then runs varlen flash attention
    from the restarting position_ids), bool for sdpa, additive (0 / dtype min) for eager and others."""
    if mask.dim() != 4:
        return mask
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "flash_attention_2":
        return None
    if impl == "sdpa":
        return mask.bool()
    if mask.dtype != torch.bool:
        return mask
    dtype = next(model.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
