"""Credit-based channels over real ZeroMQ sockets (inproc, ipc, tcp) inside one process."""

from __future__ import annotations

import asyncio
import glob
import os
import threading
import uuid

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

import protocols
from protocols import Control, MicrobatchHeader, ProtocolError, ProtocolVersionError, TrajectoryRecord
from streamrft.runtime.channels import (
    BATCH,
    DATA,
    GRANT,
    HELLO,
    ChannelClosed,
    ChannelReceiver,
    ChannelSender,
    ChannelTimeout,
    ChannelUsageError,
    channel_address,
)
from streamrft.runtime.frames import TensorFrameError
from tests.ports import free_port

TRANSPORTS = ["inproc", "ipc", "tcp"]
WAIT = 5.0  # seconds: the bound on every wait that is expected to succeed


class Harness:
    """Opens channels and raw sockets on one context and closes every one of them in teardown."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.run_id = uuid.uuid4().hex[:8]
        self.opened: list = []

    def address(self, transport: str, name: str = "inbox", rank: int = 0) -> str:
        return channel_address(transport, name, rank, self.run_id)

    def receiver(self, address: str, capacity: int, *, name="inbox", rank=0, message_type=Control):
        receiver = ChannelReceiver(address, capacity, name=name, rank=rank, message_type=message_type, ctx=self.ctx)
        self.opened.append(receiver)
        return receiver

    def sender(self, address: str, *, name="inbox", rank=0, connect_timeout=WAIT):
        sender = ChannelSender(address, name=name, rank=rank, ctx=self.ctx, connect_timeout=connect_timeout)
        self.opened.append(sender)
        return sender

    def raw_dealer(self, address: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self.opened.append(sock)
        return sock

    def close_all(self) -> None:
        for item in self.opened:
            item.close()

    def run(self, body, timeout: float = 15.0):
        """Run ``body()`` on a fresh event loop; channels close inside that loop, whatever happens."""

        async def main():
            try:
                return await asyncio.wait_for(body(), timeout)
            finally:
                self.close_all()

        return asyncio.run(main())


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close_all()
    # term() blocks while any socket of the context is open: a leaked socket fails the test here.
    terminator = threading.Thread(target=h.ctx.term, daemon=True)
    terminator.start()
    terminator.join(5.0)
    leftovers = glob.glob(f"/tmp/streamrft-{h.run_id}-*.sock")
    for path in leftovers:
        os.unlink(path)
    if terminator.is_alive():
        pytest.fail("zmq context term() hung: a socket opened by this test was never closed")
    assert not leftovers, f"closed receivers left ipc socket files behind: {leftovers}"


async def eventually(condition, what: str, timeout: float = WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 50_000, (2, 3), generator=gen),
        "logprobs": torch.randn(4, 5, generator=gen).to(torch.bfloat16),
        "empty": torch.empty(0, 5),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "half": torch.randn(3, generator=gen).half(),
        "bytes": torch.arange(7, dtype=torch.uint8),
        "big": torch.randn(1 << 20, generator=gen),  # 4 MiB: goes zero-copy
        "transposed": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),  # non-contiguous input
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_header_and_tensors_round_trip_with_dtype_and_shape_fidelity(harness, transport):
    sent = sample_tensors()

    async def body():
        rx = harness.receiver(harness.address(transport), 4, message_type=MicrobatchHeader | Control)
        tx = harness.sender(rx.address)
        await tx.send(MicrobatchHeader(step=3, sample_ids=["a", "b"], n_tokens=7), sent, timeout=WAIT)
        await tx.send(Control(signal="end_of_step", step=3), timeout=WAIT)
        return await rx.recv(WAIT), await rx.recv(WAIT)

    (header, got), (control, no_tensors) = harness.run(body)
    assert isinstance(header, MicrobatchHeader)
    assert (header.step, header.sample_ids, header.n_tokens) == (3, ["a", "b"], 7)
    assert [spec.name for spec in header.tensors] == list(sent)
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    assert isinstance(control, Control) and control.signal == "end_of_step" and no_tensors == {}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_full_receiver_stalls_sender_until_credit_returns(harness, transport):
    async def body():
        rx = harness.receiver(harness.address(transport), 2)
        tx = harness.sender(rx.address)
        await tx.send(Control(signal="m0"), timeout=WAIT)
        await tx.send(Control(signal="m1"), timeout=WAIT)
        third = asyncio.create_task(tx.send(Control(signal="m2"), timeout=WAIT))
        await asyncio.sleep(0.3)
        assert not third.done(), "a third send completed although the receiver's capacity is 2"
        assert tx.credits == 0 and rx.qsize() == 2
        first, _ = await rx.recv(WAIT)
        await asyncio.wait_for(third, WAIT)  # the returned credit lets the stalled send finish
        await eventually(lambda: rx.qsize() == 2, "the third message to arrive")
        rest = [(await rx.recv(WAIT))[0].signal for _ in range(2)]
        return first.signal, rest, rx.peak_qsize

    first, rest, peak = harness.run(body)
    assert [first, *rest] == ["m0", "m1", "m2"]
    assert peak == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_started_before_receiver_binds_completes_handshake(harness, transport):
    address = harness.address(transport) if transport != "tcp" else f"tcp://127.0.0.1:{free_port()}"

    async def body():
        tx = harness.sender(address)
        pending = asyncio.create_task(tx.send(Control(signal="early"), timeout=WAIT))
        await asyncio.sleep(0.2)
        assert not pending.done()
        rx = harness.receiver(address, 2)
        await asyncio.wait_for(pending, WAIT)
        return (await rx.recv(WAIT))[0].signal

    assert harness.run(body) == "early"


def test_send_with_no_receiver_times_out_naming_the_address_and_connect_timeout(harness):
    address = harness.address("ipc", rank=3)

    async def body():
        tx = harness.sender(address, rank=3, connect_timeout=0.3)
        with pytest.raises(ChannelTimeout) as caught:
            await tx.send(Control(signal="lost"))
        return str(caught.value)

    message = harness.run(body)
    assert "'inbox' rank 3" in message and address in message and "connect_timeout=0.3" in message


def test_send_timeout_names_channel_rank_and_credit_and_loses_no_credit(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc", rank=3), 1, rank=3)
        tx = harness.sender(rx.address, rank=3)
        await tx.send(Control(signal="fills"), timeout=WAIT)
        with pytest.raises(ChannelTimeout) as caught:
            await tx.send(Control(signal="waits"), timeout=0.2)
        assert isinstance(caught.value, TimeoutError)
        await rx.recv(WAIT)
        await tx.send(Control(signal="after"), timeout=WAIT)  # the credit asked for by the timed-out send
        return str(caught.value), (await rx.recv(WAIT))[0].signal

    message, after = harness.run(body)
    assert "'inbox' rank 3" in message and "credit" in message and "0.2s" in message
    assert after == "after"


def test_recv_timeout_names_channel_rank_and_timeout(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc", rank=3), 1, rank=3)
        with pytest.raises(ChannelTimeout) as caught:
            await rx.recv(timeout=0.15)
        return str(caught.value)

    message = harness.run(body)
    assert "'inbox' rank 3" in message and "recv" in message and "0.15s" in message


async def raw_handshake(harness: Harness, address: str) -> zmq.asyncio.Socket:
    """A peer speaking the documented wire protocol by hand: hello, then wait for a grant."""
    raw = harness.raw_dealer(address)
    await raw.send_multipart([HELLO])
    kind, credits = await asyncio.wait_for(raw.recv_multipart(), WAIT)
    assert kind == GRANT and msgspec.msgpack.decode(credits) >= 1
    return raw


def test_peer_speaking_another_protocol_version_gets_a_clear_error_naming_the_channel(harness):
    async def body():
        rx = harness.receiver(harness.address("ipc", rank=3), 4, rank=3)
        raw = await raw_handshake(harness, rx.address)
        future = msgspec.msgpack.encode({"kind": "Control", "protocol_version": 99, "signal": "stop", "tensors": []})
        await raw.send_multipart([DATA, future])
        await raw.send_multipart([DATA, protocols.encode(Control(signal="valid"))])
        with pytest.raises(ProtocolVersionError) as caught:
            await rx.recv(WAIT)
        return str(caught.value), (await rx.recv(WAIT))[0].signal

    message, next_signal = harness.run(body)
    assert "'inbox' rank 3" in message and "version 99" in message
    assert next_signal == "valid"


@pytest.mark.parametrize(
    "frames, expected",
    [
        ([b"\xc1 not msgpack"], "malformed frame"),
        ([msgspec.msgpack.encode({"kind": "Control", "protocol_version": 1, "signal": 5})], "invalid Control"),
        (
            [protocols.encode(Control(signal="x", tensors=[protocols.TensorSpec("ids", "int64", (4,))]))],
            "1 tensor",
        ),
        (
            [protocols.encode(Control(signal="x", tensors=[protocols.TensorSpec("ids", "int64", (4,))])), b"123"],
            "needs 32 bytes",
        ),
    ],
    ids=["not-msgpack", "wrong-field-type", "missing-tensor-frame", "short-tensor-frame"],
)
def test_malformed_message_is_protocol_error_and_channel_keeps_working(harness, frames, expected):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 1)
        raw = await raw_handshake(harness, rx.address)
        await raw.send_multipart([DATA, *frames])
        with pytest.raises(ProtocolError) as caught:
            await rx.recv(WAIT)
        # The bad message's credit came back: with capacity 1, a new sender can still get one.
        tx = harness.sender(rx.address)
        await tx.send(Control(signal="valid"), timeout=WAIT)
        return caught.type, str(caught.value), (await rx.recv(WAIT))[0].signal

    error_type, message, next_signal = harness.run(body)
    assert error_type is ProtocolError
    assert "'inbox' rank 0" in message and expected in message
    assert next_signal == "valid"


def test_data_from_a_peer_without_credit_is_dropped_and_counted(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 1)
        raw = harness.raw_dealer(rx.address)
        await raw.send_multipart([DATA, protocols.encode(Control(signal="uninvited"))])
        await eventually(lambda: rx.uncredited_dropped == 1, "the uncredited message to be dropped")
        return rx.qsize()

    assert harness.run(body) == 0


def test_close_during_pending_recv_raises_channel_closed(harness):
    async def body():
        rx = harness.receiver(harness.address("ipc"), 1)
        pending = asyncio.create_task(rx.recv())
        await asyncio.sleep(0.1)
        rx.close()
        with pytest.raises(ChannelClosed, match="'inbox' rank 0"):
            await asyncio.wait_for(pending, WAIT)
        with pytest.raises(ChannelClosed):
            await rx.recv(WAIT)

    harness.run(body)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_close_during_pending_send_raises_channel_closed(harness, transport):
    async def body():
        rx = harness.receiver(harness.address(transport), 1)
        tx = harness.sender(rx.address)
        await tx.send(Control(signal="fills"), timeout=WAIT)
        pending = asyncio.create_task(tx.send(Control(signal="stalls")))
        await asyncio.sleep(0.1)
        tx.close()
        with pytest.raises(ChannelClosed, match="closed while send was waiting"):
            await asyncio.wait_for(pending, WAIT)
        with pytest.raises(ChannelClosed):
            await tx.send(Control(signal="after close"))

    harness.run(body)


def test_two_senders_share_the_capacity_and_never_exceed_it(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 3)
        senders = [harness.sender(rx.address) for _ in range(2)]

        async def produce(index, tx):
            for i in range(12):
                await tx.send(Control(signal=f"s{index}", step=i), timeout=WAIT)

        producers = [asyncio.create_task(produce(i, tx)) for i, tx in enumerate(senders)]
        received = []
        for _ in range(24):
            await asyncio.sleep(0.005)  # a slow consumer: the inbox fills up
            received.append((await rx.recv(WAIT))[0])
        await asyncio.wait_for(asyncio.gather(*producers), WAIT)
        return received, rx.peak_qsize

    received, peak = harness.run(body)
    assert peak == 3
    for index in range(2):
        assert [m.step for m in received if m.signal == f"s{index}"] == list(range(12))


def test_closing_sender_returns_its_unused_credits_to_the_pool(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 4)
        first = harness.sender(rx.address)
        await first.send(Control(signal="one"), timeout=WAIT)  # a lone sender is granted all 4
        assert first.credits == 3
        first.close()
        second = harness.sender(rx.address)
        for i in range(3):  # only possible if the 3 unused credits came back
            await second.send(Control(signal=f"two-{i}"), timeout=WAIT)
        with pytest.raises(ChannelTimeout):
            await second.send(Control(signal="over capacity"), timeout=0.2)
        return rx.qsize()

    assert harness.run(body) == 4


def test_channel_address_formats_and_rejects_bad_values():
    assert channel_address("inproc", "scorer", 1, "r7") == "inproc://streamrft-r7-scorer-1"
    assert channel_address("ipc", "scorer", 1, "r7") == "ipc:///tmp/streamrft-r7-scorer-1.sock"
    assert channel_address("tcp", "scorer", 1, "r7") == "tcp://127.0.0.1:0"
    with pytest.raises(ChannelUsageError, match="'udp'"):
        channel_address("udp", "scorer", 1, "r7")
    with pytest.raises(ChannelUsageError, match="name='a/b'"):
        channel_address("ipc", "a/b", 1, "r7")
    with pytest.raises(ChannelUsageError, match="Unix socket limit"):
        channel_address("ipc", "scorer", 1, "r" * 120)


def test_bad_construction_and_send_arguments_are_value_errors_naming_the_fix(harness):
    with pytest.raises(ChannelUsageError, match="receiver.address"):
        harness.sender("tcp://127.0.0.1:0")
    with pytest.raises(ChannelUsageError, match="capacity=0"):
        harness.receiver(harness.address("inproc"), 0)

    async def body():
        rx = harness.receiver(harness.address("inproc"), 1, message_type=TrajectoryRecord)
        tx = harness.sender(rx.address)
        record = TrajectoryRecord(run_id="r", rank=0, step=0, sample_id="s", group_id="g", policy_version=0,
                                  prompt="p", response="r", prompt_ids=[], response_ids=[], behaviour_logprobs=[])
        with pytest.raises(ChannelUsageError, match="no `tensors` field"):
            await tx.send(record, {"x": torch.zeros(1)})
        with pytest.raises(TensorFrameError, match="device meta"):
            await tx.send(Control(signal="x"), {"x": torch.zeros(2, device="meta")})
        assert tx.credits == 0  # rejected before any credit was spent

    harness.run(body)


def test_received_tensors_can_be_forwarded_to_the_next_channel(harness):
    sent = sample_tensors()

    async def body():
        first = harness.receiver(harness.address("tcp", name="first"), 1, name="first")
        second = harness.receiver(harness.address("inproc", name="second"), 1, name="second")
        to_first = harness.sender(first.address, name="first")
        to_second = harness.sender(second.address, name="second")
        await to_first.send(Control(signal="hop"), sent, timeout=WAIT)
        header, views = await first.recv(WAIT)  # tensors that view the received frames
        await to_second.send(header, views, timeout=WAIT)
        return await second.recv(WAIT)

    header, got = harness.run(body)
    assert header.signal == "hop"
    assert all(got[name].dtype == t.dtype and torch.equal(got[name], t) for name, t in sent.items())


def test_misaligned_frame_is_read_correctly():
    from streamrft.runtime.frames import frames_to_tensors

    values = torch.tensor([1, -2, 3 << 40, 4], dtype=torch.int64)
    storage = bytearray(1 + values.numel() * 8)
    storage[1:] = values.numpy().tobytes()
    spec = protocols.TensorSpec("ids", "int64", (2, 2))
    got = frames_to_tensors([spec], [memoryview(storage)[1:]])["ids"]  # starts one byte off alignment
    assert torch.equal(got, values.reshape(2, 2))


# -- coalescing: items sent in one turn of the event loop travel as one message -------------------------------------


def _item(i: int) -> tuple[Control, dict[str, torch.Tensor]]:
    return Control(signal=f"item{i}"), {"ids": torch.arange(i, i + 3), "logp": torch.full((2,), float(i))}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_items_sent_in_one_loop_turn_travel_as_one_message_in_order_with_their_tensors(harness, transport):
    async def body():
        rx = harness.receiver(harness.address(transport), 16)
        tx = harness.sender(rx.address)
        await tx.send(*_item(0), timeout=WAIT)  # the handshake
        await rx.recv(WAIT)
        before = tx.messages_sent
        for i in range(1, 11):  # credits in hand: no send waits, so all ten are queued in this turn
            await tx.send(*_item(i), timeout=WAIT)
        got = [await rx.recv(WAIT) for _ in range(10)]
        return tx.messages_sent - before, got

    messages, got = harness.run(body)
    assert messages == 1
    assert [h.signal for h, _ in got] == [f"item{i}" for i in range(1, 11)]
    for i, (_, tensors) in enumerate(got, start=1):
        assert torch.equal(tensors["ids"], torch.arange(i, i + 3)) and torch.equal(tensors["logp"], torch.full((2,), float(i)))


def test_a_sender_out_of_credits_sends_what_it_queued_before_waiting_so_nothing_deadlocks(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 3)
        tx = harness.sender(rx.address)

        async def produce():
            for i in range(12):
                await tx.send(*_item(i), timeout=WAIT)
        producer = asyncio.create_task(produce())
        got = [(await rx.recv(WAIT))[0].signal for _ in range(12)]
        await producer
        return got, tx.messages_sent, rx.peak_qsize

    got, messages, peak = harness.run(body)
    assert got == [f"item{i}" for i in range(12)] and messages < 12 and peak <= 3


def test_closing_a_sender_sends_the_items_it_still_has_queued(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 8)
        tx = harness.sender(rx.address)
        await tx.send(*_item(0), timeout=WAIT)
        for i in range(1, 4):
            await tx.send(*_item(i), timeout=WAIT)
        tx.close()  # before the loop turns: the three are still queued
        return [(await rx.recv(WAIT))[0].signal for _ in range(4)]

    assert harness.run(body) == ["item0", "item1", "item2", "item3"]


@pytest.mark.parametrize("counts", [b"\xc1", msgspec.msgpack.encode([2, 2]), msgspec.msgpack.encode([0, 1]),
                                    msgspec.msgpack.encode([])], ids=["not-msgpack", "too-few-frames", "zero", "empty"])
def test_a_malformed_batch_is_a_protocol_error_at_recv_and_the_channel_keeps_working(harness, counts):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 4)
        raw = await raw_handshake(harness, rx.address)
        await raw.send_multipart([BATCH, counts, protocols.encode(Control(signal="a")),
                                  protocols.encode(Control(signal="b"))])
        await raw.send_multipart([BATCH, msgspec.msgpack.encode([1, 1]), protocols.encode(Control(signal="c")),
                                  protocols.encode(Control(signal="d"))])
        with pytest.raises(ProtocolError) as caught:
            await rx.recv(WAIT)
        return str(caught.value), [(await rx.recv(WAIT))[0].signal for _ in range(2)]

    message, after = harness.run(body)
    assert "'inbox' rank 0" in message and "malformed batch" in message
    assert after == ["c", "d"]


def test_a_batch_beyond_the_peers_credits_is_dropped_whole_and_counted(harness):
    async def body():
        rx = harness.receiver(harness.address("inproc"), 2)
        raw = await raw_handshake(harness, rx.address)  # granted 2
        await raw.send_multipart([BATCH, msgspec.msgpack.encode([1, 1, 1]),
                                  *[protocols.encode(Control(signal=s)) for s in "xyz"]])
        await eventually(lambda: rx.uncredited_dropped == 3, "the uncredited batch to be dropped")
        return rx.qsize()

    assert harness.run(body) == 0
