"""The trajectory sink interface and the one place that picks sinks from the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from protocols import TrajectoryRecord

if TYPE_CHECKING:
    from streamrft.config.metrics import SinksConfig


class TrajectorySink(Protocol):
    """Receives a record for every sample (trained, filtered or failed) of every step on its rank.

    ``write`` may buffer; ``flush`` makes what was written visible to readers (at step ends);
    ``close`` flushes and releases files and sockets. Sinks are used from one thread.
    """

    def write(self, record: TrajectoryRecord) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def build_sinks(sinks_cfg: SinksConfig, run_id: str, rank: int) -> list[TrajectorySink]:
    """The sinks ``sinks_cfg`` turns on for this rank (every rank writes its own records); with
    ``sinks.background`` they come wrapped in one :class:`BackgroundSinks` (a writer thread)."""
    from streamrft.sinks.background import BackgroundSinks
    from streamrft.sinks.jsonl import JsonlSink
    from streamrft.sinks.parquet import ParquetSink
    from streamrft.sinks.zmq_pub import ZmqPubSink, rank_address

    sinks: list[TrajectorySink] = []
    if sinks_cfg.jsonl:
        sinks.append(JsonlSink(sinks_cfg.jsonl, run_id=run_id, rank=rank))
    if sinks_cfg.parquet:
        if sinks_cfg.parquet_rows_per_file < 1:
            raise ValueError(
                f"sinks.parquet_rows_per_file={sinks_cfg.parquet_rows_per_file} must be >= 1; "
                "set sinks.parquet_rows_per_file to the number of records per Parquet file"
            )
        sinks.append(
            ParquetSink(sinks_cfg.parquet, rows_per_file=sinks_cfg.parquet_rows_per_file, run_id=run_id, rank=rank)
        )
    if sinks_cfg.zmq_pub:
        sinks.append(ZmqPubSink(rank_address(sinks_cfg.zmq_pub, rank), hwm=sinks_cfg.zmq_hwm))
    if sinks_cfg.background and sinks:
        return [BackgroundSinks(sinks)]
    return sinks
