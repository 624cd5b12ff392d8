"""Prompt datasets: bad rows are errors naming file, row and field; the order is deterministic."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrft.data import DataError, EpochOrder, PromptDataset


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_row_missing_a_field_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "reference": "2"}, {"prompt": "2+2="}])
    with pytest.raises(DataError, match=r"d.jsonl: row 1 has no field 'reference'"):
        PromptDataset(path)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "reference": "b"}\n{oops\n')
    with pytest.raises(DataError, match=r"row 1 \(line 2\) is not valid JSON"):
        PromptDataset(path)


def test_parquet_rows_load_with_default_label(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2=", "reference": "3"}]), path)
    (row,) = PromptDataset(path).rows
    assert (row.prompt, row.reference, row.label, row.row) == ("1+2=", "3", "default", 0)


def test_unsupported_format_and_missing_file_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset(tmp_path / "none.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported dataset format '.csv'"):
        PromptDataset(tmp_path / "d.csv")


def test_epoch_order_is_a_permutation_per_epoch_and_reproducible():
    order = EpochOrder(10, seed=3)
    first = [order.row_at(i) for i in range(10)]
    second = [order.row_at(i) for i in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert first == [EpochOrder(10, seed=3).row_at(i) for i in range(10)]
    assert [EpochOrder(10, seed=3, shuffle=False).row_at(i) for i in range(10)] == list(range(10))
