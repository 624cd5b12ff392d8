"""One actor interface for text, vision-language and audio-language policies.

- ``load_multimodal_policy(path)`` -> (model, processor, kind), kind in {"text", "vl", "audio"}.
- ``build_model_inputs(processor, prompt, media)`` -> the model inputs of one prompt (batch of 1).
- ``collate_prompts(inputs_list, pad_token_id)`` -> left-padded batch; media tensors concatenated in row order.
- ``response_logprobs(model, inputs, response_ids, temperature)`` -> log pi(y_t | x, y_<t) / temperature
  for the response tokens only, (R,); ``response_logprobs_batch`` is the (B, T) batched form.
- ``freeze_prefix(model, prefixes)`` (config ``model.freeze_prefix``) freezes e.g. the vision tower.
- ``supports_packing(model)``: False for M-RoPE models (3-D positions cannot be packed by 1-D cu_seqlens).

Positions: text and audio models take ``cumsum(mask) - 1``; Qwen2-VL takes (3, B, L) M-RoPE ids from
the model's own ``get_rope_index`` over prompt + response (``streamrft.models.vl.mrope_position_ids``).
"""

from __future__ import annotations


import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor, AutoTokenizer

# streamrft.models.vl / .audio are imported inside the functions that need them: a text run never
# imports them (they need the Qwen2-VL / Qwen2-Audio processors of transformers >= 5.4).

# per-prompt media tensors concatenated across rows (first dim = images / patches / clips)
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "input_features",
              "feature_attention_mask")


def _config_is(model: torch.nn.Module, class_name: str) -> bool:
    """isinstance(model.config, <transformers class_name>) without importing that model's module."""
    return any(cls.__name__ == class_name for cls in type(getattr(model, "config", None)).__mro__)


def model_kind(model: torch.nn.Module) -> str:
    """"vl" (Qwen2-VL family: its config, or a model with M-RoPE's get_rope_index), "audio" (Qwen2-Audio)
    or "text". Decided from class names, so asking about a text model imports no VL / audio code."""
    if _config_is(model, "Qwen2VLConfig") or hasattr(getattr(model, "model", None), "get_rope_index"):
        return "vl"
    if _config_is(model, "Qwen2AudioConfig"):
        return "audio"
    return "text"


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether samples may be packed into one row with 1-D position resets (False for M-RoPE models)."""
    return model_kind(model) != "vl"


def check_packing(model: torch.nn.Module, packing: bool) -> None:
    """Raise the user error for packing a model that cannot be packed."""
    if packing and not supports_packing(model):
        raise ValueError(f"sample packing is not supported for {type(model).__name__}: its M-RoPE position ids are "
                         "3-D (temporal, height, width) and cannot be reset per packed sample; turn packing off "
                         "for vision-language models")


def load_multimodal_policy(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, processor, kind) from a local Hugging Face directory; text models get their tokenizer as processor."""
    from streamrft.models.hub import resolve_model_dir

    path = resolve_model_dir(path, "model.path")  # a directory or a cached hub id
    config = AutoConfig.from_pretrained(path)
    model_type = getattr(config, "model_type", "")
    if model_type == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration as cls
    elif model_type == "qwen2_audio":
        from transformers import Qwen2AudioForConditionalGeneration as cls
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return model, AutoTokenizer.from_pretrained(path), "text"
    from streamrft.models.vl import register_processors

    register_processors()
    model = cls.from_pretrained(path, dtype=dtype).to(device)
    return model, AutoProcessor.from_pretrained(path), model_kind(model)


