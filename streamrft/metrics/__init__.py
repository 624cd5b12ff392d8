"""Observability: the Prometheus registry and exporter, TensorBoard / W&B loggers, console progress."""

from streamrft.metrics.exporter import MetricsServer, exporter_port, start_exporter, stop_exporter
from streamrft.metrics.loggers import TensorBoardLogger, WandbLogger, build_loggers, redact_secrets
from streamrft.metrics.progress import Progress
from streamrft.metrics.registry import SCALAR_GAUGES, PipelineMetrics

__all__ = [
    "PipelineMetrics",
    "SCALAR_GAUGES",
    "MetricsServer",
    "exporter_port",
    "start_exporter",
    "stop_exporter",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "redact_secrets",
    "Progress",
]
