"""Parquet trajectory sink: rolling files of ``rows_per_file`` records, one column per field.

The Arrow schema is derived from ``TrajectoryRecord``'s fields, so a field appended to the record
(the wire contract is append-only) becomes a column without a change here.

A Parquet file is readable only once its footer is written, so the file being filled is named
``*.parquet.inprogress`` and renamed to ``*.parquet`` when it is full or the sink closes: a reader
globbing ``*.parquet`` never sees a half-written file. For the same reason ``flush`` does not force
tiny row groups out: records are converted and compressed (zstd) in row groups of up to
``ROW_GROUP_ROWS``, which costs about a third of writing a row group per step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from protocols import TrajectoryRecord
from protocols.pipeline import MediaRef

ROW_GROUP_ROWS = 1024  # records buffered in memory before one row group is written

# Python annotation -> Arrow type. Log-probs and entropies are float32 on the wire already.
_ARROW_TYPES: dict[Any, pa.DataType] = {
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
    bool: pa.bool_(),
    list[int]: pa.list_(pa.int64()),
    list[float]: pa.list_(pa.float32()),
    list[str]: pa.list_(pa.string()),
    dict[str, float]: pa.map_(pa.string(), pa.float64()),
    list[MediaRef]: pa.list_(
        pa.struct([("path", pa.string()), ("sha256", pa.string()), ("kind", pa.string()), ("field", pa.string()), ("group", pa.int64())])
    ),
}


def trajectory_schema() -> pa.Schema:
    """Arrow schema with one column per TrajectoryRecord field, in field order."""
    columns = []
    for field in msgspec.structs.fields(TrajectoryRecord):
        arrow_type = _ARROW_TYPES.get(field.type)
        if arrow_type is None:
            raise TypeError(
                f"TrajectoryRecord.{field.name} has type {field.type!r}, which the Parquet sink cannot "
                "store; add it to streamrft.sinks.parquet._ARROW_TYPES"
            )
        columns.append(pa.field(field.name, arrow_type))
    return pa.schema(columns)


class ParquetSink:
    """Writes ``<dir>/<run_id>-rank<rank>-<index:05d>.parquet``, rolling every ``rows_per_file``."""

    def __init__(self, directory: str | os.PathLike, rows_per_file: int, run_id: str, rank: int):
        if rows_per_file < 1:
            raise ValueError(f"rows_per_file={rows_per_file} must be >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rows_per_file = rows_per_file
        self._prefix = f"{run_id}-rank{rank}"
        self.schema = trajectory_schema()
        self._names = self.schema.names
        self._columns: dict[str, list[Any]] = {name: [] for name in self._names}
        self._buffered = 0
        self._rows_in_file = 0
        self._file_index = self._next_free_index()
        self._writer: pq.ParquetWriter | None = None
        self._partial_path: Path | None = None
        self.files_written: list[Path] = []

    def _next_free_index(self) -> int:
        # A resumed run continues the numbering instead of overwriting earlier files.
        existing = list(self.directory.glob(f"{self._prefix}-*.parquet"))
        return len(existing)

    def write(self, record: TrajectoryRecord) -> None:
        for name in self._names:
            value = getattr(record, name)
            if isinstance(value, dict):
                value = list(value.items())
            elif value and isinstance(value, list) and isinstance(value[0], msgspec.Struct):
                value = msgspec.to_builtins(value)  # e.g. media: list[MediaRef] -> list of dicts
            self._columns[name].append(value)
        self._buffered += 1
        if self._rows_in_file + self._buffered >= self.rows_per_file:
            self._write_row_group()
            self._finish_file()
        elif self._buffered >= ROW_GROUP_ROWS:
            self._write_row_group()

    def _write_row_group(self) -> None:
        if not self._buffered:
            return
        if self._writer is None:
            stem = f"{self._prefix}-{self._file_index:05d}.parquet"
            self._partial_path = self.directory / f"{stem}.inprogress"
            self._writer = pq.ParquetWriter(self._partial_path, self.schema, compression="zstd")
        table = pa.Table.from_pydict(self._columns, schema=self.schema)
        self._writer.write_table(table)
        self._rows_in_file += self._buffered
        self._columns = {name: [] for name in self._names}
        self._buffered = 0

    def _finish_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        assert self._partial_path is not None
        final = self._partial_path.with_suffix("")  # drop ".inprogress"
        self._partial_path.rename(final)
        self.files_written.append(final)
        self._writer = None
        self._partial_path = None
        self._rows_in_file = 0
        self._file_index += 1

    def flush(self) -> None:
        """Nothing to do before a row group is full: the open file is unreadable until closed anyway."""

    def close(self) -> None:
        self._write_row_group()
        self._finish_file()
