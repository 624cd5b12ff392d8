"""Shared base for config sections: keyword-only, frozen-free msgspec Structs that reject unknown keys."""

from __future__ import annotations

import msgspec


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base for every config section. Each field's trailing comment is its one-line doc."""


class ConfigError(ValueError):
    """A config that cannot run: names the key, the value, the constraint and how to fix it."""
