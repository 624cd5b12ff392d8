"""Dataset layouts (``data.format``) and dotted field paths: which row field is the prompt, the reference
answer and the task label. Pure functions over rows; reading files is streamrft.data.rows.

Presets (a ``data.*_field`` the user sets always wins over the preset):

============  ==============================  ======================================  ===============
format        prompt                          reference                               label
============  ==============================  ======================================  ===============
``flat``      ``data.prompt_field``           ``data.reference_field``                ``data.label_field``
              (default ``prompt``)            (default ``reference``)                 (default ``label``)
``verl``      ``prompt`` (messages)           ``reward_model.ground_truth``           ``data_source``
``trl``       ``prompt`` (text or messages)   ``solution``                            ``label``
============  ==============================  ======================================  ===============

verl's other columns (``ability``, ``extra_info``, ...) and TRL's extra columns stay in the row's ``extra``.
``auto`` picks from the first row: ``verl`` when it has ``reward_model.ground_truth``; else ``trl`` when it
has no reference field but a ``solution`` column; else ``flat``.

A field path ``a.b.c`` reads ``row["a"]["b"]["c"]``; a key that itself contains dots (``row["a.b"]``) is
read first when present.
"""

from __future__ import annotations

FORMATS = ("auto", "flat", "verl", "trl")
DEFAULT_FIELDS = {"prompt": "prompt", "reference": "reference", "label": "label"}
PRESETS: dict[str, dict[str, str]] = {
    "flat": DEFAULT_FIELDS,
    "verl": {"prompt": "prompt", "reference": "reward_model.ground_truth", "label": "data_source"},
    "trl": {"prompt": "prompt", "reference": "solution", "label": "label"},
}
_MISSING = object()  # get_field's "no default given"
_ABSENT = object()  # has_field's probe value


def get_field(row: dict, path: str, default=_MISSING):
    """``row[path]``, else the nested value at the dotted ``path``; ``default`` (or KeyError naming the
    first missing part) when absent."""
    if path in row:
        return row[path]
    value: object = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is not _MISSING:
                return default
            raise KeyError(part)
        value = value[part]
    return value


def has_field(row: dict, path: str) -> bool:
    return get_field(row, path, _ABSENT) is not _ABSENT


def detect_format(row: dict, reference_field: str = "reference") -> str:
    """``auto``'s choice for a dataset whose first row is ``row`` (see the module docstring)."""
    if has_field(row, "reward_model.ground_truth"):
        return "verl"
    if not has_field(row, reference_field) and "solution" in row:
        return "trl"
    return "flat"


def written_roles(written_keys) -> frozenset[str]:
    """The roles whose ``data.<role>_field`` key is among the config keys the user wrote (``Config._written``)."""
    return frozenset(role for role in DEFAULT_FIELDS if f"data.{role}_field" in (written_keys or ()))


def field_mapping(fmt: str, first_row: dict | None, prompt_field: str = "prompt",
                  reference_field: str = "reference", label_field: str = "label",
                  written: frozenset[str] = frozenset()) -> tuple[str, dict[str, str]]:
    """(resolved format, {"prompt"|"reference"|"label": field path}) for ``data.format`` and the configured
    fields; a configured field that differs from its default, or that the user wrote (``written`` holds
    ``"prompt"`` / ``"reference"`` / ``"label"`` for data.*_field keys in the config), overrides the preset."""
    if fmt not in FORMATS:
        raise ValueError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(first_row or {}, reference_field)
    configured = {"prompt": prompt_field, "reference": reference_field, "label": label_field}
    fields = {k: v if v != DEFAULT_FIELDS[k] or k in written else PRESETS[fmt][k] for k, v in configured.items()}
    return fmt, fields
