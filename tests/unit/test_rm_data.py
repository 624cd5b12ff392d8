"""Preference / judgment files: exact errors naming file, row and field; optional fields; parquet."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrft.data import DataError
from streamrft.rm.data import read_judgments, read_preference_pairs, split_holdout


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_row_missing_a_field_is_an_error_naming_file_row_and_field(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                        {"prompt": "2+2=", "rejected": "5"}])
    with pytest.raises(DataError) as err:
        read_preference_pairs(path)
    assert str(err.value) == f"{path}: row 1: missing field 'chosen' (each row needs prompt, chosen, rejected)"


def test_a_field_of_the_wrong_type_is_named(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "tie": "yes"}])
    with pytest.raises(DataError, match=r"row 0: field 'tie' must be bool, got str"):
        read_preference_pairs(path)


def test_margin_and_tie_are_optional_and_read_when_given(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                        {"prompt": "a", "chosen": "b", "rejected": "c", "margin": 2, "tie": True}])
    first, second = read_preference_pairs(path)
    assert (first.margin, first.tie) == (0.0, False)
    assert (second.margin, second.tie) == (2.0, True)


def test_parquet_rows_are_read_like_jsonl(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]), path)
    (pair,) = read_preference_pairs(path)
    assert (pair.prompt, pair.chosen, pair.rejected) == ("1+1=", "2", "3")


def test_judgment_rows_need_one_or_two_responses(tmp_path):
    path = write(tmp_path / "j.jsonl", [{"prompt": "p", "responses": ["a", "b", "c"], "judgment": "[[A]]"}])
    with pytest.raises(DataError, match=r"row 0: field 'responses' must be a list of 1 or 2 strings"):
        read_judgments(path)
    path = write(tmp_path / "k.jsonl", [{"prompt": "p", "responses": ["a", "b"]}])
    with pytest.raises(DataError, match=r"row 0: missing field 'judgment'"):
        read_judgments(path)


def test_the_holdout_split_is_disjoint_seeded_and_sized_by_the_fraction():
    train, held = split_holdout(list(range(100)), 0.1, seed=3)
    assert len(held) == 10 and not set(train) & set(held) and sorted(train + held) == list(range(100))
    assert split_holdout(list(range(100)), 0.1, seed=3) == (train, held)
