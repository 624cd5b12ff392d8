"""Raw rows of a jsonl, parquet or Arrow file, or of a ``datasets`` directory, with errors that name the file,
the row and where in the file.

The one reader behind the prompt datasets (``streamrft.data.prompts``), the reward-model datasets
(``streamrft.rm.data``) and ``streamrft eval``. A jsonl file is read as bytes and decoded line by line,
so a line that is not UTF-8 is reported with its row, line and byte offset instead of a bare
``UnicodeDecodeError`` from deep inside the file iterator.

What the ``datasets`` library writes is read with pyarrow alone (no ``datasets`` needed):

- ``.arrow`` files: Arrow IPC streams, as ``datasets`` writes its cache files
  (``~/.cache/huggingface/datasets/.../NAME-train.arrow``) and ``save_to_disk`` shards (the IPC file format,
  Feather v2, is read too);
- ``save_to_disk`` directories: a ``Dataset`` (``state.json`` listing its ``data-*.arrow`` shards, read in
  that order) or a ``DatasetDict`` (``dataset_dict.json`` and one such directory per split), split
  ``train`` unless the path says ``DIR:SPLIT``.

Only a hub id (``org/name``, ``org/name:split``) needs the optional ``datasets`` library.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from streamrft.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json")
ARROW_SUFFIX = ".arrow"
_SAVED_MARKERS = ("state.json", "dataset_dict.json", "dataset_info.json")  # what save_to_disk writes
try:
    import pyarrow as _pa

    _ARROW_ERRORS: tuple[type[BaseException], ...] = (_pa.ArrowException,)
except ImportError:  # pyarrow is a dependency; this only keeps the module importable without it
    _ARROW_ERRORS = ()


def read_rows(path: str | Path) -> list[dict]:
    """Every row of a ``.jsonl`` / ``.json`` (one object per line), ``.parquet`` or ``.arrow`` file, or of a
    ``datasets`` save_to_disk directory (``DIR`` or ``DIR:SPLIT``), as dicts; or, with the optional ``datasets``
    library, of a hub id (``needs_datasets_library``).

    Row numbers in errors are 0-based and count non-blank lines (a directory's rows count across its shards);
    line numbers are 1-based; byte offsets are 0-based from the start of the file (``head -c OFFSET`` /
    ``xxd -s OFFSET`` find them).
    """
    saved = saved_dataset(str(path))
    if saved is not None:
        return _read_saved(*saved)
    if needs_datasets_library(str(path)):
        return _read_datasets(str(path))
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset file {path} does not exist")
    if not path.is_file():
        raise DataError(f"dataset path {path} is not a file")
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix == ARROW_SUFFIX:
        return _table_rows(_read_arrow(path), str(path))
    if path.suffix not in JSONL_SUFFIXES:
        raise DataError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl, .parquet or .arrow "
                        "(or a datasets save_to_disk directory)")
    return _read_jsonl(path)


def first_row(path: str | Path) -> dict | None:
    """The first row of a local .jsonl / .parquet / .arrow file or save_to_disk directory without reading the rest
    (the config check peeks at it); None when there is none or it cannot be read (the dataset loader reports that
    with its row)."""
    try:
        saved = saved_dataset(str(path))
        if saved is not None:
            shards = _saved_shards(*saved)
            return _first_arrow_row(shards[0]) if shards else None
        path = Path(path)
        if path.suffix == ARROW_SUFFIX:
            return _first_arrow_row(path)
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
    except (OSError, ValueError, ImportError, DataError) + _ARROW_ERRORS:
        return None
    return None


def saved_dataset(value: str) -> tuple[Path, str | None] | None:
    """(directory, split or None) when ``value`` is a ``datasets`` save_to_disk directory, given as ``DIR`` or
    ``DIR:SPLIT``; None otherwise."""
    p, split = Path(value), None
    if not p.is_dir() and ":" in value:
        head, _, tail = value.rpartition(":")
        if tail and Path(head).is_dir():
            p, split = Path(head), tail
    if p.is_dir() and any((p / name).is_file() for name in _SAVED_MARKERS):
        return p, split
    return None


def needs_datasets_library(value: str) -> bool:
    """A hub id (``org/name`` or ``org/name:split``) that is not a local path: only the ``datasets`` library
    reads it (from its cache, or the hub when a network is there)."""
    p = Path(value)
    if p.exists() or p.suffix in (".parquet", ARROW_SUFFIX, *JSONL_SUFFIXES) or saved_dataset(value) is not None:
        return False
    return bool(re.match(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?$", value))


def is_datasets_source(value: str) -> bool:
    """A dataset in a ``datasets`` layout: a save_to_disk directory (read with pyarrow) or a hub id (read with
    the ``datasets`` library)."""
    return saved_dataset(value) is not None or needs_datasets_library(value)


def datasets_missing_error(value: str) -> str | None:
    """The error text when ``value`` needs the ``datasets`` library and it is not installed, else None
    (save_to_disk directories and .arrow files need only pyarrow)."""
    import importlib.util

    if not needs_datasets_library(value) or importlib.util.find_spec("datasets") is not None:
        return None
    return (f"dataset {value!r} is a hub id (not a local file or directory), which needs the `datasets` library "
            "(not installed): pip install 'streamrft[datasets]', or give a local .jsonl / .parquet / .arrow file or "
            "save_to_disk directory")


def _read_datasets(value: str) -> list[dict]:
    """Rows of a hub id (``org/name[:split]``, split ``train`` by default; from the datasets cache, or the hub
    when a network is there), through the optional ``datasets`` library."""
    missing = datasets_missing_error(value)
    if missing:
        raise DataError(missing)
    import datasets

    try:
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
    return _table_rows(table, str(path))


def _table_rows(table, where: str) -> list[dict]:
    """The rows of an Arrow table as dicts; a cell that cannot be converted is named by row and field."""
    import pyarrow as pa

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
                    raise DataError(f"{where}: row {i} field {name!r} cannot be read "
                                    f"({type(cell_exc).__name__}: {cell_exc}); fix or drop that row") from None
        raise DataError(f"{where}: rows cannot be converted ({type(exc).__name__}: {exc})") from None


def _open_arrow(path: Path):
    """A record-batch reader over an Arrow IPC stream (what ``datasets`` writes) or IPC file (Feather v2)."""
    import pyarrow as pa

    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist")
    data = pa.py_buffer(path.read_bytes())  # in memory: no memory map outliving the file handle
    try:
        return pa.ipc.open_stream(data)
    except pa.ArrowInvalid:
        pass
    try:
        return pa.ipc.open_file(data)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Arrow IPC stream or file ({type(exc).__name__}: {exc}); "
                        "write it with datasets (save_to_disk) or pyarrow.ipc.new_stream, or use .parquet") from None


def _read_arrow(path: Path):
    import pyarrow as pa

    reader = _open_arrow(path)
    try:
        return reader.read_all()
    except (pa.ArrowException, OSError) as exc:  # a torn stream: the schema reads, a batch does not
        raise DataError(f"{path}: the Arrow data is truncated or corrupt ({type(exc).__name__}: {exc}); "
                        "write the file again") from None


def _first_arrow_row(path: Path) -> dict | None:
    """The first row of an .arrow file, reading only the batches up to it."""
    reader = _open_arrow(path)
    if hasattr(reader, "get_batch"):  # IPC file: random access
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    for batch in batches:
        if batch.num_rows:
            return batch.slice(0, 1).to_pylist()[0]
    return None


def _load_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read the {what} ({type(exc).__name__}: {exc}); save the dataset again "
                        "with save_to_disk") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: the {what} is a {type(value).__name__}, expected an object")
    return value


def _saved_shards(directory: Path, split: str | None) -> list[Path]:
    """The .arrow shards of a save_to_disk directory (a DatasetDict's ``split``, ``train`` by default), in order."""
    if (directory / "dataset_dict.json").is_file():
        splits = _load_json(directory / "dataset_dict.json", "DatasetDict index").get("splits")
        if not isinstance(splits, list):
            raise DataError(f"{directory / 'dataset_dict.json'}: no 'splits' list; save the dataset again")
        split = split or "train"
        if split not in splits:
            raise DataError(f"{directory}: the DatasetDict has no split {split!r} (splits: {', '.join(map(str, splits))}); "
                            f"give {directory}:SPLIT")
        return _saved_shards(directory / split, None)
    if split is not None:
        raise DataError(f"{directory}:{split}: {directory} is a single Dataset (no dataset_dict.json), it has no "
                        "splits; drop ':" + split + "'")
    if (directory / "state.json").is_file():
        files = _load_json(directory / "state.json", "Dataset state").get("_data_files")
        if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
            raise DataError(f"{directory / 'state.json'}: no '_data_files' list of {{'filename': ...}}; save the "
                            "dataset again with save_to_disk")
        shards = [directory / str(f["filename"]) for f in files]
        for shard in shards:
            if not shard.is_file():
                raise DataError(f"{directory}: state.json lists {shard.name}, which does not exist; the directory "
                                "is incomplete: copy it again or save the dataset again")
        return shards
    shards = sorted(directory.glob("*" + ARROW_SUFFIX))
    if not shards:
        raise DataError(f"{directory}: no .arrow files and no state.json; not a save_to_disk directory")
    return shards


def _read_saved(directory: Path, split: str | None) -> list[dict]:
    """Rows of a save_to_disk directory: its shards' tables concatenated (rows numbered across shards)."""
    import pyarrow as pa

    shards = _saved_shards(directory, split)
    tables = [_read_arrow(shard) for shard in shards]
    where = str(directory) if split is None else f"{directory}:{split}"
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as exc:
        raise DataError(f"{where}: its shards have different columns ({exc}); save the dataset again") from None
    return _table_rows(table, where)
