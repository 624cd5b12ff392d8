"""Dataset layouts users already have: dotted field paths, verl's parquet layout, TRL's layout, the optional
`datasets` library; bad rows still name file, row and field."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrft.config import ConfigError, load_config
from streamrft.config.validate import validate_data
from streamrft.data import DataError, PromptDataset
from streamrft.data.formats import detect_format, field_mapping, get_field


def _verl_rows(n: int = 3) -> list[dict]:
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_dotted_paths_read_nested_fields_and_exact_keys_first():
    row = {"reward_model": {"ground_truth": "7"}, "a.b": "flat", "a": {"b": "nested"}}
    assert get_field(row, "reward_model.ground_truth") == "7"
    assert get_field(row, "a.b") == "flat"
    assert get_field(row, "reward_model.style", None) is None
    with pytest.raises(KeyError, match="style"):
        get_field(row, "reward_model.style")


def test_presets_and_configured_fields():
    verl = _verl_rows(1)[0]
    assert detect_format(verl) == "verl"
    assert detect_format({"prompt": "x", "solution": "1"}) == "trl"
    assert detect_format({"prompt": "x", "reference": "1", "solution": "2"}) == "flat"
    assert field_mapping("auto", verl) == ("verl", {"prompt": "prompt", "reference": "reward_model.ground_truth",
                                                    "label": "data_source"})
    assert field_mapping("trl", None) == ("trl", {"prompt": "prompt", "reference": "solution", "label": "label"})
    # a field the user set wins over the preset
    assert field_mapping("trl", None, reference_field="answer")[1]["reference"] == "answer"


def test_verl_parquet_loads_without_conversion(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), path)
    ds = PromptDataset(path, format="auto")
    assert ds.format == "verl" and len(ds) == 3
    row = ds[2]
    assert row.prompt == [{"role": "user", "content": "What is 2 + 2?"}]
    assert (row.reference, row.label) == ("4", "openai/gsm8k")
    # the other columns stay with the row (for reward functions that want extra_info); prompt and data_source leave
    assert row.extra["extra_info"] == {"split": "train", "index": 2}
    assert row.extra["reward_model"]["style"] == "rule" and "prompt" not in row.extra and "data_source" not in row.extra


def test_trl_jsonl_loads_with_solution_as_reference(tmp_path):
    path = tmp_path / "trl.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "solution": "2", "difficulty": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (row,) = PromptDataset(path, format="trl").rows
    assert (row.prompt, row.reference, row.label, row.extra) == (rows[0]["prompt"], "2", "default", {"difficulty": 1})
    (row,) = PromptDataset(path, format="auto").rows  # detected: no `reference` column, a `solution` one
    assert row.reference == "2"


def test_bad_rows_name_file_row_and_field(tmp_path):
    rows = _verl_rows()
    del rows[1]["reward_model"]["ground_truth"]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"bad.parquet: row 1 field 'reward_model.ground_truth' is null; "
                                        r"fix the row, or set data.reference_field \(data.format=verl"):
        PromptDataset(path, format="verl")
    rows = _verl_rows()
    for r in rows:  # a column of lists (parquet columns have one type)
        r["reward_model"]["ground_truth"] = [r["reward_model"]["ground_truth"], "x"]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"bad.parquet: row 0 field 'reward_model.ground_truth' is a list, expected text"):
        PromptDataset(path, format="verl")


def test_config_format_key_and_datasets_sources(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "reference": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"Expected `str` matching one of .*'verl'.*got 'tfds'|data.format"):
        load_config(None, [f"data.train_path={data}", "data.format=tfds"])
    cfg = load_config(None, [f"data.train_path={data}", "data.format=verl"])
    with pytest.raises(DataError, match=r"d.jsonl: row 0 has no field 'reward_model.ground_truth'"):
        PromptDataset.from_config(data, cfg.data)  # the preset is applied, not silently ignored
    cfg = load_config(None, [f"data.train_path={data}", "data.format=verl", "data.reference_field=reference"])
    assert PromptDataset.from_config(data, cfg.data, written_keys=cfg._written)[0].reference == "2"
    # the `datasets` library is an optional extra, not installed in the test venv
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("the datasets library is installed here; the not-installed error cannot be shown")
    cfg = load_config(None, ["data.train_path=openai/gsm8k:train"])
    with pytest.raises(ConfigError, match=r"data.train_path: dataset 'openai/gsm8k:train' is a hub id \(not a local "
                                          r"file or directory\), which needs the `datasets` library \(not installed\): "
                                          r"pip install 'streamrft\[datasets\]'"):
        validate_data(cfg)
    with pytest.raises(DataError, match=r"needs the `datasets` library \(not installed\)"):
        PromptDataset("openai/gsm8k")
    # a local file that is missing is still just missing, not a hub id
    with pytest.raises(DataError, match=r"dataset file .*none.jsonl does not exist"):
        PromptDataset(tmp_path / "none.jsonl")


def test_the_configs_in_docs_migrating_load_and_validate(tmp_path, monkeypatch):
    """Every StreamRFT config shown in docs/migrating.md is a valid config (keys, types, variant rules)."""
    import re
    from pathlib import Path

    from streamrft.config.validate import validate_all

    text = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)  # the reward files the docs name, as the user would have them
    (tmp_path / "my_rewards.py").write_text("def accuracy_reward(completions, solution, **kwargs):\n"
                                            "    return [float(c.strip() == s) for c, s in zip(completions, solution)]\n")
    (tmp_path / "my_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                           "    return float(solution_str.strip() == ground_truth)\n")
    for i, block in enumerate(blocks):
        (tmp_path / f"c{i}.yaml").write_text(block)
        cfg = load_config(tmp_path / f"c{i}.yaml")
        validate_all(cfg, world_size=1, check_paths=False)
        assert cfg.rollout.prompts_per_step == 32 and cfg.rollout.n_samples_per_prompt == 8
        assert cfg.data.format == ("trl", "verl")[i] and cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
        assert cfg.reward.sources[0].convention == ("trl", "verl")[i]
