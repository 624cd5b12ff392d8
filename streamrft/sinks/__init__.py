"""Streaming trajectory sinks (JSONL, Parquet, ZeroMQ PUB) and offline trajectory analysis."""

from streamrft.sinks.background import BackgroundSinks
from streamrft.sinks.base import TrajectorySink, build_sinks
from streamrft.sinks.jsonl import JsonlSink
from streamrft.sinks.parquet import ParquetSink, trajectory_schema
from streamrft.sinks.zmq_pub import TrajectorySubscriber, ZmqPubSink, rank_address, subscribe_trajectories

__all__ = [
    "TrajectorySink",
    "build_sinks",
    "BackgroundSinks",
    "JsonlSink",
    "ParquetSink",
    "trajectory_schema",
    "ZmqPubSink",
    "TrajectorySubscriber",
    "rank_address",
    "subscribe_trajectories",
]
