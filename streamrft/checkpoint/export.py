"""`streamrft export CKPT --out DIR`: a checkpoint's policy as a Hugging Face model directory.

Runs in one plain process (no torchrun, no process group): the sharded torch.distributed.checkpoint
files are read with ``dcp.load(..., no_dist=True)``, which reassembles every DTensor shard into the full
tensor the HF model asks for. The model is built from the config saved beside the shards (``hf/``), so
the original model.path need not exist any more. Writes config.json, tokenizer files and safetensors
weights (``save_pretrained``), loadable by ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

_DTYPES = ("float32", "bfloat16", "float16")


def _dcp_keys(path: Path) -> set[str]:
    from streamrft.checkpoint.safe_load import SafeFileSystemReader

    return set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_policy_from_checkpoint(ckpt: str | Path):
    """(model, tokenizer, meta) of a checkpoint folder (or an output_dir: its latest), float32 on CPU."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from streamrft.checkpoint.layout import read_meta, resolve_checkpoint
    from streamrft.checkpoint.safe_load import safe_load_kwargs

    path = resolve_checkpoint(ckpt)
    meta = read_meta(path)
    lora = _lora_config(meta, path)
    hf_dir = path / "hf"
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{path} has no hf/config.json (written with every checkpoint); it is not a StreamRFT "
                         "checkpoint or was written by an older version")
    config = AutoConfig.from_pretrained(str(hf_dir))
    config.use_cache = True  # training turns the KV cache off; an exported model generates
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora is not None:  # the checkpoint holds base weights plus adapters: rebuild that model first
        from streamrft.learner.lora import apply_lora

        apply_lora(model, lora)
    # Tied weights appear under one name in the model's parameters but may be saved under either name.
    stored = _dcp_keys(path)
    wanted = {name: t for name, t in model.state_dict().items() if f"model.{name}" in stored}
    missing = sorted(set(model.state_dict()) - set(wanted))
    tied = {name for name in missing if _is_tied_alias(model, name, wanted)}
    if set(missing) - tied:
        raise ValueError(f"{path}: the checkpoint has no weights for {sorted(set(missing) - tied)[:5]}; it does "
                         f"not match the model in {hf_dir}")
    state = {"model": wanted}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, no_dist=True, **safe_load_kwargs(path))  # reads no pickled code (safe_load.py)
    model.load_state_dict(state["model"], strict=False)
    if lora is not None:
        model = _merged_base_model(model, config, lora)
    model.tie_weights()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    return model, tokenizer, meta


def _lora_config(meta: dict, path: Path):
    """The LoRA settings the run trained with (from meta.json), or None for a full fine-tune."""
    if meta.get("lora_rank", 0) <= 0:
        return None
    if "lora_alpha" not in meta or "lora_target_modules" not in meta:
        raise ValueError(f"{path}: a LoRA checkpoint without lora_alpha / lora_target_modules in meta.json "
                         "(written by an older version); it cannot be merged")
    from streamrft.config.model import ModelConfig

    return ModelConfig(lora_rank=int(meta["lora_rank"]), lora_alpha=float(meta["lora_alpha"]),
                       lora_target_modules=tuple(meta["lora_target_modules"]))


def _merged_base_model(lora_model, config, lora):
    """A plain HF model whose weights are W + (alpha / r) * B @ A: the adapters folded in."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrft.learner.lora import lora_scaling, merge_lora_named_tensors

    with torch.device("cpu"):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    merged = dict(merge_lora_named_tensors(lora_model.state_dict().items(), lora_scaling(lora)))
    missing, unexpected = base.load_state_dict(merged, strict=False)
    untied_missing = [m for m in missing if not _is_tied_alias(base, m, merged)]
    if untied_missing or unexpected:
        raise ValueError(f"merging LoRA adapters left missing={untied_missing[:5]} unexpected={unexpected[:5]}")
    return base


def _is_tied_alias(model, name: str, loaded: dict) -> bool:
    """True when the parameter ``name`` shares storage with one that is loaded."""
    tensors = model.state_dict(keep_vars=True)
    mine = tensors[name]
    return any(tensors[other] is mine for other in loaded)


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the checkpoint's policy to ``out`` as a HF model directory; returns ``out``."""
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
    model, tokenizer, meta = load_policy_from_checkpoint(ckpt)
    model = model.to(getattr(torch, dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def export_main(argv: list[str]) -> int:
    """`streamrft export CKPT --out DIR [--dtype float32|bfloat16|float16]`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="streamrft export",
                                     description="Write a checkpoint's policy as a Hugging Face model directory.")
    parser.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step_XXXXXXXX), or an "
                                           "output_dir (its latest complete checkpoint)")
    parser.add_argument("--out", required=True, help="directory to write (config, tokenizer, safetensors)")
    parser.add_argument("--dtype", default="float32", choices=_DTYPES, help="weight dtype of the exported model")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    except ValueError as exc:
        print(f"streamrft export: error: {exc}", file=sys.stderr)
        return 2
    print(f"streamrft export: wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(export_main(sys.argv[1:]))
