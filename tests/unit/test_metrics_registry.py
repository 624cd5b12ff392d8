"""PipelineMetrics and its exporter, checked against a real HTTP scrape."""

from __future__ import annotations

import re
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamrft.metrics import PipelineMetrics, exporter_port, start_exporter, stop_exporter


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


@pytest.fixture
def exporter():
    metrics = PipelineMetrics(rank=2)
    server, port = start_exporter(metrics, "127.0.0.1", 0)
    yield metrics, f"http://127.0.0.1:{port}/metrics"
    stop_exporter(server)


def key(metric: str, **labels: str) -> tuple[str, frozenset]:
    return metric, frozenset({"rank": "2", **labels}.items())


def test_observe_step_maps_known_scalars_onto_their_gauges_with_the_rank_label(exporter):
    metrics, url = exporter
    metrics.observe_step(
        7,
        {"loss": 0.25, "kl": 0.01, "lr": 3e-4, "clip_fraction": 0.1, "reward_mean": 0.5, "reward/correct": 0.75,
         "reward_std/correct": 0.2, "ratio_max": 1.9, "tis_clipped_fraction": 0.03, "trained_tokens_per_s": 1234.0},
    )
    got = scrape(url)
    assert got[key("streamrft_loss")] == 0.25
    assert got[key("streamrft_kl")] == 0.01
    assert got[key("streamrft_learning_rate")] == 3e-4
    assert got[key("streamrft_clip_fraction", side="all")] == 0.1
    assert got[key("streamrft_reward_mean", component="total")] == 0.5
    assert got[key("streamrft_reward_mean", component="correct")] == 0.75
    assert got[key("streamrft_reward_std", component="correct")] == 0.2
    assert got[key("streamrft_importance_ratio_max")] == 1.9
    assert got[key("streamrft_tis_clipped_fraction")] == 0.03
    assert got[key("streamrft_trained_tokens_per_second")] == 1234.0
    assert got[key("streamrft_step")] == 7


def test_unknown_scalars_are_exported_under_a_sanitised_generic_gauge_not_dropped(exporter):
    metrics, url = exporter
    metrics.observe_step(1, {"my weird/scalar!": 4.0})
    assert scrape(url)[key("streamrft_train_scalar", name="my_weird/scalar_")] == 4.0


def test_counters_histograms_and_labelled_gauges_show_up_in_the_scrape(exporter):
    metrics, url = exporter
    metrics.samples_admitted.inc(8)
    metrics.samples_trained.inc(5)
    metrics.samples_filtered.labels(reason="zero_std").inc(2)
    metrics.samples_failed.labels(reason="reward_timeout").inc()
    metrics.queue_depth.labels(stage="reward").set(3)
    metrics.stage_latency.labels(stage="generate").observe(0.3)
    metrics.phase_switch_seconds.labels(transition="rollout_to_train").observe(1.5)
    metrics.staleness.observe(1)
    metrics.staleness.observe(3)
    metrics.set_phase("train")
    got = scrape(url)
    assert got[key("streamrft_samples_admitted_total")] == 8
    assert got[key("streamrft_samples_trained_total")] == 5
    assert got[key("streamrft_samples_filtered_total", reason="zero_std")] == 2
    assert got[key("streamrft_samples_failed_total", reason="reward_timeout")] == 1
    assert got[key("streamrft_stage_queue_depth", stage="reward")] == 3
    assert got[key("streamrft_stage_latency_seconds_count", stage="generate")] == 1
    assert got[key("streamrft_stage_latency_seconds_bucket", stage="generate", le="0.5")] == 1
    assert got[key("streamrft_stage_latency_seconds_bucket", stage="generate", le="0.25")] == 0
    assert got[key("streamrft_phase_switch_seconds_sum", transition="rollout_to_train")] == 1.5
    assert got[key("streamrft_sample_staleness_versions_sum")] == 4
    assert got[key("streamrft_sample_staleness_versions_bucket", le="1.0")] == 1
    assert got[key("streamrft_phase")] == 1
    assert got[key("streamrft_process_resident_memory_bytes")] > 10 * 2**20


def test_mfu_is_absent_until_flops_are_known_then_the_given_value(exporter):
    metrics, url = exporter
    metrics.observe_step(1, {"loss": 0.5})  # a step without mfu (CPU, unknown GPU): no series, not NaN
    assert not any(name.startswith("streamrft_mfu") for name, _ in scrape(url))
    metrics.observe_step(2, {"mfu": 0.42})
    assert scrape(url)[key("streamrft_mfu")] == 0.42
    metrics.observe_step(3, {"mfu": 0.4})
    assert scrape(url)[key("streamrft_mfu")] == 0.4


def test_an_unknown_phase_name_is_rejected_with_the_valid_names():
    with pytest.raises(ValueError, match="rollout"):
        PipelineMetrics().set_phase("warmup")


def test_two_instances_in_one_process_do_not_collide_and_keep_their_own_rank():
    a, b = PipelineMetrics(rank=0), PipelineMetrics(rank=1)
    a.samples_admitted.inc(3)
    assert 'streamrft_samples_admitted_total{rank="0"} 3.0' in a.exposition()
    assert 'streamrft_samples_admitted_total{rank="1"} 0.0' in b.exposition()


def test_exporter_port_is_base_plus_local_rank_and_zero_stays_any_free_port():
    assert exporter_port(9400, 3) == 9403
    assert exporter_port(0, 3) == 0


def test_a_busy_port_fails_with_a_message_naming_the_config_key(exporter):
    metrics, url = exporter
    busy_port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError, match="metrics.port"):
        start_exporter(PipelineMetrics(), "127.0.0.1", busy_port)


def test_stop_exporter_closes_the_port():
    metrics = PipelineMetrics()
    server, port = start_exporter(metrics, "127.0.0.1", 0)
    stop_exporter(server)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_updates_grouped_in_atomic_are_never_scraped_half_done():
    metrics = PipelineMetrics()
    stop = threading.Event()

    def step_forever():
        while not stop.is_set():
            with metrics.atomic():
                metrics.samples_admitted.inc(2)
                metrics.samples_trained.inc(2)

    writer = threading.Thread(target=step_forever)
    writer.start()
    try:
        for _ in range(200):
            text = metrics.exposition()
            admitted = re.search(r"streamrft_samples_admitted_total\{rank=\"0\"\} (\S+)", text).group(1)
            trained = re.search(r"streamrft_samples_trained_total\{rank=\"0\"\} (\S+)", text).group(1)
            assert admitted == trained
    finally:
        stop.set()
        writer.join(5)
