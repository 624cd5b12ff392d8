"""Version-stamped, bucketed weight publishing: learner rank 0 → every engine process (async placement).

The transport is a ``torch.distributed`` process group of its own (publisher + subscribers, not the
learner's world), so weight traffic never queues behind the learner's collectives:

* NCCL when every member sits on its own CUDA device (``weights_backend``), tensors go GPU to GPU;
* gloo otherwise (CPU runs, or engine and learner sharing one GPU, where NCCL cannot put two ranks):
  the buckets are staged through CPU memory.

Every message is a broadcast from ``src_rank``. One version is:

    for each bucket:  HEADER(BUCKET)  TABLE  NAMES  PAYLOAD
    then:             HEADER(VERSION_END, n_tensors)
    and at the end of the run, once:  HEADER(FINISH)  ("no more versions")

- HEADER: int64[8] = (MAGIC, kind, version, n_tensors, table_len, names_len, payload_bytes, seq);
  ``seq`` counts messages, so a subscriber that lost step notices at once.
- TABLE: int64, per tensor (dtype code, ndim, name offset, name length, byte offset, byte length,
  *shape); NAMES: the UTF-8 names, concatenated, as uint8.
- PAYLOAD: the bucket's tensors' raw bytes in one uint8 buffer (one collective per bucket), each at a
  16-byte aligned offset so the receiver views it back as its dtype without a copy.

Nothing is pickled: a subscriber trusts only shapes, dtypes from a fixed table, and byte counts, and
the tensors it gets are bitwise the ones published. Every broadcast waits at most ``timeout_s`` and
a failure (a dead peer closes its sockets: gloo reports it at once) raises ``WeightSyncError`` naming
the stage ``weight_sync``, this rank and what it was waiting for.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from streamrft.runtime.stage import StageError

STAGE = "weight_sync"
MAGIC = 0x5354_5257_4754  # "STRWGT": a header from anything else is refused
BUCKET, VERSION_END, FINISH = 1, 2, 3
HEADER_LEN = 8
ALIGN = 16  # byte alignment of each tensor in a payload (the largest element size is 8)

# dtype codes on the wire; a fixed table, so a peer can never name an arbitrary type
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

Named = list[tuple[str, torch.Tensor]]
OnWeights = Callable[..., None]


class WeightSyncError(StageError):
    """A weight broadcast failed or timed out; the message names the stage, the rank and the version."""


def weights_backend(devices: Sequence[torch.device | str]) -> str:
    """``nccl`` when every member of the weights group (publisher first) is on its own CUDA device, else
    ``gloo`` (CPU members, or members sharing a GPU, which NCCL refuses)."""
    devs = [torch.device(d) for d in devices]
    if all(d.type == "cuda" for d in devs) and len({d.index for d in devs}) == len(devs):
        return "nccl"
    return "gloo"


def new_weights_group(store, rank: int, size: int, timeout_s: float, backend: str = "gloo",
                      prefix: str = "streamrft-weights"):
    """A standalone process group over ``store`` (not the torchrun world: engine processes are not
    torchrun ranks); rank 0 is the publisher by convention. ``backend``: see ``weights_backend``."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"weights group backend {backend!r}: use gloo or nccl")


