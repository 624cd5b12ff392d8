"""Every metric the Grafana dashboard queries is one PipelineMetrics really exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from streamrft.metrics import SCALAR_GAUGES, PipelineMetrics, start_exporter, stop_exporter

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"


def panel_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return exprs


def exercise_every_metric(metrics: PipelineMetrics) -> None:
    metrics.observe_step(1, {name: 0.5 for name in SCALAR_GAUGES} | {"reward/correct": 1.0, "other": 2.0})
    for stage_metric in (metrics.queue_depth, metrics.credits, metrics.in_flight):
        stage_metric.labels(stage="reward").set(1)
    metrics.stage_latency.labels(stage="reward").observe(0.1)
    metrics.generated_tokens.inc(10)
    metrics.trained_tokens.inc(10)
    metrics.policy_version.set(1)
    metrics.set_phase("train")
    metrics.phase_switch_seconds.labels(transition="sleep").observe(0.2)
    metrics.weight_sync_seconds.observe(0.3)
    metrics.weight_sync_bytes.inc(1024)
    metrics.staleness.observe(1)
    metrics.admission_in_flight_groups.set(4)
    metrics.admission_blocked.labels(reason="staleness").set(1)
    metrics.samples_admitted.inc()
    metrics.samples_trained.inc()
    metrics.samples_filtered.labels(reason="zero_std").inc()
    metrics.samples_failed.labels(reason="reward_error").inc()
    metrics.env_turns_per_episode.observe(3)
    metrics.env_tool_calls.inc(2)
    metrics.env_tool_errors.labels(reason="timeout").inc()
    metrics.env_tool_seconds.observe(0.5)


def scraped_names() -> set[str]:
    metrics = PipelineMetrics(rank=0)
    exercise_every_metric(metrics)
    server, port = start_exporter(metrics, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        stop_exporter(server)
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


# GPU memory is collected only where CUDA is available; the CPU test machine cannot scrape it.
CUDA_ONLY = {"streamrft_gpu_memory_allocated_bytes", "streamrft_gpu_memory_reserved_bytes"}


def test_every_metric_a_dashboard_panel_queries_is_exported_by_pipeline_metrics():
    dashboard = json.loads((GRAFANA / "dashboards" / "streamrft.json").read_text())
    queried = {name for expr in panel_exprs(dashboard) for name in re.findall(r"streamrft_\w+", expr)}
    assert len(queried) > 25
    unknown = queried - scraped_names() - CUDA_ONLY
    assert not unknown, f"dashboard queries metrics that PipelineMetrics does not export: {sorted(unknown)}"


def test_the_dashboard_covers_each_area_of_the_pipeline():
    dashboard = json.loads((GRAFANA / "dashboards" / "streamrft.json").read_text())
    text = " ".join(panel_exprs(dashboard))
    for needed in ("rate(streamrft_generated_tokens_total", "streamrft_phase{", "streamrft_phase_switch_seconds",
                   "streamrft_stage_queue_depth", "streamrft_stage_credits", "streamrft_stage_in_flight",
                   "streamrft_sample_staleness_versions", "streamrft_reward_mean", "streamrft_reward_std",
                   "streamrft_loss", "streamrft_kl", "streamrft_grad_norm", "streamrft_learning_rate",
                   "streamrft_samples_filtered_total", "streamrft_samples_failed_total",
                   "streamrft_env_turns_per_episode_bucket", "streamrft_env_tool_calls_total",
                   "streamrft_env_tool_errors_total", "streamrft_env_tool_seconds_bucket"):
        assert needed in text, needed


def test_provisioning_points_the_dashboard_at_the_provisioned_datasource_uid():
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads((GRAFANA / "dashboards" / "streamrft.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} == {uid}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "streamrft.yaml").read_text())
    assert provider["providers"][0]["type"] == "file"
