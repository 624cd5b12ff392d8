"""ScalarRewardModel: a causal-LM backbone, a pooled hidden state, one or more linear reward heads.

For a sequence x = prompt + response + eos with hidden states h^(l)_t (l = ``layer``; 0 is the
embedding output, -1 the last layer), the pooled vector is

    last:       v = h_T                       (T = the last non-pad position)
    attention:  v = sum_t a_t h_t,  a = softmax_t(w . h_t)  over non-pad t

and the heads give r_k = u_k . v + c_k (k < num_heads). The reward is mean_k r_k.

A saved RM directory holds the backbone (``save_pretrained``, without the LM head), the tokenizer,
``rm_heads.safetensors`` and ``rm.json`` (``{"kind": "srm", "layer", "pooling", "num_heads", "media"}``).

Media (images, videos, audio): with media fields set (``media``, see streamrft.rm.config.media_fields) the
backbone is a Qwen2-VL or Qwen2-Audio model (its whole ``...ForConditionalGeneration``, vision / audio
tower included, saved with its processor) and each sequence is the prompt's media placeholders + prompt +
response + eos, built from the pair's ``MediaRef``s by :class:`streamrft.models.media_inputs.MediaCodec`
(the same decoding as the RL runtime: hash-checked files, video sampling by ``max_video_frames`` /
``video_fps``). Batches are left-padded (the processor's layout); ``last`` pooling still reads the last
non-pad position. h^(l) are the language model's hidden states, so ``layer`` counts text layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoTokenizer

from streamrft.learner.microbatch import right_pad

RM_META = "rm.json"
HEADS_FILE = "rm_heads.safetensors"


def rm_kind(path: str | Path) -> str:
    """``"srm"`` or ``"grm"`` from a trained RM directory's rm.json; ValueError when it is not one."""
    meta = Path(path) / RM_META
    if not meta.is_file():
        raise ValueError(f"{path} is not a trained reward model directory (no {RM_META}); "
                         "train one with `streamrft train-rm CONFIG`")
    return json.loads(meta.read_text())["kind"]


def has_media(media: dict | None) -> bool:
    return bool(media) and any(media.get(k) for k in ("image_field", "video_field", "audio_field"))


class MediaInputs:
    """Model inputs of (prompt, response, media refs) rows for a multimodal RM: one sequence per row
    (``prompt + response + eos`` with the media's placeholders), collated left-padded. Decoded rows are
    cached (bounded, first in first out): a training run revisits the same pairs every epoch."""

    CACHE_ROWS = 4096

    def __init__(self, processor, media: dict) -> None:
        from streamrft.models.media_inputs import MediaCodec

        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.codec = MediaCodec(processor, media.get("image_field") or "", media.get("video_field") or "",
                                media.get("audio_field") or "", max_video_frames=int(media.get("max_video_frames") or 0),
                                video_fps=float(media.get("video_fps") or 0.0))
        self._cache: dict[tuple, dict] = {}

    def row(self, text: str, refs: Sequence, loc: str) -> dict[str, torch.Tensor]:
        key = (text, tuple((r.path, r.sha256, r.kind, r.group) for r in refs))
        hit = self._cache.get(key)
        if hit is None:
            hit = self.codec.inputs(text, list(refs), loc)
            if len(self._cache) >= self.CACHE_ROWS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = hit
        return hit

    def batch(self, texts: Sequence[str], media: Sequence[Sequence], locs: Sequence[str]) -> dict[str, torch.Tensor]:
        from streamrft.models.multimodal import collate_prompts

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return collate_prompts([self.row(t, m, loc) for t, m, loc in zip(texts, media, locs, strict=True)], pad)


class ScalarRewardModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, tokenizer, layer: int = -1, pooling: str = "last",
                 num_heads: int = 1, processor=None, media: dict | None = None) -> None:
        super().__init__()
        if pooling not in ("last", "attention"):
            raise ValueError(f"pooling={pooling!r} must be 'last' or 'attention' (model.pooling)")
        text_config = backbone.config.get_text_config()
        n_states = text_config.num_hidden_layers + 1
        if not -n_states <= layer < n_states:
            raise ValueError(f"layer={layer} is out of range for a backbone with {n_states} hidden states "
                             f"(0 = embeddings .. {n_states - 1}, or negative from the end); set model.layer")
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.layer = layer
        self.pooling = pooling
        self.processor = processor
        self.media = dict(media) if has_media(media) else None
        self.media_inputs = MediaInputs(processor, self.media) if self.media else None
        hidden = text_config.hidden_size
        self.heads = torch.nn.Linear(hidden, num_heads)
        torch.nn.init.normal_(self.heads.weight, std=1.0 / hidden ** 0.5)
        torch.nn.init.zeros_(self.heads.bias)
        self.attn = torch.nn.Linear(hidden, 1, bias=False) if pooling == "attention" else None

    @property
    def num_heads(self) -> int:
        return self.heads.out_features

    @classmethod
    def from_backbone(cls, path: str, layer: int = -1, pooling: str = "last", num_heads: int = 1,
                      dtype: torch.dtype = torch.float32, media: dict | None = None) -> "ScalarRewardModel":
        """A fresh RM on a Hugging Face causal LM directory (the LM head is dropped), or with ``media`` on a
        Qwen2-VL / Qwen2-Audio directory (the whole model and its processor)."""
        if has_media(media):
            from streamrft.models.multimodal import load_multimodal_policy

            backbone, processor, kind = load_multimodal_policy(path, dtype=dtype)
            if kind == "text":
                raise ValueError(f"{path} is a text-only model but the RM reads media ({media}); give a Qwen2-VL "
                                 "or Qwen2-Audio model.path")
            return cls(backbone, processor.tokenizer, layer, pooling, num_heads, processor, media)
        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        return cls(backbone, AutoTokenizer.from_pretrained(path), layer, pooling, num_heads)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "ScalarRewardModel":
        """Load a directory written by :meth:`save_pretrained`."""
        kind = rm_kind(path)
        if kind != "srm":
            raise ValueError(f"{path} holds a {kind!r} reward model, not a scalar one ('srm'); "
                             "load it with streamrft.rm.judge.GenerativeJudge.from_pretrained")
        meta = json.loads((Path(path) / RM_META).read_text())
        model = cls.from_backbone(str(path), meta["layer"], meta["pooling"], meta["num_heads"], dtype, meta.get("media"))
        model.load_state_dict(load_file(str(Path(path) / HEADS_FILE)), strict=False)
        return model.to(device).eval()

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path)
        (self.processor or self.tokenizer).save_pretrained(path)
        own = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if not k.startswith("backbone.")}
        save_file(own, str(path / HEADS_FILE))
        meta = {"kind": "srm", "layer": self.layer, "pooling": self.pooling, "num_heads": self.num_heads,
                "media": self.media}
        (path / RM_META).write_text(json.dumps(meta))

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, L), attention_mask (B, L), right-padded: prompt + response + eos."""
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        seqs = []
        for prompt, response in zip(prompts, responses, strict=True):
            ids = self.tokenizer(prompt + response, add_special_tokens=False)["input_ids"]
            seqs.append(ids + ([eos] if eos is not None else []))
        return right_pad(seqs, pad)

    def batch_inputs(self, prompts: Sequence[str], responses: Sequence[str],
                     media: Sequence[Sequence] | None = None) -> dict[str, torch.Tensor]:
        """The model inputs of (prompt, response[, media refs]) rows: ``encode``'s ids and mask for a text RM;
        for a media RM the collated processor inputs (placeholders, pixel / audio features)."""
        if self.media_inputs is None:
            ids_BL, mask_BL = self.encode(prompts, responses)
            return {"input_ids": ids_BL, "attention_mask": mask_BL}
        if media is None or len(media) != len(prompts):
            raise ValueError(f"this reward model reads media ({self.media}); give one list of media refs per row")
        eos = self.tokenizer.eos_token or ""
        texts = [p + r + eos for p, r in zip(prompts, responses, strict=True)]
        return self.media_inputs.batch(texts, media, [f"prompt {p[:40]!r}" for p in prompts])

    def response_token_counts(self, responses: Sequence[str]) -> list[int]:
        """Tokens that ``response + eos`` occupies at the end of each row of :meth:`batch_inputs`: everything
        before them is the prompt, media placeholders included as the processor expanded them (counting from
        the end needs no second media decode; the prompt's own length would miss the expansion)."""
        if self.media_inputs is None:  # encode: tokenizer(prompt + response) + [eos]
            extra = 1 if self.tokenizer.eos_token_id is not None else 0
            return [len(self.tokenizer(r, add_special_tokens=False)["input_ids"]) + extra for r in responses]
        eos = self.tokenizer.eos_token or ""  # batch_inputs: the processor reads prompt + response + eos as text
        return [len(self.tokenizer(r + eos, add_special_tokens=False)["input_ids"]) for r in responses]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **media: torch.Tensor) -> torch.Tensor:
        """Per-head rewards (B, H)."""
        return self.rewards_and_states(input_ids, attention_mask, **media)[0]

    def lm_logits(self, last_BLD: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, L, V) from the backbone's final (normed) states: through its own LM head for a
        media backbone (the whole ``...ForConditionalGeneration`` is kept; Qwen2-Audio's head is not tied),
        else through the tied input embedding (a text backbone is loaded without its LM head); ValueError
        when a text backbone's head is not tied."""
        head = self.backbone.get_output_embeddings() if self.media else None
        if head is not None:
            return head(last_BLD)
        if not getattr(self.backbone.config, "tie_word_embeddings", False):
            raise ValueError("the backbone's LM head is not tied to its input embedding, so the RM keeps no LM "
                             "head: set train.lm_coef=0")
        return last_BLD @ self.backbone.get_input_embeddings().weight.T

    def rewards_and_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           **media: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-head rewards (B, H), the backbone's final hidden states (B, L, D)); ``media`` are the
        processor's tensors (pixel_values, image_grid_thw, mm_token_type_ids, input_features ...)."""
        if self.media is None:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            last_BLD = out.last_hidden_state
        else:
            from streamrft.models.multimodal import forward_kwargs

            # explicit positions (M-RoPE for Qwen2-VL, cumsum(mask) - 1 otherwise): rows are left-padded
            kwargs = forward_kwargs(self.backbone, {"input_ids": input_ids, "attention_mask": attention_mask, **media})
            out = self.backbone(**kwargs, output_hidden_states=True, use_cache=False)
            last_BLD = out.hidden_states[-1]
        h_BLD = out.hidden_states[self.layer]
        mask_BL = attention_mask.bool()
        if self.attn is None:
            positions_BL = torch.arange(mask_BL.shape[1], device=mask_BL.device).expand_as(mask_BL)
            last_B = torch.where(mask_BL, positions_BL, -1).max(dim=1).values
            v_BD = h_BLD[torch.arange(h_BLD.shape[0], device=h_BLD.device), last_B]
        else:
            scores_BL = self.attn(h_BLD).squeeze(-1).masked_fill(~mask_BL, float("-inf"))
            v_BD = (torch.softmax(scores_BL.float(), dim=1).to(h_BLD.dtype).unsqueeze(-1) * h_BLD).sum(dim=1)
        return self.heads(v_BD), last_BLD

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 64,
              media: Sequence[Sequence] | None = None) -> list[float]:
        """The reward (mean over heads) of every (prompt, response[, media refs]), in batches; eval mode."""
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        out: list[float] = []
        try:
            for i in range(0, len(prompts), batch_size):
                part = media[i:i + batch_size] if media is not None else None
                inputs = self.batch_inputs(prompts[i:i + batch_size], responses[i:i + batch_size], part)
                out += self(**{k: v.to(device) for k, v in inputs.items()}).float().mean(dim=-1).tolist()
        finally:
            self.train(was_training)
        return out