# ---------------------------------------------------------------------------------------- pure encoding
def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode_bucket(named: Named, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table int64, names uint8, payload uint8) of one bucket, all on ``device``; see the module doc."""
    rows: list[int] = []
    names = bytearray()
    offset = 0
    for name, tensor in named:
        if tensor.dtype not in _CODE:
            raise ValueError(f"{STAGE}: tensor {name!r} has dtype {tensor.dtype}, which the weights wire does not "
                             f"carry; supported: {[str(d) for d in DTYPES]}")
        encoded = name.encode()
        nbytes = tensor.numel() * tensor.element_size()
        rows += [_CODE[tensor.dtype], tensor.dim(), len(names), len(encoded), offset, nbytes, *tensor.shape]
        names += encoded
        offset = _aligned(offset + nbytes)
    payload = torch.empty(offset, dtype=torch.uint8, device=device)
    for (name, tensor), at in zip(named, _offsets(rows)):
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            payload[at: at + flat.numel() * flat.element_size()].copy_(flat.view(torch.uint8))
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    name_bytes = torch.frombuffer(bytearray(names), dtype=torch.uint8) if names else torch.empty(0, dtype=torch.uint8)
    return table, name_bytes.to(device), payload


def _offsets(rows: list[int]) -> list[int]:
    """The byte offset of each tensor in a flat table."""
    out, i = [], 0
    while i < len(rows):
        out.append(rows[i + 4])
        i += 6 + rows[i + 1]
    return out


def decode_bucket(table: list[int], names: bytes, payload: torch.Tensor, n_tensors: int) -> Named:
    """The bucket's (name, tensor) pairs, viewing ``payload`` (no copy); ValueError on a malformed table."""
    out: Named = []
    i = 0
    while i < len(table):
        code, ndim, name_at, name_len, at, nbytes = table[i: i + 6]
        shape = table[i + 6: i + 6 + ndim]
        i += 6 + ndim
        if not 0 <= code < len(DTYPES) or len(shape) != ndim or min(shape, default=0) < 0:
            raise ValueError(f"{STAGE}: malformed bucket table entry {len(out)} (dtype code {code}, shape {shape})")
        dtype = DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        if nbytes != numel * dtype.itemsize or at % ALIGN or at + nbytes > payload.numel():
            raise ValueError(f"{STAGE}: bucket table entry {len(out)} does not fit the payload "
                             f"({nbytes} bytes at {at} of {payload.numel()})")
        name = names[name_at: name_at + name_len].decode()
        out.append((name, payload[at: at + nbytes].view(dtype).reshape(shape)))
    if len(out) != n_tensors:
        raise ValueError(f"{STAGE}: the bucket header announced {n_tensors} tensors, its table holds {len(out)}")
    return out


