from __future__ import annotations

from streamrft.config.base import Section


class MetricsConfig(Section):
    port: int = 0  # Prometheus exporter base port (+ local rank); 0 = off
    host: str = "127.0.0.1"  # exporter bind address
    tensorboard: bool = False  # write TensorBoard event files under output_dir/tb
    wandb: bool = False
    wandb_project: str = "streamrft"
    wandb_mode: str = "offline"  # offline works with no network
    progress: bool = True  # console progress bar on a TTY, plain log lines otherwise


class SinksConfig(Section):
    jsonl: str = ""  # directory for per-rank JSONL trajectory files; "" = off
    parquet: str = ""  # directory for rolling Parquet trajectory files; "" = off
    zmq_pub: str = ""  # ZeroMQ PUB address for trajectory records; "" = off
