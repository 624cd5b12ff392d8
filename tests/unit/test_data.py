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


def test_a_null_field_is_named_as_null_not_as_missing(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "reference": "2"}, {"prompt": None, "reference": "4"}])
    with pytest.raises(DataError, match=r"d.jsonl: row 1 field 'prompt' is null; fix the row or set data.prompt_field"):
        PromptDataset(path)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "reference": "b"}\n{oops\n')
    with pytest.raises(DataError, match=r"row 1 \(line 2, byte offset 34\) is not valid JSON"):
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


def test_item13_non_utf8_bytes_in_a_jsonl_name_file_row_line_and_byte_offset(tmp_path):
    path = tmp_path / "d.jsonl"
    first = b'{"prompt": "1+1=", "reference": "2"}\n'
    path.write_bytes(first + b"\n" + b'{"prompt": "caf\xe9", "reference": "3"}\n')  # latin-1 e-acute
    with pytest.raises(DataError) as err:
        PromptDataset(path)
    offset = len(first) + 1 + len(b'{"prompt": "caf')  # the bad byte, counted from the file's start
    assert str(err.value) == (
        f"{path}: row 1 (line 3, byte offset {len(first) + 1}) is not valid UTF-8: byte 0xe9 at byte offset "
        f"{offset}; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def test_item13_the_reward_model_and_eval_readers_share_the_checked_reader(tmp_path):
    from streamrft.rm.data import read_preference_pairs

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a", "chosen": "b", "rejected": "\xff"}\n')
    with pytest.raises(DataError, match=r"p.jsonl: row 0 \(line 1, byte offset 0\) is not valid UTF-8: byte 0xff"):
        read_preference_pairs(path)


def test_item13_a_parquet_file_that_is_torn_or_has_a_bad_string_cell_is_named(tmp_path):
    good = tmp_path / "good.parquet"
    strings = pa.array([b"1+1=", b"\xffbad", b"2+2="], pa.binary()).view(pa.string())  # unchecked UTF-8
    pq.write_table(pa.table({"prompt": strings, "reference": ["2", "3", "4"]}), good)
    with pytest.raises(DataError, match=r"good.parquet: row 1 field 'prompt' cannot be read \(UnicodeDecodeError"):
        PromptDataset(good)
    torn = tmp_path / "torn.parquet"
    torn.write_bytes(good.read_bytes()[:100])
    with pytest.raises(DataError, match=r"torn.parquet: not a readable parquet file \(ArrowInvalid: .*magic bytes"):
        PromptDataset(torn)
