"""The reward aggregator: labels pick sources, weights per label, failures become error outcomes."""

from __future__ import annotations

import asyncio
import math
import textwrap
import time

import pytest

from protocols import RewardItem
from streamrft.config.base import ConfigError
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.rewards import RewardOutcome, build_reward_scorer

FUNCS = textwrap.dedent(
    """
    import math, time, asyncio

    def half(response, reference):
        return 0.5

    def nan_for_x(response, reference):
        return math.nan if response == "x" else 1.0

    def inf_always(response, reference):
        return math.inf

    def boom(response, reference):
        raise ZeroDivisionError("division by zero in my check")

    async def hangs(response, reference):
        await asyncio.sleep(60)
        return 1.0
    """
)


@pytest.fixture
def funcs(tmp_path):
    path = tmp_path / "funcs.py"
    path.write_text(FUNCS)
    return str(path)


def item(sid, response, reference="", label="default"):
    return RewardItem(sample_id=sid, prompt="p", response=response, reference=reference, label=label)


def run_scorer(cfg: RewardConfig, batch) -> list[RewardOutcome]:
    async def go():
        scorer = build_reward_scorer(cfg)
        try:
            return await scorer.score(batch)
        finally:
            await scorer.close()

    return asyncio.run(go())


def test_components_keep_their_names_and_weights_apply_per_label(funcs):
    cfg = RewardConfig(sources=[
        RewardSourceConfig(name="correct", type="rule", fn="arith", weight=1.0),
        RewardSourceConfig(name="fmt", type="rule", fn="boxed_format", weight=0.5,
                           label_weights={"math": 2.0}, labels=["math", "arith"]),
        RewardSourceConfig(name="half", type="custom", fn=f"{funcs}:half", labels=["other"]),
    ])
    out = run_scorer(cfg, [
        item("a", "\\boxed{7}", "7", label="arith"),  # arith 1 + 0.5 * 1
        item("b", "\\boxed{7}", "7", label="math"),  # arith 1 + 2.0 * 1
        item("c", "8", "7", label="other"),  # arith 0 + half 0.5
    ])
    assert [o.error for o in out] == ["", "", ""]
    assert out[0].reward == pytest.approx(1.5) and out[0].components == {"correct": 1.0, "fmt": 1.0}
    assert out[1].reward == pytest.approx(3.0)
    assert out[2].reward == pytest.approx(0.5) and out[2].components == {"correct": 0.0, "half": 0.5}


def test_a_source_that_raises_fails_only_its_items_with_the_source_and_exception_named(funcs):
    cfg = RewardConfig(sources=[
        RewardSourceConfig(name="correct", type="rule", fn="arith"),
        RewardSourceConfig(name="bad", type="custom", fn=f"{funcs}:boom", labels=["risky"]),
    ])
    out = run_scorer(cfg, [item("a", "7", "7"), item("b", "7", "7", label="risky")])
    assert out[0].reward == 1.0 and not out[0].error
    assert math.isnan(out[1].reward)
    assert "source 'bad'" in out[1].error and "ZeroDivisionError" in out[1].error
    assert out[1].components == {"correct": 1.0}  # the sources that did succeed are kept


@pytest.mark.parametrize("fn, bad_value", [("nan_for_x", "nan"), ("inf_always", "inf")])
def test_nan_or_inf_from_a_source_is_an_error_outcome(funcs, fn, bad_value):
    cfg = RewardConfig(sources=[RewardSourceConfig(name="f", type="custom", fn=f"{funcs}:{fn}")])
    out = run_scorer(cfg, [item("a", "x"), item("b", "y")])
    assert math.isnan(out[0].reward) and f"returned {bad_value}" in out[0].error and "'f'" in out[0].error
    if fn == "nan_for_x":
        assert out[1].reward == 1.0 and not out[1].error


def test_a_hanging_source_times_out_instead_of_hanging_score(funcs):
    cfg = RewardConfig(timeout_s=0.2, sources=[
        RewardSourceConfig(name="slow", type="custom", fn=f"{funcs}:hangs"),
        RewardSourceConfig(name="correct", type="rule", fn="arith"),
    ])
    start = time.monotonic()
    out = run_scorer(cfg, [item("a", "1", "1")])
    assert time.monotonic() - start < 5
    assert out[0].error == "source 'slow': timeout after 0.2s (reward.timeout_s)"


def test_an_item_whose_label_no_source_scores_is_an_error_not_a_zero():
    cfg = RewardConfig(sources=[RewardSourceConfig(name="c", type="rule", fn="arith", labels=["arith"])])
    out = run_scorer(cfg, [item("a", "1", "1", label="poetry")])
    assert math.isnan(out[0].reward) and "label 'poetry'" in out[0].error


def test_the_scorer_counts_scored_and_failed_items(funcs):
    cfg = RewardConfig(sources=[RewardSourceConfig(name="f", type="custom", fn=f"{funcs}:nan_for_x")])

    async def go():
        scorer = build_reward_scorer(cfg)
        await scorer.score([item("a", "x"), item("b", "y"), item("c", "z")])
        await scorer.close()
        return scorer

    scorer = asyncio.run(go())
    assert (scorer.n_scored, scorer.n_failed, scorer.failures_by_source) == (2, 1, {"f": 1})


def test_building_with_no_sources_is_a_config_error_that_shows_an_example():
    with pytest.raises(ConfigError, match="reward.sources is empty"):
        build_reward_scorer(RewardConfig())


def test_building_a_missing_custom_function_names_the_source():
    cfg = RewardConfig(sources=[RewardSourceConfig(name="mine", type="custom", fn="no_such_mod_q:f")])
    with pytest.raises(ConfigError, match="'mine'.*no_such_mod_q"):
        build_reward_scorer(cfg)


def test_the_math_rule_works_inside_the_scorer_worker_threads():
    # math-verify's own timeout uses signal.alarm, which fails off the main thread; the rule must cope.
    cfg = RewardConfig(sources=[RewardSourceConfig(name="m", type="rule", fn="math")])
    out = run_scorer(cfg, [item("a", "\\boxed{\\frac{1}{2}}", "0.5"), item("b", "\\boxed{1}", "0.5")])
    assert [(o.reward, o.error) for o in out] == [(1.0, ""), (0.0, "")]