# ---------------------------------------------------------------------------------------- the two ends
class _End:
    def __init__(self, group, src_rank: int, timeout_s: float, rank: int | None = None,
                 device: torch.device | str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"{STAGE}: timeout_s={timeout_s} must be > 0")
        self.group, self.src_rank, self.timeout_s = group, src_rank, timeout_s
        self.rank = group.rank() if rank is None else rank
        if device is None:  # NCCL moves CUDA tensors; gloo stages on CPU
            nccl = group.name().lower() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.seq = 0

    def _broadcast(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if not tensor.numel():  # both ends know the length from the header: nothing to send
            return tensor
        opts = dist.BroadcastOptions()
        opts.rootRank = self.src_rank
        opts.timeout = timedelta(seconds=self.timeout_s)
        try:
            self.group.broadcast([tensor], opts).wait()
        except Exception as exc:  # gloo: "Connection closed by peer" (dead peer) or "timed out"
            role = "publisher" if self.rank == self.src_rank else f"subscriber of rank {self.src_rank}"
            raise WeightSyncError(f"{STAGE}: rank {self.rank} ({role}): {what} failed within "
                                  f"timeout_s={self.timeout_s:g}: {exc}") from exc
        return tensor

    def _header(self, kind: int, version: int, n: int = 0, table: int = 0, names: int = 0, payload: int = 0):
        return torch.tensor([MAGIC, kind, version, n, table, names, payload, self.seq], dtype=torch.int64,
                            device=self.device)


class WeightPublisher(_End):
    """The learner's rank 0 end: ``publish(version, buckets)`` per version, ``finish()`` once at the end.

    ``publish(..., background=True)`` takes the version off the learner's critical path: the buckets are
    encoded (a copy: the snapshot, so the next optimizer step may change the weights at once) on the
    calling thread, and broadcast from a thread of its own while the caller goes on training. At most one
    version is in flight: the next ``publish`` (and ``finish``) first waits for the previous send, and
    re-raises its failure there.
    """

    def __init__(self, group, src_rank: int, timeout_s: float, rank: int | None = None,
                 device: torch.device | str | None = None):
        super().__init__(group, src_rank, timeout_s, rank, device)
        if self.rank != src_rank:
            raise ValueError(f"{STAGE}: WeightPublisher on rank {self.rank}, but the source rank is {src_rank}")
        self.last_version: int | None = None
        self.finished = False
        self.published_bytes = 0  # payload bytes of the last version
        self.send_seconds = 0.0  # how long the last version's broadcasts took
        self._sending: threading.Thread | None = None
        self._sending_version: int | None = None
        self._send_deadline_s = 0.0
        self._send_error: BaseException | None = None

    def publish(self, version: int, buckets: Iterable[Iterable[tuple[str, torch.Tensor]]],
                background: bool = False) -> int:
        """Broadcast one version, bucket by bucket (each bucket one payload collective); returns its
        payload bytes. Versions must increase: subscribers rely on receiving them in order. With
        ``background`` the broadcasts run in a thread and this returns once the version is encoded."""
        if self.finished:
            raise RuntimeError(f"{STAGE}: publish(version={version}) after finish()")
        self.wait_sent()
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"{STAGE}: version {version} published after version {self.last_version}; versions "
                             "must increase")
        encoded = []
        for bucket in buckets:
            named = list(bucket)
            if named:
                encoded.append((len(named), *encode_bucket(named, self.device)))
        self.last_version = version
        self.published_bytes = sum(payload.numel() for _, _, _, payload in encoded)
        if not background:
            self._send(version, encoded)
            return self.published_bytes
        # each broadcast waits at most timeout_s: the whole send is bounded by one timeout per message
        self._send_deadline_s = self.timeout_s * (4 * len(encoded) + 1) + 5.0
        self._sending_version = version
        self._sending = threading.Thread(target=self._send_in_thread, args=(version, encoded),
                                         name=f"{STAGE}-publish-v{version}", daemon=True)
        self._sending.start()
        return self.published_bytes

    def _send(self, version: int, encoded: list) -> None:
        started = time.perf_counter()
        count = 0
        for b, (n, table, names, payload) in enumerate(encoded):
            what = f"sending bucket {b} of version {version}"
            self._broadcast(self._header(BUCKET, version, n, table.numel(), names.numel(), payload.numel()), what)
            self.seq += 1
            self._broadcast(table, what)
            self._broadcast(names, what)
            self._broadcast(payload, what)
            count += n
        self._broadcast(self._header(VERSION_END, version, count), f"ending version {version}")
        self.seq += 1
        self.send_seconds = time.perf_counter() - started

    def _send_in_thread(self, version: int, encoded: list) -> None:
        try:
            self._send(version, encoded)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the learner's thread by wait_sent
            self._send_error = exc

    def wait_sent(self) -> None:
        """Wait for a version being sent in the background; raise its failure (WeightSyncError), or one
        naming the version when the send outlives its bound."""
        thread = self._sending
        if thread is not None:
            thread.join(self._send_deadline_s)
            if thread.is_alive():
                raise WeightSyncError(f"{STAGE}: rank {self.rank} (publisher): sending version "
                                      f"{self._sending_version} did not end within {self._send_deadline_s:g} s")
            self._sending = None
        if self._send_error is not None:
            error, self._send_error = self._send_error, None
            raise error

    def finish(self) -> None:
        """Tell every subscriber that no more versions come (their ``receive`` returns ``(None, [])``),
        after the version in flight, if any, has been sent."""
        if self.finished:
            return
        self.finished = True
        self.wait_sent()
        self._broadcast(self._header(FINISH, -1), "sending the end of the run")


