"""Settings that belong to one variant of another setting, and the check that an unselected variant's
settings are not set.

Why a table and not msgspec tagged unions: a union per variant (``engine: HFEngine | VLLMEngine``) would
move keys into nested sections and rename them for every user. Instead the loader records which keys
the user wrote (the config file plus key=value overrides, ``Config.explicit_keys``), and a key written
for a variant that is not selected is an error, e.g.::

    engine.tensor_parallel_size is set but engine.type='hf'; it applies only to engine.type in ('vllm',)

A Config built in code has no record of what was written; there a key counts as set when its value
differs from the default (``set_keys``).

``VARIANT_KEYS`` maps a key to its owner: another key and the owner values under which it applies, or
``SET`` (the key applies only when the owner is set: non-empty, non-zero, true). Keys of list items
are written with ``[]`` (``reward.sources[].address``); their owner is in the same item.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamrft.config.base import ConfigError

SET = "set"  # owner condition: the owner has a non-empty, non-zero, non-false value

_VLLM_IN_PROCESS = ("vllm",)
_HF = ("hf",)
_GAMMA_ESTIMATORS = ("reinforce", "reinforce_baseline", "reinforce++", "gae")

# key -> (owner key, owner values it applies to | SET). One row per variant-specific key.
VARIANT_KEYS: dict[str, tuple[str, tuple | str]] = {
    # engine: the embedded hf engine
    "engine.static_cache": ("engine.type", _HF),
    "engine.cuda_graphs": ("engine.type", _HF),
    "engine.sync_every": ("engine.type", _HF),
    "engine.decode_kernels": ("engine.type", _HF),
    "engine.first_token_temperature": ("engine.type", _HF),
    "engine.kernel_warmup": ("engine.static_cache", SET),  # it warms the static-cache path's kernels
    # engine: vLLM in process, vLLM / SGLang servers
    "engine.tensor_parallel_size": ("engine.type", _VLLM_IN_PROCESS),
    "engine.gpu_memory_utilization": ("engine.type", _VLLM_IN_PROCESS),
    "engine.kv_cache_memory_bytes": ("engine.type", _VLLM_IN_PROCESS),
    "engine.max_model_len": ("engine.type", _VLLM_IN_PROCESS),
    "engine.enforce_eager": ("engine.type", _VLLM_IN_PROCESS),
    "engine.address": ("engine.type", ("vllm", "sglang")),
    "engine.request_timeout_s": ("engine.type", ("vllm", "sglang")),
    "engine.weight_sync": ("engine.type", ("sglang",)),
    "engine.weight_group_address": ("engine.weight_sync", ("distributed",)),
    "engine.weight_group_backend": ("engine.weight_sync", ("distributed",)),
    "engine.weight_group_server_ranks": ("engine.weight_sync", ("distributed",)),
    # model
    "model.lora_alpha": ("model.lora_rank", SET),
    "model.lora_target_modules": ("model.lora_rank", SET),
    "model.reference_path": ("algorithm.kl_coef", SET),
    # train
    "train.zero_stage": ("train.strategy", ("deepspeed",)),
    "train.min_lr_ratio": ("train.lr_schedule", ("cosine",)),
    "train.critic_lr": ("model.critic_path", SET),
    "train.offload_between_phases": ("rollout.placement", ("colocated",)),
    "train.optimizer_offload": ("train.strategy", ("fsdp2",)),  # DeepSpeed has its own offload
    "train.fused_adamw": ("train.optimizer_offload", (False,)),  # the offloaded AdamW streams its own update
    "train.compile_layers": ("train.strategy", ("fsdp2",)),  # DeepSpeed's ZeRO hooks are not composed with it
    "train.reshard_after_forward": ("train.strategy", ("fsdp2",)),  # ZeRO-3 has its own (zero_stage)
    "train.compile_warmup": ("train.strategy", ("fsdp2",)),  # it builds the learner through FSDP2Strategy
    "train.activation_memory_budget": ("train.compile_layers", ("auto", True)),  # a setting of the layer compile
    # rollout
    "rollout.engine_ranks": ("rollout.placement", ("async",)),
    # algorithm: advantage estimators
    "algorithm.gamma": ("algorithm.advantage_estimator", _GAMMA_ESTIMATORS),
    "algorithm.lam": ("algorithm.advantage_estimator", ("gae",)),
    "algorithm.value_clip_eps": ("algorithm.advantage_estimator", ("gae",)),
    # algorithm: policy losses
    "algorithm.dual_clip_c": ("algorithm.policy_loss", ("dual_clip",)),
    "algorithm.gmpo_clip_eps": ("algorithm.policy_loss", ("gmpo",)),
    "algorithm.cpg_drift_coef": ("algorithm.policy_loss", ("cpg",)),
    "algorithm.tis_cap": ("algorithm.tis_mode", ("token", "sequence")),
    "algorithm.offpolicy_mask_low": ("algorithm.offpolicy_mask", ("token", "sequence")),
    "algorithm.offpolicy_mask_high": ("algorithm.offpolicy_mask", ("token", "sequence")),
    # GMPO clips log-ratios with its own gmpo_clip_eps (policy_losses.gmpo)
    "algorithm.clip_eps_low": ("algorithm.policy_loss", ("ppo_clip", "clip_higher", "dual_clip", "gspo", "cpg")),
    "algorithm.clip_eps_high": ("algorithm.policy_loss", ("ppo_clip", "clip_higher", "dual_clip", "gspo", "cpg")),
    # algorithm: KL to the reference and its controller
    "algorithm.kl_estimator": ("algorithm.kl_coef", SET),
    "algorithm.kl_mode": ("algorithm.kl_coef", SET),
    "algorithm.kl_ctl_type": ("algorithm.kl_coef", SET),
    "algorithm.kl_target": ("algorithm.kl_ctl_type", ("adaptive",)),
    "algorithm.kl_horizon": ("algorithm.kl_ctl_type", ("adaptive",)),
    "algorithm.kl_adaptive_error_clip": ("algorithm.kl_ctl_type", ("adaptive",)),
    # algorithm: filters and shaping
    "algorithm.max_extra_prompts": ("algorithm.dynamic_sampling", SET),
    "algorithm.overlong_penalty_factor": ("algorithm.overlong_buffer_len", SET),
    # teacher (on-policy distillation)
    "teacher.address": ("teacher.type", ("streamrft", "sglang", "vllm")),
    "teacher.mode": ("teacher.type", ("streamrft", "sglang", "vllm")),
    "teacher.weight": ("teacher.mode", ("hybrid",)),
    # reward sources (per list item)
    "reward.sources[].fn": ("reward.sources[].type", ("rule", "custom")),
    "reward.sources[].address": ("reward.sources[].type", ("remote",)),
    "reward.sources[].convention": ("reward.sources[].type", ("custom",)),
    "reward.sources[].protocol": ("reward.sources[].type", ("remote",)),
    "reward.sources[].model_path": ("reward.sources[].type", ("model",)),
    # data, metrics, sinks
    "data.max_video_frames": ("data.video_field", SET),
    "data.video_fps": ("data.video_field", SET),
    "metrics.host": ("metrics.port", SET),
    "metrics.final_scrape_timeout_s": ("metrics.port", SET),
    "metrics.wandb_project": ("metrics.wandb", SET),
    "metrics.wandb_mode": ("metrics.wandb", SET),
    "sinks.parquet_rows_per_file": ("sinks.parquet", SET),
    "sinks.zmq_hwm": ("sinks.zmq_pub", SET),
    # warm-up (pipelines/arith/prepare.py)
    "warmup.lr": ("warmup.steps", SET),
    "warmup.batch_size": ("warmup.steps", SET),
}


def written_keys(data: Any, prefix: str = "") -> set[str]:
    """Dotted keys of every value in a raw (file + overrides) mapping; list items of mappings as
    ``key[i].field`` (``reward.sources[0].address``)."""
    keys: set[str] = set()
    if not isinstance(data, dict):
        return keys
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            keys |= written_keys(value, key + ".")
        else:
            keys.add(key)
            if isinstance(value, list):
                for i, item in enumerate(value):
                    keys |= written_keys(item, f"{key}[{i}].")
    return keys


def set_keys(cfg) -> set[str]:
    """For a Config built in code: the keys whose value differs from the default."""
    from streamrft.config import Config

    return _diff_keys(msgspec.to_builtins(cfg), msgspec.to_builtins(Config()), "")


def _diff_keys(value: Any, default: Any, key: str) -> set[str]:
    if isinstance(value, dict) and isinstance(default, dict):
        out: set[str] = set()
        for name, v in value.items():
            out |= _diff_keys(v, default.get(name, _MISSING), f"{key}.{name}" if key else name)
        return out
    if key in _ITEM_TYPES and isinstance(value, list):  # each item against its own struct's defaults
        out = set()
        for i, item in enumerate(value):
            item_default = _item_defaults(key)
            out |= {f"{key}[{i}].{name}" for name, v in item.items() if v != item_default.get(name, _MISSING)}
        return out
    return {key} if value != default else set()


def _item_defaults(key: str) -> dict:
    from streamrft.config.reward import RewardSourceConfig

    types = {"reward.sources": lambda: RewardSourceConfig(name="")}
    return msgspec.to_builtins(types[key]())


_ITEM_TYPES = ("reward.sources",)
_MISSING = object()


def _value(cfg, dotted: str) -> Any:
    """The value of ``a.b`` or ``a.b[3].c`` in a Config."""
    node = cfg
    for part in dotted.split("."):
        name, _, index = part.partition("[")
        node = getattr(node, name)
        if index:
            node = node[int(index.rstrip("]"))]
    return node


def _template(key: str) -> tuple[str, str]:
    """``reward.sources[2].address`` -> (``reward.sources[].address``, ``[2]``)."""
    if "[" not in key:
        return key, ""
    head, _, rest = key.partition("[")
    index, _, tail = rest.partition("]")
    return f"{head}[]{tail}", f"[{index}]"


def _is_set(value: Any) -> bool:
    return bool(value)


def validate_variants(cfg, written: set[str] | None = None) -> None:
    """Raise ConfigError for the first key (in table order) that the user set although the variant it
    belongs to is not selected. ``written``: keys from the file and overrides (``written_keys``);
    None = keys that differ from their defaults (a Config built in code)."""
    keys = set_keys(cfg) if written is None else written
    by_template: dict[str, list[str]] = {}
    for key in keys:
        template, index = _template(key)
        if template in VARIANT_KEYS:
            by_template.setdefault(template, []).append(index)
    for template in VARIANT_KEYS:
        for index in sorted(by_template.get(template, [])):
            key = template.replace("[]", index)
            failed = _unselected(cfg, template, index)
            if failed is None:
                continue
            owner_key, current, values = failed
            if values == SET:
                raise ConfigError(f"{key} is set but {owner_key}={current!r}; it applies only when "
                                  f"{owner_key} is set; remove {key} or set {owner_key}")
            raise ConfigError(f"{key} is set but {owner_key}={current!r}; it applies only to "
                              f"{owner_key} in {values!r}; remove {key} or change {owner_key}")


def _unselected(cfg, template: str, index: str):
    """(owner key, its value, the values it needs) of the outermost variant not selected above
    ``template`` (teacher.weight -> teacher.mode -> teacher.type), or None when all are selected."""
    owner, values = VARIANT_KEYS[template]
    if owner in VARIANT_KEYS:
        outer = _unselected(cfg, owner, index)
        if outer is not None:
            return outer
    owner_key = owner.replace("[]", index)
    current = _value(cfg, owner_key)
    selected = _is_set(current) if values == SET else current in values
    return None if selected else (owner_key, current, values)
