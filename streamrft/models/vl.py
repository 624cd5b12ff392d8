"""Vision-language policies (Qwen2-VL family): a tiny local model + processor, and model inputs for prompts
with images and videos.

The tiny model is ``Qwen2VLForConditionalGeneration`` built from a config (no download): a 1-block vision
tower (patch 4, merge 2, so a 32x32 image is 8x8 patches -> 16 placeholder tokens) and a 1-2 layer text
model over the character tokenizer of ``streamrft.models.tiny`` plus the Qwen2-VL special tokens.

Processor: ``Qwen2VLProcessor`` insists on a video processor, which needs torchvision (not a CPU-demo
dependency). ``TinyQwen2VLProcessor`` is the same processor without it; ``register_processors()`` makes
``AutoProcessor.from_pretrained`` resolve its saved ``processor_class`` (a real Qwen2-VL checkpoint loads
its own ``Qwen2VLProcessor`` as usual). Videos are patchified here from per-frame image patches when the
processor has no video processor (``video_patches``), in the layout the vision tower expects.
"""

from __future__ import annotations

import os

import torch
from PIL import Image
from transformers import AutoProcessor, PretrainedConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from streamrft.models.tiny import build_char_tokenizer

VL_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                     "<|video_pad|>"]
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer only (no torchvision video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class _TinyVLProcessorKey(PretrainedConfig):
    """Registry key only: lets AutoProcessor find TinyQwen2VLProcessor by its saved class name."""

    model_type = "streamrft_tiny_qwen2_vl_processor"


def register_processors() -> None:
    """Make ``AutoProcessor.from_pretrained`` resolve ``TinyQwen2VLProcessor`` (idempotent, explicit)."""
    AutoProcessor.register(_TinyVLProcessorKey, TinyQwen2VLProcessor, exist_ok=True)


def build_tiny_qwen2_vl(
    out_dir: str,
    alphabet: str,
    hidden_size: int = 32,
    num_layers: int = 1,
    num_heads: int = 2,
    vision_dim: int = 32,
    image_size: int = 32,
    seed: int = 0,
    vision_depth: int = 1,
) -> str:
    """Build and save a random tiny Qwen2-VL, its tokenizer and processor to ``out_dir``; returns it.

    Images are resized to at most ``image_size``^2 pixels (min 16x16), patch 4, merge 2; the vision tower
    has ``vision_depth`` blocks.
    """
    head_dim = hidden_size // num_heads
    if hidden_size % num_heads or head_dim % 4:
        raise ValueError(f"hidden_size={hidden_size} / num_heads={num_heads} must give a head_dim divisible by 4")
    tokenizer = build_char_tokenizer(out_dir, alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": VL_SPECIAL_TOKENS})
    ids = dict(zip(VL_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(VL_SPECIAL_TOKENS)))
    half = head_dim // 2  # M-RoPE sections (temporal, height, width) split the rotary half-dimension
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    image_processor = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=image_size * image_size,
                                               patch_size=4, merge_size=2, temporal_patch_size=2)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    TinyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)
    return out_dir


def video_patches(image_processor, frames: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos (N, C*Tp*P*P), video_grid_thw (1, 3)) of one video from per-frame image patches.

    The image processor tiles one frame Tp = temporal_patch_size times in every patch; here consecutive
    groups of Tp frames fill those Tp slots instead (the last frame repeats to make a full group). Patch
    order is (t, h-block, w-block, merge, merge), as the vision tower and get_rope_index expect.
    """
    tp = image_processor.temporal_patch_size
    frames = list(frames) + [frames[-1]] * (-len(frames) % tp)
    per_frame = [image_processor(images=[f], return_tensors="pt") for f in frames]
    grid = per_frame[0]["image_grid_thw"][0]  # (1, gh, gw)
    channels = 3
    groups = []
    for g in range(0, len(frames), tp):
        slots = [p["pixel_values"].reshape(-1, channels, tp, image_processor.patch_size, image_processor.patch_size)[:, :, 0]
                 for p in per_frame[g:g + tp]]  # each (N, C, P, P)
        groups.append(torch.stack(slots, dim=2).reshape(slots[0].shape[0], -1))  # (N, C*Tp*P*P)
    thw = torch.tensor([[len(frames) // tp, int(grid[1]), int(grid[2])]])
    return torch.cat(groups, dim=0), thw


def vl_inputs(processor, prompt: str, images: list[Image.Image], videos: list[list[Image.Image]]) -> dict:
    """Model inputs of one prompt: input_ids (1, L), attention_mask, mm_token_type_ids, and pixel_values /
    image_grid_thw and pixel_values_videos / video_grid_thw when there are images / videos.

    A prompt without placeholders gets one image block per image, then one video block per video, prepended.
    """
    if images and processor.image_token not in prompt:
        prompt = IMAGE_BLOCK * len(images) + prompt
    if videos and processor.video_token not in prompt:
        prompt = VIDEO_BLOCK * len(videos) + prompt
    n_img, n_vid = prompt.count(processor.image_token), prompt.count(processor.video_token)
    if n_img != len(images) or n_vid != len(videos):
        raise ValueError(f"prompt has {n_img} image and {n_vid} video placeholders but the row has {len(images)} "
                         f"images and {len(videos)} videos; make them match")
    if not videos or getattr(processor, "video_processor", None) is not None:
        out = processor(text=[prompt], images=images or None, videos=videos or None, return_tensors="pt")
        return {k: v for k, v in out.items()}
    return _vl_inputs_frame_videos(processor, prompt, images, videos)


def _vl_inputs_frame_videos(processor, prompt: str, images: list[Image.Image], videos: list[list[Image.Image]]) -> dict:
    """Videos without a video processor: the text between video placeholders goes through the processor
    (with its images); each placeholder becomes thw / merge^2 video tokens (type 2) with ``video_patches``."""
    merge = processor.image_processor.merge_size ** 2
    parts = [video_patches(processor.image_processor, v) for v in videos]
    ids, types, pixels, grids = [], [], [], []
    img_iter = iter(images)
    for i, segment in enumerate(prompt.split(processor.video_token)):
        if i > 0:
            n = int(parts[i - 1][1].prod()) // merge
            ids.append(torch.full((n,), processor.video_token_id, dtype=torch.long))
            types.append(torch.full((n,), 2, dtype=torch.long))
        if not segment:
            continue
        seg_images = [next(img_iter) for _ in range(segment.count(processor.image_token))]
        out = processor(text=[segment], images=seg_images or None, return_tensors="pt")
        ids.append(out["input_ids"][0])
        types.append(out["mm_token_type_ids"][0].long())
        if seg_images:
            pixels.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
    input_ids = torch.cat(ids)[None]
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "mm_token_type_ids": torch.cat(types)[None],
              "pixel_values_videos": torch.cat([p for p, _ in parts]), "video_grid_thw": torch.cat([t for _, t in parts])}
    if pixels:
        inputs["pixel_values"], inputs["image_grid_thw"] = torch.cat(pixels), torch.cat(grids)
    return inputs


def mrope_position_ids(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """(3, B, L) M-RoPE position ids of (left-padded) inputs, from the model's own ``get_rope_index``."""
    position_ids_3BL, _ = model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        attention_mask=inputs.get("attention_mask"),
    )
    return position_ids_3BL


def is_vl_model(model: torch.nn.Module) -> bool:
    from streamrft.models.multimodal import model_kind  # the one definition (it needs no VL import)

    return model_kind(model) == "vl"

