"""Prompt datasets from jsonl or parquet, checked row by row with errors naming file, row and field."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from streamrft.data.errors import DataError
from streamrft.data.rows import read_rows


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    reference: str
    label: str
    row: int  # 0-based row in the file
    # the row's other fields, raw (media values: paths, bytes, data URIs, frame lists); read by
    # streamrft.models.media_inputs.MediaCodec for data.image_field / video_field / audio_field
    extra: dict = field(default_factory=dict, compare=False, repr=False)


class PromptDataset:
    """Rows of (prompt, reference, label). ``reference`` and ``label`` may be absent if not required."""

    def __init__(
        self,
        path: str | Path,
        prompt_field: str = "prompt",
        reference_field: str = "reference",
        label_field: str = "label",
        require_reference: bool = True,
    ) -> None:
        self.path = Path(path)
        self.rows: list[PromptRow] = []
        for i, raw in enumerate(read_rows(self.path)):
            if not isinstance(raw, dict):
                raise DataError(f"{self.path}: row {i} is a {type(raw).__name__}, expected an object")
            self.rows.append(self._parse(i, raw, prompt_field, reference_field, label_field, require_reference))
        if not self.rows:
            raise DataError(f"{self.path}: the dataset has no rows")

    def _parse(self, i, raw, prompt_field, reference_field, label_field, require_reference) -> PromptRow:
        def text(name: str, required: bool, default: str = "") -> str:
            if name not in raw or raw[name] is None:
                if required:
                    raise DataError(
                        f"{self.path}: row {i} has no field {name!r} (fields present: {sorted(raw)}); "
                        f"fix the row or set data.{'prompt' if name == prompt_field else 'reference'}_field"
                    )
                return default
            value = raw[name]
            if not isinstance(value, (str, int, float)):
                raise DataError(f"{self.path}: row {i} field {name!r} is a {type(value).__name__}, expected text")
            return str(value)

        return PromptRow(
            prompt=text(prompt_field, True),
            reference=text(reference_field, require_reference),
            label=text(label_field, False, "default") or "default",
            row=i,
            extra={k: v for k, v in raw.items() if k not in (prompt_field, reference_field, label_field)},
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]