def build_model_inputs(processor, prompt: str, media: dict | None = None) -> dict[str, torch.Tensor]:
    """Inputs of one prompt (batch of 1). ``media``: {"images": [PIL], "videos": [[PIL frames]],
    "audios": [float32 mono at the processor's rate]}; absent keys = none. Placeholders are prepended to
    prompts that have none. Text-only processors (tokenizers) accept no media."""
    media = media or {}
    images, videos, audios = media.get("images") or [], media.get("videos") or [], media.get("audios") or []
    if hasattr(processor, "image_processor"):
        if audios:
            raise ValueError("this row has audio but the model is vision-language; drop the audio field")
        from streamrft.models.vl import vl_inputs

        return vl_inputs(processor, prompt, images, videos)
    if hasattr(processor, "feature_extractor"):
        if images or videos:
            raise ValueError("this row has images/videos but the model is audio-language; drop the image/video field")
        from streamrft.models.audio import audio_inputs

        return audio_inputs(processor, prompt, audios)
    if images or videos or audios:
        raise ValueError("this row has media but the model is text-only; set model.path to a multimodal model")
    ids = processor(prompt, add_special_tokens=False)["input_ids"]
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def collate_prompts(inputs_list: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-pad input_ids / attention_mask / mm_token_type_ids to the longest prompt; concatenate the media
    tensors (MEDIA_KEYS) in row order, which is the order the model consumes placeholders in."""
    length = max(x["input_ids"].shape[1] for x in inputs_list)
    out: dict[str, torch.Tensor] = {}
    for key, fill in (("input_ids", pad_token_id), ("attention_mask", 0), ("mm_token_type_ids", 0)):
        if key not in inputs_list[0]:
            continue
        rows = [torch.nn.functional.pad(x[key][0], (length - x[key].shape[1], 0), value=fill) for x in inputs_list]
        out[key] = torch.stack(rows)
    for key in MEDIA_KEYS:
        parts = [x[key] for x in inputs_list if key in x]
        if parts:
            out[key] = torch.cat(parts)
    return out


def forward_kwargs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs plus explicit position ids: (3, B, L) M-RoPE for VL, (B, L) cumsum(mask) - 1 otherwise."""
    kwargs = dict(inputs)
    if model_kind(model) == "vl":
        from streamrft.models.vl import mrope_position_ids

        kwargs["position_ids"] = mrope_position_ids(model, inputs)
    else:
        kwargs["position_ids"] = (inputs["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    return kwargs


def response_logprobs_batch(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], response_ids: list[list[int]], temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, mask_BT): log-probs of each row's response tokens under softmax(logits / temperature).

    ``inputs`` is a collated (left-padded) prompt batch; responses are appended and right-padded, so
    position p of the sequence predicts token p + 1 and row b's response token t sits at L + t.
    """
    B, L = inputs["input_ids"].shape
    T = max(len(r) for r in response_ids)
    device = inputs["input_ids"].device
    resp_BT = torch.zeros(B, T, dtype=torch.long, device=device)
    mask_BT = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, r in enumerate(response_ids):
        resp_BT[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask_BT[b, :len(r)] = 1
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], resp_BT], dim=1)
    full["attention_mask"] = torch.cat([inputs["attention_mask"], mask_BT], dim=1)
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(resp_BT)], dim=1)
    out = model(**forward_kwargs(model, full), use_cache=False)
    logits_BTV = out.logits[:, L - 1:L + T - 1, :].float() / temperature
    logp_BT = torch.log_softmax(logits_BTV, dim=-1).gather(-1, resp_BT.unsqueeze(-1)).squeeze(-1)
    return logp_BT * mask_BT, mask_BT.float()


def response_logprobs(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], response_ids: list[int], temperature: float = 1.0,
) -> torch.Tensor:
    """logp (R,) of one prompt's response tokens; ``inputs`` from ``build_model_inputs``."""
    if not response_ids:
        raise ValueError("response_ids is empty; a response needs >= 1 token")
    logp_BT, _ = response_logprobs_batch(model, inputs, [list(response_ids)], temperature)
    return logp_BT[0]


def freeze_prefix(model: torch.nn.Module, prefixes: list[str]) -> int:
    """Set requires_grad=False on parameters whose name starts with any prefix (``model.freeze_prefix``,
    e.g. ["model.visual."] or ["model.audio_tower."]); returns how many tensors were frozen. A prefix that
    matches nothing is a config error."""
    frozen = 0
    for prefix in prefixes:
        hits = [p for name, p in model.named_parameters() if name.startswith(prefix)]
        if not hits:
            roots = sorted({name.split(".")[0] + "." + name.split(".")[1] for name, _ in model.named_parameters()
                            if "." in name})
            raise ValueError(f"model.freeze_prefix entry {prefix!r} matches no parameter of {type(model).__name__}; "
                             f"parameter names start with one of {roots}")
        for p in hits:
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += 1
    return frozen
