"""Weight publishing over a process group of its own (streamrft/runtime/weight_sync.py), real processes on gloo.

This file is also the worker: ``python test_weight_sync.py ROLE RANK SIZE STORE FOLDER BASE TIMEOUT_S``.
The test process builds a tiny Qwen2, hosts the rendezvous store (TCPStore on 127.0.0.1, or a FileStore),
starts one publisher and one or two subscribers, and compares what every subscriber saved with versions
it computes itself: bitwise equal, in version order. A killed or silent publisher makes a subscriber fail
within its timeout, naming the stage and its rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

VERSIONS = (1, 2, 3)
BUCKET_BYTES = 8 << 10  # several buckets per version for the tiny model
TIMEOUT_S = 20.0


def version_state(base: dict[str, torch.Tensor], version: int) -> list[tuple[str, torch.Tensor]]:
    """The weights of ``version``: every float tensor moved by seeded noise, plus a bf16 copy of one matrix
    and an int64 counter, so the wire carries several dtypes."""
    out = []
    for i, (name, t) in enumerate(sorted(base.items())):
        gen = torch.Generator().manual_seed(1000 * version + i)
        out.append((name, t + 0.01 * version * torch.randn(t.shape, generator=gen, dtype=t.dtype)))
    first = out[0][1]
    out.append(("extra.bf16", first.to(torch.bfloat16) * version))
    out.append(("extra.step", torch.tensor([version, -version, 2**40 + version], dtype=torch.int64)))
    return out


def bucketed(named: list[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Buckets of about ``bucket_bytes``, as a learner strategy's ``full_state_for_engine`` yields them
    (streamrft.learner.memory.bucketed; not imported: the learner package costs the worker seconds)."""
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


# ------------------------------------------------------------------------------------------------ worker
def _store(spec: str, rank: int, size: int):
    import torch.distributed as dist

    kind, _, where = spec.partition(":")
    if kind == "tcp":
        return dist.TCPStore("127.0.0.1", int(where), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    return dist.FileStore(where, size)


def _worker(argv: list[str]) -> int:
    from safetensors.torch import load_file, save_file

    from streamrft.runtime.weight_sync import WeightPublisher, WeightSubscriber, new_weights_group

    role, rank, size, store_spec, folder = argv[0], int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    base_path, timeout_s = argv[5], float(argv[6])
    group = new_weights_group(_store(store_spec, rank, size), rank, size, timeout_s)
    if role == "publisher":
        base = load_file(base_path)
        publisher = WeightPublisher(group, src_rank=0, timeout_s=timeout_s)
        for v in VERSIONS:
            publisher.publish(v, bucketed(version_state(base, v), BUCKET_BYTES))
        publisher.finish()
        return 0
    if role == "publisher-background":  # broadcasts beside the caller, who overwrites the weights at once
        base = load_file(base_path)
        publisher = WeightPublisher(group, src_rank=0, timeout_s=timeout_s)
        for v in VERSIONS:
            state = version_state(base, v)
            publisher.publish(v, bucketed(state, BUCKET_BYTES), background=True)
            for _, t in state:  # the next optimizer step: the version sent must be the one published
                t.fill_(-7)
        publisher.finish()
        return 0
    if role in ("publisher-dies", "publisher-silent"):  # one version, then SIGKILL by the test or silence
        base = load_file(base_path)
        WeightPublisher(group, src_rank=0, timeout_s=timeout_s).publish(1, bucketed(version_state(base, 1), BUCKET_BYTES))
        (folder / "published").write_text("1")
        time.sleep(120)
        return 0
    subscriber = WeightSubscriber(group, src_rank=0, timeout_s=timeout_s)
    received: list[int] = []
    started = time.monotonic()

    def keep(version, named):
        save_file({n: t.clone() for n, t in named}, str(folder / f"rank{rank}-v{version}.safetensors"))
        received.append(version)

    try:
        if role == "subscriber-thread":  # the start()/on_weights helper
            import threading

            done, errors = threading.Event(), []

            def on_weights(version, named, error=None):
                if error is not None:
                    errors.append(error)
                if version is not None:
                    keep(version, named)
                else:
                    done.set()

            subscriber.start(on_weights)
            assert done.wait(3 * timeout_s), "no end of the run"
            assert subscriber.stop(), "the thread did not end after finish()"
            if errors:
                raise errors[0]
        else:  # blocking receive()
            while True:
                version, named = subscriber.receive()
                if version is None:
                    break
                keep(version, named)
    except Exception as exc:  # the test reads this line
        out = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started, "received": received}
        (folder / f"rank{rank}.json").write_text(json.dumps(out))
        return 1
    (folder / f"rank{rank}.json").write_text(json.dumps({"received": received}))
    return 0


