"""Reward functions written for TRL, verl and OpenRLHF, signatures unchanged, through the real scorer
(reward.sources[].convention; streamrft/rewards/conventions.py)."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch

from protocols import RewardItem
from streamrft.config.base import ConfigError
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.rewards.conventions import NOT_APPLICABLE, resolve_convention, reward_columns
from streamrft.rewards.custom import RewardFunction
from streamrft.rewards.rules import RULES
from streamrft.rewards.scorer import build_reward_scorer

HERE = "tests.unit.test_reward_conventions"


def _final_integer(text: str) -> str | None:
    """The last integer after the last '####' (or in the whole text), commas dropped."""
    found = re.findall(r"-?\d[\d,]*", text.rsplit("####", 1)[-1])
    return found[-1].replace(",", "") if found else None


# --- the three foreign functions, each exactly in its framework's shape -------------------------


def trl_accuracy(completions, ground_truth, **kwargs):
    """TRL GRPOTrainer's documented shape: batched, keywords, dataset columns in **kwargs; None = not mine."""
    out = []
    for completion, truth, label in zip(completions, ground_truth, kwargs["label"]):
        if label not in ("arith", "gsm8k"):
            out.append(None)
            continue
        out.append(1.0 if _final_integer(completion) == truth.replace(",", "") else 0.0)
    return out


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom_reward_function shape: per sample, dispatching on data_source, a dict with 'score'."""
    if data_source not in ("arith", "gsm8k"):
        raise NotImplementedError(f"no scorer for data_source {data_source!r}")
    pred = _final_integer(solution_str)
    correct = pred == ground_truth.replace(",", "")
    return {"score": float(correct), "acc": correct, "pred": pred or "", "index": extra_info.get("index", -1)}


def reward_func(queries, prompts, labels):
    """OpenRLHF's --remote_rm_url file shape: queries are prompt + response, labels the gold answers."""
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    rewards = torch.tensor([float(_final_integer(r) == a.replace(",", "")) for r, a in zip(responses, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"acc": rewards}}


def verl_without_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def openrlhf_without_rewards(queries, prompts, labels):
    return {"scores": [0.0] * len(queries)}


def trl_wrong_length(completions, **kwargs):
    return [1.0]


# --- samples: arith and GSM8K, with the answers the project's own rules give -----------------------

SAMPLES = [  # (label, prompt, response, reference)
    ("arith", "23+45=", "68", "68"),
    ("arith", "23+45=", "67", "68"),
    ("gsm8k", "Q: clips in April and May?\nA: ", "48/2 = 24 in May.\n48+24 = 72\n#### 72", "72"),
    ("gsm8k", "Q: cost?\nA: ", "The total is $1,200.\n#### 1,200", "1200"),
    ("gsm8k", "Q: eggs?\nA: ", "16-3-4 = 9 eggs, 9*2 = 18\n#### 17", "18"),
]
EXPECTED = [1.0, 0.0, 1.0, 1.0, 0.0]


def items() -> list[RewardItem]:
    # columns: the row's other fields (verl's extra_info is one), as the Generator passes them
    return [RewardItem(sample_id=f"s{i}", prompt=p, response=r, reference=ref, label=label,
                       columns={"extra_info": {"index": i, "split": "train"}})
            for i, (label, p, r, ref) in enumerate(SAMPLES)]


def score(*sources: RewardSourceConfig, batch: list[RewardItem] | None = None):
    scorer = build_reward_scorer(RewardConfig(sources=list(sources)))

    async def go():
        try:
            return await scorer.score(batch if batch is not None else items())
        finally:
            await scorer.close()

    return asyncio.run(go())


def source(fn: str, convention: str, name: str = "acc", **kw) -> RewardSourceConfig:
    return RewardSourceConfig(name=name, type="custom", fn=f"{HERE}:{fn}", convention=convention, **kw)


def test_the_expected_values_are_what_the_projects_own_rules_give():
    assert [RULES[label](r, ref) for label, _, r, ref in SAMPLES] == EXPECTED


@pytest.mark.parametrize("fn,convention", [("trl_accuracy", "trl"), ("compute_score", "verl"),
                                           ("reward_func", "openrlhf")])
@pytest.mark.parametrize("declared", [True, False])
def test_each_foreign_function_scores_arith_and_gsm8k_samples_correctly(fn, convention, declared):
    outcomes = score(source(fn, convention if declared else "auto"))
    assert [o.error for o in outcomes] == [""] * len(SAMPLES)
    assert [o.reward for o in outcomes] == EXPECTED
    assert [o.components["acc"] for o in outcomes] == EXPECTED


def test_verl_dict_keys_besides_score_become_components_and_only_score_is_summed():
    outcomes = score(source("compute_score", "verl", weight=2.0))
    assert [o.reward for o in outcomes] == [2.0 * v for v in EXPECTED]
    assert outcomes[2].components == {"acc": 1.0, "acc/acc": 1.0, "acc/index": 2.0}  # index: the row's extra_info
    assert "acc/pred" not in outcomes[0].components  # a string is not a component


def test_a_trl_none_means_not_applicable_the_other_source_alone_scores_that_item():
    batch = items() + [RewardItem(sample_id="s5", prompt="p", response="x", reference="", label="format")]
    outcomes = score(source("trl_accuracy", "trl", weight=1.0),
                     RewardSourceConfig(name="fmt", type="rule", fn="boxed_format", weight=0.5), batch=batch)
    last = outcomes[-1]
    assert last.error == "" and last.reward == 0.0 and last.components == {"fmt": 0.0}  # no "acc" component
    assert outcomes[0].reward == 1.0 and outcomes[0].components == {"acc": 1.0, "fmt": 0.0}


def test_an_item_every_source_declines_fails_naming_them():
    batch = [RewardItem(sample_id="s0", prompt="p", response="x", reference="", label="format")]
    (outcome,) = score(source("trl_accuracy", "trl"), batch=batch)
    assert math.isnan(outcome.reward)
    assert outcome.error == "every reward source for label 'format' returned None (not applicable): acc"


def test_the_adapter_passes_trl_columns_by_keyword_and_none_becomes_not_applicable():
    seen = {}

    def fn(prompts, completions, solution, **kwargs):
        seen.update(prompts=prompts, completions=completions, solution=solution, kwargs=kwargs)
        return [None, 0.5]

    rf = RewardFunction(fn, "fn", convention="trl", source="s")
    batch = items()[:2]
    batch[1].columns["level"] = 3  # a column only the second row has: None for the first, as a datasets column
    values = asyncio.run(rf.score(batch))
    rf.close()
    assert values == [NOT_APPLICABLE, 0.5]
    assert seen == {"prompts": ["23+45=", "23+45="], "completions": ["68", "67"], "solution": ["68", "68"],
                    "kwargs": {"ground_truth": ["68", "68"], "reference": ["68", "68"], "label": ["arith", "arith"],
                               "extra_info": [{"index": 0, "split": "train"}, {"index": 1, "split": "train"}],
                               "level": [None, 3]}}


def test_a_dataset_column_named_solution_is_passed_as_it_is_not_replaced_by_the_reference():
    def fn(completions, solution):
        return [float(c == s) for c, s in zip(completions, solution)]

    rf = RewardFunction(fn, "fn", convention="trl", source="s")
    batch = [RewardItem(sample_id="a", prompt="p", response="x", reference="y", columns={"solution": "x"})]
    assert asyncio.run(rf.score(batch)) == [1.0]
    rf.close()


def test_a_required_trl_parameter_that_is_no_column_fails_the_batch_naming_it():
    def fn(completions, answer):
        return [1.0] * len(completions)

    rf = RewardFunction(fn, "my.py:fn", convention="trl", source="s")
    values = asyncio.run(rf.score(items()[:2]))
    rf.close()
    assert [str(v) for v in values] == [
        "reward source 's' (trl convention, my.py:fn): fn(completions, answer) requires 'answer', which is no "
        "column of these rows (their columns: extra_info; also passed: prompts, completions, reference, "
        "ground_truth, solution, label)"] * 2


@pytest.mark.parametrize("fn,convention,message", [
    ("verl_without_score", "verl", "returned a dict without 'score' (keys: acc)"),
    ("openrlhf_without_rewards", "openrlhf", "returned a dict without 'rewards' (keys: scores)"),
    ("trl_wrong_length", "trl", "returned 1 values for 5 completions"),
])
def test_a_wrong_return_value_fails_its_items_naming_source_convention_and_problem(fn, convention, message):
    outcomes = score(source(fn, convention, name="mine"))
    where = f"reward source 'mine' ({convention} convention, {HERE}:{fn})"
    for o in outcomes:
        assert math.isnan(o.reward)
        assert o.error == f"source 'mine': ConventionError: {where} {message}"


def test_a_raising_verl_function_fails_only_its_sample_with_the_cause():
    batch = items()[:1] + [RewardItem(sample_id="x", prompt="p", response="1", reference="1", label="geo")]
    outcomes = score(source("compute_score", "verl", labels=[]), batch=batch)
    assert outcomes[0].reward == 1.0
    assert outcomes[1].error == ("source 'acc': RuntimeError: reward source 'acc' (verl convention, "
                                 f"{HERE}:compute_score) raised NotImplementedError: no scorer for data_source 'geo'")


def test_verl_batch_reward_manager_signature_is_called_once_per_batch():
    calls = []

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        calls.append(len(solution_strs))
        return [float(_final_integer(s) == g) for s, g in zip(solution_strs, ground_truths)]

    assert resolve_convention(batch_score, "auto", "src") == "verl"
    rf = RewardFunction(batch_score, "b", convention="verl", source="src")
    assert asyncio.run(rf.score(items())) == EXPECTED and calls == [len(SAMPLES)]
    rf.close()


# --- signatures are checked when the source is built (and at validation), never per sample ---------


def test_a_foreign_signature_under_the_default_convention_is_an_error_pointing_at_the_key():
    with pytest.raises(ConfigError) as err:
        score(source("compute_score", "streamrft"))
    assert str(err.value) == (
        f"reward source 'acc' ({HERE}:compute_score): the signature compute_score(data_source, solution_str, "
        "ground_truth, extra_info=None) is a reward function in the verl convention, not StreamRFT's fn(response, reference, ...); "
        "set reward.sources[].convention: verl"
    )


def test_an_ambiguous_signature_under_auto_is_an_error_naming_the_source():
    def both(queries, prompts, labels, completions=None):
        return []

    with pytest.raises(ValueError) as err:
        resolve_convention(both, "auto", "reward source 'x'")
    assert str(err.value) == ("reward source 'x': convention=auto cannot tell openrlhf from trl by the signature "
                              "both(queries, prompts, labels, completions=None); set reward.sources[].convention "
                              "to one of them")


def test_a_plain_function_under_auto_is_streamrft():
    assert resolve_convention(RULES["gsm8k"], "auto", "src") == "streamrft"


@pytest.mark.parametrize("convention,fn,message", [
    ("trl", lambda completions, completion_ids: [], "<lambda>(completions, completion_ids) requires 'completion_ids', "
     "which the trl convention does not pass here; it passes prompts, completions, reference, ground_truth, "
     "solution, label and the rows' columns"),
    ("trl", lambda prompts: [], "a trl reward function takes completions; <lambda>(prompts) has no parameter "
     "'completions'"),
    ("verl", lambda solution_str, answer: 0.0, "<lambda>(solution_str, answer) requires 'answer', which the verl "
     "convention does not pass here; it passes data_source, solution_str, ground_truth, extra_info"),
    ("openrlhf", lambda queries, labels: [], "an openrlhf reward function is called as reward_func(queries, "
     "prompts, labels); <lambda>(queries, labels) takes 2 positional argument(s)"),
])
def test_a_signature_that_cannot_take_the_conventions_arguments_is_refused(convention, fn, message):
    with pytest.raises(ValueError) as err:
        resolve_convention(fn, convention, "src")
    assert str(err.value) == f"src: {message}"


def test_validation_refuses_a_mismatched_convention_before_any_model_is_loaded():
    from streamrft.config import load_config
    from streamrft.config.validate import validate_reward_functions

    cfg = load_config(None, [f"reward.sources=[{{name: acc, type: custom, fn: '{HERE}:reward_func'}}]"])
    with pytest.raises(ConfigError, match=r"in the openrlhf convention, not StreamRFT's.*convention: openrlhf"):
        validate_reward_functions(cfg)


def test_convention_applies_only_to_custom_sources_and_protocol_only_to_remote():
    from streamrft.config import load_config
    from streamrft.config.validate import validate_all

    cfg = load_config(None, ["reward.sources=[{name: acc, type: rule, fn: gsm8k, convention: verl}]"])
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].convention is set but reward.sources\[0\].type="
                                          r"'rule'; it applies only to"):
        validate_all(cfg, world_size=1, check_paths=False)
    cfg = load_config(None, ["reward.sources=[{name: rm, type: remote, address: 'tcp://127.0.0.1:5555', "
                             "protocol: openrlhf}]"])
    with pytest.raises(ConfigError, match=r"protocol='openrlhf' is an HTTP JSON body, but address="
                                          r"'tcp://127.0.0.1:5555' is not http"):
        validate_all(cfg, world_size=1, check_paths=False)


def test_reward_columns_keep_json_like_fields_and_leave_media_bytes_behind():
    extra = {"extra_info": {"index": 3, "tags": ["a", None]}, "level": 2.5, "image": b"\x89PNG", "mixed": [1, b"x"]}
    assert reward_columns(extra) == {"extra_info": {"index": 3, "tags": ["a", None]}, "level": 2.5}
