"""Tiny local models for CPU demos and tests: a character tokenizer and a small Qwen2, built from a config.

Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library over a given alphabet and
the model is randomly initialised from a ``Qwen2Config``; both are saved in Hugging Face format so the
rest of the framework loads them exactly like a hub checkpoint (``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Role markers of the chat template, one special token each (appended after the alphabet, so the ids of
# <pad>/<eos>/<unk> and of every character stay where they are); a turn ends with <eos>.
CHAT_ROLES = ("system", "user", "assistant")
CHAT_TOKENS = tuple(f"<|{role}|>" for role in CHAT_ROLES)
# A real (small) chat template in the usual shape: "<|role|>content<eos>" per message, then "<|assistant|>"
# when a reply is to be generated. Content may be text or a list of parts (text parts are kept). An
# unknown role is an error rather than text the character tokenizer would silently drop.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('role ' + message['role'] + ' is not system, user or assistant') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _byte_level_char(ch: str) -> str:
    """The byte-level (GPT-2 style) spelling of one ASCII character, e.g. ' ' -> 'Ġ'."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)[0][0]


def build_char_tokenizer(out_dir: str, alphabet: str, chat: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0, 1, 2 are ``<pad>``, ``<eos>``, ``<unk>``; then one id per
    character of ``alphabet`` in order. Saved to ``out_dir`` with ``save_pretrained``.

    It is a byte-level BPE with no merges, i.e. exactly one token per ASCII character, spelled the way
    GPT-2/Qwen2 tokenizers spell bytes (space is ``Ġ``). This matters: ``AutoTokenizer`` rebuilds the
    tokenizer of a directory that holds a Qwen2 ``config.json`` as a ``Qwen2Tokenizer`` (byte-level BPE
    from the saved vocab and merges), and with this layout both loaders tokenize identically and text,
    spaces included, round-trips exactly. Characters outside the alphabet are dropped when encoding.

    ``chat=True`` adds the role tokens ``CHAT_TOKENS`` (after the alphabet) and the chat template
    ``CHAT_TEMPLATE``. It is opt-in because the extra tokens change the vocabulary size, and with it the
    random initialisation of every model built on the tokenizer (recorded fixtures depend on it).
    """
    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ValueError("alphabet is empty; pass the characters the task uses (e.g. ARITH_ALPHABET)")
    bad = [ch for ch in chars if not (32 <= ord(ch) < 127)]
    if bad:
        raise ValueError(f"alphabet has non-printable or non-ASCII characters {bad!r}; the character "
                         "tokenizer supports printable ASCII only, remove them from the alphabet")
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in chars:
        vocab[_byte_level_char(ch)] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix=""))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left",
    )
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
        tokenizer.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_qwen2(
    out_dir: str,
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> str:
    """Build a randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` and save config,
    safetensors weights and the tokenizer to ``out_dir``. Returns ``out_dir``."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_policy(
    path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Load a Hugging Face causal LM and its tokenizer from a local directory."""
    from streamrft.models.hub import resolve_model_dir

    path = resolve_model_dir(path, "model")  # a directory (e.g. pipelines/arith/prepare.py's sft/) or a cached hub id
    root = Path(path)
    if not any((root / name).is_file() for name in _WEIGHT_FILES):
        raise ValueError(f"model path {path!r} has no weights ({' or '.join(_WEIGHT_FILES)}); set model.path "
                         "to a directory saved with save_pretrained")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device), tokenizer


def add_chat_tokens(model_dir: str, out_dir: str, alphabet: str) -> str:
    """A copy of a tiny model in ``model_dir`` (built on ``build_char_tokenizer(alphabet)``) that speaks the chat
    template: the chat tokenizer, and the embeddings grown by the role tokens (their rows freshly initialised;
    every other weight unchanged). Returns ``out_dir``."""
    tokenizer = build_char_tokenizer(out_dir, alphabet, chat=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.get_input_embeddings().num_embeddings != len(tokenizer) - len(CHAT_TOKENS):
        raise ValueError(f"{model_dir}: the model's vocabulary ({model.get_input_embeddings().num_embeddings}) is not "
                         f"the character tokenizer's over the alphabet {alphabet!r}; pass the alphabet it was built on")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