# ------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

    out = tmp_path_factory.mktemp("weights")
    tok = build_char_tokenizer(str(out / "model"), "0123456789+-= ")
    build_tiny_qwen2(str(out / "model"), tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=64, tie_word_embeddings=False)
    module, _ = load_policy(str(out / "model"))
    save_file({n: t.contiguous() for n, t in module.state_dict().items()}, str(out / "base.safetensors"))
    return out


def _spawn(role: str, rank: int, size: int, store: str, folder: Path, base_dir: Path,
           timeout_s: float = TIMEOUT_S) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [role, str(rank), str(size), store, str(folder), str(base_dir / "base.safetensors"), str(timeout_s)]
    return subprocess.Popen([sys.executable, __file__, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout_s: float = 90) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def _tcp_store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)


def _check_received(folder: Path, base_dir: Path, ranks: list[int]) -> None:
    from safetensors.torch import load_file

    base = load_file(str(base_dir / "base.safetensors"))
    for r in ranks:
        assert json.loads((folder / f"rank{r}.json").read_text()) == {"received": list(VERSIONS)}
        for v in VERSIONS:
            got = load_file(str(folder / f"rank{r}-v{v}.safetensors"))
            expected = dict(version_state(base, v))
            assert sorted(got) == sorted(expected)
            for name, t in expected.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape, (r, v, name)
                assert torch.equal(_bits(got[name]), _bits(t)), (r, v, name)


@pytest.mark.parametrize("publisher", ["publisher", "publisher-background"])
def test_two_ranks_filestore_three_versions_bitwise_in_order(base_dir, tmp_path, publisher):
    """Also with the broadcast in a background thread while the publisher overwrites its weights: what
    arrives is each version as it was when published."""
    store = f"file:{tmp_path / 'store'}"
    procs = [_spawn(publisher, 0, 2, store, tmp_path, base_dir), _spawn("subscriber", 1, 2, store, tmp_path, base_dir)]
    results = _finish(procs)
    assert [code for code, _ in results] == [0, 0], results
    _check_received(tmp_path, base_dir, [1])


@pytest.mark.slow
def test_three_ranks_tcpstore_blocking_and_thread_subscribers(base_dir, tmp_path):
    store = _tcp_store()
    spec = f"tcp:{store.port}"
    procs = [_spawn("publisher", 0, 3, spec, tmp_path, base_dir), _spawn("subscriber", 1, 3, spec, tmp_path, base_dir),
             _spawn("subscriber-thread", 2, 3, spec, tmp_path, base_dir)]
    results = _finish(procs)
    assert [code for code, _ in results] == [0, 0, 0], results
    _check_received(tmp_path, base_dir, [1, 2])


@pytest.mark.slow
@pytest.mark.parametrize("role", ["subscriber", "subscriber-thread"])
def test_killed_publisher_fails_the_subscriber_within_its_timeout_naming_its_rank(base_dir, tmp_path, role):
    timeout_s = 5.0
    store = _tcp_store()
    spec = f"tcp:{store.port}"
    publisher = _spawn("publisher-dies", 0, 2, spec, tmp_path, base_dir, timeout_s)
    subscriber = _spawn(role, 1, 2, spec, tmp_path, base_dir, timeout_s)
    marker = tmp_path / "published"
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline and publisher.poll() is None, _finish([publisher, subscriber])
        time.sleep(0.05)
    publisher.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    (code, text), = _finish([subscriber], timeout_s=timeout_s + 30)
    elapsed = time.monotonic() - killed
    _finish([publisher])
    assert code == 1, text
    result = json.loads((tmp_path / "rank1.json").read_text())
    assert result["received"] == [1]
    assert elapsed < timeout_s + 5, elapsed  # the process start is not in it: it had received version 1
    assert result["error"].startswith("WeightSyncError: weight_sync: rank 1 (subscriber of rank 0): waiting for "
                                      "the next version from rank 0 failed within timeout_s=5: "), result["error"]