class WeightSubscriber(_End):
    """An engine process's end. ``receive()`` blocks for the next whole version; ``start(on_weights)``
    runs it in a daemon thread:

    - ``on_weights(version, named_tensors)`` for every version, in order, from that thread;
    - ``on_weights(None, None)`` once when the publisher calls ``finish()`` (the thread then ends);
    - ``on_weights(None, None, error=exc)`` once if receiving (or ``on_weights`` itself) fails; the
      exception is also kept in ``self.error``.
    """

    def __init__(self, group, src_rank: int, timeout_s: float, rank: int | None = None,
                 device: torch.device | str | None = None):
        super().__init__(group, src_rank, timeout_s, rank, device)
        if self.rank == src_rank:
            raise ValueError(f"{STAGE}: WeightSubscriber on the source rank {src_rank}")
        self.last_version: int | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def receive(self) -> tuple[int | None, Named]:
        """The next version and its tensors (views into received buffers on ``self.device``), or
        ``(None, [])`` once the publisher has finished."""
        named: Named = []
        version: int | None = None
        while True:
            waiting = "the next version" if version is None else f"the rest of version {version}"
            header = self._broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device),
                                     f"waiting for {waiting} from rank {self.src_rank}").tolist()
            magic, kind, v, n, table_len, names_len, payload_len, seq = header
            if magic != MAGIC or seq != self.seq or kind not in (BUCKET, VERSION_END, FINISH):
                raise WeightSyncError(f"{STAGE}: rank {self.rank}: malformed header {header} (expected message "
                                      f"{self.seq}); is another program using this process group?")
            self.seq += 1
            if kind == FINISH:
                if version is not None:
                    raise WeightSyncError(f"{STAGE}: rank {self.rank}: the publisher finished in the middle of "
                                          f"version {version}")
                return None, []
            if version is None:
                if self.last_version is not None and v <= self.last_version:
                    raise WeightSyncError(f"{STAGE}: rank {self.rank}: version {v} arrived after version "
                                          f"{self.last_version}; versions must increase")
                version = v
            elif v != version:
                raise WeightSyncError(f"{STAGE}: rank {self.rank}: a message of version {v} inside version {version}")
            if kind == VERSION_END:
                if n != len(named):
                    raise WeightSyncError(f"{STAGE}: rank {self.rank}: version {version} announced {n} tensors, "
                                          f"{len(named)} arrived")
                self.last_version = version
                return version, named
            what = f"receiving a bucket of version {version} from rank {self.src_rank}"
            table = self._broadcast(torch.empty(table_len, dtype=torch.int64, device=self.device), what)
            names = self._broadcast(torch.empty(names_len, dtype=torch.uint8, device=self.device), what)
            payload = self._broadcast(torch.empty(payload_len, dtype=torch.uint8, device=self.device), what)
            try:
                named += decode_bucket(table.tolist(), bytes(names.cpu().numpy()), payload, n)
            except ValueError as exc:
                raise WeightSyncError(f"rank {self.rank}: {exc}") from exc

    def start(self, on_weights: OnWeights) -> threading.Thread:
        """Receive every version in a daemon thread and hand it to ``on_weights`` (see the class doc)."""
        if self._thread is not None:
            raise RuntimeError(f"{STAGE}: subscriber of rank {self.rank} already started")

        def loop() -> None:
            try:
                while not self._stopping.is_set():
                    version, named = self.receive()
                    if self._stopping.is_set():
                        return
                    if version is None:
                        on_weights(None, None)
                        return
                    on_weights(version, named)
            except BaseException as exc:  # noqa: BLE001 - handed to the owner; a daemon thread has no caller
                self.error = exc
                if not self._stopping.is_set():
                    on_weights(None, None, error=exc)

        self._thread = threading.Thread(target=loop, name=f"{STAGE}-rank{self.rank}", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, join_timeout_s: float = 1.0) -> bool:
        """Stop handing versions to ``on_weights``; True once the thread has ended. The thread ends by
        itself after the publisher's ``finish()``; a thread still blocked in a broadcast (publisher gone
        without finishing) is a daemon and ends at its timeout or with the process."""
        self._stopping.set()
        if self._thread is None:
            return True
        self._thread.join(join_timeout_s)
        return not self._thread.is_alive()
