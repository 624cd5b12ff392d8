"""What the `datasets` library writes, read with pyarrow alone: .arrow files (IPC streams, as datasets writes its
cache and save_to_disk shards; IPC files too) and save_to_disk directories (Dataset: state.json + shards in
order; DatasetDict: dataset_dict.json + one directory per split, DIR:SPLIT). The layouts are written here with
pyarrow exactly as datasets lays them out; bad rows keep naming the dataset, the row and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from streamrft.config import load_config
from streamrft.config.validate import validate_data
from streamrft.data import DataError, PromptDataset, read_rows
from streamrft.data.rows import first_row, needs_datasets_library

# verl's layout: prompt messages, data_source, nested reward_model.ground_truth, extra_info
ROWS = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+{i}="}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
        for i in range(5)]


def _write_stream(path: Path, rows: list[dict], batch_rows: int = 2) -> None:
    """An Arrow IPC stream in record batches, as datasets' ArrowWriter writes it."""
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)


def _save_to_disk(directory: Path, rows: list[dict], shards: int) -> None:
    """A Dataset.save_to_disk directory: data-0000i-of-0000n.arrow shards, state.json naming them, dataset_info.json."""
    directory.mkdir(parents=True)
    per = -(-len(rows) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        _write_stream(directory / name, rows[i * per:(i + 1) * per])
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                      "_fingerprint": "0", "_split": None}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}}))


def test_an_arrow_stream_file_in_verls_layout_loads_with_nested_fields(tmp_path):
    path = tmp_path / "gsm8k-train.arrow"
    _write_stream(path, ROWS)
    assert read_rows(path) == ROWS
    data = PromptDataset(path, format="auto")
    assert data.format == "verl"
    assert [r.prompt for r in data] == [r["prompt"] for r in ROWS]
    assert [r.reference for r in data] == ["0", "2", "4", "6", "8"]
    assert [r.label for r in data] == ["arith"] * 5
    assert data[3].extra["extra_info"] == {"index": 3}
    assert first_row(path) == ROWS[0]
    # the IPC file format (Feather v2) reads the same
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert read_rows(tmp_path / "f.arrow") == ROWS and first_row(tmp_path / "f.arrow") == ROWS[0]


def test_a_save_to_disk_dataset_reads_its_shards_in_order_and_names_the_bad_row(tmp_path):
    directory = tmp_path / "saved"
    rows = [dict(r) for r in ROWS]
    rows[3] = {**rows[3], "reward_model": {"style": "rule", "ground_truth": None}}  # in the second shard
    _save_to_disk(directory, rows, shards=2)
    assert not needs_datasets_library(str(directory))
    assert read_rows(directory) == rows
    assert first_row(directory) == rows[0]
    with pytest.raises(DataError) as err:
        PromptDataset(directory, format="verl")
    # a columnar file has the column in every row: the bad row's value is null
    assert str(err.value).startswith(f"{directory}: row 3 field 'reward_model.ground_truth' is null")
    with pytest.raises(DataError, match=r"saved:train: .*saved is a single Dataset \(no dataset_dict.json\), it has no "
                                        r"splits; drop ':train'"):
        read_rows(f"{directory}:train")


def test_a_save_to_disk_datasetdict_reads_train_by_default_and_dir_colon_split(tmp_path):
    directory = tmp_path / "dd"
    _save_to_disk(directory / "train", ROWS[:3], shards=1)
    _save_to_disk(directory / "test", ROWS[3:], shards=1)
    (directory / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert [r.reference for r in PromptDataset(directory, format="verl")] == ["0", "2", "4"]
    assert [r.reference for r in PromptDataset(f"{directory}:test", format="verl")] == ["6", "8"]
    with pytest.raises(DataError) as err:
        read_rows(f"{directory}:validation")
    assert str(err.value) == (f"{directory}: the DatasetDict has no split 'validation' (splits: train, test); "
                              f"give {directory}:SPLIT")
    # accepted by the config check without the datasets library (the pyarrow reader needs nothing more)
    cfg = load_config(None, [f"data.train_path={directory}:test", f"data.eval_path={directory}"])
    validate_data(cfg)


def test_damaged_arrow_data_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "torn.arrow"
    _write_stream(path, ROWS, batch_rows=1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])  # a copy cut short: the schema reads, the last batches do not
    with pytest.raises(DataError, match=rf"{path}: the Arrow data is truncated or corrupt"):
        read_rows(path)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=r"junk.arrow: not a readable Arrow IPC stream or file"):
        read_rows(tmp_path / "junk.arrow")
    directory = tmp_path / "incomplete"
    _save_to_disk(directory, ROWS, shards=2)
    (directory / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(DataError, match=r"incomplete: state.json lists data-00001-of-00002.arrow, which does not "
                                        r"exist; the directory is incomplete"):
        read_rows(directory)