@pytest.mark.slow
def test_silent_publisher_times_the_subscriber_out(base_dir, tmp_path):
    """A publisher alive but publishing nothing: the subscriber's wait ends at its timeout, not later."""
    timeout_s = 2.0
    store = _tcp_store()
    spec = f"tcp:{store.port}"
    publisher = _spawn("publisher-silent", 0, 2, spec, tmp_path, base_dir, timeout_s)
    subscriber = _spawn("subscriber", 1, 2, spec, tmp_path, base_dir, timeout_s)
    (code, text), = _finish([subscriber], timeout_s=60)
    publisher.kill()
    _finish([publisher])
    assert code == 1, text
    result = json.loads((tmp_path / "rank1.json").read_text())
    assert result["received"] == [1]
    assert "weight_sync: rank 1 (subscriber of rank 0): waiting for the next version from rank 0 failed within " \
           "timeout_s=2" in result["error"] and "timed out" in result["error"].lower(), result["error"]


def test_encode_decode_roundtrip_and_malformed_tables():
    """The pure wire encoding: bitwise round trip of odd tensors; a table that lies is refused."""
    from streamrft.runtime.weight_sync import decode_bucket, encode_bucket

    named = [("w", torch.randn(3, 5)), ("strided", torch.randn(4, 6)[:, ::2]), ("b", torch.tensor([True, False])),
             ("scalar", torch.tensor(2.5, dtype=torch.float64)), ("empty", torch.empty(0, 3)),
             ("ünï", torch.randn(3, dtype=torch.bfloat16)), ("i8", torch.tensor([-1, 7], dtype=torch.int8))]
    table, names, payload = encode_bucket(named, torch.device("cpu"))
    out = decode_bucket(table.tolist(), bytes(names.numpy()), payload, len(named))
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    rows = table.tolist()
    with pytest.raises(ValueError, match="announced 8 tensors, its table holds 7"):
        decode_bucket(rows, bytes(names.numpy()), payload, 8)
    bad = list(rows)
    bad[5] += 4  # first tensor's byte length no longer matches its shape
    with pytest.raises(ValueError, match="bucket table entry 0 does not fit the payload"):
        decode_bucket(bad, bytes(names.numpy()), payload, len(named))
    bad = list(rows)
    bad[0] = 99
    with pytest.raises(ValueError, match="malformed bucket table entry 0 \\(dtype code 99"):
        decode_bucket(bad, bytes(names.numpy()), payload, len(named))
    with pytest.raises(ValueError, match="has dtype torch.complex64, which the weights wire does not carry"):
        encode_bucket([("c", torch.zeros(2, dtype=torch.complex64))], torch.device("cpu"))


def test_backend_choice():
    from streamrft.runtime.weight_sync import weights_backend

    assert weights_backend(["cpu", "cpu"]) == "gloo"
    assert weights_backend(["cuda:0", "cuda:0"]) == "gloo"  # one GPU shared: NCCL cannot hold two ranks there
    assert weights_backend(["cuda:0", "cuda:1", "cuda:2"]) == "nccl"
    assert weights_backend(["cuda:0", "cpu"]) == "gloo"


if __name__ == "__main__":
    # the engine worker's exit: once a peer has died, the process group's C++ teardown at interpreter exit
    # sometimes aborts (SIGABRT), which would replace the worker's exit status
    from streamrft.runtime.engine_worker import exit_now

    exit_now(_worker(sys.argv[1:]))
