"""Raw rows of a jsonl or parquet file, with errors that name the file, the row and where in the file.

The one reader behind the prompt datasets (``streamrft.data.prompts``), the reward-model datasets
(``streamrft.rm.data``) and ``streamrft eval``. A jsonl file is read as bytes and decoded line by line,
so a line that is not UTF-8 is reported with its row, line and byte offset instead of a bare
``UnicodeDecodeError`` from deep inside the file iterator.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from streamrft.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json")
try:
    import pyarrow as _pa

    _ARROW_ERRORS: tuple[type[BaseException], ...] = (_pa.ArrowException,)
except ImportError:  # pyarrow is a dependency; this only keeps the module importable without it
    _ARROW_ERRORS = ()


def read_rows(path: str | Path) -> list[dict]:
    """Every row of a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file, as dicts; or, with the
    optional ``datasets`` library, of a datasets directory or hub id (``is_datasets_source``).

    Row numbers in errors are 0-based and count non-blank lines; line numbers are 1-based; byte
    offsets are 0-based from the start of the file (``head -c OFFSET`` / ``xxd -s OFFSET`` find them).
    """
    if is_datasets_source(str(path)):
        return _read_datasets(str(path))
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset file {path} does not exist")
    if not path.is_file():
        raise DataError(f"dataset path {path} is not a file")
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix not in JSONL_SUFFIXES:
        raise DataError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")
    return _read_jsonl(path)


def first_row(path: str | Path) -> dict | None:
    """The first row of a local .jsonl / .parquet file without reading the rest (the config check peeks at it);
    None when there is none or it cannot be read (the dataset loader reports that with its row)."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
                rows = batch.to_pylist()
                return rows[0] if rows else None
            return None
        with path.open("rb") as f:
            for raw in f:
                if raw.strip():
                    row = json.loads(raw.decode("utf-8"))
                    return row if isinstance(row, dict) else None
    except (OSError, ValueError, ImportError) + _ARROW_ERRORS:
        return None
    return None


def is_datasets_source(value: str) -> bool:
    """A path the ``datasets`` library reads: a ``save_to_disk`` directory, or a hub id (``org/name`` or
    ``org/name:split``) that is not a local file."""
    p = Path(value)
    if p.is_dir():
        return (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()
    if p.exists() or p.suffix in (".parquet", *JSONL_SUFFIXES):
        return False
    return bool(re.match(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?$", value))


def datasets_missing_error(value: str) -> str | None:
    """The error text when ``value`` needs the ``datasets`` library and it is not installed, else None."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        return None
    return (f"dataset {value!r} is a datasets directory or hub id, which needs the `datasets` library "
            "(not installed): pip install 'streamrft[datasets]', or export the rows to .jsonl / .parquet")


def _read_datasets(value: str) -> list[dict]:
    """Rows of a ``datasets`` save_to_disk directory (split ``train`` of a DatasetDict) or of a hub id
    (``org/name[:split]``, split ``train`` by default; from the datasets cache, or the hub when a network is there)."""
    missing = datasets_missing_error(value)
    if missing:
        raise DataError(missing)
    import datasets

    try:
        if Path(value).is_dir():
            data = datasets.load_from_disk(value)
            split = "train"
        else:
            name, _, split = value.partition(":")
            split = split or "train"
            data = datasets.load_dataset(name, split=split)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataError(f"{value}: no split {split!r} (splits: {sorted(data)})")
            data = data[split]
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ConnectionError)
        raise DataError(f"{value}: the datasets library cannot load it ({type(exc).__name__}: {exc})") from None
    return [dict(row) for row in data]


def _read_jsonl(path: Path) -> list[dict]:
    rows: list[dict] = []
    offset = 0  # byte offset of the current line's first byte
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            where = f"row {len(rows)} (line {i + 1}, byte offset {offset})"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: {where} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset "
                    f"{offset + exc.start}; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: {where} is not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: {where} is a {type(row).__name__}, expected a JSON object")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:  # ArrowInvalid for a file that is not parquet, IOError for a torn one
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc}); "
                        "rewrite it with pyarrow.parquet.write_table or use .jsonl") from None
    try:
        return table.to_pylist()
    except (pa.ArrowException, UnicodeDecodeError) as exc:
        # Arrow reads strings without checking them; find the first cell that fails (error path only).
        for name in table.column_names:
            column = table.column(name)
            for i in range(len(column)):
                try:
                    column[i].as_py()
                except (pa.ArrowException, UnicodeDecodeError) as cell_exc:
                    raise DataError(f"{path}: row {i} field {name!r} cannot be read "
                                    f"({type(cell_exc).__name__}: {cell_exc}); fix or drop that row") from None
        raise DataError(f"{path}: parquet rows cannot be converted ({type(exc).__name__}: {exc})") from None
