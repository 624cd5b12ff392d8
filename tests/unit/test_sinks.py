"""Trajectory sinks: what they write is read back and equals what was written."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import msgspec
import pyarrow.parquet as pq
import pytest

from protocols import TrajectoryRecord
from streamrft.sinks import (
    JsonlSink,
    ParquetSink,
    TrajectorySubscriber,
    ZmqPubSink,
    build_sinks,
    rank_address,
    trajectory_schema,
)
from streamrft.sinks.reader import read_trajectories
from streamrft.sinks.synthetic import synthetic_records


def sinks_cfg(**overrides):
    base = dict(jsonl="", parquet="", parquet_rows_per_file=4096, zmq_pub="", zmq_hwm=1000, background=False)
    return SimpleNamespace(**{**base, **overrides})


def test_jsonl_sink_writes_one_file_per_rank_with_one_record_per_line(tmp_path):
    records = synthetic_records(5, rank=1)
    sink = JsonlSink(tmp_path, run_id="run7", rank=1)
    for r in records:
        sink.write(r)
    sink.close()
    lines = (tmp_path / "run7-rank1.jsonl").read_bytes().splitlines()
    assert len(lines) == 5
    assert [msgspec.json.decode(line, type=TrajectoryRecord) for line in lines] == records


def test_jsonl_sink_writes_whole_lines_only_even_when_its_buffer_fills(tmp_path, monkeypatch):
    import streamrft.sinks.jsonl as jsonl

    monkeypatch.setattr(jsonl, "_FLUSH_BYTES", 6000)  # three records; the old file buffer cut lines anywhere
    sink = JsonlSink(tmp_path, run_id="r", rank=0)
    path = tmp_path / "r-rank0.jsonl"
    written = []
    for record in synthetic_records(40, rank=0):
        sink.write(record)
        written.append(record)
        on_disk = path.read_bytes()
        assert on_disk == b"" or on_disk.endswith(b"\n")
    assert len(path.read_bytes().splitlines()) == 39  # written early, three at a time (~2.6 kB each)
    sink.close()
    assert list(read_trajectories(path)) == written


def test_a_torn_last_line_is_skipped_by_the_reader_and_cut_off_when_the_sink_reopens(tmp_path, capsys):
    first, second, third = synthetic_records(3, rank=0)
    path = tmp_path / "r-rank0.jsonl"
    whole = msgspec.json.encode(first) + b"\n"
    path.write_bytes(whole + msgspec.json.encode(second)[:37])  # killed inside write(2)
    assert list(read_trajectories(path)) == [first]
    sink = JsonlSink(tmp_path, run_id="r", rank=0)
    assert path.read_bytes() == whole
    assert f"{path}: cut off a torn last line (37 bytes" in capsys.readouterr().out
    sink.write(third)
    sink.close()
    assert list(read_trajectories(path)) == [first, third]


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    first, second = synthetic_records(2, rank=0)
    path = tmp_path / "r-rank0.jsonl"
    path.write_bytes(msgspec.json.encode(first) + b"\n{oops\n" + msgspec.json.encode(second) + b"\n")
    with pytest.raises(ValueError, match=f"{path}:2: not a TrajectoryRecord"):
        list(read_trajectories(path))


def test_parquet_sink_rolls_files_every_rows_per_file_and_reads_back_equal(tmp_path):
    records = synthetic_records(10)
    sink = ParquetSink(tmp_path, rows_per_file=4, run_id="run7", rank=0)
    for r in records[:6]:
        sink.write(r)
    sink.flush()
    # The third file is being filled: it is not yet visible as *.parquet.
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == ["run7-rank0-00000.parquet"]
    for r in records[6:]:
        sink.write(r)
    sink.close()
    files = sorted(tmp_path.glob("*.parquet"))
    assert [pq.read_metadata(f).num_rows for f in files] == [4, 4, 2]
    assert pq.read_schema(files[0]).names == [f.name for f in msgspec.structs.fields(TrajectoryRecord)]
    assert list(read_trajectories(tmp_path)) == records


def test_parquet_schema_has_a_column_for_every_trajectory_record_field():
    assert trajectory_schema().names == list(TrajectoryRecord.__struct_fields__)


def test_a_resumed_parquet_sink_continues_the_file_numbering_instead_of_overwriting(tmp_path):
    for batch in (synthetic_records(2, step=0), synthetic_records(2, step=1)):
        sink = ParquetSink(tmp_path, rows_per_file=100, run_id="r", rank=0)
        for r in batch:
            sink.write(r)
        sink.close()
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == ["r-rank0-00000.parquet", "r-rank0-00001.parquet"]
    assert [r.step for r in read_trajectories(tmp_path)] == [0, 0, 1, 1]


def test_zmq_pub_sink_delivers_every_record_after_the_ready_handshake():
    sink = ZmqPubSink("tcp://127.0.0.1:0")
    received: list[TrajectoryRecord] = []
    with TrajectorySubscriber(sink.address) as subscriber:
        assert sink.wait_for_subscribers(1, timeout=5)
        records = synthetic_records(20)
        for r in records:
            sink.write(r)
        while (r := subscriber.recv(timeout=2)) is not None and len(received) < 20:
            received.append(r)
    sink.close()
    assert received == records


def test_zmq_wait_for_subscribers_times_out_when_nobody_subscribes():
    sink = ZmqPubSink("tcp://127.0.0.1:0")
    try:
        assert sink.wait_for_subscribers(1, timeout=0.2) is False
    finally:
        sink.close()


def test_rank_address_offsets_tcp_ports_and_suffixes_other_transports():
    assert rank_address("tcp://127.0.0.1:5600", 3) == "tcp://127.0.0.1:5603"
    assert rank_address("ipc:///tmp/traj", 1) == "ipc:///tmp/traj-rank1"
    with pytest.raises(ValueError, match="explicit port"):
        rank_address("tcp://127.0.0.1", 0)


def test_build_sinks_builds_what_the_config_turns_on_for_each_rank(tmp_path):
    assert build_sinks(sinks_cfg(), run_id="r", rank=0) == []
    sinks = build_sinks(sinks_cfg(jsonl=str(tmp_path / "j"), parquet=str(tmp_path / "p")), run_id="r", rank=1)
    assert [type(s) for s in sinks] == [JsonlSink, ParquetSink]
    for s in sinks:
        s.write(synthetic_records(1, rank=1)[0])
        s.close()
    assert (tmp_path / "j" / "r-rank1.jsonl").exists()
    assert (tmp_path / "p" / "r-rank1-00000.parquet").exists()
    wrapped = build_sinks(sinks_cfg(jsonl=str(tmp_path / "b"), background=True), run_id="r", rank=0)
    assert len(wrapped) == 1 and [type(s) for s in wrapped[0].sinks] == [JsonlSink]
    wrapped[0].close()
    with pytest.raises(ValueError, match="sinks.parquet_rows_per_file"):
        build_sinks(sinks_cfg(parquet=str(tmp_path), parquet_rows_per_file=0), run_id="r", rank=0)


def test_a_slow_zmq_subscriber_never_blocks_the_writer():
    sink = ZmqPubSink("tcp://127.0.0.1:0", hwm=10)
    subscriber = TrajectorySubscriber(sink.address)
    try:
        assert sink.wait_for_subscribers(1, timeout=5)
        done = threading.Event()

        def write_many():
            for r in synthetic_records(2000, response_len=64):
                sink.write(r)
            done.set()

        writer = threading.Thread(target=write_many)
        writer.start()
        writer.join(10)
        assert done.is_set(), "writer blocked on a subscriber that never reads"
    finally:
        subscriber.close()
        sink.close()


def test_background_sinks_hand_every_record_to_the_sinks_and_close_drains(tmp_path):
    from streamrft.sinks.background import BackgroundSinks

    records = synthetic_records(50)
    background = BackgroundSinks([JsonlSink(tmp_path, "r", 0), ParquetSink(tmp_path, 1000, "r", 0)])
    for r in records:
        background.write(r)
    background.flush()
    background.close()
    assert list(read_trajectories(tmp_path / "r-rank0.jsonl")) == records
    assert list(read_trajectories(tmp_path / "r-rank0-00000.parquet")) == records


def test_a_failing_background_sink_is_reported_on_the_next_call_with_its_name(tmp_path):
    from streamrft.sinks.background import BackgroundSinks

    class Broken:
        def write(self, record):
            raise OSError("disk full")

        def flush(self):
            pass

        def close(self):
            pass

    background = BackgroundSinks([Broken()])
    background.write(synthetic_records(1)[0])
    with pytest.raises(RuntimeError, match="Broken failed.*disk full"):
        background.drain()
    with pytest.raises(RuntimeError, match="disk full"):
        background.write(synthetic_records(1)[0])
    with pytest.raises(RuntimeError):
        background.close()


def test_a_hung_background_sink_fails_the_training_thread_naming_it_instead_of_blocking_it():
    """A sink stuck in write (a hung network file system): once the queue is full, a write waits at most wait_s, then
    raises naming the sink; so do drain and close. The records before it were handed over."""
    import threading
    import time

    from streamrft.sinks.background import BackgroundSinks

    release, written = threading.Event(), []

    class Hung:
        def write(self, record):
            written.append(record)
            release.wait()

        def flush(self):
            pass

        def close(self):
            pass

    background = BackgroundSinks([Hung()], max_queued=2, wait_s=0.5)
    records = synthetic_records(4)
    for r in records[:3]:  # one in the writer's hands, two queued
        background.write(r)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"stuck in a sink \(Hung\): its queue of 2 has had no room for 0.5 s"):
        background.write(records[3])
    assert 0.4 < time.monotonic() - t0 < 5 and written == records[:1]
    with pytest.raises(RuntimeError, match=r"stuck in a sink \(Hung\): 3 record\(s\) still queued after 0.5 s"):
        background.drain()
    release.set()  # the sink recovers: everything queued is written, nothing lost
    background.drain()
    background.close()
    assert written == records[:3]
