"""Prompt datasets from jsonl, parquet (or a ``datasets`` directory / hub id), checked row by row with errors
naming file, row and field.

Which field is the prompt, the reference and the label follows ``data.format`` (streamrft.data.formats:
``flat``, verl's and TRL's layouts, dotted paths such as ``reward_model.ground_truth``). A prompt is text or
a list of chat messages (streamrft.data.chat renders it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from streamrft.data.chat import check_messages, is_messages
from streamrft.data.errors import DataError
from streamrft.data.formats import field_mapping, get_field, written_roles
from streamrft.data.rows import read_rows


_ABSENT = object()  # get_field's default: a field that is not in the row at all (None: it is, as null)


@dataclass(frozen=True)
class PromptRow:
    prompt: str | list  # text, or chat messages [{"role", "content"}] (rendered by streamrft.data.chat.render_prompt)
    reference: str
    label: str
    row: int  # 0-based row in the file
    # the row's other top-level fields, raw (media values: paths, bytes, data URIs, frame lists; verl's
    # extra_info / reward_model; TRL's extra columns); read by streamrft.models.media_inputs.MediaCodec for
    # data.image_field / video_field / audio_field
    extra: dict = field(default_factory=dict, compare=False, repr=False)


class PromptDataset:
    """Rows of (prompt, reference, label). ``reference`` and ``label`` may be absent if not required.

    ``format``: ``auto | flat | verl | trl`` (streamrft.data.formats); ``chat_template="none"`` refuses
    message-list prompts here, at load time, naming the row.
    """

    def __init__(
        self,
        path: str | Path,
        prompt_field: str = "prompt",
        reference_field: str = "reference",
        label_field: str = "label",
        require_reference: bool = True,
        format: str = "flat",
        chat_template: str = "auto",
        written: frozenset[str] = frozenset(),
    ) -> None:
        self.path = Path(path)
        self.rows: list[PromptRow] = []
        raws = read_rows(path)
        try:
            self.format, self.fields = field_mapping(format, raws[0] if raws and isinstance(raws[0], dict) else None,
                                                     prompt_field, reference_field, label_field, written)
        except ValueError as exc:
            raise DataError(f"{self.path}: {exc}") from None
        self._chat_template = chat_template
        for i, raw in enumerate(raws):
            if not isinstance(raw, dict):
                raise DataError(f"{self.path}: row {i} is a {type(raw).__name__}, expected an object")
            self.rows.append(self._parse(i, raw, require_reference))
        if not self.rows:
            raise DataError(f"{self.path}: the dataset has no rows")

    @classmethod
    def from_config(cls, path: str | Path, data_cfg, require_reference: bool = True,
                    written_keys: frozenset[str] | None = None) -> "PromptDataset":
        """The dataset at ``path`` read with the run's ``data`` section (fields, format, chat_template);
        ``written_keys``: the config keys the user wrote (``Config._written``), so a data.*_field written with
        its default value still wins over the format's preset."""
        written = written_roles(written_keys)
        return cls(path, data_cfg.prompt_field, data_cfg.reference_field, data_cfg.label_field, require_reference,
                   data_cfg.format, data_cfg.chat_template, written)

    def _hint(self, role: str) -> str:
        if self.format != "flat":
            return f"fix the row, or set data.{role}_field (data.format={self.format} reads {self.fields[role]!r})"
        return f"fix the row or set data.{role}_field"

    def _parse(self, i, raw, require_reference) -> PromptRow:
        def text(role: str, required: bool, default: str = "") -> str:
            name = self.fields[role]
            value = get_field(raw, name, _ABSENT)
            if value is _ABSENT or value is None:
                if not required:
                    return default
                if value is None:
                    raise DataError(f"{self.path}: row {i} field {name!r} is null; {self._hint(role)}")
                raise DataError(f"{self.path}: row {i} has no field {name!r} (fields present: {sorted(raw)}); "
                                f"{self._hint(role)}")
            if not isinstance(value, (str, int, float)):
                raise DataError(f"{self.path}: row {i} field {name!r} is a {type(value).__name__}, expected text")
            return str(value)

        name = self.fields["prompt"]
        prompt = get_field(raw, name, None)
        if is_messages(prompt):
            loc = f"{self.path}: row {i} field {name!r}"
            prompt = check_messages(prompt, loc)
            if self._chat_template == "none":
                raise DataError(f"{loc}: the prompt is a list of messages but data.chat_template=none; set "
                                "data.chat_template=auto (the tokenizer's template) or a Jinja file, or give text prompts")
        else:
            prompt = text("prompt", True)
        # top-level fields read as a whole leave extra; a nested one's parent (verl's reward_model) stays
        used = {f for f in self.fields.values() if f in raw}
        return PromptRow(
            prompt=prompt,
            reference=text("reference", require_reference),
            label=text("label", False, "default") or "default",
            row=i,
            extra={k: v for k, v in raw.items() if k not in used},
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]
