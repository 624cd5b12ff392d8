"""Overhead of observability on a training step: exporter + scrapes + trajectory sinks.

A "step" is a fixed CPU matmul loop (~0.2 s). The instrumented variant also updates the metrics,
writes ``--records`` trajectory records per step to the JSONL, Parquet and ZeroMQ sinks, while a
thread scrapes the exporter every ``--scrape-interval`` seconds. Plain and instrumented steps are
interleaved so machine noise hits both alike; the medians are compared (target: overhead <= 3 %).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/observability_bench.py --steps 10 --records 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request

import torch

from streamrft.metrics import PipelineMetrics, start_exporter, stop_exporter
from streamrft.sinks import JsonlSink, ParquetSink, ZmqPubSink
from streamrft.sinks.background import BackgroundSinks
from streamrft.sinks.synthetic import synthetic_records


def calibrate_matmuls(target_s: float, size: int = 256) -> int:
    a = torch.randn(size, size)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - start) / 20
    return max(1, int(target_s / per))


def plain_step(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a @ a


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--records", type=int, default=64, help="trajectory records per step")
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--inline-sinks", action="store_true", help="write on the step's thread, not BackgroundSinks")
    args = parser.parse_args()

    torch.manual_seed(0)
    a = torch.randn(256, 256)
    n_matmuls = calibrate_matmuls(args.step_seconds)
    records = synthetic_records(args.records, response_len=args.response_len)
    metrics = PipelineMetrics(rank=0)
    server, port = start_exporter(metrics, "127.0.0.1", 0)
    stop = threading.Event()

    def scrape_loop() -> None:
        while not stop.wait(args.scrape_interval):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()

    scraper = threading.Thread(target=scrape_loop, daemon=True)
    scraper.start()
    with tempfile.TemporaryDirectory() as tmp:
        sinks = [
            JsonlSink(tmp, run_id="bench", rank=0),
            ParquetSink(tmp, rows_per_file=4096, run_id="bench", rank=0),
            ZmqPubSink("tcp://127.0.0.1:0"),
        ]
        if not args.inline_sinks:
            sinks = [BackgroundSinks(sinks)]

        def instrumented_step(step: int) -> None:
            plain_step(a, n_matmuls)
            with metrics.atomic():
                metrics.samples_admitted.inc(len(records))
                metrics.samples_trained.inc(len(records))
                metrics.generated_tokens.inc(len(records) * args.response_len)
                metrics.stage_latency.labels(stage="generate").observe(0.1)
                metrics.observe_step(step, {"loss": 0.1, "kl": 0.01, "reward_mean": 0.5, "reward/correct": 0.5})
            for sink in sinks:
                for record in records:
                    sink.write(record)
                sink.flush()

        plain, instrumented = [], []
        instrumented_step(0)  # warm-up: imports, first Parquet file
        for step in range(1, args.steps + 1):
            if not args.inline_sinks:
                sinks[0].drain()  # untimed: the baseline must not share the CPU with the writer
            start = time.perf_counter()
            plain_step(a, n_matmuls)
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            instrumented_step(step)
            instrumented.append(time.perf_counter() - start)
        for sink in sinks:
            sink.close()
    stop.set()
    scraper.join(5)
    stop_exporter(server)

    base, inst = statistics.median(plain), statistics.median(instrumented)
    overhead = inst / base - 1
    print(f"step (plain)        median {base * 1e3:8.1f} ms over {args.steps} steps")
    where = "inline" if args.inline_sinks else "on a writer thread"
    print(f"step (instrumented) median {inst * 1e3:8.1f} ms ({args.records} records x {args.response_len} tokens "
          f"to jsonl+parquet+zmq {where}, scrape every {args.scrape_interval:g}s)")
    verdict = "OK" if overhead <= 0.03 else "OVER"
    print(f"overhead ratio {inst / base:.4f} ({overhead:+.2%}); target <= +3% -> {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
