from __future__ import annotations

from typing import Annotated

import msgspec

from streamrft.config.base import Section


class MetricsConfig(Section):
    port: int = 0  # Prometheus exporter base port; rank r listens on port + local rank; 0 = off
    host: str = "127.0.0.1"  # exporter bind address
    tensorboard: bool = False  # write TensorBoard event files under output_dir/tb (rank 0 only)
    wandb: bool = False  # log scalars to Weights & Biases (rank 0 only; needs the wandb extra)
    wandb_project: str = "streamrft"
    wandb_mode: str = "offline"  # offline works with no network; "online" | "offline" | "disabled"
    progress: bool = True  # console progress bar on a TTY, plain log lines otherwise
    progress_log_every_s: float = 30.0  # without a TTY: seconds between plain progress lines
    # peak FLOP/s of one rank's accelerator; 0 = detect a known GPU's dense bf16 peak (A100, H100, H200, H20,
    # L40S, B200, ...: streamrft/metrics/probe.py), else no MFU (CPU, unknown GPU: mfu absent, not NaN)
    peak_flops: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # with metrics.port: if Prometheus scraped this run, shutdown waits until it scraped once more after the
    # final step and held-out evaluation, at most this many seconds; 0 = don't wait
    final_scrape_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0


class SinksConfig(Section):
    jsonl: str = ""  # directory for per-rank JSONL trajectory files; "" = off
    parquet: str = ""  # directory for rolling Parquet trajectory files; "" = off
    parquet_rows_per_file: int = 4096  # records per Parquet file before the sink rolls to a new one
    zmq_pub: str = ""  # ZeroMQ PUB address for trajectory records (tcp port + rank); "" = off
    background: bool = True  # encode and write records on a writer thread (overlaps the next step)
    zmq_hwm: int = 10000  # PUB send high-water mark: records queued per subscriber before dropping
