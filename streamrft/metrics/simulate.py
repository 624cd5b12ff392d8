"""A process that exports deterministic pipeline metrics, for trying Prometheus and Grafana
without a training run (and for the Prometheus integration test).

    python -m streamrft.metrics.simulate --port 9400 --seconds 60

Every ``--interval`` seconds it does one fake step: admits 8 samples, trains 6, filters 1
(``zero_std``) and fails 1 (``reward_timeout``), counts 8 x 32 generated tokens, alternates the
phase and sets loss to ``1 / step``. Constant values make the results checkable: queue depth of
stage ``reward`` is 7, ``reward/correct`` is 0.75.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from streamrft.metrics.exporter import start_exporter, stop_exporter
from streamrft.metrics.registry import PipelineMetrics


def simulate_step(metrics: PipelineMetrics, step: int) -> None:
    metrics.set_phase("rollout")
    metrics.samples_admitted.inc(8)
    metrics.generated_tokens.inc(8 * 32)
    metrics.queue_depth.labels(stage="reward").set(7)
    metrics.credits.labels(stage="reward").set(1)
    metrics.in_flight.labels(stage="generate").set(8)
    metrics.stage_latency.labels(stage="generate").observe(0.2)
    metrics.staleness.observe(step % 2)
    metrics.set_phase("train")
    metrics.phase_switch_seconds.labels(transition="rollout_to_train").observe(0.5)
    metrics.samples_trained.inc(6)
    metrics.trained_tokens.inc(6 * 32)
    metrics.samples_filtered.labels(reason="zero_std").inc()
    metrics.samples_failed.labels(reason="reward_timeout").inc()
    metrics.weight_sync_seconds.observe(0.1)
    metrics.weight_sync_bytes.inc(1 << 20)
    metrics.observe_step(step, {"loss": 1.0 / step, "reward_mean": 0.5, "reward/correct": 0.75, "lr": 1e-3})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamrft.metrics.simulate", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port (see --port-file)")
    parser.add_argument("--port-file", help="write the bound port here once the exporter listens")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=60.0, help="stop after this long")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between fake steps")
    args = parser.parse_args(argv)
    metrics = PipelineMetrics(rank=args.rank)
    server, port = start_exporter(metrics, args.host, args.port)
    if args.port_file:  # written atomically so a reader never sees a partial number
        tmp = Path(f"{args.port_file}.tmp")
        tmp.write_text(str(port))
        os.replace(tmp, args.port_file)
    print(f"exporting on http://{args.host}:{port}/metrics", flush=True)
    try:
        step = 0
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            step += 1
            with metrics.atomic():  # a scrape sees whole steps only, so the test's accounting holds
                simulate_step(metrics, step)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        stop_exporter(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
