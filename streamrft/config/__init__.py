"""One typed config tree (msgspec Structs), loaded from YAML/TOML plus dotted key=value overrides.

Unknown keys, wrong types and incompatible settings are errors before any process group, socket or
model is created. ``validate_*`` functions only raise; ``derive_*`` functions fill in values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrft.config.algorithm import AlgorithmConfig
from streamrft.config.base import ConfigError, Section
from streamrft.config.checkpoint import CheckpointConfig
from streamrft.config.data import DataConfig
from streamrft.config.engine import EngineConfig
from streamrft.config.env import EnvConfig
from streamrft.config.metrics import MetricsConfig, SinksConfig
from streamrft.config.model import ModelConfig
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.config.rollout import RolloutConfig
from streamrft.config.teacher import TeacherConfig
from streamrft.config.train import TrainConfig


class WarmupConfig(Section):
    steps: int = 0  # supervised warm-up steps on (prompt, reference) pairs before RL; 0 = none
    lr: float = 1e-3
    batch_size: int = 32


class Config(Section, dict=True):
    # dict=True: load_config records the keys the user wrote (file + overrides) as ``_written`` on the
    # instance, outside the fields (see config/variants.py); a Config built in code has none.
    seed: int = 0  # seeds data order, sampling (per step, prompt, sample) and init
    output_dir: str = "runs/default"  # checkpoints, logs, metrics files
    fail_fast: bool = False  # stop the run on the first failed sample instead of counting it
    # torch.compile (Inductor) and Triton kernel caches kept here across runs (streamrft/compile_cache.py);
    # "" = their own per-user defaults (/tmp/torchinductor_$USER, ~/.triton/cache)
    compile_cache_dir: str = ""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    sinks: SinksConfig = msgspec.field(default_factory=SinksConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)  # multi-turn episodes (docs/agents.md)


__all__ = [
    "Config",
    "ConfigError",
    "RewardSourceConfig",
    "load_config",
    "apply_overrides",
    "validate_config",
]


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = msgspec.toml.decode(text)
        else:
            data = _yaml_value(text)
    except (yaml.YAMLError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'yaml'}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as text (it wants ``1.0e-3``); YAML 1.2 and every user mean a number.
    Implicit resolvers only apply to plain scalars, so a quoted ``"2024"`` or ``"1e-3"`` stays text."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
# YAML 1.1 also reads yes/no/on/off as booleans, so `algorithm.tis_mode=off` became False ("Expected
# `str`, got `bool`"); as in YAML 1.2 only true/false are booleans, every other word stays text.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _yaml_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides in place; values are parsed as YAML scalars/lists (as in the
    file: ``key=2024`` is a number, ``key='"2024"'`` the text 2024)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_steps=10)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override key {key!r} is not a dotted key like train.max_steps")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {part} is a value, not a section")
            node = child
        try:
            value = _yaml_value(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return data


def load_typed_config(path: str | Path | None, overrides: list[str] | None, config_type: type, what: str = "config"):
    """Read a YAML/TOML file, apply dotted overrides, type-check every key into ``config_type``
    (unknown keys fail). Shared by the training, reward-model and evaluation configs."""
    return _load(path, overrides, config_type, what)[0]


def _load(path, overrides, config_type: type, what: str = "config"):
    data = _read_file(Path(path)) if path else {}
    apply_overrides(data, overrides or [])
    try:
        return msgspec.convert(data, config_type), data
    except msgspec.ValidationError as exc:
        source = path or what
        if path and overrides and _converts(_read_file(Path(path)), config_type):  # the file alone is fine
            source = f"the overrides ({' '.join(overrides)})"
        raise ConfigError(f"{source}: {exc}".replace("$.", "")) from None


def _converts(data: dict, config_type: type) -> bool:
    try:
        msgspec.convert(data, config_type)
    except msgspec.ValidationError:
        return False
    return True


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """The training config: a YAML/TOML file plus overrides, every key type-checked. Remembers which
    keys were written (``_written``), so validation can refuse settings of unselected variants."""
    from streamrft.config.variants import written_keys

    cfg, data = _load(path, overrides, Config)
    cfg._written = frozenset(written_keys(data))
    return cfg


def validate_config(cfg: Config, world_size: int = 1, check_paths: bool = True) -> None:
    """Raise ConfigError for settings that cannot run together. Runs before anything starts.

    Relative paths in a config are relative to the working directory. ``check_paths`` also checks
    that the model directory and the data files exist.
    """
    from streamrft.config.env import validate_env
    from streamrft.config.validate import validate_all

    validate_all(cfg, world_size, check_paths)
    from streamrft.compile_cache import check_compile_cache_dir

    check_compile_cache_dir(cfg.compile_cache_dir)
    validate_env(cfg, check_paths)  # imports the environment's module (user code) after the cheaper checks, before any model
