"""benchmarks/bench_variants.py: the --variants spec of gpu_grpo.py (memory-options table) parses into exactly the
overrides written, bad specs stop with an error naming the variant, and the job plan runs each StreamRFT
variant (repeated) under a tag of its own."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_variants import parse_variants, plan_jobs, variants_table  # noqa: E402


def test_parse_the_suggested_memory_variants():
    spec = ("base;gc:model.gradient_checkpointing=true;offload:train.offload_between_phases=true;"
            "halfmb:train.micro_batch_tokens=12288;"
            "ck_async:checkpoint.save_every=1,checkpoint.async_save=true;"
            "ck_sync: checkpoint.save_every=1 , checkpoint.async_save=false;")
    assert parse_variants(spec) == [
        ("base", []),
        ("gc", ["model.gradient_checkpointing=true"]),
        ("offload", ["train.offload_between_phases=true"]),
        ("halfmb", ["train.micro_batch_tokens=12288"]),
        ("ck_async", ["checkpoint.save_every=1", "checkpoint.async_save=true"]),
        ("ck_sync", ["checkpoint.save_every=1", "checkpoint.async_save=false"]),
    ]


def test_commas_inside_brackets_belong_to_the_value():
    got = parse_variants("lora:model.lora_rank=16,model.lora_target_modules=[q_proj,v_proj],train.lr=1e-5")
    assert got == [("lora", ["model.lora_rank=16", "model.lora_target_modules=[q_proj,v_proj]", "train.lr=1e-5"])]


def test_the_overrides_load_into_the_config_they_name(tmp_path):
    from streamrft.config import load_config

    (name, over), = parse_variants("x:model.lora_rank=8,model.lora_target_modules=[q_proj,v_proj]")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("seed: 3\n")
    cfg = load_config(cfg_file, over)
    assert cfg.model.lora_rank == 8 and tuple(cfg.model.lora_target_modules) == ("q_proj", "v_proj")


@pytest.mark.parametrize("spec, message", [
    ("", "--variants is empty"),
    ("a b:train.lr=1", "variant #1 'a b:train.lr=1': name 'a b' must be letters"),
    ("a:train.lr=1;a:train.lr=2", "variant name 'a' appears twice"),
    ("a:train.lr", "variant 'a': 'train.lr' is not section.key=value"),
    ("a:lr=1", "variant 'a': 'lr=1' is not section.key=value"),
    ("a:train.lr=1,train.lr=2", "variant 'a' sets train.lr twice"),
])
def test_bad_specs_name_the_variant(spec, message):
    with pytest.raises(ValueError) as err:
        parse_variants(spec)
    assert message in str(err.value)


def test_plan_repeats_each_streamrft_variant_under_its_own_tag():
    jobs = plan_jobs(["0.5b", "1.5b"], ["streamrft", "trl", "eager"], [("base", []), ("gc", ["m.g=true"])], repeat=2)
    assert [(j["size"], j["kind"], j["tag"], j["overrides"]) for j in jobs] == [
        ("0.5b", "streamrft", "streamrft-base", []), ("0.5b", "streamrft", "streamrft-base-r2", []),
        ("0.5b", "streamrft", "streamrft-gc", ["m.g=true"]), ("0.5b", "streamrft", "streamrft-gc-r2", ["m.g=true"]),
        ("0.5b", "trl", "trl", []),
        ("1.5b", "streamrft", "streamrft-base", []), ("1.5b", "streamrft", "streamrft-base-r2", []),
        ("1.5b", "streamrft", "streamrft-gc", ["m.g=true"]), ("1.5b", "streamrft", "streamrft-gc-r2", ["m.g=true"]),
        ("1.5b", "trl", "trl", []),
        ("0.5b", "eager", "eager", []),
    ]
    plain = plan_jobs(["7b"], ["lora", "streamrft", "trl-lora"], None, repeat=2)
    assert [j["tag"] for j in plain] == ["lora", "streamrft", "streamrft-r2", "trl-lora"]
    with pytest.raises(ValueError, match="--repeat-streamrft=0 must be >= 1"):
        plan_jobs(["0.5b"], ["streamrft"], None, repeat=0)


def test_variants_table_rows():
    ok = dict(size="0.5b", variant="ck_async", overrides=["checkpoint.save_every=1"], step_s=6.25, train_s=4.125,
              rollout_s=2.0, peak_gib=41.54, peak_reserved_gib=50.0, checkpoint_times=[0.312, 0.298, 12.0])
    bad = dict(size="0.5b", variant="gc", overrides=["model.gradient_checkpointing=true"], error="OOM: boom")
    lines = variants_table([ok, bad]).splitlines()
    assert lines[1].split() == ["0.5b", "ck_async", "6.25", "4.12", "2.00", "41.5", "50.0", "0.31/0.30/12.00", "|",
                                "checkpoint.save_every=1"]
    assert "gc" in lines[2] and "FAILED: OOM: boom" in lines[2] and "[model.gradient_checkpointing=true]" in lines[2]
