"""The HTTP endpoint Prometheus scrapes, one per rank (base port + local rank)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from streamrft.metrics.registry import PipelineMetrics


@dataclass
class MetricsServer:
    """A running exporter: its WSGI server and the daemon thread serving it."""

    httpd: WSGIServer
    thread: threading.Thread
    host: str
    port: int  # the port actually bound (differs from the requested one when that was 0)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


def exporter_port(base_port: int, local_rank: int) -> int:
    """The port rank ``local_rank`` listens on: ``metrics.port + local_rank``. (``metrics.port=0`` turns the
    exporter off and never gets here; a 0 passed on anyway stays 0, which binds any free port.)"""
    return base_port + local_rank if base_port else 0


def start_exporter(metrics: PipelineMetrics, host: str, port: int) -> tuple[MetricsServer, int]:
    """Serve ``metrics.registry`` at ``http://host:port/metrics``; ``port=0`` picks a free port.

    Returns the server (pass it to :func:`stop_exporter`) and the port it bound.
    """
    try:
        httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise OSError(
            f"metrics exporter of rank {metrics.rank} cannot listen on {host}:{port}: {exc.strerror}; "
            "set metrics.port to another base port (rank r listens on port + local rank), or metrics.port=0 "
            "to turn the exporter off"
        ) from exc
    bound = httpd.server_address[1]
    return MetricsServer(httpd=httpd, thread=thread, host=host, port=bound), bound


def stop_exporter(server: MetricsServer, timeout: float = 5.0) -> None:
    """Stop serving, close the socket and wait for the serving thread."""
    server.httpd.shutdown()
    server.httpd.server_close()
    server.thread.join(timeout)
    if server.thread.is_alive():
        raise RuntimeError(f"metrics exporter thread on port {server.port} did not stop within {timeout}s")
